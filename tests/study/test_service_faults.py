"""Fault suite: an operator's bad day under real systemd 252 in a PID namespace (the simulator as the unit).

Every case reads the unit's ``MainPID`` and ``ActiveState`` before and after: a refusal must change
nothing on the host (not even a restart), a second tuner on the same unit is refused naming the
holder, a broken journal is refused up front or reported as its own failure, a restore that cannot
write the drop-in folder leaves the serving unit serving, and a full disk is one line that loses no
completed trial. Real parts only: the sandbox's systemd and journald, the simulator as a real
server process, real SQLite files, a real tmpfs, a real read-only bind mount.
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

import optuna
import pytest
import requests
from optuna.trial import TrialState

from tests.support.cli import one_error_line, run_tuner
from tests.support.configs import load_study as load
from tests.support.configs import study_created
from tests.support.net import free_port
from tests.support.sandbox import SystemdSandbox
from tests.support.served_unit import Calls, Served, background_run, running, wait_for
from tests.support.sim import is_healthy
from tuner.records import TrialRecord

pytestmark = [pytest.mark.slow, pytest.mark.systemd]

TRIAL_DROPIN = "90-tuner-trial.conf"



def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    return one_error_line(proc)


def _study_file(path: Path, *, trials: int = 30) -> None:
    """A real Optuna SQLite study with some finished trials (written by Optuna itself)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path.parent.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(study_name="sd", storage=f"sqlite:///{path}", directions=["maximize", "maximize"])
    for i in range(trials):
        trial = study.ask()
        trial.set_user_attr("tuner.record", {"note": "x" * 2000, "i": i})
        study.tell(trial, [float(i), float(i)])


