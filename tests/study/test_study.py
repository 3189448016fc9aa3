"""Study plumbing on a real SQLite storage: telling records, resume, environments, best, budget."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tuner.errors import StudyError
from tuner.records import TrialRecord
from tuner.sglang.failures import FailureClass
from tuner.study.best import choose_best
from tuner.study.budget import Budget
from tuner.study.hosts import recover_own
from tuner.study.optuna_io import (
    KIND_ATTR,
    check_environment,
    make_sampler,
    open_study,
    records,
    tell_record,
)
from tuner.study.storage import open_storage

OK = {"oom_or_crash": -1.0, "slo": -0.2, "stress": -1.0}


def _study(tmp_path: Path) -> optuna.Study:
    return open_study("s", open_storage(f"sqlite:///{tmp_path}/s.db"), make_sampler("tpe", 0))



def test_failed_start_is_complete_with_violated_constraint_and_skips_are_pruned(tmp_path: Path) -> None:
    study = _study(tmp_path)
    ok = TrialRecord(params={"mem_fraction_static": 0.88}, outcome="ok", context_capacity=4,
                     output_throughput_tok_s=900.0, constraints=OK, feasible=True)
    failed = TrialRecord(params={"mem_fraction_static": 0.97}, outcome="failed",
                         failure_class=FailureClass.CUDA_GRAPH_OOM, failure_evidence="Capture cuda graph failed",
                         constraints={"oom_or_crash": 1.0, "slo": 1.0, "stress": 1.0})
    skipped = TrialRecord(params={"mem_fraction_static": 0.98}, outcome="skipped", skipped_reason="must fail",
                          proved_by_trial=1, constraints={"oom_or_crash": 1.0, "slo": 1.0, "stress": 1.0})
    for record in (ok, failed, skipped):
        tell_record(study, study.ask(), record)
    again = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/s.db")
    states = [t.state for t in again.trials]
    assert states == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.PRUNED]
    assert again.trials[0].values == [4.0, 900.0]
    assert again.trials[1].values == [0.0, 0.0]
    # a record made without a quality or context_fits value (as stored before them) is told them as holding
    assert again.trials[1].constraints == {"oom_or_crash": 1.0, "slo": 1.0, "stress": 1.0, "quality": -1.0, "context_fits": -1.0}
    assert again.trials[0].constraints["slo"] == -0.2
    stored = records(again)
    assert [r.failure_class for _, r in stored] == [None, FailureClass.CUDA_GRAPH_OOM, None]
    assert stored[2][1].proved_by_trial == 1


def test_recover_own_marks_fail_and_reenqueues(tmp_path: Path) -> None:
    study = _study(tmp_path)
    tell_record(study, study.ask(), TrialRecord(outcome="ok", constraints=OK, feasible=True, context_capacity=1))
    running = study.ask()
    running._suggest("mem_fraction_static", optuna.distributions.FloatDistribution(0.5, 0.99))  # noqa: SLF001
    params = dict(running.params)
    # A new process (the killed run is gone) opens the same storage.
    resumed = _study(tmp_path)
    assert recover_own(resumed, "this-host", shared=False) == [1]
    assert resumed.trials[1].state == TrialState.FAIL
    waiting = resumed.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].user_attrs[KIND_ATTR] == "enqueued"
    nxt = resumed.ask()
    value = nxt._suggest("mem_fraction_static", optuna.distributions.FloatDistribution(0.5, 0.99))  # noqa: SLF001
    assert value == params["mem_fraction_static"]
    assert resumed.trials[0].state == TrialState.COMPLETE


def test_environment_mismatch_refused_unless_allowed() -> None:
    stored = {"sglang_version": "0.5.5", "gpu_name": "H100", "model": "m"}
    check_environment(stored, dict(stored), allow_mixed=False)
    with pytest.raises(StudyError, match="sglang_version"):
        check_environment(stored, {**stored, "sglang_version": "0.5.10"}, allow_mixed=False)
    check_environment(stored, {**stored, "sglang_version": "0.5.10"}, allow_mixed=True)


def _rec(cap: int, tput: float, feasible: bool = True) -> TrialRecord:
    return TrialRecord(outcome="ok", context_capacity=cap, output_throughput_tok_s=tput, feasible=feasible,
                       constraints=OK if feasible else {"oom_or_crash": -1, "slo": 0.5, "stress": -1})


def test_best_policies() -> None:
    finished = [(0, _rec(10, 500.0)), (1, _rec(20, 400.0)), (2, _rec(19, 450.0)), (3, _rec(30, 900.0, False))]
    best = choose_best(finished, policy="throughput_within_capacity", capacity_tolerance=0.05)
    assert best is not None and best.number == 2 and "within 5%" in best.reason
    assert choose_best(finished, policy="max_capacity").number == 1
    assert choose_best(finished, policy="max_throughput").number == 0
    assert choose_best([(3, _rec(30, 900.0, False))]) is None


def test_throughput_within_the_noise_margin_is_a_tie_won_by_capacity() -> None:
    finished = [(1, _rec(23, 48.6)), (5, _rec(22, 49.0)), (7, _rec(22, 41.0))]
    best = choose_best(finished)  # default margin 3 %: 48.6 vs 49.0 is a tie
    assert best is not None and best.number == 1, best
    assert "highest OOM-safe context capacity (23 requests) of the 2 trial(s)" in best.reason
    assert "within the 3% noise margin of the highest (49.0 tok/s, trial 5" in best.reason
    assert "among the 3 feasible trial(s) within 5%" in best.reason
    assert choose_best(finished, throughput_noise=0.0).number == 5
    # beyond the margin the faster trial wins, and the reason names no tie
    clear = choose_best([(1, _rec(23, 45.0)), (5, _rec(22, 49.0))])
    assert clear.number == 5 and "noise" not in clear.reason
    # a tie of equal capacity goes to the faster trial, then the earlier one
    assert choose_best([(1, _rec(22, 48.6)), (5, _rec(22, 49.0))]).number == 5
    assert choose_best([(3, _rec(22, 49.0)), (5, _rec(22, 49.0))]).number == 3


def test_budget_estimate_and_fit() -> None:
    now = [0.0]
    budget = Budget(600.0, clock=lambda: now[0])
    assert Budget.estimate([], prior_s=120.0).source == "prior"
    estimate = Budget.estimate([100.0, 5.0, 110.0, 120.0], prior_s=999.0)
    assert estimate.source == "history" and 100.0 <= estimate.seconds <= 120.0
    now[0] = 500.0
    assert budget.fits(90.0) and not budget.fits(110.0)
    assert budget.trials_left(50.0) == 2


def test_first_trial_estimate_counts_the_steady_windows(tmp_path: Path) -> None:
    """With an SLO (TTFT/ITL limits) a trial measures its SLO-safe capacity on a steady window and
    up to ``slo_capacity_steps`` bracketing ones, each a ramp, the warm-up and ``stress_s``
    (issue 36); the prior counts them, and only then."""
    from tuner.config import load_config
    from tuner.load import SLO
    from tuner.study.budget import prior_trial_cost_s

    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "reference-sim.toml")
    budget = config.budget
    assert config.slo.ttft_ms and budget.stress_s > 0 and budget.slo_capacity_steps == 2
    window = budget.steady_window()
    assert window.ramp == min(10.0, budget.stress_s / 2) and window.settle_s == budget.warmup_s
    each = window.ramp + budget.warmup_s + budget.stress_s
    no_slo = config.model_copy(update={"slo": SLO()})
    base = min(config.service.start_timeout_s / 3, 600) + budget.warmup_s + budget.measure_s + budget.stress_s + 5
    assert prior_trial_cost_s(no_slo) == pytest.approx(base)
    assert prior_trial_cost_s(config) == pytest.approx(base + 3 * each)
    # the capacity basis does not matter: the trial measures whenever the SLO sets a TTFT/ITL limit
    slo_safe = config.model_copy(update={"objective": config.objective.model_copy(update={"capacity": "slo_safe"})})
    assert prior_trial_cost_s(slo_safe) == prior_trial_cost_s(config)
    more = config.model_copy(update={"budget": budget.model_copy(update={"slo_capacity_steps": 5})})
    assert prior_trial_cost_s(more) == pytest.approx(base + 6 * each)
    none = config.model_copy(update={"budget": budget.model_copy(update={"slo_capacity_steps": 0})})
    assert prior_trial_cost_s(none) == pytest.approx(base + each)
    # an E2E-only SLO is not judged on the capacity windows, so none runs
    e2e = config.model_copy(update={"slo": SLO(e2e_latency_ms={"p99": 60000})})
    assert prior_trial_cost_s(e2e) == pytest.approx(base)
    # `run --dry-run` says so beside the estimate
    from tests.support.cli import run_tuner
    from tests.support.configs import config_copy

    dry = run_tuner("run", "--config", str(config_copy("reference-sim.toml", tmp_path)), "--budget", "10m", "--dry-run",
                    cwd=tmp_path)
    assert (f"(with up to 3 steady windows of the SLO-safe capacity, ramp {window.ramp:g} s + warm-up "
            f"{budget.warmup_s:g} s + window {budget.stress_s:g} s each)") in dry.stdout, dry.stdout + dry.stderr


def test_slo_clearly_lost_only_after_enough_evidence() -> None:
    from tuner.load import SLO, LiveStats
    from tuner.trial import slo_clearly_lost

    slo = SLO(ttft_ms={"p99": 1000})

    def stats(**kw: float) -> LiveStats:
        base = {"elapsed_s": 5.0, "phase": "measure", "sent": 40, "completed": 20, "errored": 0, "in_flight": 4,
                "output_tok_s": 100.0, "request_throughput": 2.0, "p99_ttft_ms_so_far": 500.0}
        return LiveStats(**{**base, **kw})

    assert not slo_clearly_lost(stats(), slo)
    assert slo_clearly_lost(stats(p99_ttft_ms_so_far=2500.0), slo)
    assert not slo_clearly_lost(stats(p99_ttft_ms_so_far=2500.0, completed=3), slo)
    assert not slo_clearly_lost(stats(p99_ttft_ms_so_far=2500.0, phase="warmup"), slo)
    assert slo_clearly_lost(stats(completed=5, errored=20), slo)


def test_skip_writer_stores_skips_in_order_and_raises_a_failed_write(tmp_path: Path) -> None:
    """The sampler's skips are written by one background thread, in order, into the real SQLite
    study; a write that fails (here a param outside its distribution) is raised by the next
    ``store`` or by ``flush``, not lost in the thread."""
    from optuna.distributions import FloatDistribution

    from tuner.study.record import SkipWriter

    study = _study(tmp_path)
    dist = {"mem_fraction_static": FloatDistribution(0.5, 0.95)}
    writer = SkipWriter(study)
    try:
        for mfs in (0.80, 0.81, 0.82):
            skip = TrialRecord(params={"mem_fraction_static": mfs}, outcome="skipped", skipped_reason="predicted")
            writer.store({"mem_fraction_static": mfs}, dist, skip, {"tuner.host": "a"})
        writer.flush()
        stored = study.get_trials(states=(TrialState.PRUNED,))
        assert [t.params["mem_fraction_static"] for t in stored] == [0.80, 0.81, 0.82]
        assert all(t.user_attrs["tuner.host"] == "a" for t in stored)
        bad = TrialRecord(params={"mem_fraction_static": 2.0}, outcome="skipped", skipped_reason="predicted")
        writer.store({"mem_fraction_static": 2.0}, dist, bad, {})
        with pytest.raises(ValueError):
            writer.flush()
    finally:
        writer.close()
    assert len(study.get_trials(states=(TrialState.PRUNED,))) == 3


def test_the_samplers_mirror_gives_the_baseline_the_knobs_it_lacks_so_tpe_models_them_jointly(tmp_path: Path) -> None:
    """The baseline runs the unit's own flags: no ``--max-running-requests`` (SGLang's default),
    so its trial lacks that param. Copied as stored, multivariate TPE's intersection search space
    leaves ``max_running_requests`` out for the whole study (sampled apart from the fraction);
    the mirror copies it at the space's grid point (``Space.snap``: the top), so TPE models all three."""
    from optuna.search_space import IntersectionSearchSpace

    from tuner.config import SpaceSection
    from tuner.study.decide.sampler import ProposalMirror
    from tuner.study.space import resolve_space

    space = resolve_space(SpaceSection(mem_fraction_step=0.01), {"mem_fraction_static": 0.85,
                          "chunked_prefill_size": 8192}, capacity_hint=8)
    study = _study(tmp_path)
    dists = space.distributions()
    baseline = {"mem_fraction_static": 0.85, "chunked_prefill_size": 8192}
    study.add_trial(optuna.trial.create_trial(values=[4.0, 900.0], params=baseline,
                                              distributions={k: dists[k] for k in baseline}))
    for mfs, mrr in ((0.88, 6), (0.9, 8)):
        params = {"mem_fraction_static": mfs, "max_running_requests": mrr, "chunked_prefill_size": 8192}
        study.add_trial(optuna.trial.create_trial(values=[float(mrr), 950.0], params=params,
                                                  distributions={k: dists[k] for k in params}))
    assert "max_running_requests" not in IntersectionSearchSpace(include_pruned=True).calculate(study)
    mirror = ProposalMirror(study.directions, make_sampler("tpe", 0), space)
    mirror.sync(study.get_trials())
    assert set(IntersectionSearchSpace(include_pruned=True).calculate(mirror.study)) == set(dists)
    copied = mirror.study.trials[0]
    assert copied.params["max_running_requests"] == space.max_running_requests[1]
    assert copied.values == [4.0, 900.0]
    assert study.trials[0].params == baseline  # the shared study keeps what ran


