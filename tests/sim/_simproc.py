"""Start ``python -m tuner.sim`` as a real process for the simulator's tests.

Each process runs in its own process group (``start_new_session``) and is ended by group at
teardown; logs go to a file under the test's tmp dir. Ports come from binding port 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

READY_LINE = "The server is fired up and ready to roll!"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bind port 0, read it, release it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """Start the simulator with ``args`` (plus --port and --sim-time-scale) without waiting."""
    port = free_port() if port is None else port
    log_path = tmp_path / f"sim-{port}.log"
    cmd = [sys.executable, "-m", "tuner.sim", *args, "--host", "127.0.0.1", "--port", str(port),
           "--sim-time-scale", str(time_scale)]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return SimProcess(proc, port, log_path)


def wait_ready(sim: SimProcess, timeout_s: float = 60.0) -> None:
    """Wait for the ready line; raise with the log if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if READY_LINE in sim.log():
            return
        if sim.proc.poll() is not None:
            raise AssertionError(f"simulator exited with {sim.proc.returncode}:\n{sim.log()[-3000:]}")
        time.sleep(0.05)
    sim.stop()
    raise AssertionError(f"simulator not ready after {timeout_s} s:\n{sim.log()[-3000:]}")


def run_to_exit(args: list[str], tmp_path: Path, timeout_s: float = 60.0) -> tuple[int, str]:
    """Run a simulator that is expected to exit (a startup failure); return (status, log)."""
    sim = spawn(args, tmp_path)
    try:
        sim.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        sim.stop()
        raise AssertionError(f"simulator still running after {timeout_s} s:\n{sim.log()[-3000:]}") from None
    return sim.proc.returncode, sim.log()
