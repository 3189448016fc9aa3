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


def fingerprints_view(rows: Sequence[Mapping[str, Any]]) -> RenderableType:
    """The terminal view of :func:`fingerprint_rows`: a table per deployment (the unreadable
    fingerprints are :func:`error_lines`)."""
    parts: list[RenderableType] = []
    by_key: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        if "error" in row:
            continue
        by_key.setdefault(str(row["deployment"]), []).append(row)
    for deployment, items in by_key.items():
        table = Table(title=deployment, header_style="bold", box=box.SIMPLE_HEAD, title_justify="left")
        for header in ("study", "launches", "B GiB", "weights GiB", "KV B/token", "tok/+0.01", "graphs GiB @bs",
                       "draft GiB", "host GB/rank", "model error GiB", "warm start"):
            table.add_column(header, overflow="fold")
        for row in items:
            f = row["figures"]
            graphs = ", ".join(f"{v}@{k}" for k, v in f["graph_gib_per_bs"].items()) or "-"
            table.add_row(Text(str(row["study"])), f"{f['launches']} ({f['failed']} failed)", _num(f["baseline_gib"]),
                          _num(f["weight_gib"]), _num(f["cell_bytes"], "{:.0f}"), _num(f["tokens_per_hundredth"], "{:,}"),
                          graphs, _num(f["draft_gib"]), _num(f["host_pool_gb_per_rank"]), _num(f["model_error_gib"]),
                          Text(warm_text(row.get("warm_start"))))
        parts.append(table)
    if not parts and not error_lines(rows):
        parts.append(Text("no fingerprints: no study in these storages has launched a trial yet"))
    return Group(*parts)
