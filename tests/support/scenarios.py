"""The search scenarios of ``tests/benchmarks/search_scenarios.toml`` as tuner configs (one reader),
and the HiCache and speculative benchmarks' workloads on the reference twin.

Read by the search-quality and many-hosts benchmarks and by the decision trace
(:mod:`tests.support.decision_trace`).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from tuner.config import TunerConfig, load_config, parse_config
from tuner.load.metrics import SLO

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS_FILE = ROOT / "tests" / "benchmarks" / "search_scenarios.toml"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def bench_capacity() -> str:
    """The ``[objective] capacity`` the search benchmarks rank by: ``BENCH_CAPACITY`` (``oom_safe``,
    the default: the memory search their grid optimum measures; ``auto``: the default objective,
    the steady SLO-safe capacity where an SLO is set, issue 36; or ``slo_safe``).

    Raises:
        ValueError: ``BENCH_CAPACITY`` names another value.
    """
    value = os.environ.get("BENCH_CAPACITY", "oom_safe")
    if value not in ("oom_safe", "auto", "slo_safe"):
        raise ValueError(f"BENCH_CAPACITY={value!r}: use oom_safe, auto or slo_safe")
    return value


def bench_slo() -> bool:
    """Whether the search benchmarks keep each scenario's ``[slo]``: ``BENCH_SLO=off`` drops it
    (every scenario of the file sets one; without it ``capacity = "auto"`` ranks by the OOM-safe
    capacity, the run that shows both objectives agree there).

    Raises:
        ValueError: ``BENCH_SLO`` names another value than ``on`` / ``off``.
    """
    value = os.environ.get("BENCH_SLO", "on")
    if value not in ("on", "off"):
        raise ValueError(f"BENCH_SLO={value!r}: use on or off")
    return value == "on"


def bench_seeds(seeds: list[int]) -> list[int]:
    """A scenario's study ``seeds``, the first ``BENCH_SEEDS`` of them when that is set (a reduced
    run; the docs say which figures are reduced).

    Raises:
        ValueError: ``BENCH_SEEDS`` is not a positive integer.
    """
    raw = os.environ.get("BENCH_SEEDS")
    if raw is None:
        return seeds
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"BENCH_SEEDS={raw!r}: use a positive number of seeds")
    return seeds[:int(raw)]


def scenarios(capacity: str = "oom_safe", *, slo: bool = True) -> dict[str, dict[str, Any]]:
    """The scenarios: name → ``config`` (a :class:`TunerConfig`), ``binds``, ``noise``, ``seeds``,
    ``grid_stride`` (see the TOML file's header); a scenario that names no ``[objective] capacity``
    ranks by ``capacity`` (the benchmarks pass :func:`bench_capacity`); ``slo=False`` drops each
    scenario's ``[slo]`` (:func:`bench_slo`)."""
    data = tomllib.loads(SCENARIOS_FILE.read_text(encoding="utf-8"))
    out = {}
    for item in data["scenario"]:
        config = item.get("config", {})
        if "config_file" in item:
            base = load_config(ROOT / item["config_file"]).model_dump(mode="json", exclude_none=True)
            base.pop("path", None)
            config = _merge(base, config)
        # The benchmark's grid optimum is the OOM-safe memory frontier (its shares measure the
        # memory search), so its studies rank by that capacity unless a scenario says otherwise;
        # the SLO-safe objective is tested in tests/study/test_slo_capacity.py.
        config = _merge({"study": {"name": item["name"], "seed": 0}}, config)
        if "capacity" not in item.get("config", {}).get("objective", {}):
            config = _merge(config, {"objective": {"capacity": capacity}})
        if not slo:
            config = {k: v for k, v in config.items() if k != "slo"}
        out[item["name"]] = {
            "config": parse_config(config), "binds": item.get("binds", "memory"), "noise": float(item.get("noise", 0.0)),
            "seeds": list(item.get("seeds", [0, 1, 2])), "grid_stride": int(item.get("grid_stride", 1)),
            "graphs": bool(item.get("graphs", False)),
        }
    return out


def with_seed(cfg: TunerConfig, seed: int, sampler: str = "tpe") -> TunerConfig:
    """``cfg`` with the study's seed and sampler set."""
    return cfg.model_copy(update={"study": cfg.study.model_copy(update={"seed": seed, "sampler": sampler})})


def with_config(cfg: TunerConfig, name: str, *, workload: dict | None = None, space: dict | None = None) -> TunerConfig:
    """``cfg`` renamed ``name``, with another ``[workload]`` or ``[space]`` keys when given."""
    update: dict = {"study": cfg.study.model_copy(update={"name": name})}
    if workload is not None:
        update["workload"] = type(cfg).model_validate({**cfg.model_dump(), "workload": workload}).workload
    if space is not None:
        update["space"] = cfg.space.model_copy(update=space)
    return cfg.model_copy(update=update)


def hicache_scenarios() -> dict[str, TunerConfig]:
    """The HiCache benchmark's three workloads on the reference twin (``bench_hicache.py``): name → config."""
    chat = load_config(ROOT / "configs" / "reference-multiturn-sim.toml")
    # ranked by the OOM-safe capacity, as the search scenarios are (the benchmark's figures are of the memory search)
    chat = chat.model_copy(update={"objective": chat.objective.model_copy(update={"capacity": "oom_safe"})})
    return {
        "multi-turn chat (64 sessions x 4 turns, 8k system prompt)": chat,
        "shared prefix (48 system prompts of 12k, 8 questions each)": with_config(chat, "shared-prefix", workload={
            "kind": "shared_prefix", "num_groups": 48, "prompts_per_group": 8, "system_prompt_len": 12288,
            "question_len": 512, "output_len": 256}),
        "no reuse (random 8k prompts)": with_config(chat, "random", workload={
            "kind": "random", "input_len": 8192, "output_len": 256, "range_ratio": 0.5, "num_requests": 256}),
    }


def spec_twin() -> TunerConfig:
    """The reference twin (Kimi-K2.5 INT4 + EAGLE-3, tp 8) on SGLang 0.5.23, every candidate loaded (no boot probe)."""
    cfg = load_config(ROOT / "configs" / "reference-sim.toml")
    command = [("0.5.23" if a == "0.5.5" else a) for a in cfg.service.command]
    return cfg.model_copy(update={"service": cfg.service.model_copy(update={"command": command}),
                                  "budget": cfg.budget.model_copy(update={"probe_only_below": 0.0})})


def spec_scenarios() -> dict[str, TunerConfig]:
    """The speculative benchmark's two workloads on :func:`spec_twin` (``bench_spec.py``): name → config."""
    twin = spec_twin()
    agent = with_config(twin, "spec-agent", workload={"kind": "text", "prompt_tokens": 2048, "output_len": 256})
    agent = agent.model_copy(update={
        "objective": agent.objective.model_copy(update={"policy": "max_throughput", "context_tokens": 8192}),
        "budget": agent.budget.model_copy(update={"max_concurrency": 2})})
    batch = with_config(twin, "spec-batch", workload={"kind": "text", "prompt_tokens": 1024, "output_len": 256})
    batch = batch.model_copy(update={
        "slo": SLO(),
        "objective": batch.objective.model_copy(update={"context_tokens": 2048}),
        "budget": batch.budget.model_copy(update={"max_concurrency": 64, "measure_s": 60})})
    return {"agent (2 in flight, max_throughput)": agent, "batch (64 in flight, capacity then throughput)": batch}
