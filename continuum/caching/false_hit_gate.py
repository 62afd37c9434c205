"""The false-hit gate: a cheap check after a cosine match that refuses hits whose texts
differ in what embeddings are known to blur.

An embedding puts "How do I enable 2FA?" next to "How do I disable 2FA?" and "a 3-day
refund" next to "a 30-day refund": the words that flip the answer are a small part of the
text. The gate looks at the words that occur in only one of the two texts and refuses the
hit when one of them is

* a negation or polarity word (``not``, ``never``, ``without``, ``n't`` forms, ``disable``
  against ``enable`` — a word that is another's negating prefix plus that word);
* a number (any word with a digit: ``30``, ``v2``, ``2024-01-05``);
* a named entity, approximated as a capitalised word that does not start a sentence
  (``France`` against ``Germany``).

It is pure Python over a few dozen words: microseconds, no model.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"[\w'\u2019.-]+")
_SENTENCE_END = (".", "?", "!", ":")
NEGATIONS = frozenset({
    "not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without",
    "cannot", "can't", "cant", "don't", "dont", "doesn't", "doesnt", "isn't", "isnt",
    "aren't", "arent", "wasn't", "wasnt", "won't", "wont", "shouldn't", "shouldnt",
    "wouldn't", "wouldnt", "didn't", "didnt", "haven't", "hasn't", "except", "stop",
})
#: Pairs an embedding places close although they mean opposite things.
OPPOSITES = frozenset({
    frozenset(p) for p in (("on", "off"), ("allow", "deny"), ("allow", "block"),
                           ("increase", "decrease"), ("before", "after"),
                           ("min", "max"), ("minimum", "maximum"), ("add", "remove"),
                           ("open", "close"), ("start", "stop"), ("upload", "download"),
                           ("import", "export"), ("include", "exclude"), ("buy", "sell"),
                           ("encrypt", "decrypt"), ("lock", "unlock"), ("up", "down"),
                           ("more", "less"), ("first", "last"), ("true", "false"))
})
_NEGATING_PREFIXES = ("dis", "un", "in", "im", "non", "de", "anti")
#: Prefixes a negating one replaces: "enable"/"disable", "able"/"unable".
_PLAIN_PREFIXES = ("", "en", "em")


def _words(text: str) -> tuple[set[str], set[str]]:
    """Lower-cased words, and the capitalised ones not at a sentence start."""
    words: set[str] = set()
    names: set[str] = set()
    start = True
    for raw in _TOKEN.findall(text):
        token = raw.strip(".-'\u2019")
        if not token:
            continue
        lower = token.lower()
        words.add(lower)
        if not start and token[0].isupper() and lower != "i":
            names.add(lower)
        start = raw.endswith(_SENTENCE_END)
    return words, names


def _negated(word: str, others: set[str]) -> bool:
    """Whether ``word`` is a negating prefix on a stem that another word carries bare or
    with a plain prefix ("disable" against "enable", "unlock" against "lock")."""
    for neg in _NEGATING_PREFIXES:
        stem = word[len(neg):]
        if word.startswith(neg) and len(stem) >= 3 and any(
                plain + stem in others for plain in _PLAIN_PREFIXES):
            return True
    return False


def refusal(a: str, b: str) -> str | None:
    """Why ``a`` and ``b`` must not share an answer (``negation``, ``number``, ``entity``),
    or None when the gate lets the match through."""
    words_a, names_a = _words(a)
    words_b, names_b = _words(b)
    only_a, only_b = words_a - words_b, words_b - words_a
    for word in only_a | only_b:
        if word in NEGATIONS or word.endswith("n't"):
            return "negation"
    for word in only_a:
        if _negated(word, only_b) or any(frozenset((word, w)) in OPPOSITES for w in only_b):
            return "negation"
    for word in only_b:
        if _negated(word, only_a):
            return "negation"
    if any(ch.isdigit() for word in only_a | only_b for ch in word):
        return "number"
    if (names_a - words_b) or (names_b - words_a):
        return "entity"
    return None
