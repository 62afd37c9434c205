"""The labelled question pairs of :mod:`tools.bench.semantic`, written out by hand.

Two families, each pair ``(a, b, label, kind)`` with label 1 when ``b`` may be served
``a``'s answer (a paraphrase) and 0 when it must not:

* **Templated pairs** (:func:`templated_pairs`): 15 support-style question templates
  filled from fixed slot lists; each filled question is paired with light rewordings
  (``template_paraphrase``) and with a negated question, a changed number, a changed
  capitalised slot (``number``/``entity``/``slot``) and an unrelated question. These are
  the *easy* cases, and their negatives differ exactly in what the false-hit gate looks
  for, so the gate scores well on them by construction.
* **Hard pairs** (the lists below): cases chosen because they are hard for an embedding,
  for the gate, or for both, each list named for the trap it sets:

  - ``hard_paraphrase``: the same question in quite different words;
  - ``gate_trap_paraphrase``: a paraphrase that differs in a word the gate reacts to (a
    digit against a spelled number, ``can't`` against ``unable``, a name said once) —
    the gate's cost in lost hits;
  - ``lowercase_entity``: another product, language or thing written in lower case (the
    gate finds names by their capital letter only);
  - ``antonym``: opposite verbs or adjectives, some in the gate's lists, most not;
  - ``number_word``: numbers spelled out (the gate sees digits only);
  - ``unit``: the same number of another unit, or another period;
  - ``role_swap``: the same words in another order (who does what to whom);
  - ``scope``: one against all, mine against everyone's.

No pair was tuned against the embedder or the gate after it was written: the hard lists
were written from the categories above, then measured.
"""

from __future__ import annotations

Pair = tuple[str, str, int, str]

#: (template, slot values); ``{x}`` is the slot.
TEMPLATES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("How do I enable {x} on my account?", ("2FA", "dark mode", "notifications")),
    ("How do I change my {x}?", ("password", "email address", "billing plan")),
    ("What is the capital city of {x}?", ("France", "Japan", "Brazil")),
    ("How do I remove a {x} from my workspace?", ("user", "project", "webhook")),
    ("What is the refund window for orders over {x} dollars?", ("50", "100", "250")),
    ("How many days does shipping to {x} take?", ("Canada", "Germany", "Australia")),
    ("Can I upgrade my plan to {x} in the middle of the month?", ("Pro", "Team")),
    ("How do I export my {x} as CSV?", ("invoices", "contacts", "reports")),
    ("What is the maximum file size for {x} uploads?", ("image", "video", "audio")),
    ("How do I reset the {x} on my router?", ("password", "firmware", "settings")),
    ("Is the {x} store open on Sundays?", ("Boston", "Denver", "Seattle")),
    ("How do I enable {x} for my team?", ("SSO", "audit logs", "guest access")),
    ("What is the late fee after {x} days?", ("10", "15", "30")),
    ("How do I remove the {x} integration?", ("Slack", "GitHub", "Jira")),
    ("How many seats does the {x} plan include?", ("Starter", "Business", "Enterprise")),
)
_REWORDINGS = (("How do I", "How can I"), ("What is", "What's"), ("change", "update"),
               ("remove", "delete"), ("How many days does", "How long does"))


def _rewordings(question: str) -> list[str]:
    out = [question.replace(old, new, 1) for old, new in _REWORDINGS if old in question]
    out.append(question.rstrip("?") + ", please?")
    out.append(question.lower().rstrip("?"))
    return out


def _negation(question: str) -> str:
    for old, new in (("enable", "disable"), ("remove", "add"), ("export", "import"),
                     ("upgrade", "downgrade"), ("maximum", "minimum")):
        if old in question:
            return question.replace(old, new, 1)
    for verb in ("Can I", "How do I", "does", "is"):
        if verb in question:
            return question.replace(verb, verb + " not", 1)
    return "Why can I not " + question[0].lower() + question[1:]


