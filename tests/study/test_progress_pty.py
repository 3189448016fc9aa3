"""The progress line of the README's demo as a terminal shows it (issue 16): `tuner run --config
configs/demo-sim.toml --budget 3m` in a pseudo-terminal, the simulator as a real server process,
with `--json-progress` writing the same events for a detached tuner-run.service.

Checks: the estimate of launches ("launch n of ~N") is never below the launches so far and does not
change mid-trial; the flags under test are shown; a start shows its last SGLang line and a load
phase its requests done.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.configs import config_copy

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[()][A-Z0-9]")
_LINE = re.compile(r"trial (?P<number>\d+) \((?P<kind>\w+), launch (?P<launch>\d+)(?: of ~(?P<expected>\d+))?\) · (?P<phase>\w+)(?P<detail>.*)")


def _run_in_pty(argv: list[str], cwd: Path, timeout_s: float) -> tuple[int, str]:
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "200", "LINES": "50"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(argv, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)  # the tuner restores the service on SIGTERM
            proc.wait(timeout=60)
        os.close(master)
    return proc.returncode, b"".join(chunks).decode("utf-8", errors="replace")


@pytest.mark.slow
def test_readme_demo_progress_line_in_a_terminal(workdir: Path) -> None:
    config = config_copy("demo-sim.toml", workdir)  # the README's demo on a free port, its own state dir
    events_file = workdir / "progress.jsonl"
    tuner = str(Path(sys.executable).with_name("tuner"))
    rc, raw = _run_in_pty([tuner, "run", "--config", str(config), "--budget", "3m", "--json-progress", str(events_file)],
                          workdir, timeout_s=420)
    screen = _ANSI.sub("", raw).replace("\r", "\n")
    (workdir / "screen.txt").write_text(screen, encoding="utf-8")
    assert rc == 0, screen[-3000:]
    lines = [m for m in (_LINE.search(line) for line in screen.splitlines()) if m]
    assert lines, screen[-3000:]

    # the estimate: never below the launches so far, and one value per trial (no mid-trial swing)
    per_trial: dict[int, set[int]] = {}
    for m in lines:
        launch, expected = int(m["launch"]), int(m["expected"]) if m["expected"] else None
        assert expected is None or expected >= launch, m.group(0)
        if expected is not None:
            per_trial.setdefault(int(m["number"]), set()).add(expected)
    assert per_trial and all(len(v) == 1 for v in per_trial.values()), per_trial
    launches = sorted({int(m["launch"]) for m in lines})
    assert launches[0] == 1 and len(launches) >= 2, launches  # 2-3 in 3 minutes on a loaded 2-core box

    # the flags under test, and progress inside the long phases
    assert re.search(r"flags: .*mem_fraction_static=0\.\d+", screen), screen[-3000:]
    assert "flags: the service's own flags" in screen
    assert re.search(r"· start · (Load weight|KV Cache|Capture cuda graph|max_total_num_tokens|The server is fired up)", screen), screen[-4000:]
    assert re.search(r"· (measure|stress) · \d+ of ≥\d+ requests done", screen), screen[-4000:]

    # the same events, machine-readable
    events = [json.loads(line) for line in events_file.read_text(encoding="utf-8").splitlines()]
    kinds = {e["event"] for e in events}
    assert {"trial_start", "phase", "trial_end", "stop"} <= kinds, kinds
    for e in events:
        if e.get("expected") is not None:
            assert e["expected"] >= e["launch"], e
    ends = [e for e in events if e["event"] == "trial_end"]
    assert len(ends) == len(launches) and all(e["flags"].get("mem_fraction_static") for e in ends), ends
    starts = [e for e in events if e["event"] == "phase" and e["phase"] == "start" and e["detail"]]
    assert starts and all(e["detail"]["line"] for e in starts), starts[:3]
    loads = [e for e in events if e["event"] == "phase" and e["phase"] == "measure" and e["detail"]]
    assert loads and all(e["detail"]["requests_done"] is not None for e in loads), loads[:3]
    assert all(e["detail"]["requests_expected"] for e in loads)
    # the results as fields, not only prose; the run's summary last
    assert all(e["result"]["outcome"] in ("ok", "failed") and "context_capacity" in e["result"] for e in ends), ends
    assert all(e["result"]["skipped_reason"] for e in events if e["event"] == "skip")
    summary = events[-1]
    assert summary["event"] == "summary" and summary["trials_run"] == len(launches), summary
    assert summary["stop_reason"] in ("budget", "exhausted") and summary["baseline"]["number"] == 0, summary
    assert summary["best"]["context_capacity"] == max(e["result"]["context_capacity"] or 0 for e in ends
                                                      if e["number"] == summary["best"]["number"])


def test_the_live_line_never_shows_a_count_past_its_floor_or_a_clock_past_its_window() -> None:
    """Operator review 2, R13: "16 of ≥8 requests done"; "16/12 s"."""
    from types import SimpleNamespace

    from tuner.cli.run import progress_line
    from tuner.study.job import PhaseProgress

    def line(done: int, elapsed: float) -> str:
        detail = PhaseProgress(requests_done=done, requests_expected=8, elapsed_s=elapsed, duration_s=12.0)
        event = SimpleNamespace(expected=3, flags={}, kind="sampled", phase="measure", number=2, launch=2,
                                detail=detail)
        return progress_line(event)

    assert "5 of ≥8 requests done, 6/12 s" in line(5, 6.0)
    late = line(16, 16.0)
    assert "16 requests done" in late and "≥8" not in late and "16/12" not in late and "window over" in late