def _half_truncated(tmp: Path) -> tuple[list[str], str]:
    db = tmp / "studies" / "sd.db"
    _study_file(db)
    size = db.stat().st_size
    with open(db, "r+b") as handle:
        handle.truncate(size // 2)
    return [], str(db)


def _zero_bytes(tmp: Path) -> tuple[list[str], str]:
    db = tmp / "studies" / "sd.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    db.write_bytes(b"")
    return [], str(db)


REFUSALS = {
    "corrupt-sqlite": (_half_truncated, ("sd.db", "corrupt")),
    "zero-byte-sqlite": (_zero_bytes, ("sd.db", "empty")),
    "budget-5s": (lambda tmp: (["--budget", "5s"], ""), ("budget",)),
    "missing-storage-folder": (lambda tmp: (["--storage", "sqlite:////nonexistent/x.db"], ""), ("/nonexistent",)),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_run_leaves_the_unit_alone(served: Served, tmp_path: Path, locks: Path, case: str) -> None:
    make, words = REFUSALS[case]
    args, _ = make(tmp_path)
    before = served.ensure_serving()
    config = served.config(tmp_path)
    proc = run_tuner("run", "--config", str(config), "--trials", "1", *args, cwd=tmp_path, timeout_s=150)
    line = _one_line_error(proc)
    assert all(w in line for w in words), line
    assert served.pid_state() == before, f"the unit was touched: {line}\n{served.journal_tail()}"
    assert served.tuner_dropins() == []
    assert not list((tmp_path / "state").glob("*.state.json")) if (tmp_path / "state").exists() else True


def test_url_port_mismatch_is_refused_before_any_change(served: Served, tmp_path: Path, locks: Path) -> None:
    other = free_port()
    before = served.ensure_serving()
    config = served.config(tmp_path, url=f"http://127.0.0.1:{other}")
    proc = run_tuner("run", "--config", str(config), "--trials", "1", cwd=tmp_path, timeout_s=150)
    line = _one_line_error(proc)
    assert str(other) in line and str(served.port) in line, line
    assert served.pid_state() == before
    assert served.tuner_dropins() == []
    leftovers = [p.name for d in (locks, tmp_path / "state") if d.exists() for p in d.iterdir()]
    assert leftovers == [], leftovers


def _failing_journalctl(tmp: Path) -> list[str]:
    script = tmp / "journalctl-failing"
    script.write_text("#!/bin/sh\necho 'Failed to open journal: Input/output error' >&2\nexit 1\n")
    script.chmod(0o755)
    return [str(script)]


@pytest.mark.parametrize("case", ["missing", "failing"])
def test_broken_journal_is_refused_before_any_change(served: Served, tmp_path: Path, locks: Path, case: str) -> None:
    journalctl = ["/nonexistent/journalctl"] if case == "missing" else _failing_journalctl(tmp_path)
    before = served.ensure_serving()
    config = served.config(tmp_path, journalctl=journalctl)
    proc = run_tuner("run", "--config", str(config), "--trials", "1", cwd=tmp_path, timeout_s=150)
    line = _one_line_error(proc)
    assert "journal" in line and journalctl[0] in line, line
    assert served.pid_state() == before
    assert served.tuner_dropins() == []


def _in_trial(served: Served) -> bool:
    return TRIAL_DROPIN in served.tuner_dropins() and is_healthy(served.url, 0.5)


@contextlib.contextmanager
def _read_only(folder: Path) -> Iterator[None]:
    """``folder`` read-only for the tuner (a bind mount on the host; systemd in its namespace still reads it)."""
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_second_tuner_refused_then_restore_never_makes_things_worse(served: Served, tmp_path: Path, locks: Path) -> None:
    served.ensure_serving()
    first = served.config(tmp_path, name="first", state="state-first", measure_s=40)
    second = served.config(tmp_path, name="second", state="state-second")
    holder = background_run(first, tmp_path, "--trials", "2")
    try:
        wait_for(lambda: _in_trial(served), 150, "the first tuner's baseline to serve", holder)
        time.sleep(2.0)  # inside its load phase: the first tuner does not restart the unit for 40 s
        before = served.pid_state()
        proc = run_tuner("run", "--config", str(second), "--trials", "1", cwd=tmp_path, timeout_s=120)
        line = _one_line_error(proc)
        assert str(holder.pid) in line and "tuner" in line, line
        assert served.pid_state() == before, "the refused tuner touched the unit"
        assert not (tmp_path / "state-second").exists() or not list((tmp_path / "state-second").iterdir())
        # restore (and apply) by anyone else is refused too while the first tuner lives
        proc = run_tuner("restore", "--config", str(second), cwd=tmp_path, timeout_s=120)
        assert str(holder.pid) in _one_line_error(proc)
        assert served.pid_state() == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    # The first tuner died by kill -9 while its trial served: its state file is the restore recipe.
    assert TRIAL_DROPIN in served.tuner_dropins()
    serving = served.pid_state()
    assert serving[1] == "active"
    with _read_only(served.trial_folder):
        proc = run_tuner("restore", "--config", str(first), cwd=tmp_path, timeout_s=120)
        line = _one_line_error(proc)
        assert str(served.trial_folder) in line, line
        assert served.pid_state() == serving, "restore stopped a serving unit it could not put back"
        assert is_healthy(served.url, 5)
        proc = run_tuner("run", "--config", str(second), "--trials", "1", cwd=tmp_path, timeout_s=120)
        assert str(served.trial_folder) in _one_line_error(proc)
        assert served.pid_state() == serving
    proc = run_tuner("restore", "--config", str(first), cwd=tmp_path, timeout_s=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert served.tuner_dropins() == [] and served.pid_state()[1] == "active"
    assert is_healthy(served.url, 60)
    assert requests.get(f"{served.url}/get_server_info", timeout=5).json()["mem_fraction_static"] == 0.80


def _dying_journalctl(tmp: Path, box: SystemdSandbox) -> tuple[list[str], Path]:
    flag = tmp / "journal-dead"
    script = tmp / "journalctl-dying"
    real = " ".join(f"'{w}'" for w in box.journalctl)
    script.write_text(f"#!/bin/sh\nif [ -e '{flag}' ]; then echo 'Failed to get journal access: Bad message' >&2; "
                      f"exit 1; fi\nexec {real} \"$@\"\n")
    script.chmod(0o755)
    return [str(script)], flag


def test_journal_dying_mid_run_is_reported_not_a_silent_success(served: Served, tmp_path: Path, locks: Path) -> None:
    served.ensure_serving()
    journalctl, flag = _dying_journalctl(tmp_path, served.box)
    config = served.config(tmp_path, journalctl=journalctl, measure_s=8)
    with running(config, tmp_path, "--trials", "3") as run:
        wait_for(lambda: _in_trial(served), 150, "the baseline to serve", run)
        flag.touch()
        _, err = run.communicate(timeout=300)
    assert run.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "journal" in err.splitlines()[-1], err[-3000:]
    assert "warning" in err.lower(), err[-3000:]
    study = load(f"sqlite:///{tmp_path}/studies/sd.db", "sd")
    record = TrialRecord.model_validate(study.trials[0].user_attrs["tuner.record"])
    assert record.outcome == "failed" and record.failure_class.value == "journal_unreadable", record
    assert len(study.trials) == 1, "the run went on without a journal"
    # restored on its own command although the journal stayed broken (health only)
    assert served.tuner_dropins() == [] and served.pid_state()[1] == "active"
    assert is_healthy(served.url, 60)


def test_drop_in_folder_unwritable_mid_run_stops_the_run(served: Served, tmp_path: Path, locks: Path) -> None:
    served.ensure_serving()
    config = served.config(tmp_path, measure_s=4)
    storage = f"sqlite:///{tmp_path}/studies/sd.db"
    with running(config, tmp_path, "--trials", "4") as run:
        wait_for(lambda: _completed(storage) >= 1 and _in_trial(served), 200, "the baseline to finish", run)
        with _read_only(served.trial_folder):
            _, err = run.communicate(timeout=300)
            after = served.pid_state()
    assert run.returncode == 1, err[-3000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert str(served.trial_folder) in lines[-1] and "Traceback" not in err, err[-3000:]
    study = load(storage, "sd")
    crashes = [t.number for t in study.trials if (t.user_attrs.get("tuner.record") or {}).get("failure_class") == "crash"]
    assert crashes == [], f"false server crashes recorded: {crashes}"
    assert after[1] == "active", "the unit was left stopped"
    assert is_healthy(served.url, 10)
    proc = run_tuner("restore", "--config", str(config), cwd=tmp_path, timeout_s=200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert served.tuner_dropins() == [] and served.pid_state()[1] == "active"


def test_drop_in_folder_turning_read_only_while_the_unit_stops_is_no_crash(served: Served, tmp_path: Path,
                                                                            locks: Path) -> None:
    """The folder passes the check before the stop and is read-only when the drop-in is written
    (a unit whose ExecStop= takes 3 s, the folder remounted meanwhile): the run stops naming the
    folder, records no server crash, and `tuner restore` puts the unit back on its own command."""
    box = served.box
    unit = Served(box)
    marker = tmp_path / "stopping"
    unit.add_to(box, f"ExecStop=/bin/sh -c 'touch {marker}; sleep 3'\n")
    unit.dropin_folder.mkdir()  # a site drop-in: the folder exists before the run (so it can be remounted)
    (unit.dropin_folder / "10-site.conf").write_text("[Service]\nEnvironment=SITE=1\n")
    box.systemctl_run("daemon-reload")
    box.systemctl_run("start", unit.unit)
    try:
        unit.ensure_serving()
        config = unit.config(tmp_path, measure_s=4)
        storage = f"sqlite:///{tmp_path}/studies/sd.db"
        with running(config, tmp_path, "--trials", "3") as run:
            wait_for(lambda: _completed(storage) >= 1, 300, "the baseline to finish", run)
            marker.unlink(missing_ok=True)
            wait_for(marker.exists, 200, "the unit to be stopped for trial 1", run)
            with _read_only(unit.trial_folder):  # holds the baseline's trial drop-in until the next is written
                _, err = run.communicate(timeout=300)
        assert run.returncode == 1, err[-3000:]
        lines = [x for x in err.splitlines() if x.strip()]
        assert str(unit.trial_folder) in lines[-1] and "Traceback" not in err, err[-3000:]
        records = [t.user_attrs.get("tuner.record") or {} for t in load(storage, "sd").trials]
        assert [r.get("failure_class") for r in records if r.get("failure_class") == "crash"] == [], records
        proc = run_tuner("restore", "--config", str(config), cwd=tmp_path, timeout_s=200)  # now writable again
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert unit.tuner_dropins() == ["10-site.conf"] and unit.pid_state()[1] == "active"
        assert is_healthy(unit.url, 60)
    finally:
        box.systemctl_run("stop", unit.unit, check=False)


def _completed(storage: str) -> int:
    if not study_created(Path(storage.removeprefix("sqlite:///"))):
        return 0  # read only once the run made it (a second schema creation can collide with the run's)
    try:
        return sum(1 for t in load(storage, "sd").trials if t.state == TrialState.COMPLETE)
    except Exception:  # noqa: BLE001 - not created yet
        return 0


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
            wait_for(lambda: _completed(storage) >= 1, 200, "the first completed trial", run)
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
            wait_for(lambda: _completed(storage) >= 1, 300, "the baseline to finish", run)
            if when == "starting":
                gate.touch()
                wait_for(lambda: TRIAL_DROPIN in unit.tuner_dropins() and unit.pid_state()[1] == "activating", 200,
                      "trial 1's drop-in with the unit held before its start", run)
            else:
                baseline_pid = unit.pid_state()[0]
                wait_for(lambda: unit.pid_state()[0] not in (0, baseline_pid) and _in_trial(unit), 200,
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
            wait_for(lambda: _in_trial(served), 150, "the baseline to serve", run)
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
