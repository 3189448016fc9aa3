"""The ``tuner_cli`` fixture: run the ``tuner`` entry point in the test process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HTML_LOG_LINE = '[TP0] Scheduler hit an exception: <script>alert("pwned")</script> & <b>bold</b>'
"""A log line with HTML in it: the report must show it escaped."""


class CliResult:
    """What one in-process ``tuner`` invocation printed and its exit status."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture()
def tuner_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """Run ``tuner.cli.main()`` (the script's entry point: TunerError → one line, exit 1) in this
    process, which spares the interpreter start of a subprocess for each call."""
    from tuner import cli

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("NO_COLOR", "1")

    def invoke(*args: str) -> CliResult:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["tuner", *args])
        code = 0
        try:
            cli.main()
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        out = capsys.readouterr()
        return CliResult(code, out.out, out.err)

    return invoke


def run_tuner(*args: str, cwd: Path | None = None, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run the real ``tuner`` CLI (``main()``: TunerError → one line, exit 1) as a subprocess."""
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "tuner.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
