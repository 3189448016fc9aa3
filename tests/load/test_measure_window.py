"""The measured window of a closed loop holds requests even when warm-up requests outlast it.

A real SSE server process on 127.0.0.1 whose requests take ~0.9 s, a window of 0.3 s: before the
fix every worker was still busy with its warm-up request when the window closed (0/0/0 measured).
"""

from __future__ import annotations

import pytest

from tuner.errors import LoadError
from tuner.load import RandomSpec, build_workload, run_load_sync
from tuner.load.arrivals import PhasePlan

_SLOW = ("--ttft-ms", "100", "--itl-ms", "20")  # 40 output tokens → E2E ≈ 0.9 s


def test_warmup_backlog_longer_than_window_still_measures(start_server) -> None:
    url = start_server(*_SLOW).url
    wl = build_workload(RandomSpec(input_len=32, output_len=40), seed=3)
    result = run_load_sync(url, wl, concurrency=4, warmup_s=0.2, duration_s=0.3, timeout_s=60.0)
    s = result.summary
    assert not result.partial and result.stop_reason is None
    assert s.completed >= 4 and s.errored == 0 and s.output_throughput > 0 and s.concurrency > 0
    assert all(r.send_time_s >= 0.2 for r in result.measured())  # warm-up sends stay excluded
    measure = next(p for p in result.phases if p.name == "measure")
    assert measure.sent == 4 and measure.end_s > 0.2 + 0.3  # the window waited for its sends
    assert result.settings["min_measured"] == 4


def test_timed_window_alone_can_be_empty_and_timeout_names_the_wait(start_server) -> None:
    url = start_server(*_SLOW).url
    wl = build_workload(RandomSpec(input_len=32, output_len=40), seed=3)
    # min_measured=0 is the old rule: the window closes on time with nothing sent in it.
    old = run_load_sync(url, wl, concurrency=4, warmup_s=0.2, duration_s=0.3, min_measured=0, timeout_s=60.0)
    assert old.summary.completed == 0 and not old.measured()
    # The wait for the window's sends is bounded by timeout_s, and the stop reason says why.
    cut = run_load_sync(url, wl, concurrency=4, warmup_s=0.2, duration_s=0.3, timeout_s=0.6)
    assert cut.partial and "waited for 4 requests (0 sent in it)" in (cut.stop_reason or "")


def test_phase_plan_window_ends_on_time_once_it_holds_its_sends() -> None:
    plan = PhasePlan(warmup_s=1.0, duration_s=2.0, min_measured=2)
    assert plan.phase_for_send(0.5) == "warmup"
    plan.advance(3.5)
    assert plan.measure_end_s is None and plan.waiting_for_sends(3.5)
    assert plan.phase_for_send(4.0) == "measure" and plan.measure_end_s is None
    assert plan.phase_for_send(4.5) == "measure" and plan.measure_end_s == 4.5
    on_time = PhasePlan(warmup_s=0.0, duration_s=2.0, min_measured=2)
    assert [on_time.phase_for_send(t) for t in (0.1, 0.2)] == ["measure", "measure"]
    on_time.advance(2.5)
    assert on_time.measure_end_s == 2.0
    with pytest.raises(LoadError):
        PhasePlan(duration_s=1.0, min_measured=-1)


def test_trial_names_the_measure_s_an_empty_window_needs(start_server) -> None:
    from tuner.trial import measure_gap

    url = start_server(*_SLOW).url
    wl = build_workload(RandomSpec(input_len=32, output_len=40), seed=3)
    empty = run_load_sync(url, wl, concurrency=2, warmup_s=0.2, duration_s=0.3, min_measured=0, timeout_s=60.0)
    line = measure_gap(empty, 0.3)
    assert line is not None and "window 0.3 s" in line and "raise [budget] measure_s to ≥ 2" in line
    # The warm-up requests were cut when the empty window ended: their span bounds E2E from below.
    span = max(r.end_time_s - r.send_time_s for r in empty.records)
    assert f"E2E ≥ {span:.1f} s" in line
    measured = run_load_sync(url, wl, concurrency=2, warmup_s=0.2, duration_s=0.3, timeout_s=60.0)
    assert measure_gap(measured, 0.3) is None
