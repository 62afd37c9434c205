"""The simulated engine's tokenizer and chat templates."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from continuum.errors import RequestError
from continuum.sim.templates import TEMPLATES, get_template
from continuum.sim.tokenizer import SPECIAL_TOKENS, SimTokenizer

TOK = SimTokenizer()

#: Text with template markers and the pieces the pre-tokenizer splits on mixed in.
_MIXED = st.lists(
    st.one_of(
        st.text(),
        st.sampled_from([*SPECIAL_TOKENS, " the", "The", "  ", "\n\n", "<|im_", "|>", "😀"]),
    ),
    max_size=12,
).map("".join)


@given(st.text())
def test_decode_inverts_encode_for_any_text(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text


@given(st.text(alphabet=st.characters(codec=None, exclude_categories=())))
def test_round_trip_includes_lone_surrogates(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text


@given(_MIXED)
def test_round_trip_with_special_markers(text: str) -> None:
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert "".join(TOK.token_strs(ids)) == text
    assert all(0 <= i < 2**31 for i in ids)


def test_ids_are_stable_across_instances_and_words_are_single_tokens() -> None:
    text = "The model cache is a prefix of the request."
    assert SimTokenizer().encode(text) == TOK.encode(text)
    # every word of the built-in list, with or without a leading space, is one token
    assert len(TOK.encode(" model cache prefix")) == 3
    assert TOK.encode("<|im_start|>") == [SPECIAL_TOKENS.index("<|im_start|>")]


def test_unknown_words_fall_back_to_short_chunks() -> None:
    ids = TOK.encode("zyxwvut")
    assert len(ids) == 3  # at most three bytes per chunk
    assert TOK.token_strs(ids) == ["zyx", "wvu", "t"]
    emoji = TOK.encode("a😀b")
    assert TOK.token_strs(emoji) == ["a", "😀", "b"]


def test_bos_is_prepended_on_request() -> None:
    assert TOK.encode("hi", bos="<|begin_of_text|>")[0] == TOK.special_id("<|begin_of_text|>")


@pytest.mark.parametrize("bad", [-1, 2**31, 64 + 100000, 65536 + 300])
def test_out_of_vocabulary_ids_are_rejected(bad: int) -> None:
    with pytest.raises(RequestError):
        TOK.decode([bad])


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


def test_chatml_rendering() -> None:
    assert get_template("chatml").render(MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi\n<image><|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_llama3_rendering_and_continue_final_message() -> None:
    text = get_template("llama3").render(
        MESSAGES[:3], add_generation_prompt=False, continue_final_message=True
    )
    assert text == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi\n<image><|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello."
    )


def test_mistral_rendering_folds_system_into_first_user_turn() -> None:
    assert get_template("mistral").render(MESSAGES) == (
        "<s>[INST] Be brief.\n\nHi\n<image> [/INST] Hello.</s>[INST] Bye [/INST]"
    )


def test_templates_share_the_prefix_of_a_growing_conversation() -> None:
    for template in TEMPLATES.values():
        short = template.render(MESSAGES[:2], add_generation_prompt=False)
        long = template.render(MESSAGES)
        assert long.startswith(short)


def test_template_errors() -> None:
    with pytest.raises(ValueError, match="chatml"):
        get_template("nope")
    with pytest.raises(RequestError):
        get_template("chatml").render([{"content": "no role"}])
    with pytest.raises(RequestError):
        get_template("chatml").render(
            MESSAGES, add_generation_prompt=True, continue_final_message=True
        )
