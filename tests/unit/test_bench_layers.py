"""tools.bench.layers: the layer servers relay what the upstream answers, streams included
(the floor numbers mean nothing if a layer skipped or broke the work), and the report
says what issue 18's goals leave above the bare Falcon layer."""

from __future__ import annotations

import http.client
import io
import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from continuum.devtools.procs import Child, free_port, wait_http
from tools.bench import layer_apps, layers

ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": "bench-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    child = Child([sys.executable, "-m", "tools.bench.upstream", "--port", str(port),
                   "--model", "bench-model", "--chunks", "5"],
                  tmp_path_factory.mktemp("up") / "upstream.log", name="upstream", cwd=ROOT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 20, children=[child])
        yield port
    finally:
        child.stop()


def _post(port: int, stream: bool, times: int = 2) -> list[tuple[int, str | None, bytes]]:
    """``times`` answers over one kept-alive connection: (status, backend header, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        answers = []
        for _ in range(times):
            conn.request("POST", "/v1/chat/completions",
                         json.dumps({**BODY, "stream": stream}).encode(),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            answers.append((resp.status, resp.getheader("X-Continuum-Backend"), resp.read()))
        return answers
    finally:
        conn.close()


@pytest.mark.parametrize("threads", [False, True], ids=["gevent", "threads"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_floor_server_relays_the_upstreams_answers_on_a_kept_alive_connection(
        upstream: int, tmp_path: Path, stream: bool, threads: bool) -> None:
    direct = _post(upstream, stream, times=1)[0]
    port = free_port()
    floor = Child([sys.executable, "-m", "tools.bench.layer_apps", "--port", str(port),
                   "--upstream-port", str(upstream), *(["--threads"] if threads else [])],
                  tmp_path / "floor.log", name="floor", cwd=ROOT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 20, children=[floor])
        answers = _post(port, stream)
    finally:
        floor.stop()
    # 0: the parent caught the stop, passed it on to the serving child and saw it end
    assert floor.popen.returncode == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert [(status, backend) for status, backend, _ in answers] == [(200, "layer")] * 2
    assert all(body == direct[2] for _, _, body in answers)
    if stream:
        assert direct[2].count(b"data: ") == 6  # five records and [DONE]


@pytest.mark.parametrize("stream", [False, True])
def test_the_wsgi_layer_relays_the_upstreams_answer(
        upstream: int, monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    monkeypatch.setenv("LAYER_UPSTREAM_PORT", str(upstream))
    monkeypatch.setattr(layer_apps, "_pool", None)
    body = json.dumps({**BODY, "stream": stream}).encode()
    started: list[tuple[str, dict[str, str]]] = []
    try:
        out = layer_apps.wsgi(
            {"PATH_INFO": "/v1/chat/completions", "CONTENT_LENGTH": str(len(body)),
             "wsgi.input": io.BytesIO(body)},
            lambda status, headers: started.append((status, dict(headers))))
        data = b"".join(out)
    finally:
        if layer_apps._pool is not None:
            layer_apps._pool.clear()  # the answer read to its end: the connection is idle
    assert started[0][0] == "200 OK"
    assert started[0][1]["X-Continuum-Backend"] == "layer"
    assert data == _post(upstream, stream, times=1)[0][2]
    assert ("Content-Length" in started[0][1]) is not stream


def test_the_report_puts_the_goals_against_the_bare_falcon_layer(
        capsys: pytest.CaptureFixture[str]) -> None:
    results = [
        layers.LayerResult("worker-falcon", 0.120, 0.210, 0.230, 8000.0, 16.0, 60.0),
        layers.LayerResult("router-pah", 0.270, 0.360, 0.370, 3600.0, 18.0, 62.0),
    ]
    layers.report(results, {"cpus": 2, "python": "3.11", "repeat": 1, "chunks": 200})
    out = capsys.readouterr().out
    assert "router CPU <= 0.15 ms at c=32: 30 us left; the router's own work takes 150 us" \
        in out
    assert "added p50 <= 0.3 ms at c=1: 70 us left; the router's own work adds 140 us" in out


def test_exec_runs_another_server_as_its_child_and_passes_the_stop_on(tmp_path: Path) -> None:
    """The Rust routers run under ``layer_apps --exec``: the serving process is the child
    of the one started (the phases read the child's CPU), and a stop reaches it."""
    port = free_port()
    wrapper = Child([sys.executable, "-m", "tools.bench.layer_apps", "--exec", sys.executable,
                     "-m", "tools.bench.upstream", "--port", str(port), "--model", "m"],
                    tmp_path / "exec.log", name="exec", cwd=ROOT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 20, children=[wrapper])
        served = layers.children_of(wrapper.pid)
        assert len(served) == 1
        with open(f"/proc/{served[0]}/cmdline", "rb") as f:
            assert b"tools.bench.upstream" in f.read()
    finally:
        wrapper.stop()
    assert wrapper.popen.returncode == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_rival_is_found_in_the_bin_directory_given_and_started_on_loopback(
        tmp_path: Path) -> None:
    assert layers.rival_executable("sglang-router-cache", str(tmp_path)) is None
    exe = tmp_path / "sglang-router"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert layers.rival_executable("sglang-router-cache", str(tmp_path)) == str(exe)
    argv = layers.rival_argv("sglang-router-cache", str(exe), 9001, 9002, 9003)
    assert argv == [str(exe), "launch", "--host", "127.0.0.1", "--port", "9001",
                    "--worker-urls", "http://127.0.0.1:9002", "--policy", "cache_aware",
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", "9003"]
    vllm = layers.rival_argv("vllm-router-rr", "/x/vllm-router", 1, 2, 3)
    assert vllm[:1] == ["/x/vllm-router"] and vllm[vllm.index("--policy") + 1] == "round_robin"


def test_the_report_divides_the_routers_rows_by_the_rust_routers(
        capsys: pytest.CaptureFixture[str]) -> None:
    results = [
        layers.LayerResult("router-pah", 0.400, 0.600, 0.500, 2000.0, 30.0, 90.0),
        layers.LayerResult("sglang-router-cache", 0.200, 0.300, 0.250, 6000.0, 25.0, None),
        layers.LayerResult("vllm-router-rr", 0.100, 0.200, 0.200, 11000.0, 20.0, 70.0),
    ]
    layers.report(results, {"cpus": 2, "python": "3.11", "repeat": 1, "chunks": 200})
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines()
               if line.startswith("router-pah / sglang-router-cache"))
    assert row.split()[3:] == ["2.00x", "2.00x", "2.00x", "1.20x", "-"]
    # router-rr was not measured: no pair with vllm-router-rr
    assert "router-rr / vllm-router-rr" not in out
