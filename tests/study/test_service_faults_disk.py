"""Fault suite, the disk and the reboot: a full disk mid-run or at the first write, journald
stopped mid-trial, and a reboot after the tuner was killed mid-trial, under real systemd 252 in a
PID namespace (the simulator as the unit). Split from ``test_service_faults.py`` so that the two
modules' sandboxes run beside each other.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from optuna.trial import TrialState

from tests.support.cli import one_error_line, run_tuner
from tests.support.configs import load_study as load
from tests.support.sandbox import SystemdSandbox
from tests.support.served_unit import (
    TRIAL_DROPIN,
    Calls,
    Served,
    completed_trials,
    in_trial,
    running,
    wait_for,
)
from tests.support.sim import is_healthy
from tuner.records import TrialRecord

pytestmark = [pytest.mark.slow, pytest.mark.systemd]


@contextlib.contextmanager
def _tmpfs(folder: Path, size: str) -> Iterator[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _fill(folder: Path) -> Path:
    """Fill the tmpfs to the last byte (the next write by anyone fails with ENOSPC)."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for chunk in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * chunk)
    finally:
        os.close(fd)
    return filler


def test_disk_full_is_one_line_and_loses_no_completed_trial(served: Served, tmp_path: Path, locks: Path) -> None:
    served.ensure_serving()
    with _tmpfs(tmp_path / "disk", "8m") as disk:
        db = disk / "sd.db"
        storage = f"sqlite:///{db}"
        # A grace period longer than the test: the heartbeat's own warning (a trial near its grace
        # period, tests/multihost/test_hosts.py) is not what this test reads.
        config = served.config(tmp_path, storage=storage, storage_lines="grace_period_s = 3600\n")
        with running(config, tmp_path, "--trials", "4") as run:
            wait_for(lambda: completed_trials(storage) >= 1, 200, "the first completed trial", run)
            filler = _fill(disk)
            _, err = run.communicate(timeout=300)
        assert run.returncode == 1, err[-3000:]
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
        # the database's disk or the artifact folder's (the same tmpfs): whichever write came first
        assert str(disk) in lines[0] and "full" in lines[0], lines[0]
        filler.unlink()
        study = load(storage, "sd")
        done = [t for t in study.trials if t.state == TrialState.COMPLETE]
        assert done and TrialRecord.model_validate(done[0].user_attrs["tuner.record"]).kind == "baseline"
        with sqlite3.connect(db) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert served.tuner_dropins() == [] and served.pid_state()[1] == "active"
    assert is_healthy(served.url, 60)


def _show(box: SystemdSandbox, unit: str) -> dict[str, str]:
    out = box.systemctl_run("show", "-p", "ActiveState,DropInPaths,ExecStart,MainPID", unit).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


@pytest.mark.parametrize("when", ["serving", "starting"])
def test_reboot_after_the_tuner_was_killed_mid_trial_brings_the_unit_up_on_its_own_flags(
    served: Served, tmp_path: Path, locks: Path, when: str
) -> None:
    """The tuner is killed (SIGKILL) while a trial serves, or after the trial's drop-in was written
    and before its server started (the unit held in ExecStartPre); the host reboots: the unit comes
    up at boot on its own command with no `tuner restore`, because the trial's drop-in lived in
    systemd's runtime folder (/run), which a boot empties. `tuner restore` afterwards sees the unit
    on its own command and only removes the killed run's state file: no restart."""
    box = served.box
    unit = Served(box)
    gate = tmp_path / "hold-start"
    unit.add_to(box, f"ExecStartPre=/bin/sh -c 'while [ -e {gate} ]; do sleep 0.1; done'\n")
    unit.dropin_folder.mkdir()
    (unit.dropin_folder / "10-site.conf").write_text("[Service]\nEnvironment=SITE=1\n")
    box.enable(unit.unit)
    box.systemctl_run("start", unit.unit)
    try:
        unit.ensure_serving()
        config = unit.config(tmp_path, measure_s=30)
        storage = f"sqlite:///{tmp_path}/studies/sd.db"
        with running(config, tmp_path, "--trials", "4") as run:
            wait_for(lambda: completed_trials(storage) >= 1, 300, "the baseline to finish", run)
            if when == "starting":
                gate.touch()
                wait_for(lambda: TRIAL_DROPIN in unit.tuner_dropins() and unit.pid_state()[1] == "activating", 200,
                      "trial 1's drop-in with the unit held before its start", run)
            else:
                baseline_pid = unit.pid_state()[0]
                wait_for(lambda: unit.pid_state()[0] not in (0, baseline_pid) and in_trial(unit), 200,
                      "trial 1 to serve", run)
            run.send_signal(signal.SIGKILL)
            run.wait(30)
        assert TRIAL_DROPIN in unit.tuner_dropins()
        gate.unlink(missing_ok=True)
        box.reboot()
        wait_for(lambda: is_healthy(unit.url, 0.5), 120, "the unit to come up after the reboot")
        shown = _show(box, unit.unit)
        assert shown["ActiveState"] == "active", shown
        assert TRIAL_DROPIN not in shown["DropInPaths"] and "10-site.conf" in shown["DropInPaths"], shown
        assert f"argv[]={' '.join(unit.argv)} ;" in shown["ExecStart"], shown
        assert requests.get(f"{unit.url}/get_server_info", timeout=5).json()["mem_fraction_static"] == 0.80
        assert unit.tuner_dropins() == ["10-site.conf"]
        # the killed run's state file is still there: restore (a fresh config: the reboot changed the
        # nsenter target) sees the unit already on its own command, healthy, and only clears the file
        calls = Calls(tmp_path, unit)
        up = unit.pid_state()
        proc = run_tuner("restore", "--config", str(unit.config(tmp_path, name="after", systemctl=calls.systemctl)),
                         "--unit", unit.unit, "--state-dir", str(tmp_path / "state"), cwd=tmp_path, timeout_s=200)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "already runs its own command" in proc.stdout and "restarted nothing" in proc.stdout, proc.stdout
        assert calls.changing() == [] and unit.pid_state() == up, calls.lines()
        assert not list((tmp_path / "state").glob("*.state.json"))
        assert unit.tuner_dropins() == ["10-site.conf"] and is_healthy(unit.url, 60)
    finally:
        gate.unlink(missing_ok=True)
        box.systemctl_run("stop", unit.unit, check=False)


