"""Structural levers in the search (issue 23): capacity found with the levers derived by default vs
the four knobs alone, at equal launches, on simulated deployments evaluated offline (virtual time).

For each deployment (with its model's ``config.json``, so DP attention can be priced): the study
with the default space, whose structural levers are derived from the baseline, the version's flags
and the feasibility table (:mod:`tuner.study.lever_space`), against the study with ``[space]
exclude_levers`` naming all three (fraction, request slots, chunk size), each for :data:`LAUNCHES`
launches through the product's own trial on the simulator's offline server
(:class:`tests.support.offline_server.OfflineExecutor`). Reported per arm: the highest feasible
context capacity within 5 and within all launches and the launch that reached it, tokens per rank,
failed launches, rungs skipped without a launch; and the best capacity over every derived rung at
the top of the fraction range up to the study's own slot cap (a small grid: the reference "best
feasible rung"). Beside each arm's OOM-safe capacity, its SLO-safe sessions (steady windows, issue
36): those of the config with the most longest contexts, and the most any feasible launch held.
``BENCH_CAPACITY=auto`` ranks the studies by the SLO-safe sessions (the default objective; the
twin's ``[slo]`` is set on every deployment). Asserted: no failed launch with the levers (a rung
that cannot start is screened).

Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_levers.py --run-benchmarks -s``
(figures in docs/tuner-explain.md, structural levers).
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path
from typing import Any

import optuna
import pytest

from tests.support.offline_server import OfflineExecutor
from tests.support.scenarios import bench_capacity
from tuner.config import TunerConfig
from tuner.records import TrialRecord
from tuner.study.job import TrialJob
from tuner.study.loop import run_study
from tuner.study.optuna_io import SPACE_ATTR
from tuner.study.space import Space

LAUNCHES = 8
MODELS = Path(__file__).resolve().parents[2] / "tuner" / "data" / "models"

_COMMON = {
    "workload": {"kind": "random", "input_len": 6144, "output_len": 64, "range_ratio": 0.25},
    "slo": {"ttft_ms": {"p99": 30000}, "itl_ms": {"p99": 4000}},
    "budget": {"warmup_s": 2, "measure_s": 20, "stress_s": 10, "max_concurrency": 64},
}
_ALL_LEVERS = ["fp8_kv", "dcp", "dp_attention"]

DEPLOYMENTS: dict[str, dict[str, Any]] = {
    "MLA tp 8 (Kimi-K2.5 INT4 + EAGLE-3, 8x RTX PRO 6000, 0.5.23)": {
        "command": ["{python}", "-m", "tuner.sim", "--model-path", "kimi-k2.5-int4", "--tp-size", "8",
                    "--speculative-algorithm", "EAGLE3", "--mem-fraction-static", "0.88", "--sim-gpu", "RTX-PRO-6000-96GB",
                    "--sim-version", "0.5.23"],
        "model": "kimi-k2.5-int4",
    },
    "MLA fp8 tp 8 (DeepSeek-V3, 8x H200, 0.5.23)": {
        "command": ["{python}", "-m", "tuner.sim", "--model-path", "deepseek-v3", "--tp-size", "8",
                    "--mem-fraction-static", "0.85", "--sim-gpu", "H200-141GB", "--sim-version", "0.5.23"],
        "model": "deepseek-v3",
    },
    # DSA: fp8 KV is already SGLang's default on SM100 (trtllm's raw 576 B row + the 132 B indexer row);
    # DCP replicates the indexer on every rank, so dcp 8 gives 3.47x, not 8x. 128k contexts: at 32k the
    # baseline already holds the 64 requests the load allows.
    "DSA tp 8 (DeepSeek-V3.2, 8x B200, 0.5.23, 128k contexts)": {
        "command": ["{python}", "-m", "tuner.sim", "--model-path", "deepseek-v3.2", "--tp-size", "8",
                    "--mem-fraction-static", "0.85", "--sim-gpu", "B200-180GB", "--sim-version", "0.5.23"],
        "model": "deepseek-v3.2",
        "context_tokens": 131072,
    },
    "GQA tp 2 (Llama-3.1-8B, 2x RTX PRO 6000, 0.5.23)": {
        "command": ["{python}", "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--tp-size", "2",
                    "--mem-fraction-static", "0.85", "--sim-gpu", "RTX-PRO-6000-96GB", "--sim-version", "0.5.23"],
        "model": "llama-3.1-8b",
    },
}


def _config(name: str, levers: bool) -> TunerConfig:
    """The deployment's study: the levers derived by default (``levers``), or ``exclude_levers``
    naming all three (the four knobs alone)."""
    item = DEPLOYMENTS[name]
    space: dict[str, Any] = {"mem_fraction_step": 0.01, **({} if levers else {"exclude_levers": _ALL_LEVERS})}
    return TunerConfig.model_validate({
        "study": {"name": "levers" if levers else "knobs", "seed": 0},
        "service": {"launcher": "process", "command": item["command"]},
        "model": {"config_json": str(MODELS / item["model"] / "config.json")},
        "space": space, **_COMMON, "objective": {"context_tokens": item.get("context_tokens", 32768),
                                             # the capacity the table reports (BENCH_CAPACITY=auto: the default objective)
                                             "capacity": bench_capacity()},
    })


def _found(history: list[tuple[int, TrialRecord]]) -> TrialRecord | None:
    """The feasible launch with the highest context capacity (the study's best may trade a little
    capacity for throughput by its policy; capacity found is what the levers are for)."""
    feasible = [r for _, r in history if r.feasible]
    return max(feasible, key=lambda r: r.context_capacity or 0, default=None)


def _slo_safe(record: TrialRecord | None) -> str:
    """A record's steady SLO-safe sessions (``"5"``, ``"≥ 16"``; ``"—"`` where none was measured)."""
    slo = None if record is None else record.slo_capacity
    return "—" if slo is None or slo.contexts is None else f"{'≥ ' if slo.at_least else ''}{slo.contexts}"


