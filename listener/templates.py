"""Find a request's prefix anchor (system prompt or first message) in a recovered prompt.

The engine's ``/detokenize`` gives back the *rendered* chat prompt of a block chain, special
markers included. :class:`ChatMarkers` describes how a template lays out turns::

    <first> role <post> content <sep> role <post> content <sep> role <post> ...

``first`` is what opens the prompt up to the first role (BOS and the header opening),
``post`` closes a role header, ``sep`` runs from the end of one turn's content to the next
role (end-of-turn marker and the next header opening). Because ``sep`` includes the next
header's opening, a content ends where the *next turn begins*, so a chain cut between the
end-of-turn marker and the next header simply waits for a longer chain.

:func:`find_anchor` mirrors :func:`continuum.prefix.anchor_text` on that text: the first
``system``/``developer`` turn with text gives tag ``S``; otherwise the first other turn gives
``M``. A content that is not complete yet is enough once it holds ``max_prefix_length``
bytes (the key only hashes that much; a system message placed *after* the first user
message is no anchor there either). Known divergence, inherent to recovering text from
tokens: templates that strip whitespace (Llama-3 strips each content) hash the stripped text.

ChatML and Llama-3 are built in; ``template: auto`` learns the markers once from two probe
conversations (:func:`learn_markers`). Templates that fold the system prompt into the first
user turn (Mistral) cannot be learned: no chain of theirs is attributed from text.
"""

from __future__ import annotations

from dataclasses import dataclass

from continuum.prefix import MESSAGE_TAG, SYSTEM_TAG

#: Roles whose text is a system prompt (as :func:`continuum.prefix.anchor_text` reads them).
SYSTEM_ROLES = ("system", "developer")
#: A role header longer than this is not a role header.
MAX_ROLE = 64

PENDING = "pending"
"""The text is a proper prefix of something that may still decide the anchor."""
NEVER = "never"
"""The text does not look like a chat prompt of this template: no longer text will help."""

#: Probe conversations for ``template: auto`` (distinctive, whitespace-free contents so no
#: template alters them).
PROBE_SYSTEM = "kvprobe7sys3c1e"
PROBE_USER = "kvprobe5usr9a2d"
PROBE_ASSISTANT = "kvprobe2ast6b0f"
PROBE_SYSTEM_CHAT = ({"role": "system", "content": PROBE_SYSTEM},
                     {"role": "user", "content": PROBE_USER})
PROBE_USER_CHAT = ({"role": "user", "content": PROBE_USER},
                   {"role": "assistant", "content": PROBE_ASSISTANT})


class TemplateError(ValueError):
    """The probe renderings do not show a template whose turns can be told apart."""


@dataclass(frozen=True)
class ChatMarkers:
    """The text around roles and contents in one chat template (see the module docstring)."""

    name: str
    first: str
    post: str
    sep: str


@dataclass(frozen=True)
class Anchor:
    """The text a prefix key is computed from, and its tag (``S`` or ``M``)."""

    tag: bytes
    text: str


CHATML = ChatMarkers("chatml", "<|im_start|>", "\n", "<|im_end|>\n<|im_start|>")
LLAMA3 = ChatMarkers("llama3", "<|begin_of_text|><|start_header_id|>",
                     "<|end_header_id|>\n\n", "<|eot_id|><|start_header_id|>")
BUILTIN_TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3}


def _settled(partial: str, sep: str) -> str:
    """Drop what may still change at the end of a cut text: an undecodable tail (a character
    whose bytes continue in the next block) and a beginning of the separator."""
    text = partial.rstrip("\ufffd")
    for size in range(min(len(sep) - 1, len(text)), 0, -1):
        if text.endswith(sep[:size]):
            return text[:-size].rstrip("\ufffd")
    return text