def templated_pairs() -> list[Pair]:
    """The easy pairs (see the module docstring), in a fixed order."""
    pairs: list[Pair] = []
    filled = [(t, x, t.format(x=x)) for t, xs in TEMPLATES for x in xs]
    for i, (template, x, question) in enumerate(filled):
        pairs += [(question, p, 1, "template_paraphrase") for p in _rewordings(question)]
        pairs.append((question, _negation(question), 0, "negation"))
        others = [v for tt, vs in TEMPLATES if tt == template for v in vs if v != x]
        if others:
            kind = "number" if x.isdigit() else "entity" if x[0].isupper() else "slot"
            pairs.append((question, template.format(x=others[0]), 0, kind))
        if x.isdigit():
            pairs.append((question, question.replace(x, str(int(x) * 10)), 0, "number"))
        else:
            pairs.append((question, question.rstrip("?") + " within 30 days?", 0, "number"))
        unrelated = filled[(i + 7) % len(filled)][2]
        pairs.append((question, unrelated, 0, "unrelated"))
    return pairs


HARD_PARAPHRASES: tuple[tuple[str, str], ...] = (
    ("How do I reset my password?", "I forgot my password, how do I get a new one?"),
    ("How do I reset my password?", "What are the steps to reset a password I forgot?"),
    ("What is your refund policy?", "Can I get my money back, and how does that work?"),
    ("How do I cancel my subscription?", "I want to stop my subscription. What do I do?"),
    ("How do I change the email on my account?", "Where can I update my account email?"),
    ("Where is my order?", "Can you tell me where my order is right now?"),
    ("How long does shipping take?", "How many days until my package arrives?"),
    ("Do you ship internationally?", "Can you send orders to other countries?"),
    ("How do I contact support?", "What is the best way to reach your support team?"),
    ("How do I delete my account?", "I would like my account deleted, how do I do that?"),
    ("What payment methods do you accept?", "Which ways can I pay?"),
    ("How do I update my billing address?", "Where do I change the address on my invoices?"),
    ("How can I invite a colleague to my workspace?", "How do I add a coworker to my "
     "workspace?"),
    ("Why was my card declined?", "My card payment failed, why?"),
    ("How do I turn on dark mode?", "Where is the setting for the dark theme?"),
    ("How do I download my invoices?", "Where can I get copies of my invoices?"),
    ("Can I change my username?", "Is it possible to pick a different username?"),
    ("How do I reset my router?", "What is the way to restart my router from scratch?"),
    ("What does the error code mean?", "What is this error code telling me?"),
    ("How do I set up two-factor authentication?", "How do I turn on two-factor "
     "authentication for my login?"),
    ("How do I share a document with my team?", "What is the way to give my team access "
     "to a document?"),
    ("How do I merge two git branches?", "How can I combine two branches in git?"),
    ("How do I undo my last git commit?", "How can I revert the most recent commit in "
     "git?"),
    ("How do I sort a list in python?", "What is the way to order a python list?"),
    ("How do I read a file line by line in python?", "In python, how can I loop over the "
     "lines of a file?"),
    ("What is the difference between a process and a thread?", "How does a thread differ "
     "from a process?"),
    ("Explain how photosynthesis works", "How does photosynthesis work?"),
    ("What causes inflation?", "Why does inflation happen?"),
    ("What are the symptoms of the flu?", "How do I know if I have the flu?"),
    ("How do I make my laptop battery last longer?", "Tips to extend my laptop's battery "
     "life?"),
    ("Is it safe to eat raw eggs?", "Can raw eggs be eaten safely?"),
    ("How do I change a flat tire?", "What are the steps for replacing a flat tyre?"),
    ("Summarize the plot of Hamlet", "Give me a summary of the plot of Hamlet"),
    ("What's a good name for a bakery?", "Suggest a name for my bakery"),
    ("How do I boil an egg?", "What is the right way to boil eggs?"),
    ("How do I improve my credit score?", "What can I do to raise my credit score?"),
    ("Where can I find my API key?", "Where is my API key shown?"),
    ("How do I rotate my API key?", "How can I replace my API key with a new one?"),
    ("What is the rate limit of the API?", "How many API requests am I allowed to make?"),
    ("Why is the app so slow?", "The app is really slow, why is that?"),
)

