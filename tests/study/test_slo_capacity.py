"""The SLO-safe context capacity beside the OOM-safe one (issue 28): measured by the stress phase and
its bracketing steps on the simulator, told to Optuna and used by the best rule when an SLO is set;
and the choice among throughput ties (lower p99 latency, then fewer request slots, loads said)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.offline_server import OfflineExecutor
from tuner.config import load_config
from tuner.load.metrics import quantile_interval
from tuner.load.search import bracket_level
from tuner.records import MeasuredLoad, PhaseResult, SloCapacity, SloStep, TrialRecord
from tuner.study.best import choose_best
from tuner.study.loop import run_study

ROOT = Path(__file__).resolve().parents[2]
OK = {"oom_or_crash": -1.0, "slo": -0.5, "stress": -1.0}


def test_p99_interval_is_order_statistics_and_unbounded_above_for_few_requests() -> None:
    # 50 requests: P(Binomial(50, 0.99) <= 47) = 1.4 % <= 2.5 %, so x_(48) bounds p99 from below;
    # no order statistic bounds it from above (P(B <= 49) = 39 % < 97.5 %)
    assert quantile_interval(list(range(1, 51))) == (48.0, None)
    low, high = quantile_interval(list(range(1, 1001)))
    assert low is not None and high is not None and low < 990 < high
    assert quantile_interval([]) == (None, None)


def test_bracketing_scales_the_broken_count_by_its_overshoot_inside_the_bracket() -> None:
    assert bracket_level(None, 8, 0.54) == 5  # 8 / 1.54 = 5.2
    assert bracket_level(5, 8, None) == 6  # no overshoot known: the search's midpoint
    assert bracket_level(5, 6, 0.3) is None  # nothing lies between
    assert bracket_level(None, 8, 20.0) == 1  # never below the floor


@pytest.fixture(scope="module")
def reference_study() -> tuple[OfflineExecutor, object]:
    config = load_config(ROOT / "configs" / "reference-sim.toml")
    runner = OfflineExecutor(config)
    summary = run_study(config, runner, max_trials=6, storage_url=":memory:")
    return runner, summary


def test_a_stress_load_that_breaks_the_slo_is_bracketed_to_the_count_that_meets_it(reference_study) -> None:
    runner, _ = reference_study
    broken = [(n, r) for n, r in runner.history if r.outcome == "ok" and r.slo_capacity.stress is not None
              and not r.slo_capacity.stress.met]
    assert broken, "the reference twin's stress load (the longest contexts at the capacity) breaks p99 ITL"
    for _, record in broken:
        slo = record.slo_capacity
        assert slo.limits == {"p99_ttft_ms": 30000.0, "p99_itl_ms": 4000.0}
        assert slo.stress.contexts == record.context_capacity
        assert slo.contexts is not None and 0 < slo.contexts < record.context_capacity
        met = next(s for s in slo.steps if s.contexts == slo.contexts)
        assert met.met and met.completed == slo.contexts
        assert all(v <= 0 for v in met.violations.values() if v is not None)
        assert slo.broken_at is not None and slo.contexts < slo.broken_at <= record.context_capacity
        assert record.objective_capacity == slo.contexts and slo.basis == "slo_safe"
        assert "breaks the SLO" in slo.describe() and f"{slo.contexts} meets it" in slo.describe()


def test_each_bracketing_step_sends_prompts_no_earlier_load_of_the_trial_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bracketing step drew the stress load's own prompts (same seed): on a real server the radix
    cache then held every prompt of the smaller step, and its p99 TTFT measured a cache hit (a real
    run of the reference twin: 15,685 ms at 4 × 32k, then 72 ms at 3, "meets the SLO")."""
    config = load_config(ROOT / "configs" / "reference-sim.toml")
    runner = OfflineExecutor(config)
    loads: list[tuple[int, list[tuple[int, ...]]]] = []
    real = runner.offline.load

    def recording(plan, on_tick):  # noqa: ANN001, ANN202 - the server's own signature
        if plan.name == "stress":
            loads.append((plan.concurrency, [tuple(r.input_ids[:256]) for r in plan.workload.passes()]))
        return real(plan, on_tick)

    monkeypatch.setattr(runner.offline, "load", recording)
    run_study(config, runner, max_trials=3, storage_url=":memory:")
    bracketed = [r for _, r in runner.history if len(r.slo_capacity.steps) > 1]
    assert bracketed and len(loads) > len(runner.history), "the reference twin's stress load breaks its SLO"
    prefixes = [p for _, prompts in loads for p in prompts]
    assert len(set(prefixes)) == len(prefixes), "a prompt was sent twice to one server"
    assert [n for n, _ in loads] == [len(prompts) for _, prompts in loads]


