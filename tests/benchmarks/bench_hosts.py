"""Many hosts: trials finished per wall-clock minute with 1, 2 and 4 workers sharing one study on a
real PostgreSQL server, and the search quality at equal total launches.

Each worker is a process running the product's own loop (``tuner.study.loop.run_study``: claim
lock, planner, constant-liar TPE, heartbeats, reaper) against the shared study, with its own
``TUNER_HOST``. A worker's "unit" is the simulator's offline evaluation (``OfflineRunner``, the
search-quality benchmark's runner): the results come from the simulated server, and each launch
then sleeps to a fixed :data:`TRIAL_S` seconds of wall-clock time, so the figures are real time and
measure what the hosts add (coordination in the database, duplicate avoidance, waiting for the
baseline), not the box's CPU. Scenario: "8B on L4, 4k contexts, chunks to 16k" of
``bench_search.py`` (the one where the top of the fraction range is not safe).

Rate: launched trials (not skips) completed within :data:`WINDOW_S` seconds after the baseline
completed, per minute. Quality: the best (the config's policy) among the first k launches to
complete, study-wide, for each k of :data:`K_LAUNCHES`.

Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_hosts.py --run-benchmarks -s`` (about 8
minutes; figures in README § Many hosts).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tuner.records import RECORD_ATTR, TrialRecord
from tuner.study.best import choose_best

TRIAL_S = 12.0
"""Wall-clock seconds of one launch (restart + load phases of a real trial, scaled down)."""
WINDOW_S = 96.0
"""Seconds after the baseline in which finished launches are counted."""
K_LAUNCHES = (5, 8, 10)
"""Launch counts at which search quality is compared (the first to complete, study-wide)."""
SCENARIO = "8B on L4, 4k contexts, chunks to 16k"


def _worker(url: str, host: str, budget_s: float, cwd: str) -> None:
    """One host: the product's loop on the shared study, trials timed to :data:`TRIAL_S`."""
    os.environ["TUNER_HOST"] = host
    os.chdir(cwd)  # its studies/<study>/artifacts folder lands in the test's folder
    from tests.benchmarks.bench_search import scenarios
    from tests.support.offline_runner import OfflineRunner
    from tuner.study.loop import run_study

    class TimedRunner(OfflineRunner):
        def run(self, job, on_phase):  # noqa: ANN001, ANN202 - TrialRunner.run
            begun = time.monotonic()
            record = super().run(job, on_phase)
            time.sleep(max(0.0, TRIAL_S - (time.monotonic() - begun)))
            return record.model_copy(update={"duration_s": TRIAL_S})

    cfg = scenarios()[SCENARIO]
    run_study(cfg, TimedRunner(cfg), budget_s=budget_s, storage_url=url)


def _run(cluster, workers: int, cwd: Path) -> dict:  # noqa: ANN001 - PostgresCluster
    url = cluster.create_database()
    ctx = multiprocessing.get_context("spawn")
    budget_s = WINDOW_S + 40.0
    procs = [ctx.Process(target=_worker, args=(url, f"worker-{i}", budget_s, str(cwd))) for i in range(workers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=budget_s + 120)
        assert proc.exitcode == 0, f"worker exited {proc.exitcode}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name="l4-8b-chunks", storage=url)
    done = [(t, TrialRecord.model_validate(t.user_attrs[RECORD_ATTR])) for t in study.trials
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and RECORD_ATTR in t.user_attrs]
    launched = sorted([(t, r) for t, r in done if r.outcome in ("ok", "failed")], key=lambda p: p[0].datetime_complete)
    baseline = [t for t, r in launched if r.kind == "baseline"]
    start = baseline[0].datetime_complete
    counted = [t for t, r in launched if r.kind != "baseline" and (t.datetime_complete - start).total_seconds() <= WINDOW_S]
    keys = [tuple(sorted(t.params.items())) for t, r in launched if r.repeat_of is None]  # repeats: the noise
    from tests.benchmarks.bench_search import scenarios

    cfg = scenarios()[SCENARIO]
    quality = {}
    for k in K_LAUNCHES:
        first = [(t.number, r) for t, r in launched[:k]]
        best = choose_best(first, policy=cfg.objective.policy, capacity_tolerance=cfg.objective.capacity_tolerance,
                           throughput_noise=cfg.objective.throughput_noise)
        quality[k] = (best.record.context_capacity if best else 0, best.record.output_throughput_tok_s if best else 0.0,
                      sum(1 for _, r in first if r.outcome == "failed") / max(1, len(first)))
    out = {
        "workers": workers,
        "baselines": len(baseline),
        "rate_per_min": len(counted) / WINDOW_S * 60.0,
        "launches": len(launched),
        "duplicates": len(keys) - len(set(keys)),
        "hosts": sorted({t.user_attrs.get("tuner.host") for t, _ in launched}),
        "quality": quality,
        "skipped": sum(1 for _, r in done if r.outcome == "skipped"),
    }
    print(f"\n{out}", flush=True)
    if len(baseline) != 1:
        for t, r in sorted(done, key=lambda p: p[0].number)[:12]:
            print(t.number, t.state.name, r.kind, t.user_attrs.get("tuner.host"), t.datetime_start.time(),
                  t.datetime_complete.time(), flush=True)
    return out


@pytest.mark.benchmark
@pytest.mark.timeout(1800)
def test_trials_per_minute_scale_with_hosts_and_quality_holds(postgres_cluster, tmp_path: Path) -> None:  # noqa: ANN001
    results = {n: _run(postgres_cluster, n, tmp_path) for n in (1, 2, 4)}
    single = results[1]
    print(f"\nmany hosts, {SCENARIO}, {TRIAL_S:.0f} s per launch, PostgreSQL on 127.0.0.1:")
    for n, res in results.items():
        best = "; ".join(f"@{k}: {c} contexts, {t:.1f} tok/s, {f:.0%} failed" for k, (c, t, f) in res["quality"].items())
        print(f"  {n} worker(s): {res['rate_per_min']:.1f} launches/min ({res['rate_per_min'] / single['rate_per_min']:.2f}x), "
              f"{res['launches']} launches, {res['duplicates']} duplicate(s), hosts {res['hosts']}; best {best}")
    for n, res in results.items():
        assert res["baselines"] == 1
        assert res["duplicates"] == 0
        assert len(res["hosts"]) == n
        assert res["rate_per_min"] >= 0.9 * n * single["rate_per_min"], (n, res["rate_per_min"])
        assert res["launches"] >= max(K_LAUNCHES)
        for k in K_LAUNCHES:
            (cap, tput, _), (cap1, tput1, _) = res["quality"][k], single["quality"][k]
            assert cap >= cap1, (n, k, res["quality"])
            if cap == cap1:
                assert tput >= tput1 * (1 - 0.03), (n, k, res["quality"])