def test_the_samplers_mirror_leaves_out_other_hosts_skips_but_keeps_their_launches(tmp_path: Path) -> None:
    """A skip is what the screens conclude from the measured trials, which every host's mirror
    holds; another host's skip adds only cost to this host's sampler. Its launches (and its
    failures, COMPLETE with a violated constraint) and this host's own skips are copied."""
    from tuner.study.decide.sampler import ProposalMirror
    from tuner.study.hosts import add_record

    study = _study(tmp_path)
    dist = {"mem_fraction_static": optuna.distributions.FloatDistribution(0.5, 0.95)}
    skip = TrialRecord(params={}, outcome="skipped", skipped_reason="predicted context capacity 3")
    launched = TrialRecord(params={}, outcome="ok", context_capacity=4, output_throughput_tok_s=900.0,
                           constraints=OK, feasible=True)
    for mfs, host, record in ((0.80, "b", skip), (0.81, "a", skip), (0.85, "b", launched)):
        add_record(study, {"mem_fraction_static": mfs}, dist, record.model_copy(update={"params": {"mem_fraction_static": mfs}}),
                   {"tuner.host": host})
    mirror = ProposalMirror(study.directions, make_sampler("tpe", 0), host="a")
    mirror.sync(study.get_trials())
    kept = {(t.params["mem_fraction_static"], t.state) for t in mirror.study.trials}
    assert kept == {(0.81, TrialState.PRUNED), (0.85, TrialState.COMPLETE)}
    every = ProposalMirror(study.directions, make_sampler("tpe", 0))
    every.sync(study.get_trials())
    assert len(every.study.trials) == 3
