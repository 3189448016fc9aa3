"""The report's pictures (issue 16) on a study written by a real `tuner run` of the demo config
(the session's ``demo_run``: the simulator as a real server process, three trials), drawn by
headless Chromium with the network blocked.

Each figure is screenshotted on its own (the page with every other section hidden) into the
test's output folder (``<pytest basetemp>/report-screenshots/``), and the rendered DOM is checked:
every figure's ``<div>`` holds plotly's SVG with at least one drawn trace, so a figure that is
missing, replaced by a note, or drawn empty fails the test.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.chromium import chromium as _chromium
from tests.support.chromium import needs_chromium
from tests.support.cli import run_tuner
from tests.support.configs import DemoRun
from tests.support.study_factory import make_study, ok_trial
from tuner.report import figures

REPO = Path(__file__).resolve().parents[2]
STUDY_FIGURES = ("pareto-front", "memory", "capacity-vs-mfs", "latency", "history")
"""The figures a study with a measured baseline and a better trial must show (importance needs 10
completed trials and two parameters that varied, and is a note otherwise)."""


def _section(dom: str, div: str) -> str:
    start = dom.index(f'id="{div}"')
    end = dom.find("</section>", start)
    return dom[start: end if end > 0 else start + 400_000]


def printed_texts(dom: str, div: str) -> tuple[list[str], list[str]]:
    """The numbers a rendered figure prints, not on hover: its bars' texts and its table's cells
    (tags inside a cell dropped, a wrapped cell joined by a blank)."""
    part = _section(dom, div)
    bars = re.findall(r'<text class="bartext[^"]*"[^>]*>(.*?)</text>', part)
    cells = [re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", c)).strip()
             for c in re.findall(r'<text class="cell-text"[^>]*>(.*?)</text>', part)]
    return [re.sub(r"<[^>]+>", "", b) for b in bars], cells


def memory_numbers_missing(dom: str, div: str, stored: Any) -> list[str]:
    """What the memory figure ``div`` should print but does not: every trial's KV pool GiB on its
    bar (the largest segment above the weights), every stored segment's GiB and the KV pool's
    tokens in the table, and the zoomed panel's axis ("GiB above the weights")."""
    from tuner.report.figures import MEMORY_ITEMS, memory_steps

    bars, cells = printed_texts(dom, div)
    missing = [] if "GiB above the weights" in _section(dom, div) else ["the zoomed panel"]
    for view in stored.trials:
        steps = memory_steps(view)
        if not steps:
            continue
        if f"{steps['kv_pool'].gib:.2f}" not in bars:
            missing.append(f"trial {view.number}: KV pool on its bar")
        for item in MEMORY_ITEMS:
            if item in steps and steps[item].gib is not None and f"{steps[item].gib:.2f}" not in cells:
                missing.append(f"trial {view.number}: {item} in the table")
        if steps["kv_pool"].tokens is not None and f"{steps['kv_pool'].tokens:,}" not in cells:
            missing.append(f"trial {view.number}: KV tokens in the table")
    return missing


def figure_problems(dom: str, ids: tuple[str, ...]) -> dict[str, str]:
    """For each figure id, why it is not a drawn figure in a rendered DOM ({} when all are)."""
    problems = {}
    for div in ids:
        start = dom.find(f'id="{div}"')
        if start < 0:
            problems[div] = "missing"
            continue
        end = dom.find("</section>", start)
        part = dom[start: end if end > 0 else start + 400_000]
        if 'class="main-svg"' not in part:
            problems[div] = "not drawn (no plotly SVG)"
        elif not re.search(r'class="(trace|bars|point)[ "]', part) and "<path" not in part:
            problems[div] = "empty (no trace drawn)"
    return problems


