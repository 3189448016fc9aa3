"""The search scenarios of ``tests/benchmarks/search_scenarios.toml`` as tuner configs (one reader).

Read by the search-quality and many-hosts benchmarks and by the decision trace
(:mod:`tests.support.decision_trace`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from tuner.config import TunerConfig, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS_FILE = ROOT / "tests" / "benchmarks" / "search_scenarios.toml"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def scenarios() -> dict[str, dict[str, Any]]:
    """The scenarios: name → ``config`` (a :class:`TunerConfig`), ``binds``, ``noise``, ``seeds``,
    ``grid_stride`` (see the TOML file's header)."""
    data = tomllib.loads(SCENARIOS_FILE.read_text(encoding="utf-8"))
    out = {}
    for item in data["scenario"]:
        config = item.get("config", {})
        if "config_file" in item:
            base = load_config(ROOT / item["config_file"]).model_dump(mode="json", exclude_none=True)
            base.pop("path", None)
            config = _merge(base, config)
        config = _merge({"study": {"name": item["name"], "seed": 0}}, config)
        out[item["name"]] = {
            "config": parse_config(config), "binds": item.get("binds", "memory"), "noise": float(item.get("noise", 0.0)),
            "seeds": list(item.get("seeds", [0, 1, 2])), "grid_stride": int(item.get("grid_stride", 1)),
        }
    return out


def with_seed(cfg: TunerConfig, seed: int, sampler: str = "tpe") -> TunerConfig:
    """``cfg`` with the study's seed and sampler set."""
    return cfg.model_copy(update={"study": cfg.study.model_copy(update={"seed": seed, "sampler": sampler})})
