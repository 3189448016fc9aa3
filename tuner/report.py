"""Rendering of stored results: trial tables, one trial in full, the best trial, and the HTML report.

Reads only what :mod:`tuner.results` loaded from the study (as vLLM's ``sweep/plot.py`` reads only
stored results); it never talks to a server. Terminal output is rich; the HTML report is one
self-contained file with plotly's JavaScript inlined, so it opens offline. Every string that came
from a log or a server is escaped with :func:`html.escape` before it reaches the HTML.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import datetime as dt
import html
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import optuna
import plotly.graph_objects as go
import plotly.offline
from rich import box
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tuner.errors import ConfigError, StudyError
from tuner.results import METRICS, BestTrial, StoredStudy, TrialView, best_trial
from tuner.study.best import max_running_requests_cut
from tuner.study.storage import STUDIES_DIR
from tuner.sglang.failures import STARTUP_MEMORY_FAILURES

__all__ = [
    "check_listen_address",
    "KEY_PARAMS",
    "key_params",
    "trials_table",
    "trials_json",
    "trials_csv",
    "trial_detail",
    "best_panel",
    "studies_table",
    "build_html_report",
    "write_html_report",
    "write_study_report",
    "json_text",
    "trial_json",
    "studies_rows",
    "dashboard_argv",
    "serve_dashboard",
    "applies_table",
    "apply_result",
    "print_fitted",
]

logger = logging.getLogger(__name__)

KEY_PARAMS = (
    "mem_fraction_static",
    "max_running_requests",
    "chunked_prefill_size",
    "enable_hierarchical_cache",
    "hicache_ratio",
)
"""Parameters shown first in tables, by SGLang field name; others follow alphabetically."""

PIPE_MAX_WIDTH = 400
"""Widest output (columns) :func:`print_fitted` renders for a pipe; wider cells fold."""

_TABLE_METRICS = (
    "context_capacity",
    "token_capacity",
    "output_throughput_tok_s",
    "p99_ttft_ms",
    "p99_itl_ms",
)
_PHASE_METRICS = (
    ("request_throughput", "req/s"),
    ("output_throughput", "out tok/s"),
    ("goodput", "goodput req/s"),
    ("p99_ttft_ms", "p99 TTFT ms"),
    ("p99_itl_ms", "p99 ITL ms"),
    ("p99_tpot_ms", "p99 TPOT ms"),
    ("p99_e2e_latency_ms", "p99 E2E ms"),
    ("concurrency", "concurrency"),
    ("slo_attainment", "SLO attain."),
    ("error_rate", "error rate"),
)


def print_fitted(renderable: RenderableType, *, markup: bool = True) -> None:
    """Print to stdout: on a terminal (or with ``COLUMNS`` set) at its width; otherwise (a pipe, a
    CI log) at the width the content needs, up to :data:`PIPE_MAX_WIDTH` columns, so that tables
    are neither truncated (``210…``) nor wrapped mid-word at rich's default of 80 columns.

    Args:
        renderable: A rich renderable or a string.
        markup: Whether a string is read as rich markup.
    """
    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        options = console.options.update(max_width=PIPE_MAX_WIDTH)
        needed = Measurement.get(console, options, renderable).maximum
        console = Console(width=max(console.width, min(needed, PIPE_MAX_WIDTH)))
    console.print(renderable, markup=markup)


def key_params(trials: Iterable[TrialView]) -> list[str]:
    """Parameter columns: :data:`KEY_PARAMS` present in any trial, then (sorted) every other
    parameter that takes at least two distinct values (a flag only the baseline states is not a
    column; ``tuner show`` lists every parameter)."""
    values: dict[str, set[str]] = {}
    for view in trials:
        for name, value in view.params.items():
            values.setdefault(name, set()).add(repr(value))
    others = sorted(n for n, seen in values.items() if n not in KEY_PARAMS and len(seen) > 1)
    return [p for p in KEY_PARAMS if p in values] + others


def _cell(value: Any) -> str:
    """Format one value for a table cell: ``-`` for unknown, thousands separators, 3 sig. digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def _text(value: Any) -> Text:
    """A table cell as plain :class:`Text`: log and server strings are never read as rich markup."""
    return Text(value if isinstance(value, str) else _cell(value))


