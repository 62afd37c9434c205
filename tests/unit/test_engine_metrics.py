"""Slots learned from an engine's queue gauges (continuum.routing.engine_metrics)."""

from __future__ import annotations

from continuum.routing.engine_metrics import KEEP, NEED, SlotLearner, read_queue

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 6.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.97
vllm:generation_tokens_total{engine="0",model_name="m"} 1234.0
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 16.0 1733400000000
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 5.0 1733400000000
sglang:num_used_tokens{model_name="m",tp_rank="0"} 40000.0
"""


def test_vllm_gauges_are_summed_over_engines_and_other_families_ignored() -> None:
    assert read_queue(VLLM) == (8, 3)


def test_sglang_gauges_with_timestamps() -> None:
    assert read_queue(SGLANG) == (16, 5)


def test_unlabelled_series_and_a_missing_waiting_gauge() -> None:
    assert read_queue("vllm:num_requests_running 4\nvllm:num_requests_waiting 1\n") == (4, 1)
    assert read_queue("vllm:num_requests_running 4\n") == (4, 0)


def test_no_engine_gauges_is_none_and_bad_samples_are_skipped() -> None:
    assert read_queue("") is None
    assert read_queue("# TYPE http_requests_total counter\nhttp_requests_total 7\n") is None
    assert read_queue("vllm:num_requests_waiting 3\n") is None  # no running gauge
    text = ("vllm:num_requests_running{a=\"}\"} NaN\nvllm:num_requests_running{} -1\n"
            "vllm:num_requests_running{engine=\"0\"} oops\nvllm:num_requests_running 2\n"
            "vllm:num_requests_waiting{engine=\"0\"}\n")
    assert read_queue(text) == (2, 0)


def test_a_label_value_with_braces_and_spaces() -> None:
    text = 'vllm:num_requests_running{model_name="a {b} c"} 5\n'
    assert read_queue(text) == (5, 0)


def test_slots_need_two_saturated_probes_and_are_the_most_that_ran() -> None:
    learner = SlotLearner()
    assert NEED == 2 and KEEP == 4
    assert learner.observe(8, 0) is None  # nobody waits: says nothing about the limit
    assert learner.observe(0, 5) is None  # waiting with nothing running: starting up
    assert learner.observe(5, 2) is None  # one saturated probe is not enough
    assert learner.observe(8, 1) == 8
    assert learner.observe(3, 4) == 8  # a probe between steps does not lower it


def test_old_saturated_probes_age_out() -> None:
    learner = SlotLearner()
    for running in (16, 16):
        learner.observe(running, 1)
    assert learner.slots == 16
    for _ in range(KEEP - 1):
        assert learner.observe(6, 3) == 16
    assert learner.observe(6, 3) == 6  # the engine's mix changed: KV memory binds at 6
