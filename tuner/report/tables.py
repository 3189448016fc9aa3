"""Terminal rendering of stored results (rich): trial tables, one trial in full, the best trial,
the studies, the applies, and ``tuner run``'s closing summary.

Reads only what :mod:`tuner.results` loaded from the study; it never talks to a server.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import optuna
from rich import box
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tuner.load import LoadSummary, MaxLoadResult
from tuner.results import (
    METRICS,
    BestTrial,
    CacheEffect,
    StoredStudy,
    TrialView,
    cache_effect,
    lever_lines,
    status_text,
)
from tuner.study.best import admission_line, max_running_requests_cut
from tuner.study.space import KNOBS
from tuner.study.storage import display_url
from tuner.study.warm import WARM_ATTR

__all__ = ["KEY_PARAMS", "TABLE_METRICS", 'key_params', 'print_fitted', 'cell', 'quality_text', 'quality_rows', 'delta_text', 'trials_table', 'trials_json', 'trials_csv', 'trial_detail', 'terminal_safe', 'trial_json', 'json_text', 'best_panel', 'studies_rows', 'studies_table', 'warm_text', 'applies_table', 'apply_result']

logger = logging.getLogger(__name__)

KEY_PARAMS = tuple(knob.name for knob in KNOBS if knob.shown_first)
"""Parameters shown first in tables, by SGLang field name (the knob table's
:attr:`~tuner.study.space.Knob.shown_first`); others follow alphabetically."""

PIPE_MAX_WIDTH = 400
"""Widest output (columns) :func:`print_fitted` renders for a pipe; wider cells fold."""

TABLE_METRICS = (
    "context_capacity",
    "slo_context_capacity",
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


def cell(value: Any) -> str:
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
    return Text(value if isinstance(value, str) else cell(value))


def quality_text(view: TrialView) -> str:
    """The quality gate of a trial in a few words: ``-`` (the baseline's numerics, or stored
    before the gate), ``reference`` (its answers are the study's reference), ``pass 88% @32``
    (exact-match share, first divergence; ``cached #10`` when an earlier probe of the same
    numerics decided), ``FAIL 0% @0``, ``unprobed``."""
    facts = view.record.quality if view.record is not None else None
    if facts is None or facts.status in (None, "same"):
        return "-"
    if facts.status in ("reference", "unprobed"):
        return str(facts.status)
    text = "pass" if facts.status == "passed" else "FAIL"
    if facts.exact_match_share is not None:
        text += f" {facts.exact_match_share:.0%}"
    if facts.first_divergence is not None:
        text += f" @{facts.first_divergence}"
    if facts.probed_on_trial is not None and facts.probed_on_trial != view.number:
        text += f" (#{facts.probed_on_trial})"
    return text


def quality_rows(view: TrialView) -> list[tuple[str, Any]]:
    """``tuner show``'s quality-gate rows (empty when the trial has no quality facts)."""
    facts = view.record.quality if view.record is not None else None
    if facts is None or facts.status is None:
        return []
    rows: list[tuple[str, Any]] = [("verdict", facts.status), ("numerics", ", ".join(f"{k}={v}" for k, v in facts.numerics.items()) or "SGLang's defaults"),
                                   ("changes vs the baseline", ", ".join(facts.changes) or "none")]
    for label, value in (("exact-match share", facts.exact_match_share), ("first divergence (token)", facts.first_divergence),
                         ("mean |Δ logprob| (nats)", facts.mean_abs_logprob_delta), ("task accuracy", facts.task_accuracy),
                         ("baseline task accuracy", facts.reference_task_accuracy), ("prompts", facts.prompts),
                         ("probed on trial", facts.probed_on_trial), ("reference trial", facts.reference_trial),
                         ("probe time (s)", facts.probe_s), ("reason", facts.reason)):
        if value is not None:
            rows.append((label, value))
    return rows


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
    "slo_context_capacity": "SLO cap",
    "token_capacity": "tokens",
    "output_throughput_tok_s": "tok/s",
    "p99_ttft_ms": "TTFT p99",
    "p99_itl_ms": "ITL p99",
})
"""Column headers of the compact trial table (the caption spells them out)."""