def _status(view: TrialView) -> str:
    """Why a trial is not feasible: its failure class, ``skipped``, or the violated constraints."""
    if view.failure_class:
        return view.failure_class
    if view.record is not None and (view.record.failure_evidence or "").startswith("interrupted"):
        return "interrupted"
    if view.state == "RUNNING":
        return "running, or killed (`tuner run` resumes it)"
    if view.outcome == "skipped" or view.state == "PRUNED":
        return "skipped"
    if view.feasible or view.state != "COMPLETE":
        return ""
    return ",".join(k for k, v in view.constraints.items() if v > 0) or "infeasible"


def _kind(view: TrialView) -> str:
    kind = view.kind or "-"
    return kind if view.state == "COMPLETE" else f"{kind}/{view.state.lower()}"


_SHORT = MappingProxyType({
    "mem_fraction_static": "mfs",
    "max_running_requests": "max_run",
    "chunked_prefill_size": "chunk",
    "enable_hierarchical_cache": "hicache",
    "hicache_ratio": "hc_ratio",
    "context_capacity": "ctx cap",
    "token_capacity": "tokens",
    "output_throughput_tok_s": "tok/s",
    "p99_ttft_ms": "TTFT p99",
    "p99_itl_ms": "ITL p99",
})
"""Column headers of the compact trial table (the caption spells them out)."""


def trials_table(trials: Sequence[TrialView], *, title: str | None = None) -> Table:
    """The ``tuner trials`` table: number, state, kind, key params, capacities, throughput, p99
    TTFT/ITL, feasible, failure class (or which constraint failed).

    Headers are short (:data:`_SHORT`); the caption maps them to SGLang field names and units.
    """
    params = key_params(trials)
    used = [p for p in params if p in _SHORT] + list(_TABLE_METRICS)
    legend = ", ".join(f"{_SHORT[k]} = {k}" for k in used)
    table = Table(
        title=title,
        caption=f"{legend}; latencies in ms; ctx cap in requests",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        collapse_padding=True,
        pad_edge=False,
    )
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    for name in params:
        table.add_column(_SHORT.get(name, name), justify="right")
    for name in _TABLE_METRICS:
        table.add_column(_SHORT[name], justify="right")
    table.add_column("feas.")
    table.add_column("failure", overflow="fold")
    for view in trials:
        style = None if view.feasible else ("red" if view.failed else "yellow")
        table.add_row(
            str(view.number),
            _kind(view),
            *[_text(view.params.get(p)) for p in params],
            *[_text(view.metric(m)) for m in _TABLE_METRICS],
            "yes" if view.feasible else "no",
            _text(_status(view)),
            style=style,
        )
    return table


def trials_json(trials: Sequence[TrialView]) -> str:
    """``tuner trials --json``: a JSON list of :meth:`TrialView.row` objects."""
    return json_text([v.row() for v in trials])


def json_text(data: Any) -> str:
    """Indented JSON of a JSON-ready object (what every ``--json`` prints)."""
    return json.dumps(data, indent=2, default=str)


def trial_json(stored: StoredStudy, view: TrialView) -> str:
    """``tuner show N --json``: the summary row, the whole record, and artifact paths."""
    data = view.row()
    data["record"] = view.record.model_dump(mode="json") if view.record else None
    data["artifact_paths"] = {k: str(p) for k, p in stored.artifact_paths(view).items()}
    return json_text(data)


