"""``sources[].data_parallel_size``: the config checks and the engines' per-rank endpoints.

A vLLM or SGLang engine with N data-parallel ranks publishes rank ``r``'s stream on its
endpoint offset by ``r`` (``docs/kv-events.md`` §1.1): a tcp port plus ``r``, an inproc name
plus ``_dp<r>``, the replay endpoint alike. The listener derives the same endpoints, so the
endpoints it can be given are the ones that rule can offset N times.
"""

from __future__ import annotations

from typing import Any

import pytest

from continuum.sim.kv_publish import offset_endpoint as sim_offset_endpoint
from continuum.sim.kv_wire import get_profile
from listener.config import (
    MAX_DATA_PARALLEL,
    SourceConfig,
    check_listener_config,
    offset_endpoint,
    rank_endpoint_problem,
    rank_endpoints,
)

BASE = {"backend_name": "vllm-dp", "engine": "vllm", "model": "m",
        "zmq_endpoint": "tcp://127.0.0.1:5557", "allowed_publishers": ["127.0.0.1"],
        "detokenize_endpoint": "http://127.0.0.1:8000/detokenize"}


def errors_of(*sources: dict[str, Any]) -> dict[str, str]:
    """``{key path: message}`` of the config errors of ``sources`` (each over ``BASE``)."""
    config, errors, _warnings = check_listener_config(
        {"sources": [{**BASE, **source} for source in sources]})
    assert (config is None) == bool(errors)
    found = {issue.path: issue.message for issue in errors}
    assert len(found) == len(errors), errors  # one error per key
    return found


def test_data_parallel_size_defaults_to_one_and_is_range_checked() -> None:
    config, errors, _ = check_listener_config({"sources": [BASE]})
    assert errors == [] and config is not None
    assert config.sources[0].data_parallel_size == 1
    assert errors_of({"data_parallel_size": 2}) == {}
    assert errors_of({"data_parallel_size": MAX_DATA_PARALLEL}) == {}
    for bad in (0, -1, MAX_DATA_PARALLEL + 1, "two", 1.5, True):
        found = errors_of({"data_parallel_size": bad})
        assert list(found) == ["sources[0].data_parallel_size"], bad


def test_every_rank_needs_its_own_sequence_counter() -> None:
    """Ranks beyond ``limits.max_sequence_streams`` would push each other's counters out,
    and every rank's next batch would read as lost state."""
    source = {**BASE, "data_parallel_size": 8}
    _config, errors, _ = check_listener_config(
        {"limits": {"max_sequence_streams": 4}, "sources": [source]})
    [issue] = errors
    assert issue.path == "sources[0].data_parallel_size"
    assert "limits.max_sequence_streams of at least 8" in issue.message
    _config, errors, _ = check_listener_config(
        {"limits": {"max_sequence_streams": 8}, "sources": [source]})
    assert errors == []


def test_data_parallel_size_is_for_zmq_engines_only() -> None:
    """trtllm-serve reports every attention-DP rank in one reply (``attention_dp_rank``)."""
    trtllm = {"engine": "trtllm", "zmq_endpoint": None, "detokenize_endpoint": None,
              "trtllm_endpoint": "http://127.0.0.1:8000/kv_cache_events"}
    top = {"cache_salt": {"secret": "s" * 32}}
    _config, errors, _ = check_listener_config(
        {**top, "sources": [{**BASE, **trtllm, "data_parallel_size": 2}]})
    [issue] = errors
    assert issue.path == "sources[0].data_parallel_size"
    assert "trtllm" in issue.message and "attention-DP rank" in issue.message
    _config, errors, _ = check_listener_config({**top, "sources": [{**BASE, **trtllm}]})
    assert errors == []


@pytest.mark.parametrize(("key", "endpoint", "ranks", "fragment"), [
    ("zmq_endpoint", "tcp://127.0.0.1:65535", 2, "ports 65535..65536"),
    ("zmq_endpoint", "tcp://*:65500", 37, "ports 65500..65536"),
    ("replay_endpoint", "tcp://127.0.0.1:65534", 3, "ports 65534..65536"),
    ("zmq_endpoint", "tcp://127.0.0.1:0", 2, "port 0 cannot be offset"),
    ("zmq_endpoint", "tcp://127.0.0.1:*", 2, "wildcard port"),
    ("zmq_endpoint", "ipc:///tmp/kv-events", 2, "only tcp:// ports and inproc:// names"),
    ("replay_endpoint", "ipc:///tmp/kv-replay", 2, "only tcp:// ports and inproc:// names"),
    ("zmq_endpoint", "tcp://inproc-host:5557", 2, "containing 'inproc'"),
])
def test_endpoints_the_rank_rule_cannot_offset_are_errors(
        key: str, endpoint: str, ranks: int, fragment: str) -> None:
    errors = errors_of({key: endpoint, "data_parallel_size": ranks})
    assert list(errors) == [f"sources[0].{key}"]
    assert fragment in errors[f"sources[0].{key}"]
    assert errors_of({key: endpoint}) == {}  # one rank: nothing is offset