def trials_table(trials: Sequence[TrialView], *, title: str | None = None) -> Table:
    """The ``tuner trials`` table: number, host (when the study's trials ran on more than one),
    kind, key params, capacities, throughput, p99 TTFT/ITL, and a status: ``feasible``, else the
    failure class (or which constraint failed).

    Headers are short (:data:`_SHORT`); the caption maps them to SGLang field names and units.
    """
    params = key_params(trials)
    used = [p for p in params if p in _SHORT] + list(TABLE_METRICS)
    legend = ", ".join(f"{_SHORT[k]} = {k}" for k in used)
    table = Table(
        title=title,
        caption=f"{legend}; latencies in ms; ctx cap: longest contexts that fit without OOM, SLO cap: "
                "closed-loop sessions at which the SLO's p99 still holds in a steady window (measured)",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        padding=(0, 0),  # the box's column separator is the one space between columns: fits 80 columns
        collapse_padding=True,
        pad_edge=False,
    )
    def column(header: str, **kw: Any) -> None:
        # a narrow terminal may wrap a header at its spaces ("ctx cap", "TTFT p99"), never cut a
        # word of it ("max_…"): each column is at least as wide as the header's longest word
        # and a header of two words is two lines, so it does not ask for the width of both
        table.add_column(header.replace(" ", "\n"), min_width=max(len(w) for w in header.split()), **kw)

    hosts = len({v.host for v in trials if v.host}) > 1  # a study shared by many hosts
    gated = any(v.record is not None and v.record.quality.changes for v in trials)  # a numerics change
    column("#", justify="right", no_wrap=True)
    if hosts:
        column("host", no_wrap=True)
    column("kind", no_wrap=True)
    for name in params:
        column(_SHORT.get(name, name), justify="right")
    for name in TABLE_METRICS:
        column(_SHORT[name], justify="right")
    if gated:
        column("quality", overflow="fold")
    column("status", overflow="fold")
    for view in trials:
        style = None if view.feasible else ("red" if view.failed else "yellow")
        table.add_row(
            str(view.number),
            *([view.host or "-"] if hosts else []),
            _kind(view),
            *[_text(view.params.get(p)) for p in params],
            *[_text(view.metric(m)) for m in TABLE_METRICS],
            *([_text(quality_text(view))] if gated else []),
            _text("feasible" if view.feasible else (status_text(view) or "infeasible")),
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
    fields += ["feasible", "failure_class", "skipped_reason", "started_at", "host", "quality"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for view in trials:
        row = view.row()
        out = {k: row.get(k) for k in fields if not k.startswith("param.")}
        out.update({f"param.{p}": view.params.get(p) for p in params}, quality=quality_text(view))
        writer.writerow(out)
    return buf.getvalue()


def _kv_table(title: str, rows: Iterable[tuple[Any, ...]], *headers: str) -> Table:
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
    """The memory waterfall of ``tuner explain`` for a stored memory report, else a flat table of
    the report's fields (a report stored by an older version that does not validate)."""
    from tuner.report.explain import waterfall_table

    try:
        return waterfall_table(memory)
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
    table.add_row("duration (s)", *[cell(p.duration_s) for p in phases])
    table.add_row("completed / errored / incomplete",
                  *[f"{p.completed} / {p.errored} / {p.incomplete}" for p in phases])  # fmt: skip
    for key, label in _PHASE_METRICS:
        table.add_row(label, *[cell(p.metrics.get(key)) for p in phases])
        if key in ("p99_ttft_ms", "p99_itl_ms"):
            table.add_row(f"  95 % interval, over n ({label.split()[1]})", *[_p99_interval(p, key) for p in phases])

    # Speculative decoding: tokens per verify step, pooled and per prompt class (LoadSummary).
    spec_keys = sorted({k for p in phases for k in p.metrics if k.startswith("accept_length")})
    for key in spec_keys:
        label = "accept length" + (f" ({key.removeprefix('accept_length_')})" if key != "accept_length" else "")
        table.add_row(label, *[cell(p.metrics.get(key)) for p in phases])
    table.add_row(
        "stopped early",
        *[_text((p.stop_reason or "yes") if p.stopped_early else "no") for p in phases],
    )
    return table


def _p99_interval(phase: Any, key: str) -> str:
    """``1,900-∞ over 49``: the p99's 95 % order-statistic interval (ms; ``∞``: too few samples to
    bound it from above) and the requests (TTFT) or token gaps (ITL) it is over; ``-`` when not
    recorded (a phase stored before intervals were)."""
    low = phase.metrics.get(key.replace("_ms", "_low_ms"))
    high = phase.metrics.get(key.replace("_ms", "_high_ms"))
    n = phase.completed if key == "p99_ttft_ms" else phase.metrics.get("itl_count")
    if low is None or n is None:
        return "-"
    return f"{low:,.0f}-{'∞' if high is None else f'{high:,.0f}'} over {int(n)}"


_CONTROL = re.compile(
    r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"   # OSC (window title, hyperlink) to BEL or ST
    r"|\x1b[P^_X][^\x1b]*(?:\x1b\\)?"         # DCS, PM, APC, SOS strings
    r"|\x1b\[[0-?]*[ -/]*[@-~]"               # CSI (colours, cursor moves, clear screen)
    r"|\x1b[ -/]*[0-~]?"                       # other escapes (charset, keypad, a lone ESC)
    r"|\x9b[0-?]*[ -/]*[@-~]"                  # 8-bit CSI
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]"         # the other C0/C1 controls (tab and newline stay)
)


def terminal_safe(text: str) -> str:
    """``text`` without terminal control sequences (ANSI colours, OSC titles and hyperlinks, cursor
    moves, backspaces): server text (log lines, evidence, argv) must never drive the terminal."""
    return _CONTROL.sub("", text)


def trial_detail(stored: StoredStudy, view: TrialView) -> Group:  # noqa: C901 - over the complexity ceiling when it was set (15); it only goes down
    """``tuner show N``: params, resolved values, the memory waterfall, each load phase, the
    failure and its evidence, the log excerpt, and artifact paths."""
    rec = view.record
    head = Text()
    head.append(f"trial {view.number}", style="bold")
    head.append(f"  {view.state}  kind={view.kind or '-'}  outcome={view.outcome or '-'}  ")
    head.append("feasible" if view.feasible else "infeasible", "green" if view.feasible else "red")
    if view.host:
        head.append(f"  host {view.host}")
    if view.started_at:
        head.append(f"  started {view.started_at}")
    if rec and rec.duration_s is not None:
        head.append(f"  took {rec.duration_s:.0f} s")
    parts: list[Any] = [head]
    parts.append(_kv_table("params", sorted(view.params.items()), "SGLang field", "value"))
    metrics = [(METRICS[m][0], view.metric(m)) for m in METRICS]
    metrics.append(("constraints (≤ 0 is met)", ", ".join(f"{k} {cell(v)}" for k, v in view.constraints.items())))
    parts.append(_kv_table("results", metrics, "metric", "value"))
    if rec is not None and rec.slo_capacity.limits:
        parts.append(_capacity_text(rec))
    parts.extend(Text(line) for line in lever_lines(stored.trials, view, stored.baseline()))
    if view.state == "FAIL":
        parts.append(_failed_note(stored, view))
    if rec is None:
        parts.append(Text("no tuner record stored with this trial", style="yellow"))
        return Group(*parts)
    if rec.resolved:
        rows: list[tuple[Any, ...]] = [(k, v.get("value"), str(v.get("source", "?"))) for k, v in rec.resolved.items()]
        parts.append(_kv_table("resolved by SGLang", rows, "field", "value", "source"))
    if rec.prediction.stored():
        parts.append(_kv_table("memory-model prediction", _memory_rows(rec.prediction.stored())))
    if rec.memory.stored():
        parts.append(_waterfall(rec.memory.stored()))
    if rec.phases:
        parts.append(_phases_table(view))
    if quality := quality_rows(view):
        parts.append(_kv_table("quality gate (answers vs the baseline's)", quality, "figure", "value"))
    effect = cache_effect(stored, view)
    if effect is not None:
        parts.append(_cache_table(effect))
    if rec.failure_class or rec.failure_evidence:
        text = Text("failure: ", style="bold red")
        text.append(rec.failure_class.value if rec.failure_class else "?")
        if rec.failure_evidence:
            text.append("\nevidence: ", style="bold")
            text.append(terminal_safe(rec.failure_evidence))
        parts.append(text)
    if rec.skipped_reason:
        proof = f" (proved by trial {rec.proved_by_trial})" if rec.proved_by_trial is not None else ""
        parts.append(Text(f"skipped: {rec.skipped_reason}{proof}", style="yellow"))
    if rec.argv:
        parts.append(Panel(Text(terminal_safe(" ".join(rec.argv))), title="command line", title_align="left"))
    if rec.log_excerpt:
        parts.append(
            Panel(Text(terminal_safe("\n".join(rec.log_excerpt))), title="log excerpt", title_align="left")
        )
    if rec.artifacts:
        rows = []
        for name, path in stored.artifact_paths(view).items():
            rows.append((name, str(path) + ("" if path.exists() else "  (missing)")))
        parts.append(_kv_table("artifacts", rows, "name", "path"))
    return Group(*parts)


def _capacity_text(rec: Any) -> Text:
    """Both context capacities, the burst admission's SLO verdict, what the config admits against
    what holds the SLO, and which capacity the objective used."""
    slo = rec.slo_capacity
    text = Text("context capacity: ", style="bold")
    text.append(f"OOM-safe {cell(rec.context_capacity)}; SLO-safe {slo.describe()}")
    stress = slo.stress
    if stress is not None:
        text.append("\nburst admission (the OOM stress): ", style="bold")
        text.append(f"{stress.contexts} longest contexts at once "
                    + ("meet the SLO" if stress.met else "break the SLO"),
                    "green" if stress.met else "yellow")
    admits = admission_line(rec)
    if admits is not None:
        text.append("\nadmission: ", style="bold")
        text.append(admits)
    label = "SLO-safe" if slo.basis == "slo_safe" else "OOM-safe"
    text.append(f"\nthe study's objective used the {label} capacity ({cell(rec.objective_capacity)})")
    return text


def _failed_note(stored: StoredStudy, view: TrialView) -> Text:
    """Why a FAIL trial has no result, and the trial that ran its params again (if any)."""
    rec = view.record
    why = (rec.failure_evidence if rec is not None and rec.failure_evidence else
           "no result was stored: the run that held it was killed, or its host stopped beating for the "
           "grace period and another host marked it FAIL")
    again = stored.rerun_of(view.number)
    text = Text("marked FAIL: ", style="bold yellow")
    text.append(terminal_safe(why))
    text.append(f"; its params were run again as trial {again} (`tuner show {again}`)" if again is not None
                else "; its params were not run again (yet)")
    return text


def _cache_table(effect: CacheEffect) -> Table:
    """The prefix cache's tiers, the host pool, and the same flags without the cache (§7)."""
    pct = lambda x: None if x is None else f"{x:.1%}"  # noqa: E731
    rows: list[tuple[str, Any]] = [("hit rate (all tiers)", pct(effect.hit_rate))]
    if effect.host_hit_rate is not None:
        rows += [("  device tier", pct(effect.device_hit_rate)), ("  host tier", pct(effect.host_hit_rate))]
        if effect.storage_hit_rate is not None:
            rows.append(("  storage tier", pct(effect.storage_hit_rate)))
        rows.append(("  source", effect.hit_rate_source))
    if effect.hicache:
        if effect.host_pool_gb is not None:
            rows.append(("host pool pinned", f"{effect.host_pool_gb_per_rank:g} GB × {effect.host_pool_ranks} ranks = "
                                             f"{effect.host_pool_gb:g} GB"))
        if effect.without is None:
            rows.append(("without the cache", "no measured trial of the same flags"))
        else:
            rows.append((f"p99 TTFT ms (without → with, trial {effect.without})",
                         f"{cell(effect.without_p99_ttft_ms)} → {cell(effect.p99_ttft_ms)}"))
            rows.append(("output tok/s (without → with)",
                         f"{cell(effect.without_output_throughput_tok_s)} → {cell(effect.output_throughput_tok_s)}"))
    return _kv_table("prefix cache (hierarchical cache: " + ("on" if effect.hicache else "off") + ")", rows,
                     "metric", "value")


def delta_text(name: str, delta: Any) -> str:
    if delta.delta is None:
        return "-"
    sign = "+" if delta.delta >= 0 else ""
    ratio = f" ({delta.ratio:.2f}×)" if delta.ratio is not None else ""
    return f"{sign}{cell(delta.delta)}{ratio}"


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
            METRICS[name][0], cell(delta.baseline), cell(delta.best), delta_text(name, delta)
        )
    params = Table(title="flags of the chosen trial", title_justify="left", header_style="bold")
    params.add_column("SGLang field")
    params.add_column("baseline", justify="right")
    params.add_column("best", justify="right")
    base_params = choice.baseline.params if choice.baseline else {}
    for name in key_params([choice.trial] + ([choice.baseline] if choice.baseline else [])):
        params.add_row(
            name, cell(base_params.get(name)), cell(choice.trial.params.get(name))
        )
    parts: list[Any] = [front, reason, params, deltas]
    facts = choice.trial.record.quality if choice.trial.record is not None else None
    if facts is not None and facts.changes:
        parts.append(Text(f"quality gate: {quality_text(choice.trial)} ({', '.join(facts.changes)} changed; "
                          f"mean |Δ logprob| {cell(facts.mean_abs_logprob_delta)} nats)"))
    parts.extend(Text(note) for note in choice.notes)
    if choice.cache is not None:
        parts.append(Text(choice.cache.describe()))
    cut = max_running_requests_cut(choice.trial.record, choice.baseline.record if choice.baseline else None)
    if cut is not None:
        parts.append(Text(cut, style="yellow"))
    if choice.baseline is None:
        parts.append(Text("the study has no baseline trial to compare with", style="yellow"))
    return Group(*parts)