@needs_chromium
def test_report_figures_render_offline_with_screenshots(demo_run: DemoRun, tmp_path: Path,
                                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    config, storage = demo_run.config, demo_run.storage
    report = tmp_path / "report.html"
    proc = run_tuner("report", "--storage", storage, "--config", str(config), "-o", str(report), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = report.read_text(encoding="utf-8")
    assert "https://" not in text.replace(__import__("plotly.offline").offline.get_plotlyjs(), "")
    dump = _chromium(report, tmp_path / "profile", "--dump-dom")
    assert dump.returncode == 0, dump.stderr[-2000:]
    dom = dump.stdout
    assert figure_problems(dom, STUDY_FIGURES) == {}
    # what each picture must say
    assert "KV pool" in text and "free after graphs" in text and "mfs × B: the reserve lies above" in text
    assert "memory model (calibrated on trial" in text and "startup: no KV budget below" in text
    assert "SLO p99 TTFT 10,000 ms" in text and "SLO p99 ITL 2,500 ms" in text
    pareto = dom[dom.index('id="pareto-front"'):dom.index("</section>", dom.index('id="pareto-front"'))]
    assert "baseline #0" in pareto and re.search(r"best #\d+", pareto) and 'class="colorbar' not in pareto
    assert re.search(r'id="memory-trial-0"', text)  # the same picture for one trial, in its section
    assert figure_problems(dom, ("memory-trial-0",)) == {}
    # the memory picture prints its numbers (zoomed above the weights, on the bars and in a table)
    from tuner.results import StudyLocation, open_study

    stored = open_study(StudyLocation(storage_url=storage, study_name="demo-sim"))
    assert sum(1 for v in stored.trials if figures.memory_steps(v)) >= 2
    assert memory_numbers_missing(dom, "memory", stored) == []

    shots = tmp_path_factory.getbasetemp() / "report-screenshots"
    shots.mkdir(exist_ok=True)
    for div in STUDY_FIGURES:
        page = tmp_path / f"only-{div}.html"
        page.write_text(text.replace("</head>", f"<style>body>section,body>h1{{display:none}}"
                                                f"body>section#section-{div}{{display:block}}</style></head>", 1),
                        encoding="utf-8")
        png = shots / f"{div}.png"
        proc = _chromium(page, tmp_path / "profile", "--window-size=1300,760", f"--screenshot={png}")
        assert proc.returncode == 0 and png.is_file(), proc.stderr[-2000:]
        assert png.stat().st_size > 20_000, (div, png.stat().st_size)  # a drawn chart, not a blank page
    print(f"report screenshots: {shots}")


@needs_chromium
def test_the_check_fails_when_a_figure_is_missing_or_empty(tmp_path: Path) -> None:
    """A study whose trials stored no memory report and ran no load phase: those figures are
    notes, and the check says so (it is not a check that cannot fail)."""
    from tuner.report.html import build_html_report
    from tuner.results import StudyLocation, open_study

    spec = ok_trial(0.8, 64, 10, 1000.0, kind="baseline")
    spec["record"]["memory"] = {}
    spec["record"]["phases"] = []
    url = make_study(tmp_path / "bare.db", "bare", [spec])
    page = tmp_path / "bare.html"
    page.write_text(build_html_report(open_study(StudyLocation(storage_url=url)), None, "none"), encoding="utf-8")
    dom = _chromium(page, tmp_path / "profile", "--dump-dom").stdout
    problems = figure_problems(dom, STUDY_FIGURES)
    assert set(problems) == {"memory", "latency"}, problems
    assert figure_problems(dom.replace('id="pareto-front"', 'id="gone"'), ("pareto-front",)) == {"pareto-front": "missing"}


@needs_chromium
def test_the_number_check_fails_on_a_memory_picture_that_has_them_only_on_hover(tmp_path: Path) -> None:
    """The same study's memory bars drawn as main drew them before issue 28 (numbers only in the
    hover text, one 0-100 GiB axis): the printed-number check names every missing number; the
    figure the report draws now passes it."""
    import plotly
    import plotly.graph_objects as go

    from tuner.results import StudyLocation, open_study

    spec = ok_trial(0.8, 64, 10, 1000.0, kind="baseline")
    url = make_study(tmp_path / "one.db", "one", [spec])
    stored = open_study(StudyLocation(storage_url=url))
    steps = figures.memory_steps(stored.trials[0])
    assert steps and steps["kv_pool"].gib
    hover_only = go.Figure([go.Bar(x=["#0"], y=[steps[k].gib], name=k, hovertext=[f"{steps[k].gib:.2f} GiB"],
                                   hoverinfo="text") for k in figures.MEMORY_ITEMS if k in steps])
    hover_only.update_layout(barmode="stack")
    now = figures.memory_figure(stored.trials, baseline=0)
    assert not isinstance(now, str)
    page = tmp_path / "memory.html"
    page.write_text("<html><head><meta charset='utf-8'><script>" + plotly.offline.get_plotlyjs() + "</script></head><body>"
                    + "".join(f'<section>{fig.to_html(full_html=False, include_plotlyjs=False, div_id=div)}</section>'
                              for div, fig in (("old", hover_only), ("memory", now))) + "</body></html>",
                    encoding="utf-8")
    dom = _chromium(page, tmp_path / "profile", "--dump-dom").stdout
    assert figure_problems(dom, ("old", "memory")) == {}
    old = memory_numbers_missing(dom, "old", stored)
    assert "the zoomed panel" in old and "trial 0: KV pool on its bar" in old and "trial 0: weights in the table" in old
    assert memory_numbers_missing(dom, "memory", stored) == []


def test_a_run_names_the_objectives_for_optuna_dashboard(demo_run: DemoRun) -> None:
    import optuna

    from tuner.study.optuna_io import METRIC_NAMES

    assert optuna.load_study(study_name="demo-sim", storage=demo_run.storage).metric_names == list(METRIC_NAMES)
