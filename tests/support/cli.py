"""The ``tuner`` CLI in tests: as a real subprocess, or in-process (the ``tuner_cli`` fixture), and
the one check of the error boundary (a user error is ONE ``error: ...`` line and a non-zero exit)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

TUNER = str(Path(sys.executable).with_name("tuner"))
"""The installed ``tuner`` script of this venv (what a user runs)."""


class CliResult:
    """What one in-process ``tuner`` invocation printed and its exit status."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_tuner(
    *args: str,
    cwd: Path | None = None,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """Run the installed ``tuner`` script as a subprocess (``main()``: TunerError → one line, exit 1).

    Args:
        args: The command line after ``tuner``.
        cwd: Working directory (``studies/`` lands there by default).
        timeout_s: Limit (s); ``subprocess.TimeoutExpired`` past it.
        env: The whole environment (default: this process's, plus ``COLUMNS=200`` and ``NO_COLOR=1``).
        prefix: argv before the script (e.g. ``("nsenter", ...)``).

    The command and its output are printed, so pytest shows them when a test fails.
    """
    env = dict(env) if env is not None else dict(os.environ, COLUMNS="200", NO_COLOR="1")
    proc = subprocess.run([*prefix, TUNER, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    print(f"$ tuner {' '.join(args)}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}rc={proc.returncode}")
    return proc


def one_error_line(proc: subprocess.CompletedProcess[str] | CliResult, *needles: str, code: int = 1) -> str:
    """Assert the CLI refused with exit ``code`` and one ``error: `` line holding every needle; return it."""
    assert proc.returncode == code, (proc.returncode, proc.stdout[-1500:], proc.stderr[-1500:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def in_process_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., CliResult]:
    """Run ``tuner.cli.main()`` (the script's entry point) in this process: the ``tuner_cli`` fixture.

    It spares the interpreter start of a subprocess for each call; ``sys.argv`` is the only thing
    patched, ``COLUMNS=200`` and ``NO_COLOR=1`` keep the tables on one line each. ``main()`` ignores
    SIGINT once its command is over (the script's shutdown guard); the worker's own SIGINT handler is
    put back after each call, or every process a later test starts would inherit the ignore (CI saw
    ``tuner load`` survive its Ctrl-C).
    """
    import signal

    from tuner import cli

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("NO_COLOR", "1")

    def invoke(*args: str) -> CliResult:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["tuner", *args])
        code = 0
        handler = signal.getsignal(signal.SIGINT)
        try:
            cli.main()
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        finally:
            signal.signal(signal.SIGINT, handler)
        out = capsys.readouterr()
        return CliResult(code, out.out, out.err)

    return invoke


def signal_when(proc: subprocess.Popen[str], ready: Callable[[], object], sig: int, *,
                timeout_s: float = 120.0) -> tuple[object, str]:
    """Send ``sig`` to ``proc`` once ``ready()`` (which waits as it needs) returned something not
    ``None``; return that and ``proc``'s stderr once it exited. ``proc`` is killed on any failure.

    Raises:
        AssertionError: ``ready()`` returned ``None`` (with the exit and stderr if ``proc`` ended).
    """
    try:
        got = ready()
        exited = f"; it exited {proc.returncode}: {proc.communicate()[1][-2000:]}" if proc.poll() is not None else ""
        assert got is not None, "what the signal waited for never came" + exited
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    return got, err
