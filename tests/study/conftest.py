"""Helpers for the study's end-to-end tests: config copies on free ports, the tuner as a process."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bind port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def config_copy(name: str, tmp_path: Path, *, extra_service: str = "", replace: dict[str, str] | None = None) -> Path:
    """``configs/<name>`` with a free port, a private state dir and storage under ``tmp_path``."""
    text = (ROOT / "configs" / name).read_text()
    port = free_port()
    for old in ("30000", "30001"):
        text = text.replace(old, str(port))
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    text = text.replace("[service]\n", f'[service]\nstate_dir = "{tmp_path / "state"}"\n{extra_service}', 1)
    path = tmp_path / name
    path.write_text(text)
    return path


def tuner(*args: str, cwd: Path, timeout_s: float = 600.0) -> subprocess.CompletedProcess[str]:
    """Run ``tuner`` (the CLI entry point) in ``cwd``."""
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def load(storage: str, name: str) -> optuna.Study:
    """The stored study."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=storage)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A working directory for one tuner run (``studies/`` lands here)."""
    return tmp_path
