"""The report's pictures (plotly figures), built only from what each trial stored.

One figure per question an operator asks:

- :func:`memory_figure`: where the GPU memory went, per trial (a stacked bar of the memory
  waterfall of :func:`tuner.sglang.explain.waterfall_steps`, GiB per GPU; the part above the
  weights zoomed beside it, every number printed on the bars and in a table below).
- :func:`capacity_figure`: what another ``mem_fraction_static`` would hold (the calibrated
  :class:`tuner.sglang.memory.KVCapacityModel` of a measured start, the measured trials on it, and
  where starts fail: the startup boundaries and the runtime one, §1.2, §1.6, §8).
- :func:`latency_figure`: p99 TTFT and ITL against the load each trial ran, with the SLO.
- :func:`pareto_figure`: context capacity against output throughput, the Pareto front, and the
  baseline and the best marked so they read at a glance.

Nothing here recomputes SGLang's memory rules: the waterfall is the one ``tuner show`` and
``tuner explain`` print, the curve is the memory model's own prediction.
"""

from __future__ import annotations

import html
import logging
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from tuner.results import METRICS, StoredStudy, TrialView
from tuner.sglang.explain import waterfall_steps
from tuner.sglang.failures import STARTUP_MEMORY_FAILURES
from tuner.sglang.memory import KVCapacityModel
from tuner.study.decide.rungs import same_rung

__all__ = [
    "CATEGORY_COLORS", "MEMORY_ITEMS", "memory_figure", "capacity_figure", "latency_figure", "pareto_figure",
    "category", "hover", "measured_boundaries", "memory_steps",
]

_log = logging.getLogger(__name__)

CATEGORY_COLORS = MappingProxyType(
    {"feasible": "#2a9d8f", "infeasible": "#e9a03b", "failed": "#e63946", "skipped": "#8d99ae"}
)
BASELINE_COLOR = "#1d3557"
BEST_COLOR = "#d62828"

MEMORY_ITEMS = MappingProxyType({
    "weights": ("weights", "#264653"),
    "kv_pool": ("KV pool", "#2a9d8f"),
    "other_static": ("other static", "#8ab17d"),
    "req_to_token": ("req_to_token table", "#e9c46a"),
    "cuda_graphs": ("CUDA graphs", "#f4a261"),
    "draft_model": ("draft model", "#9b5de5"),
    "other_reserve": ("other reserve use", "#b8b8d1"),
    "free_after_graphs": ("free after graphs", "#a8dadc"),
})
"""The stacked segments of the memory bar, bottom to top (``WaterfallStep.item`` → label, colour):
the static part (``mfs × B``: weights, KV pool, anything else) below, the reserve's parts above."""

_RUNTIME_FAILURES = {"runtime_oom"}


def category(view: TrialView) -> str:
    """``feasible``, ``infeasible`` (started, missed a constraint), ``failed`` or ``skipped``."""
    if view.outcome == "skipped" or view.state == "PRUNED":
        return "skipped"
    if view.failed:
        return "failed"
    return "feasible" if view.feasible else "infeasible"


def _label(view: TrialView, baseline: int | None, best: int | None) -> str:
    """``#3 best``, ``#0 baseline``, or ``#0 baseline = best`` when the baseline is the best."""
    roles = [name for name, number in (("baseline", baseline), ("best", best)) if number == view.number]
    return " ".join([f"#{view.number}", " = ".join(roles)]) if roles else f"#{view.number}"


def hover(view: TrialView) -> str:
    """Hover text of a trial's marker: number, category, params, failure class (escaped)."""
    lines = [f"trial {view.number} ({category(view)})"]
    lines += [f"{k}={v}" for k, v in sorted(view.params.items())]
    if view.failure_class:
        lines.append(f"failure: {view.failure_class}")
    rec = view.record
    if rec is not None and rec.context_capacity is not None:
        lines.append(f"OOM-safe context capacity {rec.context_capacity}")
        if rec.slo_capacity.limits:
            lines.append(f"SLO-safe {rec.slo_capacity.describe()}")
    return "<br>".join(html.escape(line) for line in lines)


def _ordered(trials: Sequence[TrialView], baseline: int | None, best: int | None) -> list[TrialView]:
    """Baseline first, then the best, then every other trial in trial order; each trial once (a
    baseline that is the best is one bar, not two stacked under one label)."""
    first = [v for n in dict.fromkeys((baseline, best)) for v in trials if n is not None and v.number == n]
    seen = {v.number for v in first}
    return first + [v for v in trials if v.number not in seen]


# ---- where the memory went -------------------------------------------------------------------


