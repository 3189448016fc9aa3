"""The HTML report: one self-contained file with plotly's JavaScript inlined, so it opens offline.

Every string that came from a log or a server is escaped with :func:`html.escape` before it
reaches the HTML.
"""

from __future__ import annotations

import datetime as dt
import html
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType

import optuna
import plotly.graph_objects as go
import plotly.offline

from tuner.errors import StudyError
from tuner.report.tables import TABLE_METRICS, cell, delta_text, key_params, status_text
from tuner.results import METRICS, BestTrial, StoredStudy, TrialView, best_trial
from tuner.sglang.failures import STARTUP_MEMORY_FAILURES
from tuner.study.storage import STUDIES_DIR

__all__ = ['build_html_report', 'write_html_report', 'write_study_report']

_COLORS = MappingProxyType(
    {"feasible": "#2a9d8f", "infeasible": "#e9c46a", "failed": "#e63946", "skipped": "#8d99ae"}
)


def _category(view: TrialView) -> str:
    if view.outcome == "skipped" or view.state == "PRUNED":
        return "skipped"
    if view.failed:
        return "failed"
    return "feasible" if view.feasible else "infeasible"


def _hover(view: TrialView) -> str:
    lines = [f"trial {view.number} ({_category(view)})"]
    lines += [f"{k}={v}" for k, v in sorted(view.params.items())]
    if view.failure_class:
        lines.append(f"failure: {view.failure_class}")
    return "<br>".join(html.escape(line) for line in lines)


def _pareto_figure(stored: StoredStudy) -> go.Figure:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig = optuna.visualization.plot_pareto_front(
            stored.study,
            target_names=[METRICS["context_capacity"][0], METRICS["output_throughput_tok_s"][0]],
        )
    fig.update_layout(title="Pareto front: context capacity vs output throughput")
    return fig


def _history_figure(stored: StoredStudy) -> go.Figure:
    fig = go.Figure()
    for category, color in _COLORS.items():
        views = [v for v in stored.trials if _category(v) == category]
        if not views:
            continue
        fig.add_trace(
            go.Scatter(
                x=[v.number for v in views],
                y=[v.metric("context_capacity") or 0 for v in views],
                mode="markers",
                name=category,
                marker={"color": color, "size": 10},
                hovertext=[_hover(v) for v in views],
                hoverinfo="text",
            )
        )
    best_so_far: list[float | None] = []
    running: float | None = None
    for view in stored.trials:
        cap = view.metric("context_capacity") if view.feasible else None
        if cap is not None and (running is None or cap > running):
            running = float(cap)
        best_so_far.append(running)
    fig.add_trace(
        go.Scatter(
            x=[v.number for v in stored.trials],
            y=best_so_far,
            mode="lines",
            line={"shape": "hv", "color": "#264653"},
            name="best feasible so far",
        )
    )
    fig.update_layout(
        title="Optimization history (context capacity per trial)",
        xaxis_title="trial",
        yaxis_title=METRICS["context_capacity"][0],
    )
    return fig


