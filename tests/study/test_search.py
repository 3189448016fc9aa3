"""The search strategy on the simulator's offline evaluation (virtual time): fast, real parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.offline_server import OfflineExecutor
from tests.support.views import plan
from tuner.config import SpaceSection, load_config
from tuner.records import Prediction
from tuner.sglang.memory import must_fail
from tuner.study.loop import run_study
from tuner.study.space import resolve_space

ROOT = Path(__file__).resolve().parents[2]


def test_space_contains_the_baseline_and_snaps_to_its_grid() -> None:
    space = resolve_space(SpaceSection(mem_fraction_step=0.005), {"mem_fraction_static": 0.883,
                          "max_running_requests": 48, "chunked_prefill_size": 8192}, capacity_hint=8)
    low, high, step = space.mem_fraction_static
    assert low <= 0.883 <= high and abs((0.883 - low) / step - round((0.883 - low) / step)) < 1e-6
    assert space.max_running_requests[0] <= 48 <= space.max_running_requests[1]
    assert 8192 in space.chunked_prefill_size and 4096 in space.chunked_prefill_size
    snapped = space.snap({"mem_fraction_static": 0.9912, "max_running_requests": 100000, "chunked_prefill_size": 5000})
    assert snapped["mem_fraction_static"] == high
    assert snapped["max_running_requests"] == space.max_running_requests[1]
    assert snapped["chunked_prefill_size"] == 4096


def test_planner_reaches_the_reference_frontier_without_waste() -> None:
    config = load_config(ROOT / "configs" / "reference-sim.toml")
    runner = OfflineExecutor(config)
    summary = run_study(config, runner, max_trials=8, storage_url=":memory:")
    launched = runner.history
    baseline = launched[0][1]
    assert baseline.kind == "baseline" and baseline.context_capacity == 4
    # The memory model's first candidate already gives 1.5x, without a failed start.
    first = launched[1][1]
    assert first.kind == "predicted" and first.feasible and first.context_capacity >= 6
    assert first.prediction.context_capacity == first.context_capacity
    assert summary.best is not None and summary.best.record.context_capacity >= 7
    assert runner.failures <= 1
    failures = []
    for _, record in launched:
        assert not must_fail(record.params, failures)[0]
        if record.outcome == "failed" and record.failure_class is not None:
            failures.append((record.params, record.failure_class))


def test_hierarchical_cache_knobs_are_conditional_and_render_for_the_version() -> None:
    import optuna

    from tuner.sglang.flags import FlagTable
    from tuner.trial import render_argv

    space = resolve_space(SpaceSection(hierarchical_cache=True, hicache_write_policy=["write_through", "write_back"]),
                          {"mem_fraction_static": 0.85, "max_running_requests": 64, "chunked_prefill_size": 4096})
    study = optuna.create_study(directions=["maximize", "maximize"], sampler=optuna.samplers.RandomSampler(seed=1))
    seen = {True: 0, False: 0}
    table = FlagTable.for_version("0.5.5.post3")
    base = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--enable-hierarchical-cache",
            "--hicache-ratio", "3"]
    for _ in range(12):
        trial = study.ask()
        params = space.suggest(trial)
        on = params["enable_hierarchical_cache"]
        seen[on] += 1
        assert ("hicache_ratio" in params) == on and ("hicache_write_policy" in params) == on
        argv = render_argv(base, params, table)
        assert ("--enable-hierarchical-cache" in argv) == on and ("--hicache-ratio" in argv) == on
        study.tell(trial, [1.0, 1.0])
    assert seen[True] and seen[False]


def _l4_after(launches: int):  # noqa: ANN202 - (config, StudyRun, space, view with tried/pending)
    """The "8B on L4, chunks to 16k" search after the baseline and ``launches`` more trials of one
    host, on the offline evaluation, with the loop's own planner; and a function that makes the
    view a decision would see with given configs running (``tried``) and planner trials running on
    other hosts (``pending``)."""
    from tests.support.views import study_view
    from tuner.config import parse_config
    from tuner.study.calibration import ModelSettings
    from tuner.study.loop import StudyRun

    config = parse_config({
        "study": {"name": "l4-believer", "seed": 2},
        "service": {"launcher": "process", "command": [
            "{python}", "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB",
            "--mem-fraction-static", "0.85", "--chunked-prefill-size", "8192"]},
        "space": {"mem_fraction_step": 0.01, "mem_fraction_static": [0.80, 0.99],
                  "chunked_prefill_size": [2048, 4096, 8192, 16384]},
        "workload": {"kind": "random", "input_len": 2048, "output_len": 128, "range_ratio": 0.25},
        "objective": {"context_tokens": 4096},
        "budget": {"warmup_s": 2, "measure_s": 30, "stress_s": 10, "max_concurrency": 64}})
    run = StudyRun(config, OfflineExecutor(config), max_trials=1 + launches, storage_url=":memory:")
    run.run()
    history, space = list(run.finished()), run.read().space
    settings = ModelSettings.for_config(config, 4096)

    def view(tried=(), pending=()):  # noqa: ANN001, ANN202 - StudyView
        return study_view(space, history, context_tokens=4096, budget=settings.budget,
                          mean_request_tokens=settings.mean_request_tokens, objective=settings.objective,
                          tried=tried, pending=pending)

    return config, run, space, view


def test_with_planner_trials_running_on_other_hosts_the_planner_proposes_given_them() -> None:
    """The believer: trials in flight are believed to reach their predicted capacity, so the next
    proposal builds on the best of them (its knobs, more request slots, in its band) instead of
    the sequential plan's next step, whose value depends on their outcome."""
    config, _run, space, view = _l4_after(0)
    pending: list[tuple[dict, Prediction]] = []
    for _ in range(2):  # two hosts take the plan's first two steps
        step = plan(view(pending=pending))
        assert step is not None
        pending.append((step.params, step.prediction))
    ahead_params, ahead = max(pending, key=lambda p: p[1].context_capacity or 0)
    believer = plan(view(pending=pending))
    sequential = plan(view(tried=[p for p, _ in pending]))
    assert believer is not None and sequential is not None
    assert believer.params not in [p for p, _ in pending]
    band = (ahead.context_capacity or 0) * (1 - config.objective.capacity_tolerance)
    assert believer.prediction.context_capacity >= band
    # built on the believed incumbent's knobs: the same chunk, more request slots
    assert believer.params["chunked_prefill_size"] == ahead_params["chunked_prefill_size"]
    assert believer.params["max_running_requests"] > ahead_params["max_running_requests"]
    assert "given trials running on other hosts" in believer.prediction.why
    assert believer.params != sequential.params  # without them: the sequential plan's next step