def _full_tmpfs_prefix(folder: Path) -> tuple[str, ...]:
    """argv prefix running a command in a private mount namespace where ``folder`` is a small tmpfs
    filled to the last byte (the sandbox's systemd, in its own namespace, does not see it)."""
    script = 'mount -t tmpfs -o size=256k tmpfs "$0" && { cat /dev/zero > "$0/filler" 2>/dev/null; exec "$@"; }'
    return ("unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, str(folder))


FULL_DISKS = {
    "state folder": lambda served, tmp: tmp / "state",
    "lock folder": lambda served, tmp: tmp / "locks",
    "runtime drop-in folder": lambda served, tmp: served.box.runtime_dir,
    "study storage": lambda served, tmp: tmp / "studies",
}


@pytest.mark.parametrize("case", list(FULL_DISKS))
def test_full_disk_at_the_first_write_is_one_line_and_leaves_the_unit_alone(
    served: Served, tmp_path: Path, locks: Path, case: str
) -> None:
    """The disk holding a folder the run writes first (state file, lock, trial drop-in, study
    database) is full: `tuner run` refuses before any systemctl verb that changes anything, in one
    line naming the disk as full and how to fix it; MainPID and the drop-ins are unchanged."""
    folder = FULL_DISKS[case](served, tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    before = served.ensure_serving()
    config = served.config(tmp_path)
    dropins = served.tuner_dropins()
    proc = run_tuner("run", "--config", str(config), "--trials", "1", cwd=tmp_path, timeout_s=150,
                     prefix=_full_tmpfs_prefix(folder))
    line = one_error_line(proc, "full", "free space")
    assert str(folder) in line, line
    assert served.pid_state() == before, f"the unit was touched: {line}\n{served.journal_tail()}"
    assert served.tuner_dropins() == dropins


def test_journald_stopping_mid_trial_stops_the_run_and_is_not_the_candidates_failure(
    served: Served, tmp_path: Path, locks: Path
) -> None:
    """journald (the real one, inside the sandbox) is stopped while a trial is measured: the trial is
    recorded as journal_unreadable (not a crash of the candidate), the run stops with exit 1 and one
    line naming journald, and the unit is back on its own command, healthy."""
    box = served.box
    served.ensure_serving()
    config = served.config(tmp_path, measure_s=20)
    storage = f"sqlite:///{tmp_path}/studies/sd.db"
    try:
        with running(config, tmp_path, "--trials", "4") as run:
            wait_for(lambda: in_trial(served), 150, "the baseline to serve", run)
            time.sleep(3.0)  # inside its 20 s load phase
            box.systemctl_run("stop", "systemd-journald.service", "systemd-journald.socket",
                              "systemd-journald-dev-log.socket")
            _, err = run.communicate(timeout=300)
    finally:
        box.systemctl_run("start", "systemd-journald.socket", "systemd-journald-dev-log.socket",
                          "systemd-journald.service", check=False)
    assert run.returncode == 1, err[-3000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert "Traceback" not in err and "journald" in lines[-1], err[-3000:]
    records = [TrialRecord.model_validate(t.user_attrs["tuner.record"]) for t in load(storage, "sd").trials
               if "tuner.record" in t.user_attrs]
    assert [r.failure_class.value for r in records if r.failure_class] == ["journal_unreadable"], records
    assert served.tuner_dropins() == [] and served.pid_state()[1] == "active"
    assert is_healthy(served.url, 60)
    assert requests.get(f"{served.url}/get_server_info", timeout=5).json()["mem_fraction_static"] == 0.80
