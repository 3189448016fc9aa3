"""The SLO-safe context capacity beside the OOM-safe one (issue 28), measured on steady windows of
closed-loop sessions with the burst admission beside it (issue 36) on the simulator, told to Optuna and used by the best rule when an SLO is set;
and the choice among throughput ties (lower p99 latency, then fewer request slots, loads said)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tests.support.offline_server import OfflineExecutor
from tuner.config import load_config
from tuner.load.metrics import quantile_interval
from tuner.load.search import bracket_level
from tuner.records import MeasuredLoad, PhaseResult, SloCapacity, SloStep, TrialRecord
from tuner.study.best import admission_limit, admission_line, binding_phase, choose_best, edge_noise
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


def test_the_burst_breaks_the_slo_where_steady_sessions_of_the_same_count_hold_it(reference_study) -> None:
    """Issue 36: the twin's burst of its OOM-safe capacity in 32k prompts at once breaks p99 ITL,
    while as many closed-loop sessions started over a ramp hold the SLO in their steady window: the
    SLO-safe capacity is the sessions' count, the burst admission reported beside it."""
    runner, _ = reference_study
    records = [r for _, r in runner.history if r.outcome == "ok" and r.slo_capacity.burst is not None]
    assert records
    for record in records:
        slo = record.slo_capacity
        assert slo.measure == "steady" and slo.limits == {"p99_ttft_ms": 30000.0, "p99_itl_ms": 4000.0}
        assert slo.burst.contexts == record.context_capacity and not slo.burst.met
        assert slo.steps[0].contexts == record.context_capacity  # the first window: the OOM-safe count
        assert slo.contexts is not None and slo.contexts > 0
        met = next(s for s in slo.steps if s.contexts == slo.contexts)
        assert met.met and met.completed >= slo.contexts
        assert all(v <= 0 for v in met.violations.values() if v is not None)
        assert record.objective_capacity == slo.contexts and slo.basis == "slo_safe"
        assert "sessions (steady window:" in slo.describe() and "burst admission:" in slo.describe()
    held = [r for r in records if r.slo_capacity.contexts == r.context_capacity]
    assert held, "sessions of the burst's own count hold the SLO on some config"


def test_a_record_stored_before_steady_windows_reads_as_burst_admission() -> None:
    stored = {"limits": {"p99_ttft_ms": 30000.0}, "contexts": 3, "broken_at": 4, "basis": "slo_safe",
              "steps": [{"contexts": 4, "completed": 4, "met": False, "p99_itl_ms": 4970.0},
                        {"contexts": 3, "completed": 3, "met": True, "p99_itl_ms": 3100.0}]}
    old = SloCapacity.model_validate(stored)
    assert old.measure == "burst" and old.burst is not None and old.burst.contexts == 4
    assert old.describe().startswith("3 by burst admission (stored before steady windows: burst at 4")
    new = SloCapacity.model_validate(old.model_dump(mode="json"))
    assert new.measure == "burst" and new == old


