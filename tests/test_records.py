"""Trial records are typed and frozen, and every study stored before they were still reads.

``tests/fixtures/studies/records-2639f26.db`` was written by the product's loop with the untyped
records of 2639f26 (plain ``memory``, ``prediction``, ``cache``, ``measured_load`` dictionaries and a
stored ``feasible``): each of its records validates into the typed facts, means what it meant
(feasible as Optuna's constraints say; the memory model the planner calibrated on), stores back
byte for byte the same shape, and the readers (``tuner trials``/``show``) show it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import optuna
import pytest
from pydantic import ValidationError

from tuner.records import (
    RECORD_ATTR,
    CacheFacts,
    Constraints,
    MeasuredLoad,
    MemoryFacts,
    Prediction,
    TrialRecord,
)
from tuner.sglang.memory import KVCapacityModel
from tuner.study.optuna_io import records

STORED = Path(__file__).resolve().parent / "fixtures" / "studies" / "records-2639f26.db"


@pytest.fixture()
def stored(tmp_path: Path) -> str:
    """A copy of the stored studies (opening a file can touch it)."""
    copy = tmp_path / "stored.db"
    shutil.copy(STORED, copy)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return f"sqlite:///{copy}"


@pytest.mark.parametrize("name", ["l4-chunks-2639f26", "multiturn-hicache-2639f26"])
def test_every_record_of_a_study_stored_before_the_types_reads_as_typed_facts(stored: str, name: str) -> None:
    study = optuna.load_study(study_name=name, storage=stored)
    finished = [t for t in study.trials if t.state.is_finished()]
    pairs = records(study)
    assert len(pairs) == len(finished)  # not one record dropped as unreadable
    for trial, record in pairs:
        raw = trial.user_attrs[RECORD_ATTR]
        assert record.feasible == raw["feasible"] == Constraints.holds(trial.constraints or {"x": 1.0})
        assert isinstance(record.memory, MemoryFacts) and isinstance(record.prediction, Prediction)
        assert isinstance(record.cache, CacheFacts) and isinstance(record.measured_load, MeasuredLoad)
        if record.outcome == "ok":
            assert isinstance(record.memory.capacity_model, KVCapacityModel)
            assert record.memory.capacity_model == KVCapacityModel.model_validate(raw["memory"]["capacity_model"])
            assert record.memory.context_len == raw["memory"]["context_len"]
            assert record.measured_load.running_requests == raw["measured_load"].get("running_requests")
        if record.kind == "predicted":
            assert record.prediction.why == raw["prediction"]["why"]
        # what it stores again is what was stored (the stored shape's keys, and their values)
        again = record.model_dump(mode="json")
        for key in ("params", "outcome", "constraints", "feasible", "context_capacity", "output_throughput_tok_s"):
            assert again[key] == raw[key], key
        for part in ("memory", "prediction", "cache", "measured_load"):  # nothing stored is lost
            assert {k: again[part].get(k) for k in raw[part]} == raw[part], part
        assert TrialRecord.model_validate(again) == record


def test_the_stored_hierarchical_cache_facts_read_by_tier(stored: str) -> None:
    study = optuna.load_study(study_name="multiturn-hicache-2639f26", storage=stored)
    cached = [r for _, r in records(study) if r.params.get("enable_hierarchical_cache") and r.outcome == "ok"]
    assert cached
    for record in cached:
        assert record.cache.measured and record.cache.hit_rate is not None
        assert record.cache.hit_rate_source == "/metrics"


def test_the_readers_show_a_study_stored_before_the_types(stored: str, tuner_cli) -> None:  # noqa: ANN001
    listed = tuner_cli("trials", "--storage", stored, "--study", "l4-chunks-2639f26", "--json")
    assert listed.returncode == 0, listed.stderr
    shown = tuner_cli("show", "1", "--storage", stored, "--study", "l4-chunks-2639f26")
    assert shown.returncode == 0, shown.stderr
    assert "KV pool" in shown.stdout or "kv pool" in shown.stdout.lower()  # the waterfall, not a flat table


def test_a_record_is_frozen_and_refuses_a_feasible_that_contradicts_its_constraints() -> None:
    record = TrialRecord(outcome="ok", constraints={"oom_or_crash": -1.0, "slo": -0.1, "stress": -1.0})
    assert record.feasible
    with pytest.raises(ValidationError):
        record.outcome = "failed"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="contradicts constraints"):
        TrialRecord.model_validate({"outcome": "ok", "feasible": True})  # no constraints: nothing was measured
    assert not TrialRecord.model_validate({"outcome": "failed", "feasible": False, "constraints": {}}).feasible


def test_a_stored_memory_model_that_no_longer_validates_is_an_error_not_an_unreadable_record() -> None:
    record = TrialRecord.model_validate({"outcome": "ok", "memory": {"capacity_model": {"baseline_gib": "?"},
                                                                       "context_len": 4096}})
    assert record.memory.capacity_model is None and not record.memory.calibrates
    assert "stored memory model unreadable" in (record.memory.capacity_model_error or "")
