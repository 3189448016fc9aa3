"""The quality gate on a speculative, DP-attention deployment (issue 38): the reference twin's
shape (Kimi-K2.5 INT4, EAGLE-3 with the shape SGLang chooses, tp 8, DP attention derived) with a
numerics fault planted on DP attention or on one speculative shape. The failed numerics is
launched at most once per study and is never the best nor applied; the baseline's own shape,
left to SGLang on its command line, is no numerics change. The product's trial and loop on the
simulator's offline evaluation, a real SQLite file, ``tuner apply --dry-run`` as a process.

Before, the key of a launch was its command line's: the baseline (``--speculative-algorithm
EAGLE3``, no shape) and every candidate naming the shape SGLang chose for it (3, 1, 4) differed,
so the baseline's own numerics cost a probe, and a record's shape was not SGLang's (``steps 2,
draft 4`` runs ``steps 2, draft 3``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support.offline_server import OfflineExecutor
from tuner.config import TunerConfig, load_config
from tuner.records import TrialRecord
from tuner.study.launch import record_numerics
from tuner.study.loop import run_study

KIMI = Path(__file__).resolve().parents[2] / "tuner" / "data" / "models" / "kimi-k2.5-int4"


def _config(tmp_path: Path, fault: str, exclude: tuple[str, ...], seed: int = 0) -> TunerConfig:
    command = ["{python}", "-m", "tuner.sim", "--model-path", "kimi-k2.5-int4", "--tp-size", "8", "--speculative-algorithm",
               "EAGLE3", "--mem-fraction-static", "0.88", "--sim-gpu", "RTX-PRO-6000-96GB", "--sim-version", "0.5.23",
               "--sim-numerics-fault", fault]
    path = tmp_path / "gate.toml"
    path.write_text(f"""
[study]
name = "gate-levers"
seed = {seed}
[service]
launcher = "process"
command = {json.dumps(command)}
[model]
config_json = {json.dumps(str(KIMI / "config.json"))}
[storage]
url = {json.dumps(f"sqlite:///{tmp_path / 'study.db'}")}
artifacts_dir = {json.dumps(str(tmp_path / "artifacts"))}
[space]
mem_fraction_step = 0.01
exclude_levers = {json.dumps(list(exclude))}
[workload]
kind = "random"
input_len = 6144
output_len = 64
range_ratio = 0.25
[slo]
ttft_ms = {{ p99 = 30000 }}
itl_ms = {{ p99 = 4000 }}
[objective]
context_tokens = 32768
[budget]
warmup_s = 2
measure_s = 20
stress_s = 10
max_concurrency = 64
""", encoding="utf-8")
    return load_config(path)


def _faulty(record: TrialRecord, fault: str) -> bool:
    name, _, value = fault.partition("=")
    return str(record_numerics(record).get(name)).lower() == value


@pytest.mark.parametrize(("fault", "exclude"), [
    ("enable_dp_attention=true", ("dcp",)),  # DP attention searched first (the larger DCP rung left out)
    ("speculative_num_steps=2", ("dcp", "dp_attention", "fp8_kv")),  # the shapes searched first
], ids=["dp-attention", "speculative-shape"])
def test_a_numerics_that_failed_is_launched_once_and_never_chosen_nor_applied(
        tmp_path: Path, fault: str, exclude: tuple[str, ...], tuner_cli: Any) -> None:
    config = _config(tmp_path, fault, exclude)
    runner = OfflineExecutor(config, world_seed=0)
    summary = run_study(config, runner, max_trials=12, storage_url=config.storage.url)
    history = runner.history
    faulty = [(n, r) for n, r in history if _faulty(r, fault)]
    assert faulty, "the study launched no candidate the fault hits"
    launches = Counter(json.dumps(record_numerics(r), sort_keys=True) for _, r in faulty)
    assert set(launches.values()) == {1}, launches  # each failed numerics launched once (fp8 KV or not, DP 4 or 8)
    assert all(r.quality.status == "failed" and not r.feasible for _, r in faulty)
    number = faulty[0][0]
    assert summary.best is not None and not _faulty(summary.best.record, fault)
    # the baseline's own shape (chosen by SGLang) is its numerics: no probe, no change
    baseline = history[0][1]
    assert baseline.quality.numerics["speculative_num_steps"] == 3  # Kimi is DeepSeek-V3-like: (3, 1, 4)
    same_shape = [r for _, r in history[1:] if record_numerics(r) == record_numerics(baseline)]
    assert same_shape and all(r.quality.status == "same" and not r.quality.changes for r in same_shape)
    probes = Counter(json.dumps(record_numerics(r), sort_keys=True) for n, r in history
                     if r.quality.probed_on_trial == n and r.quality.status != "reference")
    assert all(count == 1 for count in probes.values()), probes  # one probe per distinct numerics
    apply = ("--storage", config.storage.url, "--config", str(config.path), "--dry-run")
    refused = tuner_cli("apply", str(number), *apply)
    assert refused.returncode == 1 and "not feasible (" in refused.stderr, refused.stderr
    best = tuner_cli("apply", "best", *apply)
    assert best.returncode == 0, best.stderr
