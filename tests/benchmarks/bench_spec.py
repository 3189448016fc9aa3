"""Speculative decoding tuned together with memory and concurrency, on the reference twin (0.5.23).

The reference deployment's simulated twin (Kimi-K2.5 INT4 + EAGLE-3, tp 8, RTX PRO 6000) on
SGLang 0.5.23, evaluated offline (``tuner.sim.evaluate``, virtual time; every launch sizes the
server from its rendered command line, runs the measured window and the stress load), loaded with
text prompts (the shipped chat/code set, :class:`tuner.load.workloads.TextSpec`), two workloads:

- **agent**: two requests in flight, 2k-token prompts, 256-token answers, objective
  ``max_throughput`` (capacity cannot matter at two in flight);
- **batch**: up to 64 in flight, 1k-token prompts, 256-token answers, no latency SLO (offline
  batch jobs), the default objective (the most 2k contexts within 5 %, then throughput).

For each: the study with the speculative knobs (on/off, steps, top-k, draft tokens) within 10
launches, against the same study searching the base knobs alone (``[space] speculative = false``:
the baseline's draft shape kept), and a reference sweep (every shape the space holds, speculation
off included, at the memory knobs the base-only study chose). Reports the chosen config,
its objective against the best known (≥ 98 % asked; ranked by the objective's capacity, SLO-safe
where a latency SLO is set; the tables show the OOM-safe one), failed launches (0 asked, asserted for the tuned study) and the acceptance
length it measured.

Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_spec.py --run-benchmarks -s``
(figures in docs/speculative.md).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.offline_server import OfflineExecutor
from tests.support.scenarios import spec_scenarios as scenarios
from tests.support.scenarios import with_config
from tuner.config import TunerConfig
from tuner.records import TrialRecord
from tuner.study.best import choose_best
from tuner.study.job import TrialJob
from tuner.study.loop import run_study
from tuner.study.space import SPEC_SHAPE_KNOBS

LAUNCHES = 10


def _study(cfg: TunerConfig) -> OfflineExecutor:
    runner = OfflineExecutor(cfg, pool_requests=256)
    run_study(cfg, runner, max_trials=LAUNCHES, storage_url=":memory:")
    return runner


def _best(cfg: TunerConfig, launched: list[tuple[int, TrialRecord]]) -> tuple[int, TrialRecord] | None:
    o = cfg.objective
    choice = choose_best(launched, policy=o.policy, capacity_tolerance=o.capacity_tolerance,
                         throughput_noise=o.throughput_noise)
    return None if choice is None else next((n, r) for n, r in launched if n == choice.number)


def _shape(record: TrialRecord) -> str:
    p = record.params
    if p.get("speculative_algorithm") is False:
        return "off"
    if "speculative_num_steps" not in p:
        return "baseline's"
    return "/".join(str(p[k]) for k in SPEC_SHAPE_KNOBS)


def _accept(record: TrialRecord) -> float | None:
    measure = next((ph for ph in record.phases if ph.name == "measure"), None)
    return None if measure is None else measure.metrics.get("accept_length")


def _sweep(cfg: TunerConfig, runner: OfflineExecutor, params: dict[str, Any]) -> list[tuple[int, TrialRecord]]:
    """Every shape of the study's space (and off) at ``params``' other knobs, launched offline."""
    shapes: list[dict[str, Any]] = [{"speculative_algorithm": False}]
    for steps in (1, 2, 3, 4, 5):
        shapes.append({"speculative_algorithm": True, "speculative_num_steps": steps, "speculative_eagle_topk": 1,
                       "speculative_num_draft_tokens": steps + 1})
    base = {k: v for k, v in params.items() if not k.startswith("speculative_")}
    out = []
    for i, shape in enumerate(shapes):
        job = TrialJob(number=1000 + i, params={**base, **shape}, kind="sampled", context_tokens=cfg.objective.context_tokens or 8192)
        out.append((1000 + i, runner.run(job, lambda *_a, **_k: None)))
    return out


def _objective(cfg: TunerConfig, chosen: TrialRecord, top: TrialRecord) -> float:
    """The chosen config's share of the best known by the study's objective: throughput, and under
    the capacity-first policy 0 when its capacity is outside the best's 5 % band."""
    if cfg.objective.policy != "max_throughput":
        band = (1 - cfg.objective.capacity_tolerance) * (top.objective_capacity or 0)
        if (chosen.objective_capacity or 0) < band:
            return 0.0
    return float(chosen.output_throughput_tok_s or 0.0) / max(float(top.output_throughput_tok_s or 0.0), 1e-9)


@pytest.mark.parametrize("name", list(scenarios()))
def test_speculation_tuned_with_memory_and_concurrency(name: str) -> None:
    cfg = scenarios()[name]
    tuned = _study(cfg)
    base_only = _study(with_config(cfg, cfg.study.name + "-base", space={"speculative": False}))
    launched = tuned.history[:LAUNCHES]
    chosen = _best(cfg, launched)
    base_best = _best(cfg, base_only.history[:LAUNCHES])
    assert chosen is not None and base_best is not None
    # Every shape at the memory knobs the base-only study chose (where the draft fits).
    sweep = _sweep(cfg, OfflineExecutor(cfg, pool_requests=256), base_best[1].params)
    everything = launched + base_only.history[:LAUNCHES] + sweep
    top = _best(cfg, everything)
    assert top is not None
    ratio = _objective(cfg, chosen[1], top[1])
    print(f"\n### {name}")
    print("| study | chosen shape | mfs / max_running_requests | context capacity | output tok/s | accept length | failed launches |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, runner, (_n, r) in (("speculative knobs searched", tuned, chosen), ("base knobs alone", base_only, base_best),
                                  ("best known (studies + shape sweep)", None, top)):
        acc = _accept(r)
        fails = "-" if runner is None else str(sum(1 for _, x in runner.history[:LAUNCHES] if x.outcome == "failed"))
        print(f"| {label} | {_shape(r)} | {r.params.get('mem_fraction_static')} / {r.params.get('max_running_requests')} | "
              f"{r.context_capacity} | {r.output_throughput_tok_s:.0f} | {'-' if acc is None else f'{acc:.2f}'} | {fails} |")
    print(f"chosen / best known by the study's objective: {ratio:.1%}; launches {min(tuned.launches, LAUNCHES)}")
    print("shape sweep at the base-only study's memory knobs: " + ", ".join(
        f"{_shape(r)} {r.output_throughput_tok_s or 0:.0f} tok/s (cap {r.context_capacity}, accept "
        f"{'-' if _accept(r) is None else f'{_accept(r):.2f}'})" for _, r in sweep))
    print("tuned study's launches: " + "; ".join(
        f"#{n} {_shape(r)} {r.params.get('mem_fraction_static')}/{r.params.get('max_running_requests')} "
        f"{r.outcome}{'' if r.failure_class is None else ' ' + str(r.failure_class.value)} "
        f"{r.output_throughput_tok_s or 0:.0f} tok/s cap {r.context_capacity}" for n, r in launched))
    assert ratio >= 0.98
    assert not [n for n, r in launched if r.outcome == "failed"], "a launch of the tuned study failed"
    assert _accept(chosen[1]) is not None or chosen[1].params.get("speculative_algorithm") is False
