"""A run's end counts its skips by reason (issue 28: "a per-reason count at the run's end"), in the
closing text and in the ``--json-progress`` summary, on the simulator's offline study."""

from __future__ import annotations

from pathlib import Path

from tests.support.offline_server import OfflineExecutor
from tuner.config import load_config
from tuner.study.loop import run_study
from tuner.study.progress import SKIP_KINDS, skip_kind

ROOT = Path(__file__).resolve().parents[2]


def test_every_skip_of_a_run_is_counted_under_its_reason() -> None:
    config = load_config(ROOT / "configs" / "reference-sim.toml")
    summary = run_study(config, OfflineExecutor(config), max_trials=30, storage_url=":memory:")
    assert summary.trials_skipped > 0, "the reference twin's study skips sampled configs"
    assert sum(summary.skip_reasons.values()) == summary.trials_skipped
    named = {kind for _, kind in SKIP_KINDS}
    assert set(summary.skip_reasons) <= named, summary.skip_reasons  # every screen's sentence has a short name
    text = summary.skips_text()
    assert text is not None and text.startswith(f"{summary.trials_skipped} skipped without a restart: ")
    top = max(summary.skip_reasons.items(), key=lambda item: item[1])
    assert f"{top[1]} {top[0]}" in text
    assert summary.as_json()["skip_reasons"] == summary.skip_reasons


def test_a_reason_no_phrase_names_groups_by_its_words_before_the_first_figure() -> None:
    assert skip_kind("predicted context capacity 5 (model calibrated on trial 1) is below 8, the capacity band "
                     "of the best feasible trial, so it cannot win") == "predicted below the best capacity's band"
    assert skip_kind("a new screen said no to 12 requests") == "a new screen said no to"