def test_each_bracketing_step_sends_prompts_no_earlier_load_of_the_trial_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bracketing step drew the stress load's own prompts (same seed): on a real server the radix
    cache then held every prompt of the smaller step, and its p99 TTFT measured a cache hit (a real
    run of the reference twin: 15,685 ms at 4 × 32k, then 72 ms at 3, "meets the SLO"). Within a
    trial (one server's life, from its burst on) no prompt is sent twice; across trials the server
    was restarted, and every trial's n-th window sends the same traffic (common random numbers)."""
    config = load_config(ROOT / "configs" / "reference-sim.toml")
    runner = OfflineExecutor(config)
    loads: list[tuple[str, list[tuple[int, ...]]]] = []
    real = runner.offline.load

    def recording(plan, on_tick):  # noqa: ANN001, ANN202 - the server's own signature
        if plan.name in ("stress", "steady"):
            sent = itertools.islice(plan.workload.passes(), max(64, 6 * plan.concurrency))
            loads.append((plan.name, [tuple(r.input_ids[:256]) for r in sent]))
        return real(plan, on_tick)

    monkeypatch.setattr(runner.offline, "load", recording)
    run_study(config, runner, max_trials=3, storage_url=":memory:")
    assert len(loads) >= 2 * len([r for _, r in runner.history if r.outcome == "ok"]), "a burst and a steady window each"
    trials: list[list[tuple[int, ...]]] = []
    for name, prompts in loads:
        if name == "stress" or not trials:  # a trial's burst opens its loads on a freshly started server
            trials.append([])
        trials[-1].extend(prompts)
    assert len(trials) >= 2
    for prefixes in trials:
        assert len(set(prefixes)) == len(prefixes), "a prompt was sent twice to one server"


def test_with_an_slo_the_study_chooses_by_the_slo_safe_capacity(reference_study) -> None:
    runner, summary = reference_study
    done = [(n, r) for n, r in runner.history]
    assert summary.best is not None and summary.best.basis == "slo_safe"
    feasible = [r for _, r in done if r.feasible and r.outcome == "ok"]
    assert summary.best.record.capacity("slo_safe") == max(r.capacity("slo_safe") or 0 for r in feasible)
    assert "SLO-safe context capacity" in summary.best.reason
    by_oom = choose_best(done, capacity="oom_safe")
    assert by_oom is not None and by_oom.basis == "oom_safe"
    assert not by_oom.record.slo_capacity.stress.met  # its burst breaks the SLO: never the SLO-safe figure


def _record(cap: int, slo_cap: int | None, tput: float, *, ttft: float = 1000.0, mrr: int | None = None,
            streams: float = 8.0, slo: float = -0.5, completed: int = 27) -> TrialRecord:
    limits = {"p99_ttft_ms": 10000.0}
    steps = [] if slo_cap is None else [SloStep(contexts=cap, completed=cap, met=slo_cap >= cap)]
    return TrialRecord(
        params={"mem_fraction_static": 0.8 + cap / 1000, "max_running_requests": mrr or cap}, outcome="ok",
        context_capacity=cap, output_throughput_tok_s=tput, p99_ttft_ms=ttft, p99_itl_ms=ttft / 10,
        constraints={**OK, "slo": slo}, measured_load=MeasuredLoad(streams=streams),
        phases=[PhaseResult(name="measure", duration_s=20.0, completed=completed)],
        slo_capacity=SloCapacity(limits=limits, contexts=slo_cap, steps=steps, basis="slo_safe", measure="steady"),
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


def _bound(cap: int, held: int, tput: float, *, broke: dict[str, float], measured: dict[str, float],
           graphs: int | None = None) -> TrialRecord:
    """A trial whose steady windows held the SLO at ``held`` sessions and broke it at ``held + 2``."""
    limits = {"p99_ttft_ms": 30000.0, "p99_itl_ms": 4000.0}
    steps = [SloStep(contexts=held + 2, completed=held + 2, violations=broke, met=False, **measured),
             SloStep(contexts=held, completed=held, violations={k: -0.2 for k in limits}, met=True)]
    record = _record(cap, held, tput)
    resolved = {"cuda_graph_max_bs": {"value": graphs, "source": "server_info"}} if graphs else {}
    return record.model_copy(update={"resolved": resolved, "slo_capacity": SloCapacity(
        limits=limits, contexts=held, broken_at=held + 2, steps=steps, basis="slo_safe", measure="steady")})


def test_the_admission_limit_that_holds_the_slo_is_named_with_its_binding_phase() -> None:
    queued = _bound(8, 6, 100.0, broke={"p99_ttft_ms": 0.59, "p99_itl_ms": -0.5}, measured={"p99_ttft_ms": 47600.0})
    assert admission_line(queued) == (
        "admits 8 longest contexts at once, holds the SLO up to 6 sessions (bound by prefill queueing (p99 TTFT "
        "47,600 ms > 30,000 ms at 8 sessions: new prompts wait behind the others' prefills)); applying "
        "--max-running-requests 6 (requests beyond 6 wait in SGLang's queue: their TTFT grows with the wait, "
        "the 6 running keep the SLO; --keep-admission keeps the trial's own)")
    assert admission_limit(queued) == 6
    assert admission_line(queued, applied=False).endswith(
        "; keeping the trial's own admission (--keep-admission): set --max-running-requests 6 to hold the SLO "
        "(requests beyond 6 wait in SGLang's queue: their TTFT grows with the wait, the 6 running keep the SLO)")
    decode = _bound(8, 6, 100.0, broke={"p99_ttft_ms": -0.3, "p99_itl_ms": 0.24}, measured={"p99_itl_ms": 4970.0})
    assert binding_phase(decode).startswith("decode step time (p99 ITL 4,970 ms > 4,000 ms at 8 sessions")
    edge = _bound(48, 6, 100.0, broke={"p99_itl_ms": 0.1}, measured={"p99_itl_ms": 4400.0}, graphs=4)
    assert binding_phase(edge).startswith("a graph-size edge (8 sessions exceed cuda_graph_max_bs 4")
    held = _record(8, 8, 100.0)
    assert admission_line(held).endswith("holds the SLO at 8 sessions: no admission limit needed")
    none = _none_held(8, 1)
    assert admission_line(none) == ("admits 8 longest contexts at once; no session count meets the SLO (1 session "
                                    "breaks it): loosen the SLO or choose another config")
    # no limit where none is needed, none makes it hold, a capped figure proves none, or the figure is a stored burst's
    capped = queued.model_copy(update={"slo_capacity": queued.slo_capacity.model_copy(update={"at_least": True})})
    burst = queued.model_copy(update={"slo_capacity": queued.slo_capacity.model_copy(update={"measure": "burst"})})
    assert [admission_limit(r) for r in (held, none, capped, burst)] == [None, None, None, None]


def _none_held(cap: int, *broken: int) -> TrialRecord:
    """A trial whose steady windows at ``broken`` sessions (in order) all broke the SLO."""
    limits = {"p99_ttft_ms": 30000.0, "p99_itl_ms": 4000.0}
    steps = [SloStep(contexts=n, completed=n, violations={"p99_itl_ms": 0.3}, met=False, p99_itl_ms=5200.0)
             for n in broken]
    return _record(cap, 0, 100.0).model_copy(update={"slo_capacity": SloCapacity(
        limits=limits, contexts=0, broken_at=min(broken), steps=steps, basis="slo_safe", measure="steady")})


def test_a_bracket_that_ran_out_of_windows_above_one_session_names_more_windows_as_the_fix() -> None:
    """Windows at 8, 6 and 5 sessions all broke the SLO and ``[budget] slo_capacity_steps`` (2)
    allowed no fourth: the SLO-safe figure is 0, but 1-4 sessions were never measured, so the line
    names more windows, not a looser SLO (before, it said no admission limit makes it hold)."""
    ran_out = _none_held(8, 8, 6, 5)
    line = admission_line(ran_out)
    assert line == ("admits 8 longest contexts at once; no session count measured meets the SLO (8, 6, 5 sessions "
                    "broke it; 1-4 not measured: the bracket's windows ran out): raise [budget] slo_capacity_steps, "
                    "or measure the count with `tuner load --max-under-slo --ramp ...`")
    assert "loosen the SLO" not in line and admission_limit(ran_out) is None
    assert "1-4 not measured" in ran_out.slo_capacity.describe()
    assert "1 session breaks it" in _none_held(8, 8, 3, 1).slo_capacity.describe()


def test_an_slo_edge_within_the_windows_noise_is_said_beside_the_admission_limit() -> None:
    """The reference twin's default study (real time, 10 s windows, trial 1 at 0.93): 5 sessions
    held p99 ITL at 3,360 ms (no upper bound over 5 requests), 6 broke it at 5,032 ms (95 % from
    3,363 ms); the applied limit of 5, re-measured over 60 s, read 5,036 ms (broken) with one seed
    and 3,583 ms (held) with another. The line says the edge is within the noise; a window that
    decided it (the broken p99's lower bound past the limit) gets no such clause."""
    limits = {"p99_ttft_ms": 30000.0, "p99_itl_ms": 4000.0}

    def twin(broken_low: float, held_high: float | None) -> TrialRecord:
        steps = [SloStep(contexts=7, completed=7, p99_itl_ms=5034.0, p99_itl_low_ms=4469.0, met=False,
                         violations={"p99_ttft_ms": -0.56, "p99_itl_ms": 0.26}),
                 SloStep(contexts=5, completed=5, p99_ttft_ms=9885.0, p99_itl_ms=3360.0, p99_itl_low_ms=3360.0,
                         p99_itl_high_ms=held_high, met=True, violations={"p99_ttft_ms": -0.67, "p99_itl_ms": -0.16}),
                 SloStep(contexts=6, completed=6, p99_ttft_ms=10037.0, p99_itl_ms=5032.0, p99_itl_low_ms=broken_low,
                         p99_itl_high_ms=8369.0, met=False, violations={"p99_ttft_ms": -0.67, "p99_itl_ms": 0.258})]
        return _record(7, 5, 123.0).model_copy(update={"slo_capacity": SloCapacity(
            limits=limits, contexts=5, broken_at=6, steps=steps, basis="slo_safe", measure="steady")})

    noisy = twin(3363.0, None)
    assert edge_noise(noisy) == (
        "the edge is within the windows' noise (6 sessions broke p99 ITL at 5,032 ms, 95 % from 3,363 ms; 5 held "
        "it at 3,360 ms, 95 % up to ∞): 5 may break it when re-measured; longer windows ([budget] stress_s) narrow it")
    line = admission_line(noisy)
    assert "holds the SLO up to 5 sessions (bound by decode step time" in line and "; the edge is within" in line
    assert line.endswith("; applying --max-running-requests 5 (requests beyond 5 wait in SGLang's queue: their TTFT "
                         "grows with the wait, the 5 running keep the SLO; --keep-admission keeps the trial's own)")
    assert admission_limit(noisy) == 5
    assert edge_noise(twin(4100.0, None)) is None  # 6 broke it past its noise
    assert edge_noise(twin(3363.0, 3900.0)) is None  # 5 held it past its noise


def test_memory_that_holds_no_more_sessions_is_named_with_the_binding_phase() -> None:
    """fp8 KV + DP attention + the frontier give 8 → 48 longest contexts on the twin; where the SLO
    holds no more sessions with them, the choice says which phase binds."""
    base = _bound(8, 6, 100.0, broke={"p99_ttft_ms": -0.3, "p99_itl_ms": 0.24}, measured={"p99_itl_ms": 4970.0})
    wide = _bound(48, 6, 90.0, broke={"p99_ttft_ms": -0.3, "p99_itl_ms": 0.3}, measured={"p99_itl_ms": 5200.0})
    choice = choose_best([(0, base), (1, wide)])
    assert choice.number == 0
    assert ("trial 1 admits 48 longest contexts (vs 8) but holds the SLO at 6 sessions: bound by decode step "
            "time (p99 ITL 5,200 ms > 4,000 ms at 8 sessions") in choice.reason
    # a count capped by [budget] max_concurrency that held the SLO proves no bound: not named
    capped = _record(18, 6, 90.0).model_copy(update={"slo_capacity": SloCapacity(
        limits={"p99_ttft_ms": 30000.0}, contexts=6, at_least=True, basis="slo_safe", measure="steady",
        steps=[SloStep(contexts=6, completed=6, met=True)])})
    assert "admits 18" not in choose_best([(0, base), (2, capped)]).reason


def test_capacity_beyond_the_concurrency_the_deployment_needs_does_not_outrank_throughput() -> None:
    """A batch workload at 96 in flight: speculation off held 133 contexts, on 104 (both hold the 96
    streams) at 39 % more throughput; capacity above 96 is capacity the traffic cannot use."""
    spec_off = _record(133, 133, 61.0)
    spec_on = _record(104, 104, 100.0)
    assert choose_best([(1, spec_off), (2, spec_on)]).number == 1  # no concurrency named: capacity first
    choice = choose_best([(1, spec_off), (2, spec_on)], concurrency=96)
    assert choice is not None and choice.number == 2 and choice.concurrency == 96
    assert ("capacities above the 96 concurrent sessions the deployment needs ([objective] concurrency) count as 96 "
            "(trial(s) 1, 2): capacity the traffic cannot use does not outrank throughput") in choice.reason


def test_the_concurrency_a_config_implies_is_the_objective_s(tmp_path: Path) -> None:
    from tests.support.configs import config_copy

    assert load_config(ROOT / "configs" / "reference-multiturn-sim.toml").objective.concurrency == 64  # num_sessions
    assert load_config(ROOT / "configs" / "reference-sim.toml").objective.concurrency is None
    batch = config_copy("reference-sim.toml", tmp_path, replace={"max_concurrency = 16": "max_concurrency = 16\nconcurrency = 96"})
    assert load_config(batch).objective.concurrency == 96


def test_an_slo_no_session_count_meets_is_one_line_naming_the_fix_and_keeps_every_trial(tmp_path: Path) -> None:
    """A p99 TTFT of 50 ms that no session count of 2k-token prompts meets on the demo's L4: every
    trial is stored with SLO-safe 0 and its reason, ``tuner best`` and ``tuner apply best`` say in
    one line to relax the SLO, and nothing is lost or written."""
    from tests.support.cli import run_tuner
    from tests.support.configs import config_copy

    config = config_copy("demo-sim.toml", tmp_path, replace={"ttft_ms = { p99 = 10000 }": "ttft_ms = { p99 = 50 }"})
    cfg = load_config(config)
    url = f"sqlite:///{tmp_path}/demo.db"
    runner = OfflineExecutor(cfg)
    runner.work_dir = tmp_path / "work"
    run_study(cfg, runner, max_trials=2, storage_url=url)
    launched = [n for n, r in runner.history if r.outcome == "ok"]
    assert launched and all(dict(runner.history)[n].slo_capacity.contexts == 0 for n in launched)
    before = (tmp_path / "demo.db").read_bytes()
    for args in (("best",), ("apply", "best", "--dry-run", "--config", str(config))):
        proc = run_tuner(*args, "--storage", url, cwd=tmp_path)
        errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert proc.returncode == 1 and "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr
        assert "has no feasible trial" in errors[0] and "relax its slo" in errors[0]
    shown = run_tuner("show", str(launched[0]), "--storage", url, cwd=tmp_path).stdout
    assert "no session count meets the SLO (1 session breaks it): loosen the SLO or choose another config" in shown
    rows = json.loads(run_tuner("trials", "--storage", url, "--json", cwd=tmp_path).stdout)
    assert [r["number"] for r in rows if r["outcome"] == "ok"] == launched  # every trial kept
    assert (tmp_path / "demo.db").read_bytes() == before