def _importance_figure(stored: StoredStudy) -> go.Figure | str:
    """Optuna's parameter importance for context capacity, or why it cannot be computed."""
    complete = [t for t in stored.study.get_trials(deepcopy=False) if t.values is not None]
    varying = {
        name
        for name in {p for t in complete for p in t.params}
        if len({repr(t.params.get(name)) for t in complete}) > 1
    }
    if len(complete) < 4 or not varying:
        return (
            f"Parameter importance needs at least 4 completed trials with varying parameters "
            f"(this study has {len(complete)} completed, {len(varying)} varying parameter(s))."
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fig = optuna.visualization.plot_param_importances(
                stored.study,
                target=lambda t: t.values[0],
                target_name=METRICS["context_capacity"][0],
            )
    except (ValueError, RuntimeError, ZeroDivisionError, IndexError) as err:
        return f"Parameter importance could not be computed for this study: {err}"
    fig.update_layout(title="Parameter importance (for context capacity)")
    return fig


def _boundaries(views: Sequence[TrialView]) -> list[tuple[float, float, str]]:
    """Failure boundaries on mem_fraction_static: (low, high, label) spans between the nearest
    started fraction and the nearest fraction that failed at startup on a memory failure
    (§4.3), above and below the fractions that started."""
    started = [
        float(v.params["mem_fraction_static"])
        for v in views
        if "mem_fraction_static" in v.params and v.state == "COMPLETE" and not v.failure_class
    ]
    failed = [
        (float(v.params["mem_fraction_static"]), v.failure_class or "")
        for v in views
        if "mem_fraction_static" in v.params
        and v.failure_class in {f.value for f in STARTUP_MEMORY_FAILURES} | {"runtime_oom"}
    ]
    if not started or not failed:
        return []
    lo, hi = min(started), max(started)
    spans = []
    above = [f for f in failed if f[0] > hi]
    below = [f for f in failed if f[0] < lo]
    if above:
        frac, cls = min(above)
        spans.append((hi, frac, f"fails above: {cls}"))
    if below:
        frac, cls = max(below)
        spans.append((frac, lo, f"fails below: {cls}"))
    return spans


def _capacity_figure(stored: StoredStudy) -> go.Figure | str:
    views = [v for v in stored.trials if "mem_fraction_static" in v.params]
    if not views:
        return "No trial recorded mem_fraction_static."
    fig = go.Figure()
    for category, color in _COLORS.items():
        group = [v for v in views if _category(v) == category]
        if not group:
            continue
        fig.add_trace(
            go.Scatter(
                x=[float(v.params["mem_fraction_static"]) for v in group],
                y=[v.metric("context_capacity") or 0 for v in group],
                mode="markers",
                name=category,
                marker={
                    "color": color,
                    "size": 11,
                    "symbol": "x" if category == "failed" else "circle",
                },
                hovertext=[_hover(v) for v in group],
                hoverinfo="text",
            )
        )
    for low, high, label in _boundaries(views):
        edge = (low + high) / 2
        fig.add_vline(
            x=edge,
            line={"color": _COLORS["failed"], "dash": "dash"},
            annotation_text=html.escape(f"failure boundary ({label})"),
        )
    bounded = " (failure boundary dashed)" if _boundaries(views) else ""
    fig.update_layout(
        title=f"Context capacity vs mem_fraction_static{bounded}",
        xaxis_title="mem_fraction_static",
        yaxis_title=METRICS["context_capacity"][0],
    )
    return fig


def _figure_html(fig: go.Figure | str, div_id: str) -> str:
    if isinstance(fig, str):
        return f'<p class="note">{html.escape(fig)}</p>'
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id)


