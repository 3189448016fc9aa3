"""The deployment's memory fingerprint and the warm start (issue 27), on real SQLite files.

Studies run the product's loop and trial on the simulator's offline server
(:class:`tests.support.offline_server.OfflineExecutor`: every launch sizes a simulated server from
its rendered command line); ``tuner fingerprints`` runs as the installed script.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest

from tests.support.cli import run_tuner
from tests.support.offline_server import OfflineExecutor
from tests.support.scenarios import scenarios, with_config, with_seed
from tuner.config import TunerConfig
from tuner.records import TrialRecord
from tuner.study.best import choose_best
from tuner.study.fingerprint import FINGERPRINT_ATTR, Fingerprint, compare, parse_fingerprint
from tuner.study.loop import run_study
from tuner.study.optuna_io import record_of
from tuner.study.warm import WARM_ATTR, WarmStart

SCENARIO = "70B tp4 on H100, 8k contexts"



@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Studies' artifacts (``studies/<study>/artifacts``) land in the test's folder."""
    monkeypatch.chdir(tmp_path)

def _config(name: str | None = None, *, workload: dict[str, Any] | None = None,
            replace: dict[str, str] | None = None) -> TunerConfig:
    cfg = with_seed(scenarios()[SCENARIO]["config"], 0)
    cfg = with_config(cfg, name or cfg.study.name, workload=workload)
    if replace:
        command = list(cfg.service.command or [])
        for flag, value in replace.items():
            if flag in command:
                command[command.index(flag) + 1] = value
            else:
                command += [flag, value]
        cfg = cfg.model_copy(update={"service": cfg.service.model_copy(update={"command": command})})
    return cfg


def _run(cfg: TunerConfig, url: str, trials: int = 8) -> tuple[list[tuple[int, TrialRecord]], list[str]]:
    runner = OfflineExecutor(cfg, world_seed=0)
    notes: list[str] = []
    run_study(cfg, runner, max_trials=trials, storage_url=url,
              on_progress=lambda e: notes.append(e.message) if e.event == "note" and e.message else None)
    return runner.history, notes


def _study(url: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=url)


@pytest.mark.slow
def test_a_study_stores_its_fingerprint_and_the_next_one_on_the_deployment_starts_from_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/fleet.db"
    first, _ = _run(_config("first"), url)
    stored = _study(url, "first").user_attrs[FINGERPRINT_ATTR]
    fp = Fingerprint.model_validate(stored)
    launched = [n for n, r in first if r.outcome in ("ok", "failed")]
    assert [s.trial for s in fp.starts] == launched
    assert fp.key.gpu_name == "H100-80GB" and fp.key.layout.get("tp_size") == 4
    figures = fp.figures()
    assert figures["baseline_gib"] and figures["weight_gib"] and figures["cell_bytes"] and figures["graph_gib_per_bs"]

    second, notes = _run(_config("second"), url)
    warm = WarmStart.model_validate(_study(url, "second").user_attrs[WARM_ATTR])
    assert warm.source == "first" and warm.level == "same"
    assert any(n.startswith("warm start from study first") for n in notes), notes
    # the same workload: the earlier best is the first proposal after the baseline, measured here
    number, record = second[1]
    assert record.kind == "predicted" and "the best config of study first" in (record.prediction.why or "")
    objective = _config("first").objective
    chosen = choose_best(first, policy=objective.policy, capacity_tolerance=objective.capacity_tolerance,
                         throughput_noise=objective.throughput_noise, capacity=objective.capacity)
    assert chosen is not None and record.params == chosen.record.params, (record.params, chosen)
    assert record.context_capacity == chosen.record.context_capacity
    assert warm.sampler_trials > 0 and warm.checks_gib

    # a resumed run re-applies the stored warm start: nothing is looked up or enqueued again
    _run(_config("second"), url, trials=2)
    again = _study(url, "second")
    assert WarmStart.model_validate(again.user_attrs[WARM_ATTR]) == warm
    enqueued = [t for t in again.trials if "the best config of study first" in str(t.user_attrs.get("tuner.prediction"))]
    assert len(enqueued) == 1, [t.number for t in enqueued]

    proc = run_tuner("fingerprints", "--storage", url)
    assert proc.returncode == 0
    assert "1x H100-80GB" in proc.stdout and "first" in proc.stdout and "from first (same)" in proc.stdout
    studies = run_tuner("studies", "--storage", url)
    assert studies.returncode == 0 and "from first (same)" in studies.stdout


