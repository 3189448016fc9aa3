"""Fixtures: the small SSE server (``tests/support/sse_server.py``) as a real subprocess on a free loopback port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

SERVER = Path(__file__).parents[1] / "support" / "sse_server.py"


class ServerProcess:
    """A started ``sse_server.py``; ``kill()`` ends its process group."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), "--port", "0", *args],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.kill()
            raise RuntimeError(f"sse_server.py did not start: {line!r}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerProcess]]:
    """Start SSE servers with the given flags; all are killed at teardown."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(*args)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def sse_url(start_server: Callable[..., ServerProcess]) -> str:
    """URL of a fast SSE server (TTFT 5 ms, ITL 2 ms)."""
    return start_server("--ttft-ms", "5", "--itl-ms", "2").url