def studies_rows(
    by_storage: Mapping[str, Sequence[optuna.study.StudySummary]],
) -> list[dict[str, Any]]:
    """``tuner studies --json``: storage, study, trials, started, target, model per study."""
    rows = []
    for url, summaries in by_storage.items():
        for summary in summaries:
            info = summary.user_attrs.get("tuner.study") or {}
            rows.append(
                {
                    "storage": display_url(url),
                    "study": summary.study_name,
                    "n_trials": summary.n_trials,
                    "started": summary.datetime_start.isoformat(timespec="seconds")
                    if summary.datetime_start
                    else None,
                    "target": info.get("target") if isinstance(info, dict) else None,
                    "model": (info.get("environment") or {}).get("model")
                    if isinstance(info, dict)
                    else None,
                    "warm_start": summary.user_attrs.get(WARM_ATTR),
                }
            )
    return rows


def studies_table(summaries: Sequence[optuna.study.StudySummary], storage_url: str) -> Table:
    """``tuner studies``: name, trials, started, and the tuner's target of each study."""
    table = Table(title=f"studies in {display_url(storage_url)}", header_style="bold")
    for header in ("study", "trials", "started", "target", "model", "warm start"):
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
            _text(warm_text(summary.user_attrs.get(WARM_ATTR))),
        )
    return table


