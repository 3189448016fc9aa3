"""The quality gate on the search benchmark's scenarios, and the probe's cost per distinct numerics.

For every scenario and seed of ``search_scenarios.toml`` the study also searches the KV cache's
dtype (``[space] kv_cache_dtype = ["auto", "fp8_e4m3"]``) on the simulator's offline evaluation
(the product's trial and loop, 20 launches), twice: with a numerics fault planted on the fp8 KV
rung (``--sim-numerics-fault kv_cache_dtype=fp8_e4m3``) and healthy. With the fault, the study must
never choose an fp8 candidate (nor can ``tuner apply`` take it: it is infeasible); healthy, every
fp8 candidate must pass with the default thresholds. Each study pays one probe per distinct
numerics (the baseline's reference, then one for fp8 whatever the fp8 launches).

The probe's cost is measured on the simulator as a real process over HTTP on 127.0.0.1: one
probe (16 prompts, 48 greedy tokens each, one batch ``/generate`` with ``return_logprob``; and the
32-question arithmetic task set) per distinct numerics, wall seconds, and its size in tokens.

Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_quality.py --run-benchmarks -s``
(figures in docs/quality-gate.md). ``BENCH_QUALITY_JSON=path`` also writes them as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from tests.support.offline_server import OfflineExecutor
from tests.support.scenarios import scenarios, with_seed
from tests.support.sim import start_healthy
from tuner.config import TunerConfig
from tuner.load.quality import QualityConfig, arithmetic_tasks, probe_prompts, run_probe
from tuner.sglang.client import GreedyAnswer, SGLangClient
from tuner.study.loop import run_study

LAUNCHES = 20
FAULT = ["--sim-numerics-fault", "kv_cache_dtype=fp8_e4m3"]


def _with_fp8(cfg: TunerConfig, *, fault: bool) -> TunerConfig:
    command = [*(cfg.service.command or []), *(FAULT if fault else [])]
    return cfg.model_copy(update={"space": cfg.space.model_copy(update={"kv_cache_dtype": ["auto", "fp8_e4m3"]}),
                                  "service": cfg.service.model_copy(update={"command": command})})


def _study(cfg: TunerConfig, seed: int, *, fault: bool) -> dict[str, Any]:
    cfg = with_seed(_with_fp8(cfg, fault=fault), seed)
    runner = OfflineExecutor(cfg, world_seed=0)
    summary = run_study(cfg, runner, max_trials=LAUNCHES, storage_url=":memory:")
    fp8 = [r for _, r in runner.history if r.params.get("kv_cache_dtype") == "fp8_e4m3"]
    best = summary.best.record if summary.best is not None else None
    probes = {(n, r.quality.status) for n, r in runner.history if r.quality.probed_on_trial == n}
    return {
        "fp8_launches": len(fp8),
        "fp8_passed": sum(r.quality.status == "passed" for r in fp8),
        "fp8_failed": sum(r.quality.status == "failed" for r in fp8),
        "probes": len(probes),
        "best_is_fp8": best is not None and best.params.get("kv_cache_dtype") == "fp8_e4m3",
        "exact_match": [r.quality.exact_match_share for r in fp8 if r.quality.exact_match_share is not None][:1],
    }


def test_a_planted_fp8_fault_is_never_chosen_and_a_healthy_fp8_passes(capsys: Any) -> None:
    figures: dict[str, Any] = {}
    for name, item in scenarios().items():
        rows = {}
        for seed in item["seeds"]:
            broken, healthy = _study(item["config"], seed, fault=True), _study(item["config"], seed, fault=False)
            assert not broken["best_is_fp8"], (name, seed, broken)
            assert broken["fp8_passed"] == 0 and broken["fp8_launches"] == broken["fp8_failed"], (name, seed, broken)
            assert healthy["fp8_failed"] == 0 and healthy["fp8_passed"] == healthy["fp8_launches"], (name, seed, healthy)
            assert broken["probes"] <= 2 and healthy["probes"] <= 2  # the reference, then one per distinct numerics
            rows[seed] = {"fault": broken, "healthy": healthy}
        figures[name] = rows
        with capsys.disabled():
            line = " | ".join(f"seed {s}: fault fp8 {r['fault']['fp8_launches']} launched/{r['fault']['fp8_failed']} failed, "
                              f"healthy fp8 {r['healthy']['fp8_launches']}/{r['healthy']['fp8_passed']} passed"
                              f"{' (best)' if r['healthy']['best_is_fp8'] else ''}, probes {r['fault']['probes']}/"
                              f"{r['healthy']['probes']}" for s, r in rows.items())
            print(f"\n{name}: {line}")
    if path := os.environ.get("BENCH_QUALITY_JSON"):
        Path(path).write_text(json.dumps(figures, indent=1), encoding="utf-8")


def test_the_probe_costs_seconds_per_distinct_numerics(tmp_path: Path, capsys: Any) -> None:
    config = QualityConfig()
    tasks = arithmetic_tasks()
    sims = {name: start_healthy(["--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB", *extra], tmp_path,
                                time_scale=0.02)
            for name, extra in (("auto", []), ("fp8_e4m3", ["--kv-cache-dtype", "fp8_e4m3"]))}
    try:
        costs = {}
        for name, sim in sims.items():
            client = SGLangClient(sim.url)

            def generate(texts: list[str], n: int, timeout_s: float, client: SGLangClient = client) -> list[GreedyAnswer]:
                return client.greedy_answers(texts, max_new_tokens=n, timeout_s=timeout_s)

            walls = []
            for _ in range(3):
                begun = time.monotonic()
                run_probe(generate, config, tasks)
                walls.append(time.monotonic() - begun)
            costs[name] = statistics.median(walls)
    finally:
        for sim in sims.values():
            sim.stop()
    prompt_words = sum(len(p.text.split()) for p in probe_prompts()) + sum(len(t.question.split()) for t in tasks)
    out_tokens = len(probe_prompts()) * config.max_new_tokens + len(tasks) * config.task_max_new_tokens
    with capsys.disabled():
        print("\nprobe per distinct numerics (simulated H100, Llama-3.1-8B, over HTTP): "
              + ", ".join(f"{k} {v:.2f} s" for k, v in costs.items())
              + f"; {len(probe_prompts())} prompts + {len(tasks)} tasks, {prompt_words} prompt words (≈ tokens), "
              f"{out_tokens} output tokens; [quality] timeout_s {config.timeout_s:g} s")
    assert max(costs.values()) < config.timeout_s  # within the default minute
