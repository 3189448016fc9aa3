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
    assert f"OOM-safe {record.context_capacity}; SLO-safe {record.slo_capacity.contexts} sessions" in text
    assert f"burst admission (the OOM stress): {record.context_capacity} longest contexts at once break the SLO" in text
    assert "admission: admits " in text
    assert "the study's objective used the SLO-safe capacity" in text
    assert "SLO-safe context capacity (sessions)" in text


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
        assert slo["stress_slo_met"] == slo["burst"]["met"] and row["objective_capacity"] == slo["contexts"]
        assert slo["measure"] == "steady"
        assert slo["limits"] == {"p99_ttft_ms": 30000.0, "p99_itl_ms": 4000.0}
    assert any(r["slo_capacity"]["stress_slo_met"] is False for r in launched)


def test_report_figures_draw_the_objective_capacity_and_the_bracketing_steps(reference_offline_study) -> None:
    study = reference_offline_study
    stored = open_study(StudyLocation(storage_url=study.url))
    pareto = figures.pareto_figure(stored, best=study.best)
    assert not isinstance(pareto, str)
    assert pareto.layout.xaxis.title.text == "SLO-safe context capacity (sessions)"
    front = next(t for t in pareto.data if t.name == "Pareto front (feasible)")
    # both objectives maximized: drop first, then run right, so every corner lies below an attained point
    assert front.line.shape == "vh"
    assert list(front.x) == sorted(front.x) and list(front.y) == sorted(front.y, reverse=True)
    latency = figures.latency_figure(stored.trials, slo_ms={"ttft": 30000.0, "itl": 4000.0}, best=study.best)
    assert not isinstance(latency, str)
    steps = [t for t in latency.data if t.name == "steady window (sessions)"]
    assert steps and all(len(t.x) > 0 for t in steps)
    html = _tuner("report", "--storage", study.url, "-o", str(study.folder / "r.html"), cwd=study.folder)
    assert html.returncode == 0, html.stderr
    page = (study.folder / "r.html").read_text(encoding="utf-8")
    assert "ranked by the SLO-safe context capacity" in page and "SLO-safe context capacity (sessions)" in page


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] - 1 and b[0] < a[2] - 1 and a[1] < b[3] - 1 and b[1] < a[3] - 1


@needs_chromium
def test_the_latency_figure_prints_nothing_on_its_panels_and_judges_each_limit_apart(
        reference_offline_study, tmp_path: Path) -> None:
    """R8 (operator review 2): the latency figure's point labels were clipped at both edges of a
    panel, the best's label overprinted the SLO line's label, and the TTFT panel labelled a stress
    point below its TTFT limit "stress breaks the SLO" (the ITL broke it). Now the baseline and the
    best are ringed and named in the legend, and the subtitle judges each limit on its own: rendered
    by headless Chromium, no text is printed on a panel, no title overlaps another, and each
    verdict agrees with the stress load's own p99 against that limit."""
    study = reference_offline_study
    stored = open_study(StudyLocation(storage_url=study.url))
    limits = {"ttft": 30000.0, "itl": 4000.0}
    baseline = stored.baseline()
    assert baseline is not None and baseline.number != study.best
    figure = figures.latency_figure(stored.trials, slo_ms=limits, best=study.best, baseline=baseline.number)
    assert not isinstance(figure, str)
    names = {trace.name for trace in figure.data}
    assert {f"baseline #{baseline.number}", f"best #{study.best}"} <= names, names
    title = figure.layout.title.text
    for role, number in (("baseline", baseline.number), ("best", study.best)):
        stress = next(p for p in dict(study.history)[number].phases if p.name == "stress")
        for name, metric, key in (("TTFT", "p99_ttft_ms", "ttft"), ("ITL", "p99_itl_ms", "itl")):
            value = stress.metrics[metric]
            verdict = "meets" if value <= limits[key] else "breaks"
            assert f"{name} {value:,.0f} ms {verdict} {limits[key]:,.0f}" in title.split(f"{role} #{number}:")[1].split("<br>")[0], title
    page = tmp_path / "latency.html"
    page.write_text(figure.to_html(include_plotlyjs=True, div_id="latency"), encoding="utf-8")
    drawn = drawn_boxes(page, tmp_path / "profile")["latency"]
    assert len(drawn["plots"]) == 2 and drawn["titles"], drawn
    assert drawn["labels"] == [], f"text printed on a panel: {drawn['labels']}"
    texts = drawn["annotations"] + drawn["titles"]
    for one in texts:
        assert drawn["svg"][0] - 1 <= one["box"][0] and one["box"][2] <= drawn["svg"][2] + 1, f"clipped: {one}"
        for other in texts:
            assert other is one or not _overlap(one["box"], other["box"]), f"{one['text']!r} overprints {other['text']!r}"