def memory_steps(view: TrialView) -> dict[str, Any]:
    """The stored memory waterfall of one trial by item (``{}`` when it stored none, e.g. a start
    that failed before SGLang printed its memory lines)."""
    memory = view.record.memory if view.record is not None else None
    if memory is None or not memory.ranks:
        return {}
    try:
        return {s.item: s for s in waterfall_steps(memory.stored())}
    except (ValueError, KeyError, TypeError) as err:
        _log.debug("trial %s: stored memory report not shown: %s", view.number, err)
        return {}


_ABOVE_WEIGHTS = tuple(k for k in MEMORY_ITEMS if k != "weights")
"""The segments of the zoomed panel: everything above the weights."""


def _memory_rows(rows: Sequence[tuple[TrialView, dict[str, Any]]]) -> list[dict[str, float | None]]:
    """Per trial: each segment's GiB (``None``: not stored), ``weights`` (0 when not stored), the
    static part ``mfs × B`` (weights + KV pool + other static; ``None`` without a reserve line) and
    ``B`` (free at the baseline)."""
    out = []
    for _, steps in rows:
        row: dict[str, float | None] = {
            item: steps[item].gib if item in steps and steps[item].gib is not None else None for item in MEMORY_ITEMS}
        static = sum(steps[k].gib or 0.0 for k in ("weights", "kv_pool", "other_static") if k in steps)
        row["static"] = static if "reserve" in steps and steps["reserve"].gib is not None else None
        row["B"] = steps["baseline_free"].gib if "baseline_free" in steps else None
        out.append(row)
    return out


def _segment_hover(view: TrialView, steps: dict[str, Any], item: str, name: str, gib: float | None) -> str:
    step = steps.get(item)
    text = f"trial {view.number}: {name} {gib:.2f} GiB" if gib is not None else ""
    if step is not None and step.tokens is not None:
        text += f"<br>{step.tokens:,} tokens"
    if step is not None:
        text += f"<br>{html.escape(step.label)}<br>source: {html.escape(step.source)}"
    return text


