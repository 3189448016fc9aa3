"""The simulator (``python -m tuner.sim``) as a real process, and the one ``/health`` poll.

Each process runs in its own process group (``start_new_session``) and is ended by group;
logs go to a file under the test's tmp dir. Ports come from :func:`tests.support.net.free_port`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.support.net import free_port

READY_LINE = "The server is fired up and ready to roll!"


def sim_command(port: int, mem_fraction_static: str = "0.85", *extra: str, gpu: str = "H100-80GB",
                time_scale: str = "0.02") -> list[str]:
    """argv of the simulator (Llama-3.1-8B) serving on ``port``; it starts in about a second."""
    return [sys.executable, "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--sim-gpu", gpu,
            "--mem-fraction-static", mem_fraction_static, "--host", "127.0.0.1", "--port", str(port),
            "--sim-time-scale", time_scale, *extra]


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced (or the pair appended)."""
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def wait_healthy(url: str, timeout_s: float = 90.0, *, exited: Callable[[], str | None] | None = None) -> None:
    """Poll ``GET {url}/health`` until it answers 200.

    Args:
        url: The server's base URL.
        timeout_s: Limit (s).
        exited: Returns why the server can no longer come up (its process ended), else ``None``.

    Raises:
        AssertionError: The server exited, or ``timeout_s`` passed.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        why = exited() if exited is not None else None
        if why:
            raise AssertionError(f"{url} will not come up: {why}")
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not healthy within {timeout_s:g} s")


def is_healthy(url: str, timeout_s: float) -> bool:
    """Whether ``GET {url}/health`` answers 200 within ``timeout_s`` (s): :func:`wait_healthy` as a
    condition, for tests that assert on it or wait for either outcome."""
    try:
        wait_healthy(url, timeout_s)
    except AssertionError:
        return False
    return True


@dataclass
class SimProcess:
    """One running simulator."""

    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def exited(self) -> str | None:
        """Why the process is gone (its status and log tail), or ``None`` while it runs."""
        if self.proc.poll() is None:
            return None
        return f"simulator exited with {self.proc.returncode}:\n{self.log()[-3000:]}"

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the process group, then SIGKILL it if still alive; return the exit status."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=timeout_s)
        return self.proc.returncode


def spawn(args: list[str], tmp_path: Path, *, port: int | None = None, time_scale: float = 0.0) -> SimProcess:
    """Start the simulator with ``args`` (plus --host, --port and --sim-time-scale) without waiting."""
    port = free_port() if port is None else port
    log_path = tmp_path / f"sim-{port}.log"
    cmd = [sys.executable, "-m", "tuner.sim", *args, "--host", "127.0.0.1", "--port", str(port),
           "--sim-time-scale", str(time_scale)]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return SimProcess(proc, port, log_path)


def wait_ready(sim: SimProcess, timeout_s: float = 60.0) -> None:
    """Wait for the ready line in the log (SGLang prints it once it serves); raise with the log if
    the process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if READY_LINE in sim.log():
            return
        why = sim.exited()
        if why:
            raise AssertionError(why)
        time.sleep(0.05)
    sim.stop()
    raise AssertionError(f"simulator not ready after {timeout_s} s:\n{sim.log()[-3000:]}")


def start_healthy(args: list[str], tmp_path: Path, *, time_scale: float = 0.0, timeout_s: float = 90.0) -> SimProcess:
    """:func:`spawn`, then :func:`wait_healthy` (the process is stopped if it does not come up)."""
    sim = spawn(args, tmp_path, time_scale=time_scale)
    try:
        wait_healthy(sim.url, timeout_s, exited=sim.exited)
    except AssertionError:
        sim.stop()
        raise
    return sim


def run_to_exit(args: list[str], tmp_path: Path, timeout_s: float = 60.0) -> tuple[int, str]:
    """Run a simulator that is expected to exit (a startup failure); return (status, log)."""
    sim = spawn(args, tmp_path)
    try:
        sim.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        sim.stop()
        raise AssertionError(f"simulator still running after {timeout_s} s:\n{sim.log()[-3000:]}") from None
    return sim.proc.returncode, sim.log()
