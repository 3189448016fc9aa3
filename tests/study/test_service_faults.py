"""Fault suite: an operator's bad day under real systemd 252 in a PID namespace (the simulator as the unit).

Every case reads the unit's ``MainPID`` and ``ActiveState`` before and after: a refusal must change
nothing on the host (not even a restart), a second tuner on the same unit is refused naming the
holder, a broken journal is refused up front or reported as its own failure, a restore that cannot
write the drop-in folder leaves the serving unit serving (the disk and the reboot are in
``test_service_faults_disk.py``). Real parts only: the sandbox's systemd and journald, the
simulator as a real server process, real SQLite files, a real read-only bind mount.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import requests

from tests.support.cli import one_error_line, run_tuner
from tests.support.configs import load_study as load
from tests.support.net import free_port
from tests.support.sandbox import SystemdSandbox
from tests.support.served_unit import (
    TRIAL_DROPIN,
    Served,
    background_run,
    completed_trials,
    in_trial,
    running,
    wait_for,
)
from tests.support.sim import is_healthy
from tuner.records import TrialRecord

pytestmark = [pytest.mark.slow, pytest.mark.systemd]


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
        wait_for(lambda: in_trial(served), 150, "the first tuner's baseline to serve", holder)
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
        wait_for(lambda: in_trial(served), 150, "the baseline to serve", run)
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
        wait_for(lambda: completed_trials(storage) >= 1 and in_trial(served), 200, "the baseline to finish", run)
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
            wait_for(lambda: completed_trials(storage) >= 1, 300, "the baseline to finish", run)
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