def test_with_an_slo_the_study_chooses_by_the_slo_safe_capacity(reference_study) -> None:
    runner, summary = reference_study
    done = [(n, r) for n, r in runner.history]
    assert summary.best is not None and summary.best.basis == "slo_safe"
    feasible = [r for _, r in done if r.feasible and r.outcome == "ok"]
    assert summary.best.record.capacity("slo_safe") == max(r.capacity("slo_safe") or 0 for r in feasible)
    assert "SLO-safe context capacity" in summary.best.reason
    # chosen by the OOM-safe capacity, the study would recommend a config whose stress load breaks the SLO
    by_oom = choose_best(done, capacity="oom_safe")
    assert by_oom is not None and by_oom.basis == "oom_safe"
    assert by_oom.record.context_capacity > (by_oom.record.slo_capacity.contexts or 0)
    assert not by_oom.record.slo_capacity.stress.met


def _record(cap: int, slo_cap: int | None, tput: float, *, ttft: float = 1000.0, mrr: int | None = None,
            streams: float = 8.0, slo: float = -0.5, completed: int = 27) -> TrialRecord:
    limits = {"p99_ttft_ms": 10000.0}
    steps = [] if slo_cap is None else [SloStep(contexts=cap, completed=cap, met=slo_cap >= cap)]
    return TrialRecord(
        params={"mem_fraction_static": 0.8 + cap / 1000, "max_running_requests": mrr or cap}, outcome="ok",
        context_capacity=cap, output_throughput_tok_s=tput, p99_ttft_ms=ttft, p99_itl_ms=ttft / 10,
        constraints={**OK, "slo": slo}, measured_load=MeasuredLoad(streams=streams),
        phases=[PhaseResult(name="measure", duration_s=20.0, completed=completed)],
        slo_capacity=SloCapacity(limits=limits, contexts=slo_cap, steps=steps, basis="slo_safe"),
    )


def test_slo_safe_and_oom_safe_choices_differ_when_the_larger_capacity_breaks_the_slo() -> None:
    wide = _record(8, 5, 100.0)  # fits 8 without OOM; only 5 meet the SLO
    safe = _record(7, 7, 100.0)
    assert choose_best([(1, wide), (2, safe)]).number == 2  # an SLO was set: SLO-safe by default
    assert choose_best([(1, wide), (2, safe)], capacity="oom_safe").number == 1


def test_throughput_ties_go_to_the_lower_p99_latency_then_fewer_slots() -> None:
    # review N9: 53.7 tok/s at p99 TTFT 1786 ms and 27 slots vs 53.2 tok/s at 1460 ms and 23 slots
    fast = _record(23, 23, 53.7, ttft=1786.0, mrr=27, slo=1786 / 10000 - 1)
    calm = _record(23, 23, 53.2, ttft=1460.0, mrr=23, slo=1460 / 10000 - 1)
    choice = choose_best([(3, fast), (1, calm)])
    assert choice is not None and choice.number == 1
    assert "lower p99 latency (p99 TTFT 1,460 ms, ITL 146 ms over 27 requests)" in choice.reason
    # equal latency: fewer request slots
    wide = _record(23, 23, 53.7, mrr=40)
    narrow = _record(23, 23, 53.2, mrr=24)
    choice = choose_best([(3, wide), (1, narrow)])
    assert choice.number == 1 and "fewer request slots (24)" in choice.reason


def test_throughputs_measured_at_different_loads_are_said_so() -> None:
    a = _record(23, 23, 53.7, mrr=24, streams=13.0)
    b = _record(23, 23, 53.2, mrr=24, streams=8.0)
    b = b.model_copy(update={"params": {**b.params, "chunked_prefill_size": 4096}})
    choice = choose_best([(1, a), (2, b)])
    assert "not at equal load" in choice.reason and "trial 1: 13" in choice.reason
    same = choose_best([(1, _record(23, 23, 53.7)), (2, _record(23, 23, 53.2, mrr=24))])
    assert "equal load" not in same.reason
