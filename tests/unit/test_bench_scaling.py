"""tools.bench.scaling: what it reads from wrk, what it sends, what nginx answers, and the
ratio and ceiling it prints (the bench itself needs wrk and nginx and is not run here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tools.bench import overhead as ob
from tools.bench import scaling
from tools.bench.upstream import Answers

# wrk 4.1.0's own output (Debian's package), against nginx answering 503 and 200.
WRK_NON_2XX = """\
Running 1s test @ http://127.0.0.1:18999/bad
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    34.59us   86.49us   2.24ms   98.91%
    Req/Sec   120.14k    10.29k  129.42k    72.73%
  Latency Distribution
     50%   28.00us
     75%   31.00us
     90%   35.00us
     99%  137.00us
  130832 requests in 1.10s, 22.21MB read
  Non-2xx or 3xx responses: 130832
Requests/sec: 118926.29
Transfer/sec:     20.19MB
"""

WRK_SOCKET_ERRORS = """\
Running 10s test @ http://127.0.0.1:41234/v1/chat/completions
  1 threads and 32 connections
  Latency Distribution
     50%    8.36ms
     75%    9.10ms
     90%   10.02ms
     99%    1.20s
  36040 requests in 10.00s, 20.00MB read
  Socket errors: connect 0, read 2, write 0, timeout 5
Requests/sec:   3604.00
"""


def test_wrk_output_gives_requests_seconds_errors_and_latency_in_ms() -> None:
    requests, seconds, errors, p50, p99 = scaling.parse_wrk(WRK_NON_2XX)
    assert (requests, seconds, errors) == (130832, 1.10, 130832)
    assert p50 == pytest.approx(0.028) and p99 == pytest.approx(0.137)
    requests, seconds, errors, p50, p99 = scaling.parse_wrk(WRK_SOCKET_ERRORS)
    assert (requests, seconds, errors) == (36040, 10.0, 7)
    assert p50 == pytest.approx(8.36) and p99 == pytest.approx(1200.0)


def test_wrk_output_without_a_request_count_is_an_error() -> None:
    with pytest.raises(ob.BenchError, match="no request count"):
        scaling.parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")


def test_the_wrk_script_sends_the_goal_suites_request(tmp_path: Path) -> None:
    script = scaling.wrk_script(tmp_path, 8080).read_text()
    assert 'wrk.method = "POST"' in script
    body = re.search(r"^wrk\.body = (.*)$", script, re.M)
    assert body is not None
    raw = ob.build_request(8080, stream=False)
    assert json.loads(body.group(1)).encode() == raw.split(b"\r\n\r\n", 1)[1]
    headers = dict(re.findall(r'^wrk\.headers\["([^"]+)"\] = "([^"]*)"$', script, re.M))
    assert headers == {"User-Agent": "continuum-bench/1", "Accept": "application/json",
                       "Authorization": "Bearer sk-bench",
                       "Content-Type": "application/json"}  # wrk sets Host, Content-Length


def test_nginx_answers_what_the_python_upstream_answers(tmp_path: Path) -> None:
    conf = scaling.NGINX_CONF.format(
        tmp=tmp_path, port=8081,
        models=scaling._body_of(Answers(ob.MODEL, 8, 0.0).models),
        completion=scaling._body_of(Answers(ob.MODEL, 8, 0.0).completion))
    returns = dict(re.findall(r"location = (\S+) \{ return 200 '([^']*)'; \}", conf))
    answers = Answers(ob.MODEL, 8, 0.0)
    assert set(returns) == {"/health", "/v1/models", "/v1/chat/completions"}
    assert json.loads(returns["/v1/chat/completions"]) == json.loads(
        scaling._body_of(answers.completion))
    assert json.loads(returns["/v1/models"])["data"][0]["id"] == ob.MODEL
    assert "$" not in conf  # nginx would read it as a variable
    assert "listen 127.0.0.1:8081 " in conf


def _round(workers: int, rps: float, router_ms: float) -> scaling.Round:
    return scaling.Round(workers=workers, rps=rps, requests=int(rps * 10), errors=0,
                         latency_p50_ms=1.0, latency_p99_ms=2.0, router_cpu_ms=router_ms,
                         upstream_cpu_us=20.0, client_cpu_us=30.0, worker_shares=[1.0])


def test_summary_takes_medians_and_the_ceiling_from_two_workers_cpu() -> None:
    rounds = [_round(1, 3000, 0.30), _round(2, 5000, 0.25), _round(1, 3600, 0.28),
              _round(2, 6000, 0.25), _round(1, 3300, 0.29), _round(2, 5400, 0.25)]
    summary = scaling.summarize(rounds, cpus=2)
    assert summary["shapes"][1]["rps"] == 3300 and summary["shapes"][2]["rps"] == 5400
    assert summary["ratio"] == pytest.approx(5400 / 3300)
    # 2 CPUs / (0.25 + 0.020 + 0.030 ms) = 6,667 req/s; over one worker's 3,300: 2.02 -> 2
    assert summary["ceiling_rps"] == pytest.approx(2000 / 0.3)
    assert summary["ceiling_ratio"] == 2.0
    assert "ratio" not in scaling.summarize(rounds[::2], cpus=2)
