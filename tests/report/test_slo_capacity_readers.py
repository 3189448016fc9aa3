"""Every reader says which capacity a figure is and the stress load's SLO verdict (issue 28): show,
best, trials (table and JSON) and the HTML report, on the product's own study of the reference twin
(whose stress load of 8 x 32k breaks p99 ITL)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.chromium import drawn_boxes, needs_chromium
from tuner.report import figures
from tuner.results import StudyLocation, open_study

TUNER = str(Path(sys.executable).with_name("tuner"))


def _tuner(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TUNER, *args], capture_output=True, text=True, timeout=120, check=False, cwd=cwd,
                          env={"PATH": "/usr/bin:/bin", "COLUMNS": "200", "NO_COLOR": "1"})


def test_show_states_both_capacities_and_the_stress_verdict(reference_offline_study) -> None:
    study = reference_offline_study
    broken = next(n for n, r in study.history if r.slo_capacity.stress is not None and not r.slo_capacity.stress.met)
    record = dict(study.history)[broken]
    text = _tuner("show", str(broken), "--storage", study.url, cwd=study.folder).stdout
    assert f"OOM-safe {record.context_capacity}; SLO-safe {record.slo_capacity.contexts}" in text
    assert f"stress load: {record.context_capacity} longest contexts at once break the SLO" in text
    assert "the study's objective used the SLO-safe capacity" in text
    assert "SLO-safe context capacity (requests)" in text


def test_best_says_which_capacity_ranked_and_holds_the_chosen_trial(reference_offline_study) -> None:
    study = reference_offline_study
    proc = _tuner("best", "--storage", study.url, "--json", cwd=study.folder)
    assert proc.returncode == 0, proc.stderr
    best = json.loads(proc.stdout)
    assert best["trial"]["number"] in [row["number"] for row in best["front"]]
    assert best["notes"][0] == "ranked by the SLO-safe context capacity"
    assert any("SLO-safe" in note and "the SLO" in note for note in best["notes"][1:])
    assert any("load" in note for note in best["notes"])  # equal or unequal load, said plainly
    text = _tuner("best", "--storage", study.url, cwd=study.folder).stdout
    assert "ranked by the SLO-safe context capacity" in text and "SLO cap" in text


def test_trials_json_carries_the_slo_capacity_and_its_verdict(reference_offline_study) -> None:
    study = reference_offline_study
    rows = json.loads(_tuner("trials", "--storage", study.url, "--json", cwd=study.folder).stdout)
    launched = [r for r in rows if r["outcome"] == "ok"]
    assert launched and all(r["slo_capacity"] is not None for r in launched)
    for row in launched:
        slo = row["slo_capacity"]
        assert row["slo_context_capacity"] == slo["contexts"] <= row["context_capacity"]
        assert slo["stress_slo_met"] == slo["steps"][0]["met"] and row["objective_capacity"] == slo["contexts"]
        assert slo["limits"] == {"p99_ttft_ms": 30000.0, "p99_itl_ms": 4000.0}
    assert any(r["slo_capacity"]["stress_slo_met"] is False for r in launched)


def test_report_figures_draw_the_objective_capacity_and_the_bracketing_steps(reference_offline_study) -> None:
    study = reference_offline_study
    stored = open_study(StudyLocation(storage_url=study.url))
    pareto = figures.pareto_figure(stored, best=study.best)
    assert not isinstance(pareto, str)
    assert pareto.layout.xaxis.title.text == "SLO-safe context capacity (requests)"
    front = next(t for t in pareto.data if t.name == "Pareto front (feasible)")
    # both objectives maximized: drop first, then run right, so every corner lies below an attained point
    assert front.line.shape == "vh"
    assert list(front.x) == sorted(front.x) and list(front.y) == sorted(front.y, reverse=True)
    latency = figures.latency_figure(stored.trials, slo_ms={"ttft": 30000.0, "itl": 4000.0}, best=study.best)
    assert not isinstance(latency, str)
    steps = [t for t in latency.data if t.name == "bracketing step (longest contexts)"]
    assert steps and all(len(t.x) > 0 for t in steps)
    html = _tuner("report", "--storage", study.url, "-o", str(study.folder / "r.html"), cwd=study.folder)
    assert html.returncode == 0, html.stderr
    page = (study.folder / "r.html").read_text(encoding="utf-8")
    assert "ranked by the SLO-safe context capacity" in page and "SLO-safe context capacity (requests)" in page


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] - 1 and b[0] < a[2] - 1 and a[1] < b[3] - 1 and b[1] < a[3] - 1


@needs_chromium
def test_the_latency_figure_s_labels_are_whole_apart_and_true_to_their_panel(reference_offline_study, tmp_path: Path) -> None:
    """R8 (operator review 2): the latency figure's labels were clipped at both edges of a panel, the
    best's label overprinted the SLO line's label, and the TTFT panel labelled a stress point below
    its TTFT limit "stress breaks the SLO" (the ITL broke it). Rendered by headless Chromium at the
    report's width: every label lies whole inside its panel's plot area, none overlaps another label
    or an annotation, and a panel's label says "breaks" only above that panel's limit."""
    study = reference_offline_study
    stored = open_study(StudyLocation(storage_url=study.url))
    limits = {"ttft": 30000.0, "itl": 4000.0}
    baseline = stored.baseline()
    figure = figures.latency_figure(stored.trials, slo_ms=limits, best=study.best,
                                    baseline=baseline.number if baseline else None)
    assert not isinstance(figure, str)
    labelled = 0
    for trace in figure.data:
        if trace.mode != "markers+text":
            continue
        limit = limits["ttft" if trace.xaxis in (None, "x") else "itl"]
        for text, y in zip(trace.text, trace.y, strict=True):
            if "stress" in text:
                labelled += 1
                assert ("breaks" in text) == (y > limit), (text, y, limit)
    assert labelled >= 2, "the baseline's and the best's stress points carry their verdict"
    page = tmp_path / "latency.html"
    page.write_text(figure.to_html(include_plotlyjs=True, div_id="latency"), encoding="utf-8")
    drawn = drawn_boxes(page, tmp_path / "profile")["latency"]
    labels, notes, plots = drawn["labels"], drawn["annotations"], drawn["plots"]
    assert len(labels) >= 4 and len(plots) == 2, drawn
    for label in labels:
        box = label["box"]
        assert any(p[0] - 1 <= box[0] and box[2] <= p[2] + 1 for p in plots), f"clipped at a panel's edge: {label}"
        for other in labels + notes:
            assert other is label or not _overlap(box, other["box"]), f"{label['text']!r} overprints {other['text']!r}"
