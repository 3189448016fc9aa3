"""Pictures that never mislead (issue 42, operator review 2: R2, R5, R6): the report of a study
whose best is the baseline, a model boundary a measurement contradicts, and parameter importance
on a parameter that never varied or a study too small, each checked on the page headless Chromium
rendered (real SQLite studies written as ``tuner run`` stores them)."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

from tests.support.chromium import chromium, needs_chromium
from tests.support.cli import run_tuner
from tests.support.study_factory import make_study, ok_trial
from tuner.report import figures
from tuner.results import StudyLocation, open_study


def _rendered(report: Path, tmp_path: Path) -> str:
    dump = chromium(report, tmp_path / "profile", "--dump-dom")
    assert dump.returncode == 0, dump.stderr[-2000:]
    return dump.stdout


def _section(dom: str, key: str) -> str:
    start = dom.index(f'id="section-{key}"')
    return dom[start: dom.index("</section>", start)]


def _ticks(part: str, axis: str) -> list[str]:
    """The tick labels plotly drew on the ``x`` or ``y`` axes of a rendered figure."""
    return [html.unescape(t) for t in re.findall(rf'class="{axis}\d*tick"><text[^>]*data-unformatted="([^"]*)"', part)]


def _texts(part: str, css_class: str) -> list[str]:
    """The printed texts of ``<text class="css_class">`` elements (a wrapped text joined by one blank)."""
    return [" ".join(re.sub(r"<[^>]+>", " ", t).split()) for t in re.findall(rf'<text class="{css_class}"[^>]*>(.*?)</text>', part)]


@needs_chromium
def test_a_baseline_that_is_the_best_is_drawn_once(tmp_path: Path) -> None:
    """R2: the memory figure stacked the baseline's bar on itself under one label (a 188 GiB bar on a
    96 GB GPU) and its table listed '#0 baseline' twice; the Pareto front drew two markers."""
    url = make_study(tmp_path / "keep.db", "keep", [
        ok_trial(0.88, 64, 16, 1300.0, kind="baseline"), ok_trial(0.80, 64, 10, 1000.0), ok_trial(0.84, 96, 12, 1100.0)])
    report = tmp_path / "keep.html"
    proc = run_tuner("report", "--storage", url, "-o", str(report), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "trial 0" in report.read_text(encoding="utf-8").split("<b>best</b>")[1][:400]  # the baseline is the best
    dom = _rendered(report, tmp_path)
    memory = _section(dom, "memory")
    rows = [c for c in _texts(memory, "cell-text") if c.startswith("#")]
    assert [r for r in rows if r.startswith("#0")] == ["#0 baseline = best"], rows
    ticks = _ticks(memory, "x")
    assert ticks.count("#0 baseline = best") == 2 and len(ticks) == 6, ticks  # one bar per trial in each panel
    stored = open_study(StudyLocation(storage_url=url))
    figure = figures.memory_figure(stored.trials, baseline=0, best=0)
    assert not isinstance(figure, str)
    for trace in figure.data:
        if trace.type == "bar":
            assert len(set(trace.x)) == len(trace.x), (trace.name, trace.x)
    pareto = _section(dom, "pareto-front")
    assert "baseline = best #0" in pareto and "baseline #0" not in pareto and "best #0" not in pareto.replace("= best #0", "")


def _contradicted(figure: Any, stored: Any) -> list[str]:
    """The model boundaries the capacity figure draws with a measured feasible trial on the side
    the line says fails (below a 'below' line, above an 'above' one)."""
    feasible = [float(v.params["mem_fraction_static"]) for v in stored.trials if figures.category(v) == "feasible"]
    wrong = []
    for shape, note in zip(figure.layout.shapes, [a for a in figure.layout.annotations if a.text], strict=False):
        text = note.text
        if not text.startswith(("startup:", "runtime:")):
            continue
        at = shape.x0
        if (" below " in text and any(f < at for f in feasible)) or (" above " in text and any(f > at for f in feasible)):
            wrong.append(text)
    return wrong


@needs_chromium
def test_a_model_boundary_a_measured_trial_contradicts_is_not_drawn(tmp_path: Path) -> None:
    """R5: the runtime-OOM line is the calibrating trial's (its request slots and its activation
    peak); a feasible trial measured above it sat inside the region labelled 'runtime: headroom <
    ... activations'. Trial 1 (the best) peaked at 5 GiB of activations: its own line falls at
    0.929, and trial 2 ran its load at 0.95 without an OOM."""
    best = ok_trial(0.88, 128, 14, 1300.0)
    best["record"]["memory"]["peak_activation_gib"] = 5.0
    url = make_study(tmp_path / "edge.db", "edge", [
        ok_trial(0.80, 64, 10, 1000.0, kind="baseline"), best, ok_trial(0.95, 64, 13, 1100.0)])
    stored = open_study(StudyLocation(storage_url=url))
    figure = figures.capacity_figure(stored, baseline=0, best=1)
    assert not isinstance(figure, str)
    assert _contradicted(figure, stored) == []
    assert "runtime boundary at 0.929 (for trial 1's knobs) is not drawn: trial 2 ran beyond it" in figure.layout.title.text
    assert any(a.text.startswith("startup: no KV budget below") for a in figure.layout.annotations)  # the uncontradicted one stays
    page = tmp_path / "capacity.html"
    page.write_text(figure.to_html(include_plotlyjs=True), encoding="utf-8")
    dom = _rendered(page, tmp_path)
    assert "is not drawn: trial 2 ran beyond it" in dom and "runtime: headroom" not in dom


def _importance(dom: str) -> str:
    return _section(dom, "importance")


@needs_chromium
def test_importance_is_hidden_on_a_small_study_and_never_ranks_a_parameter_that_never_varied(tmp_path: Path) -> None:
    """R6: Optuna's importance gave 0.33 / 0.33 / 0.33 on the demo's few trials, one share to
    chunked_prefill_size, which never varied. A small study says why there is no chart; a study
    large enough ranks only what varied and names the rest."""
    small = make_study(tmp_path / "small.db", "small", [
        ok_trial(0.80, 64, 10, 1000.0, kind="baseline"), ok_trial(0.88, 128, 14, 1200.0),
        ok_trial(0.89, 96, 15, 1100.0), ok_trial(0.91, 256, 16, 900.0), ok_trial(0.85, 64, 12, 1000.0)])
    assert run_tuner("report", "--storage", small, "-o", str(tmp_path / "small.html"), cwd=tmp_path).returncode == 0
    part = _importance(_rendered(tmp_path / "small.html", tmp_path))
    assert "main-svg" not in part, "a chart drawn from 5 trials"
    assert "Parameter importance is not drawn" in part and "never varied: chunked_prefill_size" in part

    trials = [ok_trial(0.80, 64, 10, 1000.0, kind="baseline")]
    trials += [ok_trial(0.80 + 0.01 * i, 32 * (1 + i % 4), 10 + i, 1000.0 + 10 * i) for i in range(1, 12)]
    large = make_study(tmp_path / "large.db", "large", trials)
    assert run_tuner("report", "--storage", large, "-o", str(tmp_path / "large.html"), cwd=tmp_path).returncode == 0
    part = _importance(_rendered(tmp_path / "large.html", tmp_path))
    ranked = _ticks(part, "y")
    assert sorted(ranked) == ["max_running_requests", "mem_fraction_static"], ranked
    assert "never varied: chunked_prefill_size" in part and "12 completed trials" in part


@needs_chromium
def test_trials_on_other_structural_levers_are_drawn_apart_from_the_curve(tmp_path: Path) -> None:
    """The capacity curve is one rung's (the calibrating trial's KV dtype and DP attention): a
    trial on another rung holds another pool at each fraction, so it is drawn open, apart, and named
    in the title, not read against the curve or its boundaries (the lever study's baseline sat on
    the fp8 + DP-attention rung's curve as if it had missed it)."""
    rung = ok_trial(0.92, 64, 30, 1300.0)
    rung["params"].update({"dp_size": 4, "kv_cache_dtype": "fp8_e4m3"})
    url = make_study(tmp_path / "rungs.db", "rungs", [ok_trial(0.80, 64, 10, 1000.0, kind="baseline"), rung])
    stored = open_study(StudyLocation(storage_url=url))
    figure = figures.capacity_figure(stored, baseline=0, best=1)
    assert not isinstance(figure, str)
    traces = {trace.name: list(trace.x) for trace in figure.data}
    assert traces.get("measured on other structural levers (not this curve)") == [0.80], traces
    assert traces.get("measured: feasible") == [0.92], traces
    assert "trial 0 ran other structural levers than trial 1: drawn open, off this curve" in figure.layout.title.text
    page = tmp_path / "capacity.html"
    page.write_text(figure.to_html(include_plotlyjs=True), encoding="utf-8")
    assert "measured on other structural levers (not this curve)" in _rendered(page, tmp_path)
