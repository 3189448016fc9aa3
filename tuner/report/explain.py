"""The rich text view of ``tuner explain`` (:class:`tuner.sglang.explain.Explanation`) and the
waterfall table of a stored trial memory report (``tuner show``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tuner.results import StoredStudy
from tuner.sglang.explain import Explanation, WaterfallStep, waterfall_steps
from tuner.sglang.failures import Lever
from tuner.sglang.ladder import Rung

__all__ = ["renderables", "waterfall_table", "ladder_table", "bound_by_study"]


def _fmt(x: float | None, unit: str = "GiB") -> str:
    return "—" if x is None else f"{x:,.2f} {unit}"


def _steps_table(steps: Sequence[WaterfallStep]) -> Table:
    wf = Table(title="Memory per GPU (waterfall)", title_justify="left")
    for col in ("item", "GiB", "tokens", "source"):
        wf.add_column(col, justify="right" if col in ("GiB", "tokens") else "left")
    for s in steps:
        wf.add_row(s.label, _fmt(s.gib, "").strip(), f"{s.tokens:,}" if s.tokens is not None else "", s.source)
    return wf


def waterfall_table(memory: Mapping[str, Any]) -> Table:
    """A rich table of :func:`waterfall_steps` (``tuner show`` uses it)."""
    return _steps_table(waterfall_steps(memory))


def _lever_words(lever: dict[str, Any]) -> str:
    if not lever:
        return "as observed"
    return " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else " none" if v is None else f" {v}") for k, v in lever.items())


def _yes(x: bool | None) -> str:
    return {True: "yes", False: "no", None: "?"}[x]


def _num(x: int | None) -> str:
    return "—" if x is None else f"{x:,}"


def ladder_table(rungs: Sequence[Rung]) -> RenderableType:
    """The structural-levers ladder: one row per rung, then each rung's ``why`` (``?`` = unknown)."""
    t = Table(title="Structural levers (priced on this start, before any restart)", title_justify="left")
    for col in ("#", "lever", "tokens/rank", "logical", "one request", "free GiB", "starts", "available", "numerics"):
        t.add_column(col, justify="left" if col in ("lever",) else "right")
    base = rungs[0].logical_tokens if rungs and rungs[0].logical_tokens else None
    for i, r in enumerate(rungs, 1):
        gain = f" ({r.logical_tokens / base:.2f}×)" if base and r.logical_tokens else ""
        t.add_row(str(i), _lever_words(r.lever), _num(r.tokens_per_rank), _num(r.logical_tokens) + gain, _num(r.per_request_max_tokens),
                  _fmt(r.free_after_graphs_gib, "").strip(), _yes(r.starts), _yes(r.available), "changes" if r.changes_numerics else "same")
    lines: list[RenderableType] = [t]
    lines += [Text(f"  {i}. {r.why}", style="dim") for i, r in enumerate(rungs, 1)]
    return Group(*lines)


def _other_levers(e: Explanation) -> list[RenderableType]:
    """The levers after the first (``Explanation.levers``), one line each."""
    return [Text(f"  also: {lv.direction} {lv.knob}  ({lv.why})" if lv.knob else f"  also: no knob  ({lv.why})") for lv in e.levers[1:]]


def renderables(e: Explanation) -> RenderableType:  # noqa: C901 - over the complexity ceiling when it was set (15); it only goes down
    """The rich text view of an explanation (the CLI prints it)."""
    parts: list[RenderableType] = []
    head = Text()
    head.append("SGLang memory explained", style="bold")
    head.append(f"  state: {e.state}")
    if e.sglang_version:
        head.append(f"  version: {e.sglang_version}")
    if e.log_format:
        head.append(f"  log format: {e.log_format}")
    parts.append(head)
    if e.sources:
        parts.append(Text("from: " + "; ".join(e.sources), style="dim"))
    parts.append(_steps_table(e.waterfall))
    parts.append(Text("Capacity: " + e.capacity.statement, style="bold"))
    if e.capacity.fits:
        ft = Table(title="Requests resident at once", title_justify="left")
        for col in ("request tokens", "requests", "limited by"):
            ft.add_column(col, justify="right" if col != "limited by" else "left")
        for f in e.capacity.fits:
            ft.add_row(f"{f.request_tokens:,}", f"{f.resident_requests:,}", f.limited_by)
        parts.append(ft)
    if e.predictions:
        pt = Table(title="At other mem_fraction_static values", title_justify="left")
        for col in ("fraction", "tokens", "Δ tokens", "KV GiB", "headroom", "note"):
            pt.add_column(col, justify="left" if col == "note" else "right")
        for p in e.predictions:
            pt.add_row(f"{p.mem_fraction_static:.3f}", f"{p.max_total_num_tokens:,}", f"{p.delta_tokens:+,}" if p.delta_tokens is not None else "",
                       f"{p.kv_pool_gib:.2f}", _fmt(p.free_after_graphs_gib), p.note or "")
        parts.append(pt)
    if e.traps:
        parts.append(Text("Traps", style="bold"))
        colours = {"info": "cyan", "warning": "yellow", "error": "red"}
        for t in e.traps:
            line = Text()
            line.append(f"[{t.severity}] ", style=colours[t.severity])
            line.append(t.title, style="bold")
            parts.append(line)
            parts.append(Text("  " + t.detail))
            for ev in t.evidence:
                parts.append(Text("  evidence: " + ev, style="dim"))
            if t.fix:
                parts.append(Text("  fix: " + t.fix, style="green"))
    if e.lever is not None:
        lever = Text()
        lever.append("Lever: ", style="bold")
        lever.append(f"{e.lever.direction} {e.lever.knob}" if e.lever.knob else "no knob", style="bold green")
        lever.append(f"  ({e.lever.why})")
        parts.append(lever)
        parts += _other_levers(e)
    if e.ladder:
        parts.append(ladder_table(e.ladder))
    if e.diagnosis is not None:
        where = f", phase {e.diagnosis.phase}" if e.diagnosis.phase else ""
        parts.append(Text(f"Diagnosis: {e.diagnosis.failure_class.value}{where}; evidence: {e.diagnosis.evidence}", style="bold"))
    if e.findings:
        parts.append(Text("Findings", style="bold"))
        for finding in e.findings:
            parts.append(Text("  - " + finding))
    for w in e.warnings:
        parts.append(Text("note: " + w, style="dim"))
    return Group(*parts)


