"""Warm start from the deployment's memory fingerprint (issue 27), on simulated deployments.

For each scenario of ``search_scenarios.toml`` below and each seed: a cold study on a fresh SQLite
file, then a second study of the same deployment and workload in the same file (same seed). Each
launch is the simulator's offline evaluation through the product's own trial
(:class:`tests.support.offline_server.OfflineExecutor`), the studies are the product's loop
(:func:`tuner.study.loop.run_study`). The figure is the first launch (the baseline is launch 1)
whose best (the default policy) reaches 98 % of the exhaustive grid optimum's context capacity
and throughput (``bench_search``'s grid and measure); the target: the warm study within 2
launches, never later than the cold one.

A second study on another workload of the same deployment (prompts a quarter shorter) reuses the
memory facts but no measured value: its first planned launch is compared with a cold study's on
that workload (the fraction it proposes and the launch where it reaches the cold study's best at
20 launches; no grid for that workload).

After a version change (the reference twin, Kimi-K2.5 + EAGLE-3 on 8 RTX PRO 6000, from SGLang
0.5.5 to 0.5.23, where the draft's KV moved into the cell, §1.5) the fingerprint matches in part:
the new study's first planned launch is predicted from its own baseline (one boot probe), and the
predicted token capacity must be within 1 % of the measured one; beside it, the capacity the old
version measured for the same flags (what a full transfer would have predicted).

Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_fingerprint.py --run-benchmarks -s``
(figures in docs/fingerprint.md). ``BENCH_FINGERPRINT_JSON=path`` also writes them as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks.bench_search import _grid, _until
from tests.support.offline_server import OfflineExecutor
from tests.support.scenarios import scenarios, with_config, with_seed
from tuner.config import TunerConfig
from tuner.records import TrialRecord
from tuner.study.loop import run_study

LAUNCHES = 20
MATCHING = ("70B tp4 on H100, 8k contexts", "8B on L4, 4k contexts, chunks to 16k",
            "reference twin (Kimi-K2.5 tp8, 32k)", "70B tp8 on A100, 1k requests, p99 TTFT 3 s")
SEEDS = (0, 1, 2)
_FIGURES: dict[str, Any] = {}



@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Studies' artifacts (``studies/<study>/artifacts``) land in the test's folder."""
    monkeypatch.chdir(tmp_path)

def _launches(cfg: TunerConfig, url: str, n: int = LAUNCHES) -> list[tuple[int, TrialRecord]]:
    """The first ``n`` launches of ``cfg``'s study in ``url`` (skips are no launches)."""
    runner = OfflineExecutor(cfg, world_seed=0)
    run_study(cfg, runner, max_trials=n, storage_url=url)
    return runner.history[:n]


def _dump() -> None:
    path = os.environ.get("BENCH_FINGERPRINT_JSON")
    if path:
        Path(path).write_text(json.dumps(_FIGURES, indent=2, default=str), encoding="utf-8")


@pytest.mark.parametrize("name", MATCHING)
def test_a_matching_fingerprint_reaches_the_optimum_in_two_launches(name: str, tmp_path: Path) -> None:
    cfg0 = scenarios()[name]["config"]
    _history, optimum, _space, _baseline, _context = _grid(name)
    rows = []
    for seed in SEEDS:
        cfg = with_seed(cfg0, seed)
        url = f"sqlite:///{tmp_path}/seed{seed}.db"
        cold = _launches(cfg, url)
        warm = _launches(with_config(cfg, cfg.study.name + "-again"), url)
        rows.append({"seed": seed, "cold": _until(cold, cfg, optimum, noisy=False),
                     "warm": _until(warm, cfg, optimum, noisy=False),
                     "warm_second": (warm[1][1].params if len(warm) > 1 else None)})
    _FIGURES.setdefault("matching", {})[name] = rows
    _dump()
    print(f"\n{name} (optimum {optimum.context_capacity} contexts, {optimum.output_throughput_tok_s:.0f} tok/s): "
          f"≥98 % at launch cold {[r['cold'] for r in rows]} / warm {[r['warm'] for r in rows]}")
    for row in rows:
        assert row["warm"] is not None and row["warm"] <= 2, row
        assert row["cold"] is None or row["warm"] <= row["cold"], row