def _trial_rows_html(stored: StoredStudy) -> str:
    params = key_params(stored.trials)
    heads = ["#", "state", "kind", *params, *[METRICS[m][0] for m in TABLE_METRICS]]
    heads += ["feasible", "failure"]
    out = ['<div style="overflow-x:auto"><table><thead><tr>']
    out += [f"<th>{html.escape(h)}</th>" for h in heads]
    out.append("</tr></thead><tbody>")
    for view in stored.trials:
        cells = [str(view.number), view.state, view.kind or "-"]
        cells += [cell(view.params.get(p)) for p in params]
        cells += [cell(view.metric(m)) for m in TABLE_METRICS]
        cells += ["yes" if view.feasible else "no", status_text(view)]
        out.append(f'<tr class="{_category(view)}">')
        out += [f"<td>{html.escape(c)}</td>" for c in cells]
        out.append("</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _trial_details_html(stored: StoredStudy) -> str:
    out = []
    for view in stored.trials:
        rec = view.record
        if rec is None or not (rec.log_excerpt or rec.failure_evidence or rec.argv):
            continue
        out.append(f"<details><summary>trial {view.number}: {html.escape(_category(view))}")
        if view.failure_class:
            out.append(f" ({html.escape(view.failure_class)})")
        out.append("</summary>")
        if rec.argv:
            out.append(f"<p><b>command</b></p><pre>{html.escape(' '.join(rec.argv))}</pre>")
        if rec.failure_evidence:
            out.append(f"<p><b>evidence</b></p><pre>{html.escape(rec.failure_evidence)}</pre>")
        if rec.skipped_reason:
            out.append(f"<p><b>skipped</b>: {html.escape(rec.skipped_reason)}</p>")
        if rec.log_excerpt:
            out.append(f"<p><b>log excerpt</b></p><pre>{html.escape(chr(10).join(rec.log_excerpt))}</pre>")
        out.append("</details>")
    return "".join(out)


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #ccc;padding:3px 6px;text-align:right}
th{background:#f3f3f3}tr.failed td{background:#fde2e4}tr.infeasible td{background:#fff5d6}
tr.skipped td{color:#777}pre{background:#f7f7f7;padding:.5em;overflow-x:auto;font-size:12px}
.note{color:#555;font-style:italic}section{margin-bottom:2em}
"""


def build_html_report(stored: StoredStudy, best: BestTrial | None, best_error: str | None) -> str:
    """The self-contained HTML report of a study, as a string.

    Sections: summary (study, storage, environment, baseline command, best trial and why), Pareto
    front, optimization history, parameter importance (Optuna's, guarded for small studies),
    context capacity vs mem_fraction_static with the failure boundary, the trial table, and each
    trial's command, failure evidence and log excerpt (escaped).

    Args:
        stored: The study.
        best: The chosen best trial, or ``None``.
        best_error: Why there is no best trial (shown instead), or ``None``.
    """
    info = stored.info
    summary = [
        f"<p><b>study</b> {html.escape(stored.name)} — <b>storage</b> "
        f"{html.escape(stored.location.storage_url)} — {len(stored.trials)} trials — "
        f"generated {html.escape(dt.datetime.now(dt.UTC).isoformat(timespec='seconds'))}</p>"
    ]
    if info is not None:
        env = ", ".join(f"{k}={v}" for k, v in info.environment.items())
        summary.append(f"<p><b>environment</b> {html.escape(env or '-')}</p>")
        if info.baseline_argv:
            summary.append(
                f"<p><b>baseline command</b></p><pre>{html.escape(' '.join(info.baseline_argv))}</pre>"
            )
    if best is not None:
        summary.append(f"<p><b>best</b>: {html.escape(best.reason)}</p><table><tr>")
        summary.append("<th>metric</th><th>baseline</th><th>best</th><th>change</th></tr>")
        for name, delta in best.deltas.items():
            row = [METRICS[name][0], cell(delta.baseline), cell(delta.best), delta_text(name, delta)]
            summary.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
        summary.append("</table>")
    elif best_error:
        summary.append(f'<p class="note">{html.escape(best_error)}</p>')
    sections = [
        ("Pareto front", _figure_html(_pareto_figure(stored), "pareto-front")),
        ("Optimization history", _figure_html(_history_figure(stored), "history")),
        ("Parameter importance", _figure_html(_importance_figure(stored), "importance")),
        (
            "Capacity vs mem_fraction_static",
            _figure_html(_capacity_figure(stored), "capacity-vs-mfs"),
        ),
        ("Trials", _trial_rows_html(stored)),
        ("Trial details", _trial_details_html(stored) or '<p class="note">none</p>'),
    ]
    body = "".join(
        f"<section><h2>{html.escape(title)}</h2>{content}</section>" for title, content in sections
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>sglang-tuner report: {html.escape(stored.name)}</title>"
        f"<style>{_CSS}</style>"
        f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script>"
        f"</head><body><h1>sglang-tuner report: {html.escape(stored.name)}</h1>"
        f"<section>{''.join(summary)}</section>{body}</body></html>"
    )


def write_html_report(
    stored: StoredStudy, path: Path, best: BestTrial | None, best_error: str | None = None
) -> Path:
    """Write :func:`build_html_report` to ``path`` atomically (temp file, then rename).

    Returns:
        The path written.

    Raises:
        StudyError: The file cannot be written (the message names the path).
    """
    path = Path(path)
    if not path.parent.is_dir():  # as every output option: a missing folder is refused, not created
        raise StudyError(f"cannot write the report to {path}: folder {path.parent} does not exist",
                         hint="create it first, or pass -o FILE in an existing folder")
    text = build_html_report(stored, best, best_error)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as err:
        raise StudyError(
            f"cannot write the report to {path}: {err.strerror}",
            hint="pass a writable path with -o FILE",
        ) from err
    return path


def write_study_report(stored: StoredStudy, output: Path | None = None) -> Path:
    """``tuner report``: choose the best trial (if any) and write the HTML report.

    Args:
        stored: The study.
        output: The file; default ``studies/<study>-report.html``.

    Returns:
        The path written.

    Raises:
        StudyError: The file cannot be written, or the stored policy is invalid.
    """
    best = best_trial(stored) if stored.pareto_front() else None
    why = None if best else "No feasible trial: no trial met every constraint (see the table)."
    if output is None:
        STUDIES_DIR.mkdir(exist_ok=True)  # only the default studies/ is created (as for storage)
    return write_html_report(stored, output or STUDIES_DIR / f"{stored.name}-report.html", best, why)