def warm_text(warm: Any) -> str:
    """A study's warm start in a few words (:mod:`tuner.study.warm`): ``from X (same)``, ``none``, ``-``."""
    if not isinstance(warm, dict):
        return "-"
    return f"from {warm['source']} ({warm.get('level')})" if warm.get("source") else "none"


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
            str(rec.id), rec.at, rec.action, rec.study, cell(rec.trial), rec.target,
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


# ---- tuner load and tuner run ------------------------------------------------------------

LOAD_SUMMARY_ROWS = (
    ("completed / errored / incomplete", None),
    ("duration (s)", "duration"),
    ("request throughput (req/s)", "request_throughput"),
    ("output throughput (tok/s)", "output_throughput"),
    ("total throughput (tok/s)", "total_throughput"),
    ("concurrency (mean in flight)", "concurrency"),
    ("TTFT mean / p50 / p99 (ms)", "ttft"),
    ("ITL mean / p50 / p99 (ms)", "itl"),
    ("accept length (tokens per verify step)", "accept_length"),
    ("TPOT mean / p50 / p99 (ms)", "tpot"),
    ("E2E latency mean / p50 / p99 (ms)", "e2e_latency"),
    ("prefix-cache hit rate", "cache_hit_rate"),
    ("error rate", "error_rate"),
    ("goodput (req/s meeting the SLO)", "goodput"),
    ("SLO attainment", "slo_attainment"),
)
"""``tuner load``'s summary rows: label, :class:`tuner.load.LoadSummary` field (``None``: the counts)."""


