"""Fixtures of the study suites that drive a real systemd unit (``tests/support/served_unit.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.sandbox import SystemdSandbox
from tests.support.served_unit import Served


@pytest.fixture(scope="module")
def served(systemd_sandbox: SystemdSandbox) -> Iterator[Served]:
    """The simulator as a unit of the sandbox's real systemd, serving, enabled (up again after a
    reboot of the sandbox); stopped after the module."""
    box = systemd_sandbox
    box.require_real()
    unit = Served(box)
    unit.add_to(box)
    box.enable(unit.unit)  # up again right after a reboot of the sandbox (its port held, not lent out)
    try:
        unit.ensure_serving()
        yield unit
    finally:
        box.systemctl_run("stop", unit.unit, check=False)


@pytest.fixture
def locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The host-wide lock folder, private to this test (the product's default is /run/lock/sglang-tuner)."""
    folder = tmp_path / "locks"
    monkeypatch.setenv("SGLANG_TUNER_LOCK_DIR", str(folder))
    return folder