def _study(cfg: TunerConfig) -> tuple[list[tuple[int, TrialRecord]], int, Space]:
    runner = OfflineExecutor(cfg, world_seed=0)
    skips: list[str] = []

    def on_progress(event: Any) -> None:
        if event.event == "skip" and ("unavailable" in (event.message or "") or "not to start" in (event.message or "")):
            skips.append(event.message)

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/study.db"
        run_study(cfg, runner, max_trials=LAUNCHES, storage_url=url, on_progress=on_progress)  # --trials caps launches
        space = Space.model_validate(optuna.load_study(study_name=cfg.study.name, storage=url).user_attrs[SPACE_ATTR])
    return runner.history[:LAUNCHES], len(skips), space


def _rung_reference(cfg: TunerConfig, space: Space, baseline: TrialRecord) -> tuple[int, dict[str, Any]]:
    """The best feasible context capacity over every derived rung at the top fractions, on the
    baseline's other knobs (the reference)."""
    runner = OfflineExecutor(cfg, world_seed=0)
    levers = {k: space.grid(k) for k in ("kv_cache_dtype", "dcp_size", "dp_size") if space.searches(k)}
    best, where, n = 0, {}, 0
    for combo in itertools.product(*([(k, v) for v in values] for k, values in levers.items())):
        flags = dict(combo)
        top = space.max_running_requests[1]  # the study's own slot cap (what its load can fill)
        for mfs, mrr in itertools.product((0.9, 0.93, 0.96), sorted({m for m in (32,) if m < top} | {top})):
            n += 1
            rec = runner.run(TrialJob(number=n, kind="sampled", params={**baseline.params, **flags, "mem_fraction_static": mfs,
                                                                            "max_running_requests": mrr},
                                      context_tokens=cfg.objective.context_tokens or 32768), lambda *_a, **_k: None)
            held = all(v <= 0 for k, v in rec.constraints.items() if k != "quality")  # no quality reference here
            if rec.outcome == "ok" and held and (rec.context_capacity or 0) > best:
                best, where = rec.context_capacity or 0, {**flags, "mem_fraction_static": mfs}
    return best, where


# The DSA deployment's 128k-context launches are slow to simulate; with the trial cap counting
# launches each arm makes its LAUNCHES (5 min 16 s for the DSA row alone on the shared 2-core box,
# over pytest's default 300 s).
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_levers_vs_knobs(name: str) -> None:
    rows = []
    space = None
    for levers in (False, True):
        cfg = _config(name, levers)
        history, skipped, arm_space = _study(cfg)
        space = arm_space if levers else space
        at5, best = _found(history[:5]), _found(history)
        failed = sum(1 for _, r in history if r.outcome == "failed")
        first = next((i + 1 for i, (_, r) in enumerate(history) if r.feasible and best and
                      (r.context_capacity or 0) >= (best.context_capacity or 0)), None)
        held = max((r for _, r in history if r.feasible), key=lambda r: r.capacity("slo_safe") or 0, default=None)
        held_at = next((i + 1 for i, (_, r) in enumerate(history) if held is not None and r is held), None)
        rows.append((levers, at5.context_capacity if at5 else 0, best.context_capacity if best else 0,
                     best.token_capacity if best else 0, len(history), failed, skipped, first,
                     {k: v for k, v in (best.params if best else {}).items()
                      if k in ("kv_cache_dtype", "dcp_size", "dp_size", "mem_fraction_static")},
                     f"SLO-safe sessions {_slo_safe(best)} (most held: {_slo_safe(held)} at launch {held_at}, "
                     f"{held.context_capacity if held else 0} contexts OOM-safe)"))
    assert space is not None
    reference, where = _rung_reference(_config(name, True), space, history[0][1])
    print(f"\n{name}: derived levers: " + "; ".join(r.split(":")[0] + (" yes" if ": derived" in r else " no")
                                                   for r in space.lever_reasons))
    print(f"  best feasible rung (grid, max_running_requests ≤ {space.max_running_requests[1]}) {reference} requests of {_config(name, True).objective.context_tokens} tokens at {where}")
    print(f"  [capacity = {_config(name, True).objective.capacity}]")
    for levers, at5, cap, tokens, launches, failed, skipped, first, flags, slo_safe in rows:
        arm = "levers derived" if levers else "four knobs alone"
        print(f"  {arm:17s} capacity@5 {at5:3d}  capacity@{launches} {cap:3d} (first at launch {first})  tokens/rank {tokens:>9,}  "
              f"failed {failed}  rungs skipped {skipped}  best {flags}  {slo_safe}")
    knobs, with_levers = rows
    assert with_levers[5] == 0  # never a launch that fails (a rung that cannot start is screened)
