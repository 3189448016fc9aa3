"""The hierarchical cache, tuned where it pays and left out where it cannot.

Three workloads on the reference deployment's simulated twin (Kimi-K2.5 INT4 + EAGLE-3, tp 8,
RTX PRO 6000, 0.5.5, a 256 GiB host), evaluated offline (``tuner.sim.evaluate``, virtual time;
every launch sizes the server from its rendered command line and runs the measured window and the
stress load): multi-turn chat (``configs/reference-multiturn-sim.toml``), shared system prompts,
and random prompts without reuse. The study runs unchanged (space from the workload's reuse
estimate, planner, sampler, skip rules, the host-memory check before every launch). For each: the
chosen trial within 10 launches, whether it uses the cache, its p99 TTFT, output throughput and
hit rates by tier, against the same flags with the cache off and against the best config of the
same study run with ``[space] hierarchical_cache = false`` (a study that could not use it).

Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_hicache.py --run-benchmarks -s``
(figures in docs/hicache.md).
"""

from __future__ import annotations

import pytest

from tests.support.offline_server import OfflineExecutor
from tests.support.scenarios import hicache_scenarios as scenarios
from tests.support.scenarios import with_config as _with
from tuner.config import TunerConfig
from tuner.records import TrialRecord
from tuner.sglang.failures import FailureClass
from tuner.study.best import choose_best
from tuner.study.job import TrialJob
from tuner.study.loop import run_study

LAUNCHES = 10


def _study(cfg: TunerConfig) -> tuple[OfflineExecutor, list[tuple[int, TrialRecord]], object]:
    runner = OfflineExecutor(cfg, pool_requests=256)
    summary = run_study(cfg, runner, max_trials=LAUNCHES, storage_url=":memory:")
    return runner, runner.history[:LAUNCHES], summary


def _best(cfg: TunerConfig, launched: list[tuple[int, TrialRecord]]) -> tuple[int, TrialRecord] | None:
    objective = cfg.objective
    choice = choose_best(launched, policy=objective.policy, capacity_tolerance=objective.capacity_tolerance,
                         throughput_noise=objective.throughput_noise, capacity=objective.capacity)
    if choice is None:
        return None
    return next((n, r) for n, r in launched if n == choice.number)


def _row(label: str, record: TrialRecord | None) -> str:
    if record is None:
        return f"| {label} | - | - | - | - |"
    c = record.cache
    pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
    pool = f"{c.host_pool_gb:g} GB" if c.host_pool_gb else "-"
    return (f"| {label} | {record.p99_ttft_ms / 1000:.1f} s | {record.output_throughput_tok_s:.0f} tok/s | "
            f"{pct(c.device_hit_rate)} / {pct(c.host_hit_rate)} | {pool} |")


@pytest.mark.parametrize("name", list(scenarios()))
def test_cache_on_where_it_pays_off_where_it_cannot(name: str) -> None:
    cfg = scenarios()[name]
    runner, launched, summary = _study(cfg)
    reuse_pays = "no reuse" not in name
    assert all(r.failure_class is not FailureClass.HOST_MEMORY for _, r in launched), "a host-memory failure was launched"
    chosen = _best(cfg, launched)
    assert chosen is not None
    number, best = chosen
    on = bool(best.params.get("enable_hierarchical_cache"))
    # Cache off: the chosen flags without it (one more offline launch, outside the study's 10).
    off_params = {k: v for k, v in best.params.items() if not k.startswith("hicache_")} | {"enable_hierarchical_cache": False}
    off = OfflineExecutor(cfg, pool_requests=256).run(
        TrialJob(number=99, kind="sampled", params=off_params, context_tokens=best.context_tokens or 0), lambda _p: None)
    # The best of a study that could not use the cache.
    blind_cfg = _with(cfg, cfg.study.name + "-nocache", space={"hierarchical_cache": False})
    _, blind_launched, _ = _study(blind_cfg)
    blind = _best(blind_cfg, blind_launched)
    skipped = summary.trials_skipped
    print(f"\n{name}: launches {len(launched)}, skipped without a restart {skipped}; chosen trial {number} "
          f"(cache {'on' if on else 'off'}, {best.params})")
    print("| config | p99 TTFT | output throughput | hit rate device / host | host pool |")
    print("| --- | --- | --- | --- | --- |")
    print(_row(f"tuned (trial {number}, cache {'on' if on else 'off'})", best))
    print(_row("same flags, cache off", off))
    print(_row("best of a study without the cache", blind[1] if blind else None))
    if reuse_pays:
        assert on, f"the cache pays on {name} but the chosen config does not use it"
        assert best.output_throughput_tok_s > off.output_throughput_tok_s
        assert blind is not None and best.output_throughput_tok_s > blind[1].output_throughput_tok_s
    else:
        assert not on and all(not r.params.get("enable_hierarchical_cache") for _, r in launched)