def trials_csv(trials: Sequence[TrialView]) -> str:
    """``tuner trials --csv``: one row per trial; params as ``param.<name>`` columns."""
    params = key_params(trials)
    fields = ["number", "state", "kind", "outcome", *[f"param.{p}" for p in params], *METRICS]
    fields += ["feasible", "failure_class", "started_at"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for view in trials:
        row = view.row()
        out = {k: row.get(k) for k in fields if not k.startswith("param.")}
        out.update({f"param.{p}": view.params.get(p) for p in params})
        writer.writerow(out)
    return buf.getvalue()


def _kv_table(title: str, rows: Iterable[tuple[str, Any]], *headers: str) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold", show_header=bool(headers))
    for i, header in enumerate(headers or ("key", "value")):
        table.add_column(header, justify="left" if i == 0 else "right", overflow="fold")
    for row in rows:
        table.add_row(*[_text(v) for v in row])
    return table


def _memory_rows(memory: dict[str, Any]) -> list[tuple[str, Any]]:
    """Flatten a stored memory report (per-rank dicts, nested values) into label/value rows."""
    rows: list[tuple[str, Any]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, sub in enumerate(value):
                walk(f"{prefix}[{i}]", sub)
        else:
            rows.append((prefix, value if not isinstance(value, list) else json.dumps(value)))

    walk("", memory)
    return rows


def _waterfall(memory: dict[str, Any]) -> Any:
    """The memory waterfall of ``tuner explain`` when :mod:`tuner.sglang.explain` can render a
    stored memory report, else a flat table of the report's fields."""
    try:
        from tuner.sglang import explain  # optional: owned by the SGLang-knowledge issue
    except ImportError:
        explain = None
    render = getattr(explain, "waterfall_table", None) if explain is not None else None
    if render is not None:
        try:
            return render(memory)
        except (TypeError, ValueError, KeyError) as err:
            logger.debug("explain.waterfall_table could not render the stored report: %s", err)
    return _kv_table("memory (as stored)", _memory_rows(memory), "field", "value")


def _phases_table(view: TrialView) -> Table:
    """Load phases as columns, metrics as rows (fits a narrow terminal)."""
    assert view.record is not None
    phases = view.record.phases
    table = Table(title="load phases", title_justify="left", header_style="bold")
    table.add_column("metric")
    for phase in phases:
        table.add_column(phase.name, justify="right")
    table.add_row("duration (s)", *[_cell(p.duration_s) for p in phases])
    table.add_row("completed / errored / incomplete",
                  *[f"{p.completed} / {p.errored} / {p.incomplete}" for p in phases])  # fmt: skip
    for key, label in _PHASE_METRICS:
        table.add_row(label, *[_cell(p.metrics.get(key)) for p in phases])
    table.add_row(
        "stopped early",
        *[_text((p.stop_reason or "yes") if p.stopped_early else "no") for p in phases],
    )
    return table


def trial_detail(stored: StoredStudy, view: TrialView) -> Group:
    """``tuner show N``: params, resolved values, the memory waterfall, each load phase, the
    failure and its evidence, the log excerpt, and artifact paths."""
    rec = view.record
    head = Text()
    head.append(f"trial {view.number}", style="bold")
    head.append(f"  {view.state}  kind={view.kind or '-'}  outcome={view.outcome or '-'}  ")
    head.append("feasible" if view.feasible else "infeasible", "green" if view.feasible else "red")
    if view.started_at:
        head.append(f"  started {view.started_at}")
    if rec and rec.duration_s is not None:
        head.append(f"  took {rec.duration_s:.0f} s")
    parts: list[Any] = [head]
    parts.append(_kv_table("params", sorted(view.params.items()), "SGLang field", "value"))
    metrics = [(METRICS[m][0], view.metric(m)) for m in METRICS]
    metrics.append(("constraints (≤ 0 is met)", json.dumps(view.constraints)))
    parts.append(_kv_table("results", metrics, "metric", "value"))
    if rec is None:
        parts.append(Text("no tuner record stored with this trial", style="yellow"))
        return Group(*parts)
    if rec.resolved:
        rows = [(k, v.get("value"), str(v.get("source", "?"))) for k, v in rec.resolved.items()]
        parts.append(_kv_table("resolved by SGLang", rows, "field", "value", "source"))
    if rec.prediction:
        parts.append(_kv_table("memory-model prediction", _memory_rows(rec.prediction)))
    if rec.memory:
        parts.append(_waterfall(rec.memory))
    if rec.phases:
        parts.append(_phases_table(view))
    if rec.failure_class or rec.failure_evidence:
        text = Text("failure: ", style="bold red")
        text.append(rec.failure_class.value if rec.failure_class else "?")
        if rec.failure_evidence:
            text.append("\nevidence: ", style="bold")
            text.append(rec.failure_evidence)
        parts.append(text)
    if rec.skipped_reason:
        proof = f" (proved by trial {rec.proved_by_trial})" if rec.proved_by_trial is not None else ""
        parts.append(Text(f"skipped: {rec.skipped_reason}{proof}", style="yellow"))
    if rec.argv:
        parts.append(Panel(Text(" ".join(rec.argv)), title="command line", title_align="left"))
    if rec.log_excerpt:
        parts.append(
            Panel(Text("\n".join(rec.log_excerpt)), title="log excerpt", title_align="left")
        )
    if rec.artifacts:
        rows = []
        for name, path in stored.artifact_paths(view).items():
            rows.append((name, str(path) + ("" if path.exists() else "  (missing)")))
        parts.append(_kv_table("artifacts", rows, "name", "path"))
    return Group(*parts)


def _delta_text(name: str, delta: Any) -> str:
    if delta.delta is None:
        return "-"
    sign = "+" if delta.delta >= 0 else ""
    ratio = f" ({delta.ratio:.2f}×)" if delta.ratio is not None else ""
    return f"{sign}{_cell(delta.delta)}{ratio}"


def best_panel(choice: BestTrial) -> Group:
    """``tuner best``: the feasible Pareto front, the chosen trial with the reason, and the deltas
    against the baseline."""
    front = trials_table(choice.front, title="Pareto front (feasible trials)")
    reason = Text()
    reason.append("best: ", style="bold green")
    reason.append(choice.reason)
    deltas = Table(title="chosen vs baseline", title_justify="left", header_style="bold")
    deltas.add_column("metric")
    base_title = f"baseline (#{choice.baseline.number})" if choice.baseline else "baseline"
    deltas.add_column(base_title, justify="right")
    deltas.add_column(f"best (#{choice.trial.number})", justify="right")
    deltas.add_column("change", justify="right")
    for name, delta in choice.deltas.items():
        deltas.add_row(
            METRICS[name][0], _cell(delta.baseline), _cell(delta.best), _delta_text(name, delta)
        )
    params = Table(title="flags of the chosen trial", title_justify="left", header_style="bold")
    params.add_column("SGLang field")
    params.add_column("baseline", justify="right")
    params.add_column("best", justify="right")
    base_params = choice.baseline.params if choice.baseline else {}
    for name in key_params([choice.trial] + ([choice.baseline] if choice.baseline else [])):
        params.add_row(
            name, _cell(base_params.get(name)), _cell(choice.trial.params.get(name))
        )
    parts: list[Any] = [front, reason, params, deltas]
    cut = max_running_requests_cut(choice.trial.record, choice.baseline.record if choice.baseline else None)
    if cut is not None:
        parts.append(Text(cut, style="yellow"))
    if choice.baseline is None:
        parts.append(Text("the study has no baseline trial to compare with", style="yellow"))
    return Group(*parts)


def studies_rows(
    by_storage: dict[str, Sequence[optuna.study.StudySummary]],
) -> list[dict[str, Any]]:
    """``tuner studies --json``: storage, study, trials, started, target, model per study."""
    rows = []
    for url, summaries in by_storage.items():
        for summary in summaries:
            info = summary.user_attrs.get("tuner.study") or {}
            rows.append(
                {
                    "storage": url,
                    "study": summary.study_name,
                    "n_trials": summary.n_trials,
                    "started": summary.datetime_start.isoformat(timespec="seconds")
                    if summary.datetime_start
                    else None,
                    "target": info.get("target") if isinstance(info, dict) else None,
                    "model": (info.get("environment") or {}).get("model")
                    if isinstance(info, dict)
                    else None,
                }
            )
    return rows


def dashboard_argv(storage_url: str, *, host: str, port: int) -> list[str]:
    """The ``optuna-dashboard`` command for a storage (the script next to this Python, else
    ``python -m optuna_dashboard``)."""
    script = Path(sys.executable).with_name("optuna-dashboard")
    head = [str(script)] if script.is_file() else [sys.executable, "-m", "optuna_dashboard"]
    return [*head, storage_url, "--host", host, "--port", str(port)]


def check_listen_address(host: str, port: int) -> None:
    """Check that a server can listen on ``host:port`` by binding it once and closing it.

    The bind uses ``SO_REUSEADDR`` as the dashboard's HTTP server does, so a port held only by
    closed connections passes and a port another program listens on fails.

    Raises:
        ConfigError: The port is in use, out of range, or the host is not a local address.
    """
    if not 0 < port < 65536:
        raise ConfigError(f"--port {port} is not a TCP port", hint="pass --port between 1 and 65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--port {port} on {host} is already in use by another program",
                hint="pass --port with a free port, or stop the program holding it",
            ) from err
        raise ConfigError(
            f"cannot listen on --host {host} --port {port}: {err.strerror or err}",
            hint="pass a local address as --host (e.g. 127.0.0.1) and a free --port",
        ) from err


def serve_dashboard(storage_url: str, *, host: str, port: int, stop_timeout_s: float = 10.0) -> int | None:
    """Run optuna-dashboard (:func:`dashboard_argv`) until it exits, Ctrl-C or SIGTERM.

    The dashboard runs as a child in its own session, so a terminal's Ctrl-C reaches only this
    process, which then stops the child's process group (SIGTERM, ``stop_timeout_s``, SIGKILL):
    no KeyboardInterrupt traceback from the child, and no child left behind.

    Args:
        storage_url: The Optuna storage URL (checked by the caller).
        host: Address to listen on.
        port: Port to listen on.
        stop_timeout_s: How long the dashboard may take to exit after SIGTERM.

    Returns:
        The dashboard's exit status when it ended by itself; ``None`` when it was stopped.

    Raises:
        ConfigError: ``host:port`` cannot be listened on (see :func:`check_listen_address`).
    """
    from tuner.launch.safety import interrupt_on_signals

    check_listen_address(host, port)
    child = subprocess.Popen(dashboard_argv(storage_url, host=host, port=port), start_new_session=True)
    try:
        with interrupt_on_signals():
            return child.wait()
    except KeyboardInterrupt:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=stop_timeout_s)
        return None


def studies_table(summaries: Sequence[optuna.study.StudySummary], storage_url: str) -> Table:
    """``tuner studies``: name, trials, started, and the tuner's target of each study."""
    table = Table(title=f"studies in {storage_url}", header_style="bold")
    for header in ("study", "trials", "started", "target", "model"):
        table.add_column(header, justify="right" if header == "trials" else "left")
    for summary in summaries:
        info = summary.user_attrs.get("tuner.study") or {}
        target = info.get("target", {}) if isinstance(info, dict) else {}
        env = info.get("environment", {}) if isinstance(info, dict) else {}
        started = summary.datetime_start.isoformat(timespec="seconds") if summary.datetime_start else "-"
        command = target.get("command")
        shown = target.get("unit") or (" ".join(command) if isinstance(command, list) else command)
        table.add_row(
            _text(summary.study_name),
            str(summary.n_trials),
            started,
            _text(str(shown or target.get("url") or "-")),
            _text(str(env.get("model") or "-")),
        )
    return table


# ---- HTML report ---------------------------------------------------------------------------

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
    heads = ["#", "state", "kind", *params, *[METRICS[m][0] for m in _TABLE_METRICS]]
    heads += ["feasible", "failure"]
    out = ['<div style="overflow-x:auto"><table><thead><tr>']
    out += [f"<th>{html.escape(h)}</th>" for h in heads]
    out.append("</tr></thead><tbody>")
    for view in stored.trials:
        cells = [str(view.number), view.state, view.kind or "-"]
        cells += [_cell(view.params.get(p)) for p in params]
        cells += [_cell(view.metric(m)) for m in _TABLE_METRICS]
        cells += ["yes" if view.feasible else "no", _status(view)]
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
        f"generated {html.escape(dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds'))}</p>"
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
            row = [METRICS[name][0], _cell(delta.baseline), _cell(delta.best), _delta_text(name, delta)]
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
    text = build_html_report(stored, best, best_error)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
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
    return write_html_report(stored, output or STUDIES_DIR / f"{stored.name}-report.html", best, why)


# ---- applies -----------------------------------------------------------------------------


def applies_table(records: Sequence[Any]) -> Table:
    """``tuner applies``: every apply, undo and rollback with its outcome (newest last)."""
    table = Table(title="applies", header_style="bold", box=box.SIMPLE_HEAD)
    for header in ("#", "at", "action", "study", "trial", "target", "outcome", "what happened"):
        table.add_column(header, justify="right" if header in ("#", "trial") else "left",
                         overflow="fold")
    for rec in records:
        style = "green" if rec.outcome == "verified" else ("red" if "fail" in rec.outcome else "yellow")
        table.add_row(
            str(rec.id), rec.at, rec.action, rec.study, _cell(rec.trial), rec.target,
            Text(rec.outcome, style=style), Text(rec.message),
        )
    return table


def apply_result(record: Any) -> Group:
    """The outcome of one apply: its message and each verification check."""
    parts: list[Any] = [Text(f"#{record.id} {record.action}: {record.message}", style="bold green")]
    for check in record.checks:
        line = Text(f"  {'ok ' if check.ok else 'FAIL'} {check.name}: ", style="green" if check.ok else "red")
        line.append(check.detail, style="")
        parts.append(line)
    return Group(*parts)