def test_beside_a_running_first_step_a_host_takes_the_step_the_checked_model_would_take_next() -> None:
    """The believer believes a running trial's predicted free memory too: the margin is the one the
    model has once that start checks it, not the unchecked prior, so a second host aims where the
    sequential plan goes after the first step (past its capacity), not beside it."""
    _config, _run, space, view = _l4_after(0)
    first = plan(view())
    assert first is not None
    beside = plan(view(pending=[(first.params, first.prediction)]))
    assert beside is not None
    assert beside.prediction.context_capacity > first.prediction.context_capacity
    assert beside.prediction.need_gib < first.prediction.need_gib  # the checked margin
    _config, _run, space, after = _l4_after(1)  # the first step measured
    sequential = plan(after())
    assert sequential is not None
    assert sequential.prediction.context_capacity == beside.prediction.context_capacity


def test_with_the_measured_plan_spent_hosts_plan_from_the_running_trials_in_the_band() -> None:
    """Hosts that keep asking while nothing comes back: once every step of the plan on the measured
    trials is running, each running trial in the band is taken as the incumbent in turn (its knobs
    with more request slots, its neighbours), so the planner proposes more distinct configs in the
    band before handing over to the sampler; without trials running it stops where it did."""
    _config, _run, space, view = _l4_after(1)
    measured = {tuple(sorted(space.snap(r.params).items())) for _, r in view().finished}
    alone: set = set()
    taken: list[dict] = []
    while (step := plan(view(tried=taken))) is not None:  # one host, nothing in flight
        taken.append(step.params)
        alone.add(tuple(sorted(step.params.items())))
    pending: list[tuple[dict, Prediction]] = []
    seen = set(measured)
    while (step := plan(view(pending=pending))) is not None and len(pending) < 40:
        key = tuple(sorted(step.params.items()))
        assert key not in seen  # never a config measured or running
        seen.add(key)
        pending.append((step.params, step.prediction))
    top = max(p.context_capacity or 0 for _, p in pending)
    extra = [p for params, p in pending if tuple(sorted(params.items())) not in alone]
    assert len(pending) >= len(alone) + 4  # four more hosts kept busy by the planner
    assert all((p.context_capacity or 0) >= top * (1 - 0.05) for p in extra)  # in the believed band
    assert all("given trials running on other hosts" in (p.why or "") for p in extra)


