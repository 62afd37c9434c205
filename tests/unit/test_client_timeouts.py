"""``server.client_header_timeout_seconds`` / ``client_body_timeout_seconds``: defaults,
durations, ranges (behaviour: tests/integration/test_slow_clients.py)."""

from __future__ import annotations

from continuum.config import check_config, defaults_text, parse_config

BACKEND = {"name": "a", "url": "http://127.0.0.1:9000"}


def test_defaults_and_durations() -> None:
    server = parse_config({"backends": [BACKEND]}).server
    assert (server.client_header_timeout_seconds, server.client_body_timeout_seconds) == (10, 30)
    server = parse_config({"backends": [BACKEND], "server": {
        "client_header_timeout_seconds": "1500ms", "client_body_timeout_seconds": "2m"}}).server
    assert (server.client_header_timeout_seconds, server.client_body_timeout_seconds) == (1.5, 120)
    text = defaults_text()
    assert 'client_header_timeout_seconds: "10s"' in text
    assert 'client_body_timeout_seconds: "30s"' in text


def test_out_of_range_names_the_key() -> None:
    result = check_config({"backends": [BACKEND], "server": {
        "client_header_timeout_seconds": 0, "client_body_timeout_seconds": "2h"}})
    assert sorted(issue.render("c.yaml") for issue in result.errors) == [
        "c.yaml: server.client_body_timeout_seconds: must be between 1 and 3600 (got '2h')",
        "c.yaml: server.client_header_timeout_seconds: must be between 1 and 3600 (got 0)",
    ]
