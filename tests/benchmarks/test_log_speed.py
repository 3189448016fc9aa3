"""Log parser throughput on a long journal (figure in docs/tuner-explain.md)."""

from __future__ import annotations

import time
from pathlib import Path

from tuner.sglang.logs import parse_log

REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "logs" / "reference-0.5.5-tp8.log"


def test_parse_a_million_line_journal_fast() -> None:
    ref = REFERENCE.read_text().splitlines()
    batches = [ln for ln in ref if "batch" in ln]
    lines = ref + batches * (1_000_000 // len(batches))
    start, cpu = time.perf_counter(), time.process_time()
    report = parse_log(lines)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    # CPU time too: on a shared box the wall clock also counts other processes' turns.
    print(f"{len(lines):,} lines in {elapsed:.1f} s = {len(lines) / elapsed:,.0f} lines/s "
          f"(CPU {cpu:.1f} s = {len(lines) / cpu:,.0f} lines/s)")
    assert report.batch_summary.decode_lines > 600_000 and report.ready
    assert len(lines) / elapsed > 20_000  # a week of a busy unit's journal in under a minute