GATE_TRAP_PARAPHRASES: tuple[tuple[str, str], ...] = (
    ("I can't log in, what should I do?", "What should I do when I am unable to log in?"),
    ("Is the basic plan free?", "Does the basic plan cost nothing?"),
    ("Can I ship to Canada in 2 days?", "Can I ship to Canada in two days?"),
    ("Is there a 30 day trial?", "Is there a thirty day trial?"),
    ("How do I pay with PayPal?", "Can I pay using PayPal?"),
    ("How do I reset my password on the iPhone app?", "How do I reset my password in the "
     "app on my iphone?"),
    ("How do I connect my account to Slack?", "How can my account be linked with Slack?"),
    ("Why won't the app start?", "Why does the app fail to start?"),
    ("Can I get a refund without a receipt?", "Is a receipt required for a refund?"),
    ("The page doesn't load, what can I do?", "What can I do if the page fails to load?"),
    ("How do I cancel before renewal?", "How do I cancel so I am not charged again?"),
    ("What is the price of the Pro plan?", "How much does the pro plan cost?"),
    ("Can I use the API with Python?", "Does the API work from python?"),
    ("Does the Team plan have SSO?", "Is SSO included in the Team plan?"),
    ("What time do you open on Monday?", "When do you open on Mondays?"),
    ("Explain version 2 of the API", "Explain the second version of the API"),
)

LOWERCASE_ENTITY: tuple[tuple[str, str], ...] = (
    ("How do I install python on ubuntu?", "How do I install java on ubuntu?"),
    ("How do I install python on ubuntu?", "How do I install python on windows?"),
    ("How do I run docker on a mac?", "How do I run podman on a mac?"),
    ("How do I read a csv file in python?", "How do I read a json file in python?"),
    ("What is the difference between a list and a tuple in python?", "What is the "
     "difference between a list and a set in python?"),
    ("How do I convert a string to an integer?", "How do I convert a string to a float?"),
    ("How do I convert text to lowercase?", "How do I convert text to uppercase?"),
    ("How much does a monthly pass cost?", "How much does a day pass cost?"),
    ("Which guitar is best for beginners?", "Which piano is best for beginners?"),
    ("How do I back up my iphone?", "How do I back up my android phone?"),
    ("How do I connect my printer over wifi?", "How do I connect my printer over "
     "bluetooth?"),
    ("How do I cook rice in a pressure cooker?", "How do I cook beans in a pressure "
     "cooker?"),
    ("Is the salmon dish gluten free?", "Is the chicken dish gluten free?"),
    ("How do I add a user with the admin role?", "How do I add a user with the viewer "
     "role?"),
    ("What does the starter plan include?", "What does the business plan include?"),
    ("Can I pay by credit card?", "Can I pay by bank transfer?"),
    ("How do I sort an array in javascript?", "How do I sort an array in rust?"),
    ("How do I export my contacts?", "How do I export my calendar?"),
    ("What are the side effects of ibuprofen?", "What are the side effects of aspirin?"),
    ("How do I clean a cast iron pan?", "How do I clean a nonstick pan?"),
)

ANTONYMS: tuple[tuple[str, str], ...] = (
    ("How do I accept a pull request?", "How do I reject a pull request?"),
    ("How do I raise the volume?", "How do I lower the volume?"),
    ("What is the cheapest plan?", "What is the most expensive plan?"),
    ("How do I join a team?", "How do I leave a team?"),
    ("How do I archive a channel?", "How do I restore a channel?"),
    ("Why is my upload so fast?", "Why is my upload so slow?"),
    ("How do I show hidden files?", "How do I hide files?"),
    ("How do I subscribe to the newsletter?", "How do I unsubscribe from the newsletter?"),
    ("How do I follow a user?", "How do I unfollow a user?"),
    ("How do I mute a conversation?", "How do I unmute a conversation?"),
    ("How do I pin a message?", "How do I unpin a message?"),
    ("How do I approve an expense report?", "How do I deny an expense report?"),
    ("What happens if my payment succeeds?", "What happens if my payment fails?"),
    ("How do I zoom in on the map?", "How do I zoom out on the map?"),
    ("What are the advantages of remote work?", "What are the disadvantages of remote "
     "work?"),
    ("How do I encrypt a file?", "How do I decrypt a file?"),
    ("How do I maximize the window?", "How do I minimize the window?"),
    ("Is this medicine safe for children?", "Is this medicine dangerous for children?"),
    ("How do I grant access to a folder?", "How do I revoke access to a folder?"),
    ("Which foods raise blood pressure?", "Which foods lower blood pressure?"),
)

