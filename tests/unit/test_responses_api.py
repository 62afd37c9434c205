"""The Responses API shapes shared by the simulated engine and the Gemini translation."""

from __future__ import annotations

from typing import Any

import pytest

from continuum.errors import RequestError
from continuum.sim.responses import chat_messages
from continuum.wire.responses_api import input_role


@pytest.mark.parametrize(("item", "role"), [
    ({"role": "user"}, "user"), ({"role": "developer"}, "system"),
    ({"role": "tool"}, None), ({"role": {"user": 1}}, None), ({"role": ["user"]}, None),
    ({}, None), ("user", None),
])
def test_an_input_items_role_maps_to_a_chat_role_or_to_none(item: Any, role: Any) -> None:
    assert input_role(item) == role


def test_the_simulated_engine_refuses_a_role_that_is_not_a_string_naming_the_item() -> None:
    with pytest.raises(RequestError) as caught:
        chat_messages({"model": "m", "input": [{"role": "user", "content": "hi"},
                                               {"role": {"user": 1}, "content": "hi"}]})
    assert caught.value.param == "input[1]"
