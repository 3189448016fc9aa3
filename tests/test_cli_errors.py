"""The CLI's error boundary: every user error is one line on stderr and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def tuner(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("tuner")), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "120", "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("load", "--bogus"), "No such option: --bogus — see `tuner load --help`"),
        (("show", "-1"), "No such option: -1"),
        (("nosuch",), "No such command 'nosuch'"),
        (("run", "--budget"), "requires an argument"),
    ],
)
def test_usage_errors_are_one_line_exit_2(args: tuple[str, ...], needle: str) -> None:
    proc = tuner(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_tuner_error_keeps_square_brackets(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[service]\nlauncher = 'process'\nbogus_key = 1\n")
    proc = tuner("run", "--config", str(bad), "--budget", "1m", "--dry-run")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "[service]" in lines[0] or "service." in lines[0], lines[0]


def test_no_arguments_prints_help_and_help_keeps_brackets() -> None:
    proc = tuner()
    assert proc.returncode == 0 and "Usage: tuner" in proc.stdout and "apply" in proc.stdout
    proc = tuner("trials", "--help")
    assert proc.returncode == 0 and "[study]" in proc.stdout, proc.stdout