def load_number(value: object, pct: bool = False) -> str:
    """A load figure for a table: ``-`` when unknown, a share as ``12.3%`` (``pct``), floats as ``1,234.50``."""
    if value is None:
        return "-"
    if pct:
        return f"{float(value):.1%}"  # type: ignore[arg-type]
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


def load_summary_table(summary: LoadSummary, title: str) -> Table:
    """``tuner load``'s summary: one row per :data:`LOAD_SUMMARY_ROWS` entry, then the SLO verdict
    and, with a percentile ITL limit, the gaps above it over the share it allows
    (:func:`tuner.load.metrics.itl_exceedance`: ≤ 1× holds)."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, key in LOAD_SUMMARY_ROWS:
        if key is None:
            value = f"{summary.completed} / {summary.errored} / {summary.incomplete}"
        elif key in ("ttft", "itl", "tpot", "e2e_latency"):
            value = " / ".join(load_number(getattr(summary, f"{p}_{key}_ms")) for p in ("mean", "median", "p99"))
        else:
            value = load_number(getattr(summary, key), pct=key in ("cache_hit_rate", "error_rate", "slo_attainment"))
        table.add_row(label, value)
    if summary.slo_met is not None:
        verdict = "[green]met[/]" if summary.slo_met else "[red]missed[/]"
        worst = ", ".join(
            f"{k} {'n/a' if v is None else f'{v:+.0%}'}" for k, v in summary.slo_violations.items()
        )
        table.add_row("SLO", f"{verdict} ({worst})")
    if summary.itl_exceedance is not None:
        low = "" if summary.itl_exceedance_low is None else f" (95 % lower bound {summary.itl_exceedance_low:.2f}×)"
        table.add_row("ITL gaps over the limit (× the share its percentile allows)",
                      f"{summary.itl_exceedance:.2f}×{low}")
    return table


def load_steps_table(found: MaxLoadResult) -> Table:
    """``tuner load --max-under-slo``: one row per level tried, with its verdict and Wilson interval."""
    table = Table(title=f"tuner load --max-under-slo ({found.knob})", title_justify="left")
    for name in ("level", "verdict", "met [CI]", "n", "req/s", "tok/s", "p99 TTFT ms", "p99 ITL ms"):
        table.add_column(name, justify="left" if name == "verdict" else "right",
                         min_width=len("indeterminate") if name == "verdict" else None)
    for step in found.steps:
        table.add_row(
            f"{step.value:g}", step.verdict,
            f"{load_number(step.attainment, pct=True)} [{step.ci_low:.0%}-{step.ci_high:.0%}]", str(step.judged),
            load_number(step.request_throughput), f"{step.output_throughput:,.0f}",
            load_number(step.p99_ttft_ms), load_number(step.p99_itl_ms),
        )
    return table


def best_vs_baseline_table(chosen: BestTrial) -> Table:
    """``tuner run``'s closing table: the chosen trial's capacity, throughput, latency and headroom
    against the baseline's, with the ratio."""

    def fmt(value: Any, spec: str = ".0f") -> str:
        return "-" if value is None else format(value, spec)

    best = chosen.trial
    table = Table(title=f"best (trial {best.number}) vs baseline"
                  + (f" (trial {chosen.baseline.number})" if chosen.baseline else ""))
    for column in ("", "baseline", "best", "change"):
        table.add_column(column, justify="right" if column else "left")
    rows = [
        ("OOM-safe context capacity (requests)", "context_capacity", "d"),
        ("SLO-safe context capacity (sessions)", "slo_context_capacity", "d"),
        ("token capacity (tokens)", "token_capacity", "d"),
        ("output throughput (tok/s)", "output_throughput_tok_s", ".0f"),
        ("p99 TTFT (ms)", "p99_ttft_ms", ".0f"),
        ("p99 ITL (ms)", "p99_itl_ms", ".1f"),
        ("free after graphs (GiB)", "free_gib_after_graphs", ".2f"),
    ]
    for label, field, spec in rows:
        old = chosen.baseline.metric(field) if chosen.baseline else None
        new = best.metric(field)
        change = f"{new / old:.2f}×" if old and new is not None and old > 0 else "-"
        table.add_row(label, fmt(old, spec), fmt(new, spec), change)
    return table
