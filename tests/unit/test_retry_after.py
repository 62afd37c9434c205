"""A 503 for want of a healthy backend tells the client when to try again: the health
checks' interval (a backend may be back after the next probe), in whole seconds, at
least 1, as ``Retry-After`` (the openai and anthropic SDKs honour it when they retry)."""

from __future__ import annotations

import falcon
import falcon.testing
import pytest

from continuum.errors import ContinuumError, ModelNotFoundError, NoHealthyBackendError
from continuum.web.http import handle_continuum_error


def _answer(exc: ContinuumError) -> falcon.testing.Result:
    class Fails:
        def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
            raise exc

    app = falcon.App()
    app.add_route("/v1/chat/completions", Fails())
    app.add_error_handler(ContinuumError, handle_continuum_error)
    return falcon.testing.TestClient(app).simulate_post("/v1/chat/completions")


@pytest.mark.parametrize(("seconds", "header"), [(5.0, "5"), (5.5, "6"), (0.2, "1")])
def test_no_healthy_backend_says_when_to_retry(seconds: float, header: str) -> None:
    result = _answer(NoHealthyBackendError("none for 'm'", retry_after=seconds))
    assert result.status_code == 503
    assert result.headers["retry-after"] == header
    assert result.json["error"]["code"] == "no_healthy_backend"


def test_other_errors_carry_no_retry_after() -> None:
    assert "retry-after" not in _answer(ModelNotFoundError("no such model")).headers
    assert "retry-after" not in _answer(NoHealthyBackendError("drained")).headers
