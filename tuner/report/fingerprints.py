"""``tuner fingerprints``: what a storage knows of each deployment's memory, with the figures.

One table per deployment (:class:`tuner.study.fingerprint.DeploymentKey`), one row per study that
fingerprinted it (:class:`tuner.study.fingerprint.Fingerprint`): launches, free memory at the
baseline ``B``, weights, KV bytes per token, tokens per +0.01 of ``mem_fraction_static``, CUDA-graph
memory at each largest captured batch size, the draft's share, the host pool per rank, the memory
model's largest measured error, and what the study reused from another's (its warm start,
:mod:`tuner.study.warm`). A corrupt or foreign fingerprint is one line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tuner.report.tables import warm_text
from tuner.study.fingerprint import StoredFingerprint
from tuner.study.storage import display_url

__all__ = ["fingerprint_rows", "fingerprints_view", "error_lines"]


def _num(value: Any, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def fingerprint_rows(found: Mapping[str, Sequence[tuple[StoredFingerprint, Any]]]) -> list[dict[str, Any]]:
    """JSON-ready rows: per storage URL (password hidden) and study, the deployment, the figures,
    the warm start (the study's stored :class:`tuner.study.warm.WarmStart`, or ``None``), or the
    ``error`` line of an unreadable fingerprint."""
    rows = []
    for url, items in found.items():
        for stored, warm in items:
            row: dict[str, Any] = {"storage": display_url(url), "study": stored.study}
            if stored.fingerprint is None:
                row["error"] = stored.error
            else:
                fp = stored.fingerprint
                row |= {"deployment": fp.key.describe(), "key": fp.key.model_dump(mode="json"),
                        "workload": fp.workload, "figures": fp.figures(), "updated_at": fp.updated_at}
            row["warm_start"] = warm
            rows.append(row)
    return rows


def error_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per unreadable fingerprint (printed whole, never cut to the terminal's width)."""
    return [f"{row['storage']}: {row['error']}" for row in rows if "error" in row]


def _graphs(row: Mapping[str, Any]) -> str:
    return ", ".join(f"{v}@{k}" for k, v in row["figures"]["graph_gib_per_bs"].items()) or "-"


_FIGURES: tuple[tuple[str, Any], ...] = (
    ("launches", lambda r: f"{r['figures']['launches']} ({r['figures']['failed']} failed)"),
    ("baseline B (GiB)", lambda r: _num(r["figures"]["baseline_gib"])),
    ("weights (GiB)", lambda r: _num(r["figures"]["weight_gib"])),
    ("KV bytes/token", lambda r: _num(r["figures"]["cell_bytes"], "{:.0f}")),
    ("tokens per +0.01 fraction", lambda r: _num(r["figures"]["tokens_per_hundredth"], "{:,}")),
    ("CUDA graphs (GiB @ bs)", _graphs),
    ("draft (GiB)", lambda r: _num(r["figures"]["draft_gib"])),
    ("host pool (GB/rank)", lambda r: _num(r["figures"]["host_pool_gb_per_rank"])),
    ("memory model error (GiB)", lambda r: _num(r["figures"]["model_error_gib"])),
    ("warm start", lambda r: Text(warm_text(r.get("warm_start")))),
)
"""The rows of :func:`fingerprints_view`: label → the cell of one study's row."""


def fingerprints_view(rows: Sequence[Mapping[str, Any]]) -> RenderableType:
    """The terminal view of :func:`fingerprint_rows`: a table per deployment (the unreadable
    fingerprints are :func:`error_lines`)."""
    parts: list[RenderableType] = []
    by_key: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        if "error" in row:
            continue
        by_key.setdefault(str(row["deployment"]), []).append(row)
    for deployment, items in by_key.items():  # a row per figure, a column per study: fits 80 columns
        parts.append(Text(deployment, style="bold"))  # a title would wrap at the table's width
        table = Table(header_style="bold", box=box.SIMPLE_HEAD)
        table.add_column("", no_wrap=True)
        for row in items:
            table.add_column(Text(str(row["study"])), overflow="fold", justify="right")
        for label, cell in _FIGURES:
            table.add_row(label, *(cell(row) for row in items))
        parts.append(table)
    if not parts and not error_lines(rows):
        parts.append(Text("no fingerprints: no study in these storages has launched a trial yet"))
    return Group(*parts)