def _spent_config():  # noqa: ANN202 - TunerConfig
    """A space of 36 configs that a study spends quickly (L4, 8B, 4k contexts)."""
    from tuner.config import parse_config

    return parse_config({
        "study": {"name": "l4-spent", "seed": 3},
        "service": {"launcher": "process", "command": [
            "{python}", "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB",
            "--mem-fraction-static", "0.9", "--chunked-prefill-size", "4096", "--max-running-requests", "10"]},
        "space": {"mem_fraction_step": 0.01, "mem_fraction_static": [0.90, 0.95], "max_running_requests": [8, 10],
                  "chunked_prefill_size": [2048, 4096]},
        "workload": {"kind": "random", "input_len": 2048, "output_len": 128, "range_ratio": 0.25},
        "objective": {"context_tokens": 4096},
        "budget": {"warmup_s": 2, "measure_s": 30, "stress_s": 10, "max_concurrency": 64}})


def test_a_spent_space_stores_each_sampler_skip_once_and_stops_as_exhausted() -> None:
    """A space of 36 configs: once the planner and the sampler have measured or screened out what
    it holds, the sampler's draws repeat. Each config's skip is stored (and counted, and shown)
    once: a repeat is told to the sampler's mirror only; and the run stops "exhausted" after
    MAX_REPEATS_IN_A_ROW such repeats in a row, long before the trial cap (before, it drew until
    the cap, storing every repeat)."""
    from optuna.trial import TrialState

    from tuner.records import RECORD_ATTR, TrialRecord
    from tuner.study.loop import MAX_REPEATS_IN_A_ROW, StudyRun

    config = _spent_config()
    cap = 5000
    run = StudyRun(config, OfflineExecutor(config), max_trials=cap, storage_url=":memory:")
    summary = run.run()
    assert summary.stop_reason == "exhausted"
    assert summary.handled < cap and summary.trials_run <= 36
    stored = [TrialRecord.model_validate(t.user_attrs[RECORD_ATTR]) for t in run.opened.study.trials
              if t.state is TrialState.PRUNED and t.user_attrs.get("tuner.kind", "sampled") == "sampled"]
    keys = [tuple(sorted(run.read().space.snap(r.params).items())) for r in stored]
    assert len(keys) == len(set(keys))  # each config's skip stored once
    assert summary.trials_skipped == len(stored)  # a skip is counted and shown once, as stored
    assert run.streaks.repeats >= MAX_REPEATS_IN_A_ROW  # the stop: repeats, neither stored nor counted
    measured = {tuple(sorted(run.read().space.snap(r.params).items())) for _, r in run.finished() if r.outcome != "skipped"}
    assert not measured & set(keys)  # a draw of a measured config is never stored as a skip


