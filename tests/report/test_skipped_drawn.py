"""Skipped configs in the report's figures (issue 28, review N8): they were drawn at capacity 0 as
"measured: skipped" in the capacity-vs-fraction and history figures; now at the capacity they were
predicted to have (open circles, never a measured 0), or not at all when nothing was predicted."""

from __future__ import annotations

from pathlib import Path

from tests.support.study_factory import make_study, ok_trial, skipped_trial
from tuner.report import figures
from tuner.report.html import _history_figure
from tuner.results import StudyLocation, open_study


def test_skipped_configs_are_drawn_at_their_prediction_never_at_zero(tmp_path: Path) -> None:
    predicted = skipped_trial(0.93, 1)
    predicted["record"]["prediction"] = {"token_capacity": 5 * 8192 + 17, "context_capacity": 5, "calibrated_on_trial": 1}
    url = make_study(tmp_path / "s.db", "s", [
        ok_trial(0.80, 64, 10, 1000.0, kind="baseline"),
        ok_trial(0.88, 128, 14, 1200.0, kind="predicted"),
        predicted,
        skipped_trial(0.98, 1),  # no prediction: not drawn
    ])
    stored = open_study(StudyLocation(storage_url=url))
    history = _history_figure(stored)
    skipped = [t for t in history.data if t.name and t.name.startswith("skipped")]
    assert len(skipped) == 1 and list(skipped[0].y) == [5] and list(skipped[0].x) == [2], skipped
    assert "1 without one not drawn" in skipped[0].name and skipped[0].marker.symbol == "circle-open"
    assert all(0 not in (t.y or ()) or t.name in ("failed",) for t in history.data if t.mode == "markers"), [
        (t.name, t.y) for t in history.data]
    capacity = figures.capacity_figure(stored)
    assert not isinstance(capacity, str)
    drawn = [t for t in capacity.data if t.name and "skipped" in t.name]
    assert len(drawn) == 1 and list(drawn[0].x) == [0.93] and list(drawn[0].y) == [5], drawn
    assert "measured: skipped" not in {t.name for t in capacity.data}
    assert "skipped" in drawn[0].hovertext[0] and "&gt;= a fraction that failed" in drawn[0].hovertext[0]