def _memory_table(rows: Sequence[tuple[TrialView, dict[str, Any]]], labels: Sequence[str],
                  values: Sequence[dict[str, float | None]]) -> go.Table:
    """Every number of the bars printed (GiB per GPU; the KV pool's tokens beside it), one row per trial."""
    items = [k for k in MEMORY_ITEMS if any(v[k] is not None for v in values)]

    def gib(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    columns: list[list[str]] = [list(labels)]
    heads = ["trial"]
    for item in items:
        columns.append([gib(v[item]) for v in values])
        heads.append("req_to_token" if item == "req_to_token" else MEMORY_ITEMS[item][0])
        if item == "kv_pool":
            tokens = [steps["kv_pool"].tokens if "kv_pool" in steps else None for _, steps in rows]
            columns.append([f"{t:,}" if t is not None else "-" for t in tokens])
            heads.append("KV tokens")
    columns += [[gib(v["static"]) for v in values], [gib(v["B"]) for v in values]]
    heads += ["mfs × B", "B"]
    return go.Table(
        header={"values": [f"<b>{html.escape(h)}</b>" for h in heads], "fill_color": "#e9ecef", "align": "center",
                "font": {"size": 11}},
        cells={"values": columns, "align": ["left", *["right"] * (len(heads) - 1)], "font": {"size": 11},
               "height": 22},
        columnwidth=[1.4 if h == "trial" else 1.2 if h in ("KV tokens", "req_to_token") else 1.0 for h in heads],
    )


def memory_figure(trials: Sequence[TrialView], *, baseline: int | None = None, best: int | None = None,
                  title: str | None = None) -> go.Figure | str:
    """The memory waterfall of every trial (GiB per GPU, min over ranks), in three parts:

    - left, the whole GPU: one stacked bar per trial (weights at the bottom, their GiB printed);
    - right, the part above the weights zoomed (KV pool, other static, req_to_token, CUDA graphs,
      draft model, other reserve use, free after graphs; each segment's GiB printed on it where
      it fits), with ``mfs × B`` (the reserve lies above it) and ``B`` (free at the baseline), both
      less the trial's weights;
    - below, a table printing every number of the bars (the KV pool with its tokens), so a
      printed or screenshotted report keeps them (hover adds each line's source).

    Args:
        trials: The trials to draw (those without a stored memory report are left out).
        baseline: The baseline's trial number (drawn first, labelled).
        best: The best trial's number (drawn second, labelled).
        title: Figure title.

    Returns:
        The figure (height grows with the trials, in px), or a sentence saying why there is none.
    """
    rows = [(v, steps) for v in _ordered(trials, baseline, best) if (steps := memory_steps(v))]
    if not rows:
        return "No trial stored a memory report (no start got as far as SGLang's memory lines)."
    labels = [_label(v, baseline, best) for v, _ in rows]
    values = _memory_rows(rows)
    zoom_top = max(sum(max(v[k] or 0.0, 0.0) for k in _ABOVE_WEIGHTS) for v in values) or 1.0
    bars_px, table_px = 400, 80 + 22 * min(len(rows), 12)  # the table scrolls beyond 12 trials
    fig = make_subplots(
        rows=2, cols=2, column_widths=[0.24, 0.76], row_heights=[bars_px, table_px], horizontal_spacing=0.08,
        vertical_spacing=110 / (bars_px + table_px + 110), specs=[[{"type": "xy"}, {"type": "xy"}], [{"type": "table", "colspan": 2}, None]],
        subplot_titles=("the whole GPU", "above the weights (zoomed)", ""),
    )
    for item, (name, color) in MEMORY_ITEMS.items():
        ys = [v[item] for v in values]
        if all(y is None for y in ys):
            continue
        hover = [_segment_hover(view, steps, item, name, y) for (view, steps), y in zip(rows, ys, strict=True)]
        whole_text = [f"{y:.2f}" if item == "weights" and y is not None else "" for y in ys]
        fig.add_trace(go.Bar(x=labels, y=ys, name=name, marker_color=color, hovertext=hover, hoverinfo="text",
                             legendgroup=item, text=whole_text, textposition="inside", insidetextanchor="middle",
                             textangle=-90, textfont={"size": 11}), row=1, col=1)
        if item in _ABOVE_WEIGHTS:
            fits = 0.045 * zoom_top  # a segment this tall (GiB) holds one line of 11 px text in the 400 px panel
            fig.add_trace(go.Bar(x=labels, y=ys, name=name, marker_color=color, hovertext=hover, hoverinfo="text",
                                 legendgroup=item, showlegend=False, textposition="inside", insidetextanchor="middle",
                                 text=[f"{y:.2f}" if y is not None and abs(y) >= fits else "" for y in ys],
                                 textangle=0, textfont={"size": 11}), row=1, col=2)
    # The reserve: everything above mfs × B (the static part) is (1 − mfs) × B.
    weights = [v["weights"] or 0.0 for v in values]
    tops = [v["static"] for v in values]
    if any(t is not None for t in tops):
        reserve_hover = [f"trial {view.number}: reserve {steps['reserve'].gib:.2f} GiB = "
                         f"{html.escape(steps['reserve'].label)}" if v["static"] is not None else ""
                         for (view, steps), v in zip(rows, values, strict=True)]
        for col, ys in ((1, tops), (2, [t - w if t is not None else None for t, w in zip(tops, weights, strict=True)])):
            fig.add_trace(go.Scatter(x=labels, y=ys, mode="markers", name="mfs × B: the reserve lies above",
                                     marker={"symbol": "line-ew-open", "size": 46 if col == 2 else 18,
                                             "color": "#111", "line": {"width": 3, "color": "#111"}},
                                     hovertext=reserve_hover, hoverinfo="text", legendgroup="static",
                                     showlegend=col == 1), row=1, col=col)
    totals = [v["B"] for v in values]
    if any(t is not None for t in totals):
        b_hover = [f"B = {t:.2f} GiB" if t is not None else "" for t in totals]
        for col, ys in ((1, totals), (2, [t - w if t is not None else None for t, w in zip(totals, weights, strict=True)])):
            fig.add_trace(go.Scatter(x=labels, y=ys, mode="markers", name="B: free at the baseline",
                                     marker={"symbol": "triangle-down", "size": 11, "color": "#111"},
                                     hovertext=b_hover, hoverinfo="text", legendgroup="B", showlegend=col == 1),
                          row=1, col=col)
    fig.add_trace(_memory_table(rows, labels, values), row=2, col=1)
    fig.update_layout(barmode="stack", title=title or "Where the GPU memory went (GiB per GPU; hover for sources)",
                      legend={"traceorder": "normal"},
                      height=bars_px + table_px + 110 + 180)
    fig.update_xaxes(type="category", row=1, col=1)
    fig.update_xaxes(type="category", title_text="trial", row=1, col=2)
    fig.update_yaxes(title_text="GiB per GPU", row=1, col=1)
    fig.update_yaxes(title_text="GiB above the weights", rangemode="tozero", row=1, col=2)
    return fig


# ---- what another fraction would hold ---------------------------------------------------------


def _calibration(trials: Sequence[TrialView], prefer: Sequence[int | None]) -> tuple[TrialView, KVCapacityModel] | None:
    """The trial whose stored, log-calibrated memory model draws the curve: the first of
    ``prefer`` (best, baseline) that has one, else any."""
    def model(view: TrialView) -> KVCapacityModel | None:
        return view.record.memory.capacity_model if view.record is not None else None

    order = [v for n in prefer for v in trials if n is not None and v.number == n] + list(trials)
    for view in order:
        found = model(view)
        if found is not None:
            return view, found
    return None


def _resolved(view: TrialView, name: str) -> Any:
    rec = view.record
    if rec is None:
        return None
    entry = rec.resolved.get(name) if rec.resolved else None
    if isinstance(entry, Mapping):
        return entry.get("value")
    return rec.params.get(name)


def capacity_figure(stored: StoredStudy, *, baseline: int | None = None, best: int | None = None) -> go.Figure | str:
    """Concurrent contexts the KV pool holds against ``mem_fraction_static``: the calibrated
    memory model's curve, the measured trials on it, and the fractions where starts fail.

    The curve is ``KVCapacityModel.tokens(mfs) // context tokens`` of the best trial's stored model
    (else the baseline's); the boundaries are where it predicts ``Not enough memory`` (no KV
    budget, below), where the reserve no longer holds req_to_token, CUDA graphs and the rest
    (graph capture fails, above), and where the headroom left after graphs falls below the
    activation peak a trial measured under load (runtime OOM, above). Measured failures are drawn
    at zero with their class. Trials that ran other structural levers than the calibrating trial
    (:func:`tuner.study.decide.rungs.same_rung`: another KV dtype, DP attention, DCP) hold another
    pool at each fraction: they are drawn open, apart from the curve, and neither its boundaries
    nor the measured ones are read from them.

    Returns:
        The figure, or a sentence saying why there is none.
    """
    views = [v for v in stored.trials if "mem_fraction_static" in v.params]
    if not views:
        return "No trial recorded mem_fraction_static."
    context = (stored.info.context_tokens if stored.info else None) or next(
        (v.record.context_tokens for v in views if v.record is not None and v.record.context_tokens), None)
    if not context:
        return "The study recorded no context length, so no context capacity can be drawn."
    fig = go.Figure()
    fractions = [float(v.params["mem_fraction_static"]) for v in views]
    calibrated = _calibration(views, (best, baseline))
    title = "Context capacity vs mem_fraction_static"
    on_curve, elsewhere = list(views), []
    if calibrated is not None:
        source, model = calibrated
        # Another structural rung (fp8 KV, DP attention, DCP) has another KV pool per fraction: its
        # trials are drawn apart, never read against this curve or its boundaries.
        on_curve = [v for v in views if same_rung(v.params, source.params)]
        elsewhere = [v for v in views if not same_rung(v.params, source.params) and category(v) != "skipped"]
        lo = max(0.3, min(min(fractions) - 0.08, model.min_fraction()))
        grid = [round(lo + i * 0.0025, 4) for i in range(int((0.995 - lo) / 0.0025) + 1)]
        tokens = [model.tokens(x) for x in grid]
        fig.add_trace(go.Scatter(
            x=grid, y=[max(0, t) // context for t in tokens], mode="lines", line={"color": "#457b9d", "width": 2},
            name=f"memory model (calibrated on trial {source.number})",
            hovertext=[f"mfs {x:.3f}: {max(0, t):,} tokens → {max(0, t) // context} × {context:,}" for x, t in zip(grid, tokens, strict=True)],
            hoverinfo="text"))
        title += f" — model calibrated on trial {source.number}"
        hidden = _model_boundaries(fig, model, source, on_curve)
        if elsewhere:
            hidden.append(f"trial{'s' if len(elsewhere) > 1 else ''} {', '.join(str(v.number) for v in elsewhere)} "
                          f"ran other structural levers than trial {source.number}: drawn open, off this curve")
        if hidden:
            title += "<br><sup>" + html.escape("; ".join(hidden), quote=False) + "</sup>"
    for cat, color in CATEGORY_COLORS.items():
        group = [v for v in on_curve if category(v) == cat]
        if cat == "skipped":
            _skipped_trace(fig, group, context)
            continue
        if not group:
            continue
        fig.add_trace(go.Scatter(
            x=[float(v.params["mem_fraction_static"]) for v in group],
            y=[(v.metric("token_capacity") or 0) // context for v in group],
            mode="markers", name=f"measured: {cat}",
            marker={"color": color, "size": 11, "symbol": "x" if cat == "failed" else "circle",
                    "line": {"width": 1, "color": "#222"}},
            hovertext=[hover(v) + f"<br>context capacity {v.metric('context_capacity')}" for v in group],
            hoverinfo="text"))
    if elsewhere:
        fig.add_trace(go.Scatter(
            x=[float(v.params["mem_fraction_static"]) for v in elsewhere],
            y=[(v.metric("token_capacity") or 0) // context for v in elsewhere],
            mode="markers", name="measured on other structural levers (not this curve)",
            marker={"color": [CATEGORY_COLORS[category(v)] for v in elsewhere], "size": 11, "symbol": "circle-open",
                    "line": {"width": 2}},
            hovertext=[hover(v) + f"<br>context capacity {v.metric('context_capacity')}" for v in elsewhere],
            hoverinfo="text"))
    for low, high, label in measured_boundaries(on_curve):
        fig.add_vline(x=(low + high) / 2, line={"color": CATEGORY_COLORS["failed"], "dash": "dash"},
                      annotation_text=html.escape(f"failure boundary ({label})"), annotation_position="bottom left")
    lowest = min(fractions + ([model.min_fraction()] if calibrated is not None and 0 < model.min_fraction() < 1 else []))
    fig.update_layout(title=title, xaxis_title="mem_fraction_static", xaxis_range=[max(0.0, lowest - 0.03), 1.0],
                      yaxis_title=f"contexts of {context:,} tokens the KV pool holds", hovermode="closest")
    return fig


def _skipped_trace(fig: go.Figure, skipped: Sequence[TrialView], context: int) -> None:
    """Configs not launched, at the capacity they were predicted to have (open circles, the reason
    on hover); one with no prediction is not drawn (it was never measured: capacity 0 would be a
    measurement nobody made)."""
    points = [(v, v.record.prediction.token_capacity) for v in skipped
              if v.record is not None and v.record.prediction.token_capacity]
    if not points:
        return
    fig.add_trace(go.Scatter(
        x=[float(v.params["mem_fraction_static"]) for v, _ in points], y=[t // context for _, t in points],
        mode="markers", name="skipped: not launched (predicted)",
        marker={"color": CATEGORY_COLORS["skipped"], "size": 9, "symbol": "circle-open"},
        hovertext=[html.escape(f"trial {v.number} skipped: {v.record.skipped_reason if v.record else ''}")
                   for v, _ in points], hoverinfo="text"))


def _contradicting(views: Sequence[TrialView], fails: str, at: float) -> list[int]:
    """Trials whose measurement contradicts a predicted boundary at ``at``: trials that started
    (``fails="startup"``) or ran their load without a runtime OOM (``fails="runtime"``) on the side
    of it where the model says they fail (above it; ``"below"``: started below it)."""
    def beyond(view: TrialView) -> bool:
        mfs = float(view.params["mem_fraction_static"])
        return mfs < at if fails == "below" else mfs > at
    return [v.number for v in views
            if category(v) in ("feasible", "infeasible") and not v.failure_class and beyond(v)]


def _model_boundaries(fig: go.Figure, model: KVCapacityModel, source: TrialView,
                      views: Sequence[TrialView]) -> list[str]:
    """Dotted lines where the model predicts a failed start (below and above) and a runtime OOM,
    each for the calibrating trial's own knobs (its ``max_running_requests`` and context length:
    another trial's knobs move them). A boundary a measured trial contradicts (a trial that started,
    or ran its load, where the line says it cannot) is not drawn: a picture must not put measured
    feasible trials inside a region labelled as failing. Returns one sentence per boundary left out."""
    hidden: list[str] = []

    def draw(at: float, fails: str, text: str, color: str, position: str) -> None:
        against = _contradicting(views, fails, at)
        if against:
            hidden.append(f"the model's {text.split(':')[0]} boundary at {at:.3f} (for trial {source.number}'s knobs) "
                          f"is not drawn: trial{'s' if len(against) > 1 else ''} "
                          f"{', '.join(map(str, against))} ran beyond it")
            return
        fig.add_vline(x=at, line={"color": color, "dash": "dot"}, annotation_text=text, annotation_position=position)

    start = model.min_fraction()
    if 0 < start < 1:
        draw(start, "below", f"startup: no KV budget below {start:.3f}", "#6c757d", "top right")
    record = source.record
    mrr, ctx = _resolved(source, "max_running_requests"), record.memory.context_len if record is not None else None
    if not mrr or not ctx:
        return hidden
    try:
        at = [model.headroom_gib(x, max_running_requests=int(mrr), context_len=int(ctx)) for x in (0.5, 0.9)]
    except (TypeError, ValueError):
        return hidden
    slope = (at[1] - at[0]) / 0.4  # the headroom falls linearly with the fraction: −B per unit
    if slope >= 0:
        return hidden

    def where(level: float) -> float:
        return 0.5 + (level - at[0]) / slope

    knobs = f"trial {source.number}'s {int(mrr)} request slots"
    graphs = where(0.0)
    if 0 < graphs < 1:
        draw(graphs, "above", f"startup: graphs do not fit above {graphs:.3f} ({knobs})", "#6c757d", "top left")
    need = (record.memory.peak_activation_gib or record.prediction.need_gib) if record is not None else None
    if need:
        runtime = where(float(need))
        if 0 < runtime < 1:
            draw(runtime, "above", f"runtime: headroom < {float(need):.2f} GiB activations above {runtime:.3f} ({knobs})",
                 BEST_COLOR, "bottom left")
    return hidden


def measured_boundaries(views: Sequence[TrialView]) -> list[tuple[float, float, str]]:
    """Failure boundaries the trials measured on mem_fraction_static: ``(low, high, label)`` spans
    between the nearest fraction that started and the nearest one that failed on memory (at
    startup, §4.3, or under load), above and below the fractions that started."""
    started = [float(v.params["mem_fraction_static"]) for v in views
               if "mem_fraction_static" in v.params and v.state == "COMPLETE" and not v.failure_class]
    memory_classes = {f.value for f in STARTUP_MEMORY_FAILURES} | _RUNTIME_FAILURES
    failed = [(float(v.params["mem_fraction_static"]), v.failure_class or "") for v in views
              if "mem_fraction_static" in v.params and v.failure_class in memory_classes]
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


# ---- latency against load ----------------------------------------------------------------------


def latency_figure(trials: Sequence[TrialView], *, slo_ms: Mapping[str, float | None] | None = None,
                   baseline: int | None = None, best: int | None = None) -> go.Figure | str:
    """p99 TTFT and p99 ITL (ms) of each trial's load phases against the load they ran (mean
    requests in flight), with the SLO's p99 limits as dashed lines.

    Nothing is printed on the plot, where text was clipped at a panel's edges and overprinted
    other text: the baseline's and the best's points are ringed in their colour and named in the
    legend (below the panels, with the SLO lines), and the subtitle states each one's stress
    verdict per limit (a TTFT within its limit is not called broken because the ITL broke) and its
    SLO-safe capacity. A panel whose latencies span more than a factor of 20 (a stress load far
    past the SLO beside windows within it) has a log axis, so the points near the SLO are not
    squashed against zero.

    Args:
        trials: The study's trials (those with a measured phase are drawn).
        slo_ms: ``{"ttft": limit, "itl": limit}`` in ms (p99), ``None`` values or no mapping when unknown.
        baseline, best: Trial numbers to mark.

    Returns:
        The figure, or a sentence saying why there is none.
    """
    points = [(v, p) for v in trials if v.record is not None for p in v.record.phases
              if p.metrics.get("concurrency") is not None and (p.metrics.get("p99_ttft_ms") is not None
                                                              or p.metrics.get("p99_itl_ms") is not None)]
    if not points:
        return "No trial measured a load phase."
    fig = make_subplots(rows=1, cols=2, subplot_titles=("p99 TTFT", "p99 ITL"), horizontal_spacing=0.1)
    steps = [s for v in trials if v.record is not None for s in v.record.slo_capacity.steps[1:]]
    marked = [(n, role) for n, role in ((baseline, "baseline"), (best, "best")) if n is not None]
    if baseline is not None and baseline == best:
        marked = [(best, "baseline = best")]
    for col, metric in ((1, "p99_ttft_ms"), (2, "p99_itl_ms")):
        drawn = [p.metrics["concurrency"] or 0.0 for _, p in points if p.metrics.get(metric) is not None]
        drawn += [float(s.contexts) for s in steps if getattr(s, metric) is not None]
        x_max = max(drawn, default=1.0) * 1.1 + 1.0
        for phase, symbol in (("measure", "circle"), ("stress", "diamond-open")):
            group = [(v, p) for v, p in points if p.name == phase and p.metrics.get(metric) is not None]
            if not group:
                continue
            fig.add_trace(go.Scatter(
                x=[p.metrics["concurrency"] for _, p in group], y=[p.metrics[metric] for _, p in group],
                mode="markers", name=f"{phase} phase", legendgroup=phase, showlegend=col == 1,
                marker={"symbol": symbol, "size": 11, "color": [CATEGORY_COLORS[category(v)] for v, _ in group],
                        "line": {"width": 1, "color": "#222"}},
                hovertext=[f"trial {v.number} {phase}: {p.metrics[metric]:,.0f} ms at {p.metrics['concurrency']:.1f} "
                           f"in flight, {p.metrics.get('output_throughput') or 0:,.1f} tok/s" for v, p in group],
                hoverinfo="text"), row=1, col=col)
        for number, role in marked:
            mine = [p for v, p in points if v.number == number and p.metrics.get(metric) is not None]
            if mine:
                color = BASELINE_COLOR if role == "baseline" else BEST_COLOR
                fig.add_trace(go.Scatter(
                    x=[p.metrics["concurrency"] for p in mine], y=[p.metrics[metric] for p in mine],
                    mode="markers", name=f"{role} #{number}", legendgroup=role, showlegend=col == 1,
                    marker={"symbol": "circle-open", "size": 21, "color": color, "line": {"width": 3, "color": color}},
                    hoverinfo="skip"), row=1, col=col)
        _bracket_trace(fig, trials, metric, col, best)
        limit = (slo_ms or {}).get("ttft" if col == 1 else "itl")
        if limit:
            name = f"SLO p99 {'TTFT' if col == 1 else 'ITL'} {limit:,.0f} ms"
            fig.add_trace(go.Scatter(x=[0, x_max], y=[limit, limit], mode="lines", name=name, legendgroup=name,
                                     line={"color": BEST_COLOR, "dash": "dash"}, hoverinfo="name"), row=1, col=col)
        fig.update_xaxes(title_text="load: mean requests in flight", range=[0, x_max], row=1, col=col)
        values = [float(v) for v in [p.metrics.get(metric) for _, p in points]
                  + [getattr(s, metric) for s in steps] if v is not None]
        if values and min(values) > 0 and max(values) > 20 * min(values):  # orders of magnitude apart: log
            fig.update_yaxes(title_text="ms (log scale)", type="log", dtick=1, row=1, col=col)
        else:
            fig.update_yaxes(title_text="ms", rangemode="tozero", row=1, col=col)
    known = "SLO dashed" if slo_ms and any(slo_ms.values()) else "SLO unknown: pass --config to draw it"
    verdicts = [line for number, role in marked for v in trials if v.number == number
                if (line := _stress_verdict(v, role, slo_ms))]
    fig.update_layout(
        title=f"Latency against load (each trial's measure and stress phases; {known})<br>"
              "<sup>a stress point above the SLO: the burst of its OOM-safe capacity breaks the SLO; triangles: "
              "steady windows of sessions, the SLO-safe capacity the largest that meets it"
              + "".join(f"<br>{html.escape(line, quote=False)}" for line in verdicts) + "</sup>",
        title_y=0.98, title_yanchor="top",  # the subtitle's lines above the panels' own titles
        height=540 + 24 * len(verdicts), margin={"t": 130 + 24 * len(verdicts)},
        legend={"orientation": "h", "y": -0.22, "x": 0})
    return fig


def _stress_verdict(view: TrialView, role: str, slo_ms: Mapping[str, float | None] | None) -> str:
    """``best #3: stress load TTFT 27,412 ms meets 30,000; ITL 10,210 ms breaks 4,000; SLO-safe 3``,
    each limit judged on its own (p99, ms); ``""`` when the trial ran no stress load. Without known
    limits, the stress load's overall verdict."""
    record = view.record
    stress = next((p for p in record.phases if p.name == "stress"), None) if record is not None else None
    if record is None or stress is None:
        return ""
    parts = []
    for key, metric, name in (("ttft", "p99_ttft_ms", "TTFT"), ("itl", "p99_itl_ms", "ITL")):
        value, limit = stress.metrics.get(metric), (slo_ms or {}).get(key)
        if value is not None and limit:
            parts.append(f"{name} {value:,.0f} ms {'meets' if value <= limit else 'breaks'} {limit:,.0f}")
    if not parts and record.slo_capacity.stress is not None:
        parts.append(f"SLO {'met' if record.slo_capacity.stress.met else 'broken'}")
    safe = record.slo_capacity.contexts
    return (f"{role} #{view.number}: burst admission " + "; ".join(parts)
            + (f"; SLO-safe {safe}" if safe is not None else "")) if parts else ""


def _windows(capacity: Any) -> list[Any]:
    """The SLO-safe capacity's judged windows: every steady one, or a burst-based figure's steps after its burst."""
    return list(capacity.steps) if capacity.measure == "steady" else list(capacity.steps[1:])


def _bracket_trace(fig: go.Figure, trials: Sequence[TrialView], metric: str, col: int, best: int | None) -> None:
    """The SLO-safe capacity's steady windows of each trial (a stored burst-based figure's
    bracketing loads), at their session count, met (filled) or broken (open)."""
    steps = [(v, s) for v in trials if v.record is not None for s in _windows(v.record.slo_capacity)
             if getattr(s, metric) is not None]
    if not steps:
        return
    fig.add_trace(go.Scatter(
        x=[s.contexts for _, s in steps], y=[getattr(s, metric) for _, s in steps],
        mode="markers", name="steady window (sessions)", legendgroup="bracket", showlegend=col == 1,
        marker={"symbol": ["triangle-down" if s.met else "triangle-down-open" for _, s in steps], "size": 11,
                "color": [BEST_COLOR if v.number == best else "#6c757d" for v, _ in steps]},
        hovertext=[html.escape(f"trial {v.number}: {s.contexts} sessions, {getattr(s, metric):,.0f} ms "
                               f"over {s.completed} requests: {'meets' if s.met else 'breaks'} the SLO")
                   for v, s in steps], hoverinfo="text"), row=1, col=col)


# ---- why the winner won -------------------------------------------------------------------------


def pareto_figure(stored: StoredStudy, *, baseline: int | None = None, best: int | None = None) -> go.Figure | str:
    """Context capacity against output throughput of every started trial: feasible ones, the
    feasible Pareto front as a line, infeasible ones faded, and the baseline and the best as large
    labelled markers (no colour scale: colour says feasible or not).

    Returns:
        The figure, or a sentence saying why there is none.
    """
    started = [v for v in stored.trials if v.state == "COMPLETE" and category(v) in ("feasible", "infeasible")
               and v.metric("context_capacity") is not None]
    if not started:
        return "No trial was measured yet."
    fig = go.Figure()
    slo_safe = any(v.record is not None and v.record.slo_capacity.basis == "slo_safe"
                   and v.record.slo_capacity.contexts is not None for v in started)
    metric = "slo_context_capacity" if slo_safe else "context_capacity"

    def capacity(view: TrialView) -> Any:
        """The capacity the study's objective ranked (Optuna's values[0]): the SLO-safe one where measured."""
        return view.record.objective_capacity if view.record is not None else view.metric("context_capacity")

    x_name, y_name = METRICS[metric][0], METRICS["output_throughput_tok_s"][0]
    for cat in ("infeasible", "feasible"):
        group = [v for v in started if category(v) == cat]
        if group:
            fig.add_trace(go.Scatter(
                x=[capacity(v) for v in group], y=[v.metric("output_throughput_tok_s") or 0 for v in group],
                mode="markers", name=cat, opacity=0.55 if cat == "infeasible" else 0.9,
                marker={"color": CATEGORY_COLORS[cat], "size": 10, "symbol": "x" if cat == "infeasible" else "circle"},
                hovertext=[hover(v) for v in group], hoverinfo="text"))
    front = sorted(stored.pareto_front(), key=lambda v: (capacity(v) or 0))
    if front:
        # Both objectives are maximized: the front falls as capacity grows, so the staircase drops
        # first then runs right ("vh"): its corners lie below attained points, never above them.
        fig.add_trace(go.Scatter(
            x=[capacity(v) for v in front], y=[v.metric("output_throughput_tok_s") or 0 for v in front],
            mode="lines", line={"color": "#264653", "shape": "vh", "dash": "dot"}, name="Pareto front (feasible)",
            hoverinfo="skip"))
    marks = [(baseline, "baseline", BASELINE_COLOR, "diamond"), (best, "best", BEST_COLOR, "star")]
    if baseline is not None and baseline == best:  # one marker, one label: the baseline is the best
        marks = [(best, "baseline = best", BEST_COLOR, "star")]
    for number, name, color, symbol in marks:
        view = next((v for v in started if v.number == number), None)
        if view is None:
            continue
        at_right = (capacity(view) or 0) >= max((capacity(v) or 0) for v in started)  # lean the label inwards
        fig.add_trace(go.Scatter(
            x=[capacity(view)], y=[view.metric("output_throughput_tok_s") or 0],
            mode="markers+text", name=f"{name} (trial {view.number})", text=[f"{name} #{view.number}"],
            textposition=("bottom" if name == "baseline" else "top") + (" left" if at_right else " center"),
            cliponaxis=False,
            textfont={"size": 14, "color": color},
            marker={"color": color, "size": 20, "symbol": symbol, "line": {"width": 2, "color": "#fff"}},
            hovertext=[hover(view)], hoverinfo="text"))
    fig.update_layout(title=f"Pareto front: {'SLO-safe' if slo_safe else 'OOM-safe'} context capacity vs output "
                            "throughput", xaxis_title=x_name,
                      yaxis_title=y_name, hovermode="closest")
    return fig
