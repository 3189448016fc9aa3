"""``tuner show`` never passes a server's terminal control sequences (colours, OSC titles) to the terminal."""

from __future__ import annotations

from pathlib import Path

from tests.support.study_factory import failed_trial, make_study

HOSTILE = [
    "\x1b[31m[TP0] Scheduler hit an exception:\x1b[0m CUDA out of memory",
    "\x1b]0;pwned window title\x07[TP0] Load weight end.",
    "\x1b]8;;http://evil.example\x1b\\click\x1b]8;;\x1b\\ \x1b[2J\x1b[H cleared the screen\x08\x08",
]


def test_show_strips_control_sequences_from_server_text(tuner_cli, tmp_path: Path) -> None:  # noqa: ANN001
    url = make_study(tmp_path / "esc.db", "esc", [
        failed_trial(0.95, "runtime_oom", HOSTILE[0], log=HOSTILE),
    ])
    proc = tuner_cli("show", "0", "--storage", url)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout and "\x08" not in proc.stdout, repr(proc.stdout)
    # the text itself stays readable
    for words in ("Scheduler hit an exception", "CUDA out of memory", "Load weight end.", "cleared the screen"):
        assert words in proc.stdout, proc.stdout
    assert "pwned window title" not in proc.stdout