def test_endpoints_the_rank_rule_can_offset() -> None:
    assert errors_of({"zmq_endpoint": "tcp://127.0.0.1:65534", "data_parallel_size": 2}) == {}
    assert errors_of({"zmq_endpoint": "inproc://kv", "replay_endpoint": "tcp://*:6000",
                      "data_parallel_size": 8, "zmq_mode": "bind"}) == {}
    # the errors of a malformed port are check_tcp_port's, not repeated
    errors = errors_of({"zmq_endpoint": "tcp://127.0.0.1:99999", "data_parallel_size": 2})
    assert errors["sources[0].zmq_endpoint"].startswith("port must be a number")


def test_rank_endpoints_follow_the_engines_rule() -> None:
    assert rank_endpoints("tcp://*:5557", 3) == [
        "tcp://*:5557", "tcp://*:5558", "tcp://*:5559"]
    assert rank_endpoints("inproc://kv", 3) == ["inproc://kv", "inproc://kv_dp1",
                                                "inproc://kv_dp2"]
    assert rank_endpoints("tcp://[::1]:7000", 2) == ["tcp://[::1]:7000", "tcp://[::1]:7001"]
    # the "source;destination" form: the destination's port is offset (rfind(':'))
    assert offset_endpoint("tcp://127.0.0.2:0;127.0.0.1:5557", 1) == \
        "tcp://127.0.0.2:0;127.0.0.1:5558"
    assert rank_endpoints("ipc:///tmp/kv", 1) == ["ipc:///tmp/kv"]
    assert rank_endpoints("tcp://127.0.0.1:0", 1) == ["tcp://127.0.0.1:0"]
    with pytest.raises(ValueError, match="beyond 65535"):
        rank_endpoints("tcp://127.0.0.1:65535", 2)
    # the simulated engine's own implementation of the rule agrees
    profile = get_profile("vllm-0.33")
    for endpoint in ("tcp://*:5557", "tcp://10.0.0.5:6000", "inproc://kv"):
        assert rank_endpoints(endpoint, 4) == [
            sim_offset_endpoint(endpoint, rank, profile) for rank in range(4)]
    assert rank_endpoint_problem("tcp://127.0.0.1:5557", 1) is None


def test_two_sources_may_not_bind_the_same_rank_port() -> None:
    first = {"data_parallel_size": 4}  # binds 5557..5560
    second = {"backend_name": "other", "zmq_endpoint": "tcp://127.0.0.1:5560"}
    errors = errors_of(first, second)
    assert list(errors) == ["sources[1].zmq_endpoint"]
    assert "port 5560 (rank 0) is also bound by sources[0] (rank 3)" in errors[
        "sources[1].zmq_endpoint"]
    assert list(errors_of(first, {**second, "zmq_endpoint": "tcp://*:5559"})) == [
        "sources[1].zmq_endpoint"]
    # the next free port, another address, or an engine the listener connects to: fine
    assert errors_of(first, {**second, "zmq_endpoint": "tcp://127.0.0.1:5561"}) == {}
    assert errors_of(first, {**second, "zmq_endpoint": "tcp://127.0.0.2:5560"}) == {}
    assert errors_of(first, {**second, "zmq_mode": "connect"}) == {}


@pytest.mark.parametrize(("ours", "theirs"), [("127.0.0.1", "localhost"),
                                              ("localhost", "127.0.0.1"),
                                              ("::1", "localhost")])
def test_two_names_of_the_loopback_bind_the_same_port(ours: str, theirs: str) -> None:
    """``localhost`` and ``127.0.0.1`` (or ``::1``) are one interface to ZMQ: the second
    bind of a port would fail with EADDRINUSE at start, so ``--check`` refuses it (it
    compared the host texts, and passed it)."""
    host = f"[{ours}]" if ":" in ours else ours
    first = {"zmq_endpoint": f"tcp://{host}:5557", "zmq_mode": "bind", "data_parallel_size": 2}
    second = {"backend_name": "other", "zmq_endpoint": f"tcp://{theirs}:5558",
              "zmq_mode": "bind"}
    errors = errors_of(first, second)
    assert list(errors) == ["sources[1].zmq_endpoint"]
    assert "port 5558 (rank 0) is also bound by sources[0] (rank 1)" in errors[
        "sources[1].zmq_endpoint"]
    assert errors_of(first, {**second, "zmq_endpoint": f"tcp://{theirs}:5559"}) == {}


def test_source_config_built_in_code_is_checked_by_the_source() -> None:
    """A SourceConfig made without the config table (tests, embedders) still cannot make a
    ZmqSource whose ranks' ports overflow."""
    import zmq.green as zmq

    from listener.sources_zmq import ZapAuthenticator, ZmqSource

    config = SourceConfig(backend_name="b", engine="vllm", model="m",
                          zmq_endpoint="tcp://127.0.0.1:65535", data_parallel_size=2,
                          allowed_publishers=("127.0.0.1",), require_salt=True)
    context = zmq.Context()
    zap = ZapAuthenticator(context)
    try:
        with pytest.raises(ValueError, match=r"source b: .*beyond 65535"):
            ZmqSource(config, object(), context=context, zap=zap)  # type: ignore[arg-type]
    finally:
        zap.close()
        context.destroy(linger=0)