NUMBER_WORDS: tuple[tuple[str, str], ...] = (
    ("Can I return an item after three days?", "Can I return an item after thirty "
     "days?"),
    ("Is there a discount for two seats?", "Is there a discount for twelve seats?"),
    ("What does a one year plan cost?", "What does a five year plan cost?"),
    ("Can I add a second admin?", "Can I add a third admin?"),
    ("How much is shipping for one box?", "How much is shipping for ten boxes?"),
    ("Is the hotel room for two people?", "Is the hotel room for four people?"),
    ("What is the fee for a single transfer?", "What is the fee for a double transfer?"),
    ("How do I book a table for six?", "How do I book a table for sixteen?"),
    ("Can I take a half day off?", "Can I take a whole day off?"),
    ("What happens after the first warning?", "What happens after the final warning?"),
)

UNITS: tuple[tuple[str, str], ...] = (
    ("Is shipping free for orders over 50 dollars?", "Is shipping free for orders over "
     "50 euros?"),
    ("Can I pause my subscription for a week?", "Can I pause my subscription for a "
     "month?"),
    ("What time does the store close on weekdays?", "What time does the store close on "
     "weekends?"),
    ("How many calories are in 100 grams of rice?", "How many calories are in 100 cups "
     "of rice?"),
    ("Is the limit per day?", "Is the limit per hour?"),
    ("What is the daily rate?", "What is the hourly rate?"),
    ("How far is it in miles?", "How far is it in kilometers?"),
    ("What is the yearly price?", "What is the monthly price?"),
    ("Can I store 5 GB of files?", "Can I store 5 TB of files?"),
    ("Is the deadline this Friday morning?", "Is the deadline this Friday evening?"),
)

ROLE_SWAPS: tuple[tuple[str, str], ...] = (
    ("Can a manager see an employee's salary?", "Can an employee see a manager's "
     "salary?"),
    ("How do I move money from savings to checking?", "How do I move money from "
     "checking to savings?"),
    ("Translate this from English to French", "Translate this from French to English"),
    ("Is Python faster than Java?", "Is Java faster than Python?"),
    ("How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to "
     "Celsius?"),
    ("Does the tenant pay the landlord's fees?", "Does the landlord pay the tenant's "
     "fees?"),
    ("Can the buyer cancel the order after the seller ships it?", "Can the seller "
     "cancel the order after the buyer ships it?"),
    ("How do I copy files from the server to my laptop?", "How do I copy files from my "
     "laptop to the server?"),
    ("Who pays when the guest damages the host's car?", "Who pays when the host "
     "damages the guest's car?"),
    ("Does a dog chase a cat or a cat chase a dog in the story?", "Does a cat chase a "
     "dog or a dog chase a cat in the story?"),
)

SCOPES: tuple[tuple[str, str], ...] = (
    ("How do I delete one message?", "How do I delete all messages?"),
    ("Can I share a file with one person?", "Can I share a file with everyone?"),
    ("How do I reset my own password?", "How do I reset every user's password?"),
    ("How do I export this report?", "How do I export all reports?"),
    ("Can I see my invoices?", "Can I see everyone's invoices?"),
    ("How do I log out of this device?", "How do I log out of all devices?"),
    ("How do I clear the cache for one site?", "How do I clear the cache for every "
     "site?"),
    ("Does the update affect my workspace?", "Does the update affect every workspace?"),
    ("Can a guest edit a document?", "Can a guest edit any document?"),
    ("How do I stop one notification?", "How do I stop all notifications?"),
)


def hard_pairs() -> list[Pair]:
    """The hand-written pairs, each with its list's kind."""
    pairs: list[Pair] = []
    for kind, label, items in (
            ("hard_paraphrase", 1, HARD_PARAPHRASES),
            ("gate_trap_paraphrase", 1, GATE_TRAP_PARAPHRASES),
            ("lowercase_entity", 0, LOWERCASE_ENTITY), ("antonym", 0, ANTONYMS),
            ("number_word", 0, NUMBER_WORDS), ("unit", 0, UNITS),
            ("role_swap", 0, ROLE_SWAPS), ("scope", 0, SCOPES)):
        pairs += [(a, b, label, kind) for a, b in items]
    return pairs


def labelled_pairs() -> list[Pair]:
    """Every pair: the templated ones, then the hard ones."""
    return templated_pairs() + hard_pairs()