def test_another_workload_starts_at_the_frontier(tmp_path: Path) -> None:
    name = "70B tp4 on H100, 8k contexts"
    cfg = with_seed(scenarios()[name]["config"], 0)
    workload = dict(cfg.workload.model_dump(mode="json"))
    workload["input_len"] = int(workload["input_len"] * 0.75)
    other = with_config(cfg, cfg.study.name + "-short", workload=workload)
    url = f"sqlite:///{tmp_path}/s.db"
    _launches(cfg, url)
    warm = _launches(other, url)
    cold = _launches(other, f"sqlite:///{tmp_path}/cold.db")
    target = max((r.context_capacity or 0) for _, r in cold if r.feasible)

    def reached(history: list[tuple[int, TrialRecord]]) -> int | None:
        return next((i + 1 for i, (_, r) in enumerate(history) if r.feasible and (r.context_capacity or 0) >= target), None)

    figures = {"cold_second": cold[1][1].params, "warm_second": warm[1][1].params, "target_capacity": target,
               "cold_reaches_at": reached(cold), "warm_reaches_at": reached(warm)}
    _FIGURES["other_workload"] = figures
    _dump()
    print(f"\nanother workload on {name}: reaches the cold study's best capacity {target} at launch "
          f"cold {figures['cold_reaches_at']} / warm {figures['warm_reaches_at']}; second launch cold "
          f"{figures['cold_second']} / warm {figures['warm_second']}")
    assert figures["warm_reaches_at"] is not None and figures["warm_reaches_at"] <= (figures["cold_reaches_at"] or 99)


def test_a_version_change_predicts_capacity_within_one_percent_after_one_boot_probe(tmp_path: Path) -> None:
    name = "reference twin (Kimi-K2.5 tp8, 32k)"
    cfg = with_seed(scenarios()[name]["config"], 0)
    command = list(cfg.service.command or [])
    command[command.index("--sim-version") + 1] = "0.5.23"
    new = with_config(cfg, cfg.study.name + "-0523")
    new = new.model_copy(update={"service": new.service.model_copy(update={"command": command})})
    url = f"sqlite:///{tmp_path}/s.db"
    old = _launches(cfg, url)
    after = _launches(new, url, n=4)
    planned = next(r for _, r in after if r.kind == "predicted" and r.prediction.token_capacity)
    error = abs(planned.prediction.token_capacity - (planned.token_capacity or 0)) / (planned.token_capacity or 1)
    old_base, new_base = old[0][1], after[0][1]
    model = old_base.memory.capacity_model
    assert model is not None
    transferred = model.tokens(planned.params["mem_fraction_static"], page_size=old_base.memory.page_size)
    figures = {"params": planned.params, "predicted": planned.prediction.token_capacity,
               "measured": planned.token_capacity, "error": error, "old_model_predicts": transferred,
               "old_model_error": abs(transferred - (planned.token_capacity or 0)) / (planned.token_capacity or 1),
               "baseline_tokens": [old_base.token_capacity, new_base.token_capacity]}
    _FIGURES["version_change"] = figures
    _dump()
    print(f"\n0.5.5 → 0.5.23 on {name}: first planned launch {planned.params}: predicted "
          f"{figures['predicted']} tokens, measured {figures['measured']} ({error:.2%}); the baseline's pool "
          f"{old_base.token_capacity} → {new_base.token_capacity} tokens; 0.5.5's memory model would predict "
          f"{transferred} ({figures['old_model_error']:.2%} off)")
    assert error <= 0.01
