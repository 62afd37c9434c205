"""Chat templates: how a list of OpenAI messages becomes the prompt text a model sees.

The renderings follow the public templates of ChatML (Qwen), Llama-3 Instruct and Mistral
Instruct closely enough that prompts carry the real special markers and the same shape of
shared prefixes (system prompt first, one header per turn).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from continuum.errors import RequestError

Message = Mapping[str, Any]


@dataclass(frozen=True)
class ChatTemplate:
    """A named chat template with its BOS and end-of-turn (EOS) special tokens."""

    name: str
    bos: str | None
    eos: str
    _render: Callable[[list[tuple[str, str]], bool, bool], str]

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text for ``messages``.

        Args:
            messages: OpenAI chat messages (``role`` and ``content``; content may be a
                string, ``None`` or a list of content parts).
            add_generation_prompt: open an assistant turn at the end.
            continue_final_message: leave the last message open so the model continues it
                (exclusive with ``add_generation_prompt``, as in vLLM).

        Raises:
            RequestError: a message is malformed, or both flags are set.
        """
        if add_generation_prompt and continue_final_message:
            raise RequestError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        turns = [(_role(m), message_text(m)) for m in messages]
        return self._render(turns, add_generation_prompt, continue_final_message)


def _role(message: Message) -> str:
    if not isinstance(message, Mapping):
        raise RequestError("each message must be an object", param="messages")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise RequestError("each message needs a string 'role'", param="messages")
    return role


def message_text(message: Message) -> str:
    """The text of one message: string content, or its text parts joined by newlines.

    Non-text parts become a placeholder (``<image>``, ``<audio>`` …) so they still take
    tokens, as multimodal placeholders do.
    """
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping):
                kind = str(part.get("type", "text"))
                if kind == "text":
                    parts.append(str(part.get("text", "")))
                else:
                    parts.append("<" + kind.removesuffix("_url") + ">")
        return "\n".join(parts)
    raise RequestError("message 'content' must be a string or a list of parts", param="messages")


def _chatml(turns: list[tuple[str, str]], gen: bool, cont: bool) -> str:
    out = []
    for i, (role, text) in enumerate(turns):
        last_open = cont and i == len(turns) - 1
        out.append(f"<|im_start|>{role}\n{text}" + ("" if last_open else "<|im_end|>\n"))
    if gen:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _llama3(turns: list[tuple[str, str]], gen: bool, cont: bool) -> str:
    out = ["<|begin_of_text|>"]
    for i, (role, text) in enumerate(turns):
        last_open = cont and i == len(turns) - 1
        out.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{text.strip()}")
        if not last_open:
            out.append("<|eot_id|>")
    if gen:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


def _mistral(turns: list[tuple[str, str]], gen: bool, cont: bool) -> str:
    system = "\n\n".join(text for role, text in turns if role == "system")
    out = ["<s>"]
    rest = [(r, t) for r, t in turns if r != "system"]
    for i, (role, text) in enumerate(rest):
        last_open = cont and i == len(rest) - 1
        if role == "assistant":
            out.append(f" {text}" + ("" if last_open else "</s>"))
        else:
            if system and not any(r != "assistant" for r, _ in rest[:i]):
                text = f"{system}\n\n{text}"
            out.append(f"[INST] {text} [/INST]")
    return "".join(out)


TEMPLATES: dict[str, ChatTemplate] = {
    "chatml": ChatTemplate("chatml", None, "<|im_end|>", _chatml),
    "llama3": ChatTemplate("llama3", "<|begin_of_text|>", "<|eot_id|>", _llama3),
    "mistral": ChatTemplate("mistral", "<s>", "</s>", _mistral),
}


def get_template(name: str) -> ChatTemplate:
    """The template called ``name`` (``chatml``, ``llama3``, ``mistral``).

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(
            f"unknown chat template {name!r}; choose one of {', '.join(TEMPLATES)}"
        ) from None
