"""Structural levers in the search (issue 23): capacity found with the rungs in the space vs the four
knobs alone, at equal launches, on simulated deployments evaluated offline (virtual time).

For each deployment: the study with ``[space]`` naming the structural levers the deployment can take
(fp8 KV everywhere, DCP on MLA models at SGLang 0.5.23) against the study with the default space
(fraction, request slots, chunk size), each for :data:`LAUNCHES` launches through the product's own
trial on the simulator's offline server (:class:`tests.support.offline_server.OfflineExecutor`).
Reported per arm: the best context capacity after 5 and after all launches, its token capacity,
launches, failed launches, rungs skipped without a launch; and the best capacity over every rung
at the top of the fraction range (a small grid: each rung × fractions 0.85-0.96 × 8-64 request
slots; a numerics change is not held to the quality gate there, which needs the study's
baseline), the reference "best feasible rung".

Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_levers.py --run-benchmarks -s``
(figures in README § tuner explain, structural levers).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.support.offline_server import OfflineExecutor
from tuner.config import TunerConfig
from tuner.records import Constraints, TrialRecord
from tuner.study.best import choose_best
from tuner.study.job import TrialJob
from tuner.study.loop import run_study

LAUNCHES = 8

_COMMON = {
    "workload": {"kind": "random", "input_len": 6144, "output_len": 64, "range_ratio": 0.25},
    "slo": {"ttft_ms": {"p99": 30000}, "itl_ms": {"p99": 4000}},
    "budget": {"warmup_s": 2, "measure_s": 20, "stress_s": 10, "max_concurrency": 64},
}

DEPLOYMENTS: dict[str, dict[str, Any]] = {
    "MLA tp 8 (Kimi-K2.5 INT4 + EAGLE-3, 8x RTX PRO 6000, 0.5.23)": {
        "command": ["{python}", "-m", "tuner.sim", "--model-path", "kimi-k2.5-int4", "--tp-size", "8",
                    "--speculative-algorithm", "EAGLE3", "--mem-fraction-static", "0.88", "--sim-gpu", "RTX-PRO-6000-96GB",
                    "--sim-version", "0.5.23"],
        "levers": {"kv_cache_dtype": ["fp8_e4m3"], "dcp_size": [8]},
    },
    "MLA fp8 tp 8 (DeepSeek-V3, 8x H200, 0.5.23)": {
        "command": ["{python}", "-m", "tuner.sim", "--model-path", "deepseek-v3", "--tp-size", "8",
                    "--mem-fraction-static", "0.85", "--sim-gpu", "H200-141GB", "--sim-version", "0.5.23"],
        "levers": {"kv_cache_dtype": ["fp8_e4m3"], "dcp_size": [8, 4]},
    },
    # DSA: fp8 KV is already SGLang's default on SM100 (trtllm's raw 576 B row + the 132 B indexer row);
    # DCP replicates the indexer on every rank, so dcp 8 gives 3.47x, not 8x. 128k contexts: at 32k the
    # baseline already holds the 64 requests the load allows.
    "DSA tp 8 (DeepSeek-V3.2, 8x B200, 0.5.23, 128k contexts)": {
        "command": ["{python}", "-m", "tuner.sim", "--model-path", "deepseek-v3.2", "--tp-size", "8",
                    "--mem-fraction-static", "0.85", "--sim-gpu", "B200-180GB", "--sim-version", "0.5.23"],
        "levers": {"dcp_size": [8, 4]},
        "context_tokens": 131072,
    },
    "GQA tp 2 (Llama-3.1-8B, 2x L40S, 0.5.23)": {
        "command": ["{python}", "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--tp-size", "2",
                    "--mem-fraction-static", "0.85", "--sim-gpu", "L40S-48GB", "--sim-version", "0.5.23"],
        "levers": {"kv_cache_dtype": ["fp8_e4m3"]},
    },
}


def _config(name: str, levers: bool) -> TunerConfig:
    item = DEPLOYMENTS[name]
    space: dict[str, Any] = {"mem_fraction_step": 0.01, **(item["levers"] if levers else {})}
    return TunerConfig.model_validate({
        "study": {"name": "levers" if levers else "knobs", "seed": 0},
        "service": {"launcher": "process", "command": item["command"]},
        "space": space, **_COMMON, "objective": {"context_tokens": item.get("context_tokens", 32768)},
    })


def _best(history: list[tuple[int, TrialRecord]], cfg: TunerConfig) -> TrialRecord | None:
    # ranked by the OOM-safe context capacity the table reports (the default "auto" ranks by the
    # SLO-safe one, which is not the figure printed: it picked a 7-request trial over 25-request ones)
    choice = choose_best(history, policy=cfg.objective.policy, capacity_tolerance=cfg.objective.capacity_tolerance,
                         throughput_noise=cfg.objective.throughput_noise, capacity="oom_safe")
    return choice.record if choice else None


def _study(cfg: TunerConfig) -> tuple[list[tuple[int, TrialRecord]], int]:
    runner = OfflineExecutor(cfg, world_seed=0)
    skips: list[str] = []

    def on_progress(event: Any) -> None:
        if event.event == "skip" and "unavailable" in (event.message or ""):
            skips.append(event.message)

    run_study(cfg, runner, max_trials=LAUNCHES, storage_url=":memory:", on_progress=on_progress)
    return runner.history[:LAUNCHES], len(skips)


def _rung_reference(cfg: TunerConfig, levers: dict[str, list[Any]]) -> int:
    """The best feasible context capacity over every rung at the top fractions (the reference)."""
    runner = OfflineExecutor(cfg, world_seed=0)
    choices = [[(k, v) for v in [None, *values]] for k, values in levers.items()]
    best = 0
    n = 0
    for combo in itertools.product(*choices):
        flags = {k: v for k, v in combo if v is not None}
        for mfs, mrr in itertools.product((0.85, 0.9, 0.93, 0.95, 0.96), (8, 16, 32, 64)):
            n += 1
            rec = runner.run(TrialJob(number=n, kind="sampled", params={**flags, "mem_fraction_static": mfs, "max_running_requests": mrr},
                                      context_tokens=cfg.objective.context_tokens or 32768), lambda _p: None)
            # a rung that changes numerics has no baseline answers to compare with here (the study's
            # quality gate compares them with its baseline's); the reference judges memory and SLOs only
            if Constraints.feasible_values({**rec.constraints, "quality": -1.0}):
                best = max(best, rec.context_capacity or 0)
    return best


@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_levers_vs_knobs(name: str) -> None:
    rows = []
    for levers in (False, True):
        cfg = _config(name, levers)
        history, skipped = _study(cfg)
        at5, best = _best(history[:5], cfg), _best(history, cfg)
        failed = sum(1 for _, r in history if r.outcome == "failed")
        rows.append((levers, at5.context_capacity if at5 else 0, best.context_capacity if best else 0,
                     best.token_capacity if best else 0, len(history), failed, skipped,
                     {k: v for k, v in (best.params if best else {}).items() if k in ("kv_cache_dtype", "dcp_size", "mem_fraction_static")}))
    reference = _rung_reference(_config(name, True), DEPLOYMENTS[name]["levers"])
    print(f"\n{name}: best feasible rung (grid) {reference} requests of {DEPLOYMENTS[name].get('context_tokens', 32768) // 1024}k")
    for levers, at5, cap, tokens, launches, failed, skipped, flags in rows:
        arm = "levers in the space" if levers else "four knobs alone"
        print(f"  {arm:22s} capacity@5 {at5:3d}  capacity@{launches} {cap:3d}  tokens {tokens:>9,}  failed {failed}  "
              f"skipped unavailable {skipped}  best {flags}")
    knobs, with_levers = rows
    assert with_levers[2] >= knobs[2]  # the rungs never make the search worse at equal launches