# ---- an explanation bounded by what a study measured ------------------------------------------


def _raises_fraction(lever: Lever | None) -> bool:
    return lever is not None and lever.knob == "mem_fraction_static" and lever.direction == "raise"


def bound_by_study(e: Explanation, stored: StoredStudy, number: int) -> Explanation:
    """``tuner explain --trial N``: the explanation of trial ``number``'s server log, bounded by
    what its study measured under load, so it never advises what the study saw fail.

    The study's boundaries are the largest activation peak a trial measured under the stress load
    (:attr:`tuner.records.MemoryFacts.peak_activation_gib`) and the lowest fraction measured to fail
    above those that started (:func:`tuner.report.figures.measured_boundaries`). A predicted
    fraction whose free memory after graphs is below that peak, or at or above that failing
    fraction, is marked as failing under load; a "raise mem_fraction_static" lever stays only
    while a higher fraction is still inside the boundaries (its reason then names the highest),
    and the idle-reserve trap says the idle memory is the measured activation headroom when none is.

    Args:
        e: The explanation of the trial's own server log.
        stored: The study.
        number: The trial.

    Returns:
        The bounded explanation (a copy).
    """
    from tuner.report.figures import measured_boundaries

    peaks = [(v.record.memory.peak_activation_gib, v.number) for v in stored.trials
             if v.record is not None and v.record.memory.peak_activation_gib]
    peak, peak_trial = max(peaks) if peaks else (None, None)
    above = next(((hi, label) for _, hi, label in measured_boundaries(stored.trials) if label.startswith("fails above")),
                 None)
    setting = e.settings.get("mem_fraction_static")
    current = float(setting.value) if setting is not None and setting.value is not None else None
    rows = []
    for p in e.predictions:
        why = []
        if peak is not None and p.free_after_graphs_gib is not None and p.free_after_graphs_gib < peak:
            why.append(f"{p.free_after_graphs_gib:.2f} GiB free is below the {peak:.2f} GiB activation peak trial "
                       f"{peak_trial} measured under the stress load")
        if above is not None and p.mem_fraction_static >= above[0] - 1e-9:
            why.append(f"the study measured {above[1].removeprefix('fails above: ')} at {above[0]:g}")
        rows.append(p.model_copy(update={"starts": False, "note": "fails under load: " + "; ".join(why)}) if why else p)
    higher = [p.mem_fraction_static for p in rows if p.starts and current is not None and p.mem_fraction_static > current + 1e-9]
    bound = f" (study {stored.name}: up to {max(higher):g}, inside its measured boundaries)" if higher else ""

    def keep(lever: Lever | None) -> Lever | None:
        if not _raises_fraction(lever):
            return lever
        return lever.model_copy(update={"why": lever.why + bound}) if higher else None  # type: ignore[union-attr]

    traps = []
    for trap in e.traps:
        if trap.id == "idle_reserve" and not higher and peak is not None:
            trap = trap.model_copy(update={
                "severity": "info", "title": trap.title.replace("sits idle", "is this config's activation headroom"),
                "detail": (f"trial {peak_trial} of study {stored.name} measured a {peak:.2f} GiB activation peak under the "
                           "stress load" + (f" and {above[1].removeprefix('fails above: ')} at {above[0]:g}" if above else "")
                           + ": no higher fraction is inside the study's measured boundaries"),
                "fix": None, "lever": None})
        else:
            trap = trap.model_copy(update={"lever": keep(trap.lever), "also": [lv for lv in trap.also if keep(lv) is not None]})
        traps.append(trap)
    levers = [kept for lv in e.levers if (kept := keep(lv)) is not None]
    finding = (f"bounded by study {stored.name} (trial {number}'s log): "
               + (f"activation peak {peak:.2f} GiB (trial {peak_trial})" if peak is not None else "no activation peak measured")
               + (f", {above[1]} at {above[0]:g}" if above else ""))
    return e.model_copy(update={"predictions": rows, "traps": traps, "levers": levers,
                                "lever": levers[0] if levers else None, "findings": [*e.findings, finding],
                                "sources": [*e.sources, f"study {stored.name}, trial {number}"]})
