"""Two real systemd sandboxes at once (``tests/support/sandbox.py``): each in its own cgroup folder
and journal, so the suite's modules boot theirs in parallel without seeing each other's units."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.sandbox import REGISTRY, _cgroup_roots, boot_sandbox

pytestmark = pytest.mark.systemd


def _journal(box, unit: str) -> str:  # noqa: ANN001
    return subprocess.run([*box.journalctl, "-u", unit, "--no-pager", "-o", "cat"], capture_output=True,
                          text=True, timeout=30).stdout


def test_two_sandboxes_keep_their_units_cgroups_and_journals_apart(tmp_path: Path) -> None:
    with boot_sandbox(tmp_path / "a") as a, boot_sandbox(tmp_path / "b") as b:
        a.require_real()
        for name, box in (("a", a), ("b", b)):
            box.add_unit("same.service", f"[Service]\nExecStart=/bin/sh -c 'echo hello-{name}; exec sleep 600'\n")
            box.systemctl_run("start", "same.service")
        groups = {}
        for name, box in (("a", a), ("b", b)):
            shown = dict(line.split("=", 1) for line in box.systemctl_run(
                "show", "-p", "ActiveState,ControlGroup", "same.service").stdout.split())
            assert shown["ActiveState"] == "active"
            groups[name] = shown["ControlGroup"]
        assert groups["a"] != groups["b"] and all(g.endswith("/system.slice/same.service") for g in groups.values())
        a.systemctl_run("stop", "same.service")
        assert b.systemctl_run("show", "-p", "ActiveState", "same.service").stdout.strip() == "ActiveState=active"
        journal_a, journal_b = _journal(a, "same.service"), _journal(b, "same.service")
        assert "hello-a" in journal_a and "hello-b" not in journal_a
        assert "hello-b" in journal_b and "hello-a" not in journal_b
        records = sorted(p.stem for p in REGISTRY.glob("*.json"))
        ours = [g.split("/")[1] for g in groups.values()]
        assert set(ours) <= set(records), (ours, records)
    for root in _cgroup_roots():  # both sandboxes ended: their cgroup folders and records are gone
        assert not [n for n in ours if (root / n).exists()], root
    assert not [n for n in ours if (REGISTRY / f"{n}.json").exists()]