def find_anchor(text: str, markers: ChatMarkers, max_prefix_length: int) -> Anchor | str:
    """The anchor of a (possibly cut) rendered prompt, or :data:`PENDING` / :data:`NEVER`.

    Args:
        text: The detokenized chain, from the first token of the prompt.
        markers: The engine's chat template markers.
        max_prefix_length: Bytes of anchor text the key hashes (the source's setting).
    """
    if not text.startswith(markers.first):
        return PENDING if markers.first.startswith(text) else NEVER
    pos = len(markers.first)
    while True:
        role_end = text.find(markers.post, pos, pos + MAX_ROLE + len(markers.post))
        if role_end < 0:
            return PENDING if len(text) - pos <= MAX_ROLE + len(markers.post) else NEVER
        role = text[pos:role_end]
        if not role:
            return NEVER
        tag = SYSTEM_TAG if role in SYSTEM_ROLES else MESSAGE_TAG
        start = role_end + len(markers.post)
        end = text.find(markers.sep, start)
        if end < 0:
            content = _settled(text[start:], markers.sep)
            if len(content.encode("utf-8", "surrogatepass")) >= max_prefix_length:
                return Anchor(tag, content)
            return PENDING
        content = text[start:end]
        if content:
            return Anchor(tag, content)
        if tag == MESSAGE_TAG:
            return NEVER  # the router finds no text in an empty first message either
        pos = end + len(markers.sep)  # an empty system message: the anchor comes later


@dataclass(frozen=True)
class RenderedMessage:
    """One turn found in a rendered prompt: its role, its content as rendered, where the
    content starts in the text, and whether the turn is known to be complete (the next
    turn's opening follows it)."""

    role: str
    content: str
    start: int
    complete: bool


def parse_messages(text: str, markers: ChatMarkers) -> list[RenderedMessage] | None:
    """Every turn of a (possibly cut) rendered prompt, in order; None when the text does
    not start like a prompt of this template. The last turn may be incomplete (its
    undecided tail dropped as in :func:`find_anchor`); a cut role header ends the list."""
    if not text.startswith(markers.first):
        return None
    pos = len(markers.first)
    out: list[RenderedMessage] = []
    while True:
        role_end = text.find(markers.post, pos, pos + MAX_ROLE + len(markers.post))
        if role_end <= pos:
            return out
        role = text[pos:role_end]
        start = role_end + len(markers.post)
        end = text.find(markers.sep, start)
        if end < 0:
            out.append(RenderedMessage(role, _settled(text[start:], markers.sep), start, False))
            return out
        out.append(RenderedMessage(role, text[start:end], start, True))
        pos = end + len(markers.sep)


def _split_role(head: str, role: str) -> tuple[str, str]:
    at = head.rfind(role)
    if at < 0:
        raise TemplateError(f"the {role} header does not name its role")
    return head[:at], head[at + len(role):]


def learn_markers(system_text: str, user_text: str) -> ChatMarkers:
    """Markers from the renderings of :data:`PROBE_SYSTEM_CHAT` and :data:`PROBE_USER_CHAT`.

    Both are rendered without a generation prompt and detokenized.

    Raises:
        TemplateError: The renderings do not give role-named turns that can be parsed back.
    """
    i = system_text.find(PROBE_SYSTEM)
    j = system_text.find(PROBE_USER, i + len(PROBE_SYSTEM)) if i >= 0 else -1
    k = user_text.find(PROBE_USER)
    if i < 0 or j < 0 or k < 0:
        raise TemplateError("the probe contents do not appear in order")
    first, post = _split_role(system_text[:i], "system")
    sep, post_user = _split_role(system_text[i + len(PROBE_SYSTEM):j], "user")
    first_user, post_first_user = _split_role(user_text[:k], "user")
    if not (first and post and sep):
        raise TemplateError("the template has no markers around roles and turns")
    if post_user != post or first_user != first or post_first_user != post:
        raise TemplateError("system and user turns are laid out differently")
    markers = ChatMarkers("auto", first, post, sep)
    huge = 1 << 30
    if (find_anchor(system_text, markers, huge) != Anchor(SYSTEM_TAG, PROBE_SYSTEM)
            or find_anchor(user_text, markers, huge) != Anchor(MESSAGE_TAG, PROBE_USER)):
        raise TemplateError("the learned markers do not parse the probes back")
    return markers


def tokenize_url(detokenize_url: str) -> str | None:
    """The ``/tokenize`` URL next to a ``/detokenize`` URL (None when it does not end so)."""
    base, slash, last = detokenize_url.rstrip("/").rpartition("/")
    return f"{base}/tokenize" if slash and last == "detokenize" else None
