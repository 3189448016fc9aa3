"""The line-format table (``tuner.sglang.logs.LINE_FORMATS``): each golden line of each SGLang
version is the row its format id names, no line of a version or a handed case is ambiguous (two
rows covering it equally), and every format read from SGLang's source has a row or a failure
pattern."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner.sglang.logs import LINE_FORMATS, clean_line, match_format, matching_formats

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FORMATS = json.loads((Path(__file__).resolve().parents[2] / "tuner" / "data" / "log-formats.json").read_text())["formats"]
VERSIONS = ["0.5.5.post3", "0.5.10", "0.5.23"]

# Formats of SGLang's source that are read by the failure table (_FAILURES), not as a fact row, and
# continuation parts of another line's message.
FAILURE_IDS = {"graph_failed", "alloc_oom", "not_enough", "unbalanced", "req_slots"}
PART_IDS = {"retract_details", "alloc_avail_swa"}


def _golden(version: str) -> list[tuple[str, str]]:
    """``(format id, line)`` of every golden line of a version (the ``# id file:line`` comment before it)."""
    out, fmt = [], None
    for line in (FIXTURES / "sglang-formats" / f"golden-{version}.log").read_text().splitlines():
        if line.startswith("# "):
            fmt = line[2:].split()[0]
        elif line.strip() and fmt is not None:
            out.append((fmt, line))
    return out


def test_every_sglang_format_has_a_row_or_a_failure_pattern() -> None:
    rows = {f.id for f in LINE_FORMATS}
    missing = {f["id"] for f in FORMATS} - rows - FAILURE_IDS - PART_IDS
    assert not missing


@pytest.mark.parametrize("version", VERSIONS)
def test_each_golden_line_is_the_row_its_format_names(version: str) -> None:
    wrong = []
    for fmt, line in _golden(version):
        if fmt in FAILURE_IDS | PART_IDS:
            continue
        hit = match_format(clean_line(line)[0])
        if hit is None or hit[0].id != fmt:
            wrong.append((fmt, hit[0].id if hit else None, line[:100]))
    assert not wrong


def _all_lines() -> list[str]:
    lines = [line for v in VERSIONS for _fmt, line in _golden(v)]
    for path in sorted((FIXTURES / "cases").glob("case-*.json")):
        lines += json.loads(path.read_text())["log_excerpt"].splitlines()
    lines += (FIXTURES / "logs" / "reference-0.5.5-tp8.log").read_text().splitlines()
    return lines


def test_no_line_is_ambiguous() -> None:
    """The stated rule (the widest match wins) never meets a tie on real and golden lines, so the
    table's order decides nothing."""
    ties = []
    for line in _all_lines():
        hits = matching_formats(clean_line(line)[0])
        if len(hits) > 1 and hits[0][1].end() - hits[0][1].start() == hits[1][1].end() - hits[1][1].start():
            ties.append((hits[0][0].id, hits[1][0].id, line[:100]))
    assert not ties


def test_the_widest_match_wins_whatever_the_order() -> None:
    """A capture end line with the scheduler line glued on (case-21) matches both rows; the capture
    end covers more of it, and reversing the table changes nothing."""
    line = ("Capture cuda graph end. Time elapsed: 2.20 s. mem usage=0.15 GB. avail mem=10.00 GB. "
            "max_total_num_tokens=500000, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=4096, "
            "context_len=32768, available_gpu_mem=10.00 GB")
    ids = [row.id for row, _m in matching_formats(line)]
    assert ids[0] == "cap_end" and "scheduler" in ids
    hit = match_format(line)
    assert hit is not None and hit[0].id == "cap_end"


def test_every_row_names_its_source_and_a_literal_anchor() -> None:
    for row in LINE_FORMATS:
        assert row.source and row.anchor
        assert row.handler.__name__.startswith("_on_")