def test_the_documented_examples_pass_the_check() -> None:
    """The ``data_parallel_size`` examples of ``docs/kv-events.md`` §12.6 and the README."""
    import re
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    docs = (root / "docs" / "kv-events.md").read_text()
    section = docs[docs.index("### 12.6"):]
    readme = (root / "README.md").read_text()
    blocks = [re.search(r"```yaml\n(.*?)```", section, re.S),
              re.search(r"```yaml\n(sources:\n  - \{backend_name: vllm-dp.*?)```", readme,
                        re.S)]
    for block in blocks:
        assert block is not None
        config, errors, _ = check_listener_config(yaml.safe_load(block.group(1)))
        assert errors == [] and config is not None
        assert config.sources[0].data_parallel_size == 4
        assert rank_endpoints(config.sources[0].zmq_endpoint or "", 4)[-1].endswith(":5560")


def test_the_ranks_pub_and_replay_ports_may_not_overlap() -> None:
    """The engine's ranks bind PUB P .. P+N-1 and replay R .. R+N-1 (or the listener binds
    the PUB ports, on the same host): with PUB 5557 and replay 5558, rank 1 would publish on
    rank 0's replay port. Either mode, named at ``replay_endpoint``; the ranges side by
    side, or on another host, are fine."""
    for mode in ("bind", "connect"):
        found = errors_of({"zmq_mode": mode, "data_parallel_size": 2,
                           "replay_endpoint": "tcp://127.0.0.1:5558"})
        assert list(found) == ["sources[0].replay_endpoint"], mode
        assert ("rank 0's replay port 5558 is rank 1's zmq_endpoint port" in
                found["sources[0].replay_endpoint"])
    found = errors_of({"data_parallel_size": 4, "replay_endpoint": "tcp://127.0.0.1:5555"})
    assert "rank 2's replay port 5557 is rank 0's zmq_endpoint port" in found[
        "sources[0].replay_endpoint"]
    assert "5555..5558 overlap 5557..5560" in found["sources[0].replay_endpoint"]
    # one rank: the very same port
    assert list(errors_of({"replay_endpoint": "tcp://127.0.0.1:5557"})) == [
        "sources[0].replay_endpoint"]
    # a wildcard bind and a loopback engine are one machine; localhost is 127.0.0.1
    assert list(errors_of({"zmq_endpoint": "tcp://*:5557", "data_parallel_size": 2,
                           "replay_endpoint": "tcp://127.0.0.1:5558"})) == [
        "sources[0].replay_endpoint"]
    assert list(errors_of({"zmq_endpoint": "tcp://localhost:5557", "zmq_mode": "connect",
                           "allowed_publishers": ["localhost"], "data_parallel_size": 2,
                           "replay_endpoint": "tcp://127.0.0.1:5558"})) == [
        "sources[0].replay_endpoint"]
    for fine in ({"data_parallel_size": 2, "replay_endpoint": "tcp://127.0.0.1:5559"},
                 {"data_parallel_size": 2, "replay_endpoint": "tcp://127.0.0.1:5555"},
                 {"data_parallel_size": 2, "replay_endpoint": "tcp://10.0.0.7:5558",
                  "allowed_publishers": ["127.0.0.1", "10.0.0.7"]},
                 {"data_parallel_size": 2, "replay_endpoint": "inproc://replay"}):
        assert errors_of(fine) == {}, fine


def test_no_rank_port_is_the_listeners_own_http_port() -> None:
    """``listen`` binds the listener's HTTP port: a rank's PUB port (bound by the listener
    or the engine) or replay port on the same host cannot be it."""
    def errors(listen: str, **source: Any) -> dict[str, str]:
        _config, found, _ = check_listener_config(
            {"listen": listen, "sources": [{**BASE, **source}]})
        return {issue.path: issue.message for issue in found}

    found = errors("127.0.0.1:5558", data_parallel_size=2)
    assert list(found) == ["sources[0].zmq_endpoint"]
    assert ("port 5558 (data-parallel rank 1) is the listener's own HTTP port"
            in found["sources[0].zmq_endpoint"])
    assert list(errors("0.0.0.0:5557", zmq_mode="connect")) == ["sources[0].zmq_endpoint"]
    assert list(errors("[::1]:5568", data_parallel_size=2,
                       replay_endpoint="tcp://127.0.0.1:5567")) == [
        "sources[0].replay_endpoint"]
    assert errors("127.0.0.1:5559", data_parallel_size=2) == {}
    assert errors("10.0.0.9:5558", data_parallel_size=2) == {}  # another host
    assert errors("127.0.0.1:0", data_parallel_size=2) == {}  # any free port

