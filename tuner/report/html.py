"""The HTML report: one self-contained file with plotly's JavaScript inlined, so it opens offline.

Every string that came from a log or a server is escaped with :func:`html.escape` before it
reaches the HTML.
"""

from __future__ import annotations

import datetime as dt
import html
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
import plotly.graph_objects as go
import plotly.offline

from tuner.errors import StudyError
from tuner.report import figures
from tuner.report.figures import CATEGORY_COLORS, category
from tuner.report.tables import TABLE_METRICS, cell, delta_text, key_params, quality_text
from tuner.results import METRICS, BestTrial, StoredStudy, best_trial, cache_effect, status_text
from tuner.study.storage import STUDIES_DIR, display_url

__all__ = ['FIGURE_IDS', 'build_html_report', 'write_html_report', 'write_study_report']


def _history_figure(stored: StoredStudy) -> go.Figure:
    """Context capacity per trial in trial order: measured trials at their (OOM-safe) capacity, a
    failed start at 0 (it fitted nothing), skipped configs open at their predicted capacity (never
    at 0 as if measured; one without a prediction is left out and counted in the legend), and the
    best feasible capacity so far."""
    fig = go.Figure()
    for cat, color in CATEGORY_COLORS.items():
        views = [v for v in stored.trials if category(v) == cat]
        if cat == "skipped":
            drawn = [v for v in views if v.record is not None and v.record.prediction.context_capacity is not None]
            ys = [v.record.prediction.context_capacity if v.record else None for v in drawn]
            name = f"skipped: not launched, at predicted capacity ({len(views) - len(drawn)} without one not drawn)"
            marker = {"color": color, "size": 9, "symbol": "circle-open"}
            hovers = [html.escape(f"trial {v.number} skipped: {v.record.skipped_reason if v.record else ''}")
                      for v in drawn]
        else:
            drawn, name, marker = views, cat, {"color": color, "size": 10}
            ys = [v.metric("context_capacity") or 0 for v in views]
            hovers = [figures.hover(v) for v in views]
        if not drawn:
            continue
        fig.add_trace(
            go.Scatter(
                x=[v.number for v in drawn],
                y=ys,
                mode="markers",
                name=name,
                marker=marker,
                hovertext=hovers,
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


IMPORTANCE_MIN_TRIALS = 10
"""Completed trials below which parameter importance is not drawn: fANOVA's forest on a handful of
points gives every parameter about the same share (0.33 / 0.33 / 0.33 on the demo's few trials, one of them a parameter that never varied), a
picture of the sample size, not a finding."""


def _importance_figure(stored: StoredStudy) -> go.Figure | str:
    """Optuna's parameter importance (fANOVA) for the capacity the study ranked (``values[0]``),
    over the parameters that varied among the completed trials only, or a sentence saying why it
    is not drawn: fewer than :data:`IMPORTANCE_MIN_TRIALS` completed trials, or fewer than two
    parameters that varied (one has importance 1 by construction). Parameters that never varied,
    or that not every completed trial has, are named under the title, never given a share.
    """
    complete = [t for t in stored.study.get_trials(deepcopy=False) if t.values is not None]
    names = sorted({p for t in complete for p in t.params})
    in_all = [n for n in names if all(n in t.params for t in complete)]
    varying = [n for n in in_all if len({repr(t.params[n]) for t in complete}) > 1]
    constant = [n for n in in_all if n not in varying]
    partial = [n for n in names if n not in in_all]
    if len(complete) < IMPORTANCE_MIN_TRIALS or len(varying) < 2:
        return (
            f"Parameter importance is not drawn: it needs at least {IMPORTANCE_MIN_TRIALS} completed trials "
            f"and two parameters that varied (this study has {len(complete)} completed, varying: "
            f"{', '.join(varying) or 'none'}; never varied: {', '.join(constant) or 'none'}"
            + (f"; not in every trial: {', '.join(partial)}" if partial else "") + "). "
            "On fewer trials every parameter gets about the same share, whatever it did."
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shares = optuna.importance.get_param_importances(
                stored.study, params=varying, target=lambda t: t.values[0])
    except (ValueError, RuntimeError, ZeroDivisionError, IndexError) as err:
        return f"Parameter importance could not be computed for this study: {err}"
    order = sorted(shares, key=lambda n: shares[n])
    fig = go.Figure(go.Bar(
        x=[shares[n] for n in order], y=order, orientation="h", marker_color=CATEGORY_COLORS["feasible"],
        text=[f"{shares[n]:.2f}" for n in order], textposition="outside", cliponaxis=False,
        hovertext=[html.escape(f"{n}: {shares[n]:.3f} of the variance of {METRICS['context_capacity'][0]}")
                   for n in order], hoverinfo="text"))
    unranked = [f"never varied: {', '.join(constant)}"] if constant else []
    unranked += [f"not in every trial: {', '.join(partial)}"] if partial else []
    fig.update_layout(
        title=f"Parameter importance (fANOVA, for context capacity; {len(complete)} completed trials)"
              + (f"<br><sup>not ranked: {html.escape('; '.join(unranked))}</sup>" if unranked else ""),
        xaxis_title="share of the capacity's variance", xaxis_range=[0, 1.1], yaxis_title="parameter")
    return fig


def _figure_html(fig: go.Figure | str, div_id: str) -> str:
    if isinstance(fig, str):
        return f'<p class="note">{html.escape(fig)}</p>'
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id)


def _trial_rows_html(stored: StoredStudy) -> str:
    params = key_params(stored.trials)
    hosts = len({v.host for v in stored.trials if v.host}) > 1  # a study shared by many hosts
    heads = ["#", *(["host"] if hosts else []), "state", "kind", *params, *[METRICS[m][0] for m in TABLE_METRICS]]
    gated = any(v.record is not None and v.record.quality.changes for v in stored.trials)  # a numerics change
    heads += [*(["quality"] if gated else []), "feasible", "failure"]
    out = ['<div style="overflow-x:auto"><table><thead><tr>']
    out += [f"<th>{html.escape(h)}</th>" for h in heads]
    out.append("</tr></thead><tbody>")
    for view in stored.trials:
        cells = [str(view.number), *([view.host or "-"] if hosts else []), view.state, view.kind or "-"]
        cells += [cell(view.params.get(p)) for p in params]
        cells += [cell(view.metric(m)) for m in TABLE_METRICS]
        cells += [*([quality_text(view)] if gated else []), "yes" if view.feasible else "no", status_text(view)]
        out.append(f'<tr class="{category(view)}">')
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
        out.append(f"<details><summary>trial {view.number}: {html.escape(category(view))}")
        if view.failure_class:
            out.append(f" ({html.escape(view.failure_class)})")
        out.append("</summary>")
        one = figures.memory_figure([view], title=f"Where the GPU memory went: trial {view.number}")
        if not isinstance(one, str):
            one.update_layout(width=1000, showlegend=True)
            out.append(_figure_html(one, f"memory-trial-{view.number}"))
        if rec.argv:
            out.append(f"<p><b>command</b></p><pre>{html.escape(' '.join(rec.argv))}</pre>")
        if rec.failure_evidence:
            out.append(f"<p><b>evidence</b></p><pre>{html.escape(rec.failure_evidence)}</pre>")
        if rec.skipped_reason:
            out.append(f"<p><b>skipped</b>: {html.escape(rec.skipped_reason)}</p>")
        if rec.quality.changes:
            out.append(f"<p><b>quality gate</b>: {html.escape(quality_text(view))}"
                       f"{html.escape(': ' + rec.quality.reason) if rec.quality.reason else ''}</p>")
        effect = cache_effect(stored, view)
        if effect is not None:
            out.append(f"<p><b>prefix cache</b>: {html.escape(effect.describe())}</p>")
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


FIGURE_IDS = ("pareto-front", "memory", "capacity-vs-mfs", "latency", "history", "importance")
"""The ``id`` of each study figure's ``<div>`` (its section is ``section-<id>``), in page order."""


def build_html_report(stored: StoredStudy, best: BestTrial | None, best_error: str | None,
                      *, slo_ms: Mapping[str, float | None] | None = None) -> str:
    """The self-contained HTML report of a study, as a string.

    Sections: summary (study, storage, environment, baseline command, best trial and why), the
    Pareto front (baseline and best marked), where the GPU memory went (the memory waterfall of
    every trial as a stacked bar), context capacity vs mem_fraction_static (the calibrated memory
    model with the measured trials and the failure boundaries), latency against load (with the
    SLO), the optimization history, parameter importance (Optuna's, guarded for small studies),
    the trial table, and each trial's memory bar, command, failure evidence and log excerpt
    (escaped). Figures: :mod:`tuner.report.figures`.

    Args:
        stored: The study.
        best: The chosen best trial, or ``None``.
        best_error: Why there is no best trial (shown instead), or ``None``.
        slo_ms: The SLO's p99 limits in ms (``{"ttft": ..., "itl": ...}``), when known.
    """
    info = stored.info
    summary = [
        f"<p><b>study</b> {html.escape(stored.name)} — <b>storage</b> "
        f"{html.escape(display_url(stored.location.storage_url))} — {len(stored.trials)} trials — "
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
        facts = best.trial.record.quality if best.trial.record is not None else None
        if facts is not None and facts.changes:
            summary.append(f"<p><b>quality gate of the best</b>: {html.escape(quality_text(best.trial))} "
                           f"({html.escape(', '.join(facts.changes))} changed)</p>")
        summary.extend(f"<p>{html.escape(note)}</p>" for note in best.notes)
        if best.cache is not None:
            summary.append(f"<p><b>prefix cache of the best</b>: {html.escape(best.cache.describe())}</p>")
    elif best_error:
        summary.append(f'<p class="note">{html.escape(best_error)}</p>')
    base = stored.baseline()
    marks: dict[str, Any] = {"baseline": base.number if base is not None else None,
             "best": best.trial.number if best is not None else None}
    sections = [
        ("pareto-front", "Pareto front", figures.pareto_figure(stored, **marks)),
        ("memory", "Where the GPU memory went", figures.memory_figure(stored.trials, **marks)),
        ("capacity-vs-mfs", "Capacity vs mem_fraction_static", figures.capacity_figure(stored, **marks)),
        ("latency", "Latency against load", figures.latency_figure(stored.trials, slo_ms=slo_ms, **marks)),
        ("history", "Optimization history", _history_figure(stored)),
        ("importance", "Parameter importance", _importance_figure(stored)),
    ]
    body = "".join(
        f'<section id="section-{key}"><h2>{html.escape(title)}</h2>{_figure_html(fig, key)}</section>'
        for key, title, fig in sections
    )
    body += f'<section id="section-trials"><h2>Trials</h2>{_trial_rows_html(stored)}</section>'
    body += ('<section id="section-details"><h2>Trial details</h2>'
             f'{_trial_details_html(stored) or "<p class=note>none</p>"}</section>')
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>sglang-tuner report: {html.escape(stored.name)}</title>"
        f"<style>{_CSS}</style>"
        f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script>"
        f"</head><body><h1>sglang-tuner report: {html.escape(stored.name)}</h1>"
        f"<section>{''.join(summary)}</section>{body}</body></html>"
    )


def write_html_report(
    stored: StoredStudy, path: Path, best: BestTrial | None, best_error: str | None = None,
    *, slo_ms: Mapping[str, float | None] | None = None,
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
    text = build_html_report(stored, best, best_error, slo_ms=slo_ms)
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


def write_study_report(stored: StoredStudy, output: Path | None = None, *,
                       slo_ms: Mapping[str, float | None] | None = None) -> Path:
    """``tuner report``: choose the best trial (if any) and write the HTML report.

    Args:
        stored: The study.
        output: The file; default ``studies/<study>-report.html``.
        slo_ms: The SLO's p99 limits in ms for the latency figure (the study's config's ``[slo]``).

    Returns:
        The path written.

    Raises:
        StudyError: The file cannot be written, or the stored policy is invalid.
    """
    best = best_trial(stored) if stored.pareto_front() else None
    why = None if best else "No feasible trial: no trial met every constraint (see the table)."
    if output is None:
        STUDIES_DIR.mkdir(exist_ok=True)  # only the default studies/ is created (as for storage)
    return write_html_report(stored, output or STUDIES_DIR / f"{stored.name}-report.html", best, why, slo_ms=slo_ms)