def test_a_resumed_run_stores_no_skip_the_study_holds(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A second run on a spent study (a resumed run, or another host) draws configs the first one
    stored skips of: the study holds each config's skip once (it is still this run's decision,
    counted and shown), and the second run also stops "exhausted"."""
    from optuna.trial import TrialState

    monkeypatch.chdir(tmp_path)  # the study's artifacts folder (studies/<study>/artifacts) lands here, not in the checkout

    from tuner.records import RECORD_ATTR, TrialRecord
    from tuner.study.loop import StudyRun

    config = _spent_config()
    url = f"sqlite:///{tmp_path / 'spent.db'}"
    first = StudyRun(config, OfflineExecutor(config), max_trials=5000, storage_url=url)
    assert first.run().stop_reason == "exhausted"
    before = len(first.opened.study.trials)
    second = StudyRun(config, OfflineExecutor(config), max_trials=5000, storage_url=url)
    summary = second.run()
    assert summary.stop_reason == "exhausted" and summary.trials_skipped > 0  # it drew the held skips again
    trials = second.opened.study.trials
    skips = [TrialRecord.model_validate(t.user_attrs[RECORD_ATTR]) for t in trials
             if t.state is TrialState.PRUNED and t.user_attrs.get("tuner.kind", "sampled") == "sampled"]
    keys = [tuple(sorted(second.read().space.snap(r.params).items())) for r in skips]
    assert len(keys) == len(set(keys))  # each config's skip stored once, study-wide
    assert len(trials) - before < summary.trials_skipped  # the held ones were not stored again


def test_the_trial_cap_counts_launches_not_skips() -> None:
    """``--trials N`` caps the run's launches (restarts of the service): a skipped proposal costs no
    restart, so a study that skips configs between its launches still gets its N launches (before,
    skips counted, and on this space 8 trials were 4 launches and 4 skips)."""
    from tuner.study.loop import StudyRun

    config = _spent_config()
    run = StudyRun(config, OfflineExecutor(config), max_trials=8, storage_url=":memory:")
    summary = run.run()
    assert summary.stop_reason == "trials"
    assert summary.trials_run == 8
    assert summary.trials_skipped > 0  # the skips it made between launches did not spend the cap


@pytest.mark.slow
def test_new_skips_in_a_row_stop_a_spent_study_as_exhausted_and_say_why() -> None:
    """The trial cap counts launches, so skips need their own bound: on the 70B tp 4 H100 (a
    memory-bound space of ~4,000 configs that the planner spends in a few launches), every config
    the sampler draws afterwards is skipped as below the capacity band, beyond the reachable slots
    or predicted to OOM; after MAX_SKIPS_IN_A_ROW new skips with no launch between them the run
    stops as exhausted, long before the 1000-launch cap, and says why (before, it drew new skips
    until the 200-repeat stop: thousands of them)."""
    from tests.support.scenarios import scenarios, with_seed
    from tuner.study.loop import MAX_SKIPS_IN_A_ROW, StudyRun

    config = with_seed(scenarios()["70B tp4 on H100, 8k contexts"]["config"], 0)
    run = StudyRun(config, OfflineExecutor(config, world_seed=0), max_trials=1000, storage_url=":memory:")
    summary = run.run()
    assert summary.stop_reason == "exhausted" and summary.trials_run < 20
    assert run.streaks.skips == MAX_SKIPS_IN_A_ROW and run.streaks.repeats < 200
    assert summary.trials_skipped < 10 * MAX_SKIPS_IN_A_ROW
    assert f"{MAX_SKIPS_IN_A_ROW} new configs in a row were skipped without a restart" in summary.stop_detail
    assert summary.as_json()["stop_detail"] == summary.stop_detail