def test_another_workload_reuses_the_memory_facts_and_proposes_the_frontier_first(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    _run(_config("short"), url)
    workload = dict(scenarios()[SCENARIO]["config"].workload.model_dump(mode="json"))
    workload["input_len"] = int(workload["input_len"] * 0.75)
    other, _ = _run(_config("other-workload", workload=workload), url, trials=3)
    warm = WarmStart.model_validate(_study(url, "other-workload").user_attrs[WARM_ATTR])
    assert warm.level == "same" and warm.enqueued is None and warm.sampler_trials == 0
    assert any("no measured values" in line for line in warm.reused)
    # its first planned launch is calibrated on an earlier study's start (numbered -1 - n)
    planned = other[1][1]
    assert planned.kind == "predicted" and (planned.prediction.calibrated_on_trial or 0) < 0
    assert "started warm from" in (planned.prediction.why or "")


def test_a_fingerprint_of_another_gpu_or_model_is_never_used_and_the_study_says_why(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    _run(_config("h100"), url, trials=2)
    history, notes = _run(_config("a100", replace={"--sim-gpu": "A100-80GB"}), url, trials=2)
    warm = WarmStart.model_validate(_study(url, "a100").user_attrs[WARM_ATTR])
    assert warm.source is None and warm.references == [] and not warm.checks_gib
    assert any("other GPU" in line and "H100-80GB" in line for line in warm.not_used), warm.not_used
    assert any(n.startswith("warm start: none (no fingerprint matches: study h100: other GPU") for n in notes), notes
    assert all((r.prediction.calibrated_on_trial or 0) >= 0 for _, r in history)


def test_a_version_change_transfers_only_what_still_holds(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    _run(_config("old"), url, trials=2)
    _, notes = _run(_config("new", replace={"--sim-version": "0.5.23"}), url, trials=2)
    warm = WarmStart.model_validate(_study(url, "new").user_attrs[WARM_ATTR])
    assert warm.level == "version" and "0.5.5 vs 0.5.23" in warm.reason
    assert warm.references == [] and warm.checks_gib == [] and warm.enqueued is None
    assert any("warm start from study old" in n for n in notes)


def test_a_corrupt_or_foreign_fingerprint_is_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    _run(_config("good"), url, trials=2)
    for name, value in (("corrupt", {"schema": 1, "study": "corrupt", "key": "not a key"}),
                        ("foreign", {"schema": 99, "study": "foreign"}),
                        ("garbage", "[1, 2")):
        study = optuna.create_study(study_name=name, storage=url, directions=["maximize", "maximize"])
        study.set_user_attr(FINGERPRINT_ATTR, value)
    proc = run_tuner("fingerprints", "--storage", url)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    for name in ("corrupt", "foreign", "garbage"):
        found = [line for line in lines if f"study {name!r}" in line]
        assert len(found) == 1 and "not used" in found[0], (name, found)
    # a new study on the deployment names each in one line, and still uses the good one
    _run(_config("next"), url, trials=2)
    warm = WarmStart.model_validate(_study(url, "next").user_attrs[WARM_ATTR])
    assert warm.source == "good"
    assert len([line for line in warm.not_used if "not used" in line]) == 3


def test_compare_names_the_first_difference() -> None:
    good = parse_fingerprint("x", {"schema": 1, "study": "x", "key": {"gpu_name": "H100", "gpu_count": 8,
                                                                       "model": "m", "sglang_version": "0.5.5"}})
    assert good.fingerprint is not None
    key = good.fingerprint.key
    assert compare(key, key).level == "same"
    assert compare(key, key.model_copy(update={"sglang_version": "0.5.23"})).level == "version"
    assert "other model" in compare(key, key.model_copy(update={"model": "n"})).reason
    assert "tp_size" in compare(key, key.model_copy(update={"layout": {"tp_size": 4}})).reason
    assert "kv_cache_dtype" in compare(key, key.model_copy(update={"structural": {"kv_cache_dtype": "fp8_e4m3"}})).reason


@pytest.mark.parametrize("raw", [None, 3, {"schema": 1}])
def test_unreadable_attributes_are_errors_not_exceptions(raw: Any) -> None:
    assert parse_fingerprint("s", raw).error is not None


def test_the_fingerprint_reads_a_start_of_the_stored_record(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    _run(_config("one"), url, trials=1)
    study = _study(url, "one")
    record = record_of(study.trials[0])
    fp = Fingerprint.model_validate(study.user_attrs[FINGERPRINT_ATTR])
    assert record is not None and fp.starts[0].token_capacity == record.token_capacity
    assert fp.starts[0].capacity_model == record.memory.capacity_model


def test_fingerprints_are_read_across_studies_in_postgresql(postgres_url: str) -> None:
    _run(_config("pg-first"), postgres_url, trials=3)
    _, notes = _run(_config("pg-second"), postgres_url, trials=2)
    assert any(n.startswith("warm start from study pg-first") for n in notes), notes
    proc = run_tuner("fingerprints", "--storage", postgres_url, "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {row["study"]: row for row in json.loads(proc.stdout)}
    assert set(rows) == {"pg-first", "pg-second"}
    assert rows["pg-second"]["warm_start"]["source"] == "pg-first"
    assert rows["pg-first"]["figures"]["cell_bytes"] == rows["pg-second"]["figures"]["cell_bytes"]
    assert "tuner-test-pw" not in proc.stdout  # the password never shows


class _OtherDriver(OfflineExecutor):
    """The same simulated deployment reported under another NVIDIA driver."""

    def environment(self) -> dict[str, Any]:
        return {**super().environment(), "driver_version": "575.57.08"}


def test_a_driver_change_whose_figures_all_hold_transfers_the_memory_model_only(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    _run(_config("before"), url, trials=4)
    cfg = _config("after")
    runner = _OtherDriver(cfg, world_seed=0)
    run_study(cfg, runner, max_trials=2, storage_url=url)
    warm = WarmStart.model_validate(_study(url, "after").user_attrs[WARM_ATTR])
    assert warm.level == "version" and "driver simulated vs 575.57.08" in warm.reason
    assert not warm.moved and warm.references and warm.enqueued is None and warm.sampler_trials == 0
    assert any("every figure holds" in line for line in warm.reused), warm.reused
    planned = runner.history[1][1]
    assert planned.kind == "predicted" and (planned.prediction.calibrated_on_trial or 0) < 0
