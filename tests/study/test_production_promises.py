"""Production promises (issue 43), under real systemd 252 in a PID namespace (the simulator as the unit).

* **A run that changed nothing changes nothing**: on every exit path before the first restart
  (a refusal, a window stop, a drain that fails, a budget spent, Ctrl-C, a storage error) the unit's
  ``MainPID`` is unchanged and the tuner called no ``systemctl`` verb that changes anything (every
  call goes through a logging wrapper named as ``[service] systemctl``); no state file, drop-in or
  lock file is left.
* **The window bounds restarts**: a trial starts only when it and the final restore end before the
  window closes; the summary says when the restore ended and whether inside the window.
* **Drains guard**: a failed or timed-out ``pre_restart`` means no restart of the server, neither
  the trial's nor the final restore's; the run stops in one line saying what the service runs and
  what to do; a timed-out hook's process group is killed whole; a ``post_ready`` failure is stored
  as such.
* **Restore after a reboot** sees the unit already on its own command and only removes the state file.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import optuna
import psutil
import pytest

from tests.support.cli import one_error_line, run_tuner
from tests.support.configs import load_study
from tests.support.immutable import immutable
from tests.support.postgres import PASSWORD
from tests.support.served_unit import Calls, Served, wait_for
from tests.support.sim import is_healthy
from tuner.config import load_config
from tuner.records import TrialRecord
from tuner.study.budget import prior_trial_cost_s

pytestmark = [pytest.mark.slow, pytest.mark.systemd]

def _left_over(tmp: Path, served: Served) -> list[str]:
    """What a run that changed nothing must not leave: a state file, a lock file, a tuner drop-in."""
    files = [p.name for d in (tmp / "state", tmp / "locks") if d.exists() for p in d.glob("*")
             if p.suffix in (".json", ".lock")]
    return files + served.tuner_dropins()


def _hhmm(when: datetime) -> str:
    return f"{when:%H:%M}"


def _later_window() -> str:
    later = datetime.now() + timedelta(hours=3)
    return f"{_hhmm(later)}-{_hhmm(later + timedelta(hours=1))}"


def _opening_soon(min_s: float = 12.0) -> tuple[str, float]:
    """A window opening at the next minute (at least ``min_s`` from now: waits past a minute's end
    otherwise), 30 minutes long; and seconds until it opens."""
    now = datetime.now()
    if 60 - now.second < min_s:
        time.sleep(60 - now.second + 0.5)
        now = datetime.now()
    opens = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    return f"{_hhmm(opens)}-{_hhmm(opens + timedelta(minutes=30))}", (opens - now).total_seconds()


def _background(config: Path, tmp: Path, *args: str) -> tuple[subprocess.Popen[str], Path]:
    out = tmp / "run.out"
    proc = subprocess.Popen([sys.executable, "-m", "tuner.cli", "run", "--config", str(config), *args], cwd=tmp,
                            stdout=out.open("w"), stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, COLUMNS="200", NO_COLOR="1"))
    return proc, out


def _refused_budget(served: Served, tmp: Path, calls: Calls) -> tuple[subprocess.CompletedProcess[str], str]:
    config = served.config(tmp, systemctl=calls.systemctl)
    return run_tuner("run", "--config", str(config), "--budget", "5s", cwd=tmp, timeout_s=150), "budget"


def _window_stop(served: Served, tmp: Path, calls: Calls) -> tuple[subprocess.CompletedProcess[str], str]:
    config = served.config(tmp, systemctl=calls.systemctl,
                           service=f'window = "{_later_window()}"\noutside_window = "stop"\n')
    return run_tuner("run", "--config", str(config), "--trials", "2", cwd=tmp, timeout_s=150), "stopping, no restart started"


def _window_no_budget_to_wait(served: Served, tmp: Path, calls: Calls) -> tuple[subprocess.CompletedProcess[str], str]:
    config = served.config(tmp, systemctl=calls.systemctl, service=f'window = "{_later_window()}"\n')
    proc = run_tuner("run", "--config", str(config), "--budget", "10m", cwd=tmp, timeout_s=150)
    return proc, "the budget does not hold the"


def _drain_fails_first(served: Served, tmp: Path, calls: Calls) -> tuple[subprocess.CompletedProcess[str], str]:
    hook = calls.hook(tmp, 'echo "the balancer refused the drain" >&2\nexit 3')
    config = served.config(tmp, systemctl=calls.systemctl, service=f'pre_restart = ["{hook}"]\n')
    proc = run_tuner("run", "--config", str(config), "--trials", "2", cwd=tmp, timeout_s=150)
    return proc, "exited 3: the balancer refused the drain"


def _budget_spent_before_the_first_trial(served: Served, tmp: Path, calls: Calls) -> tuple[subprocess.CompletedProcess[str], str]:
    config = served.config(tmp, systemctl=calls.systemctl)
    cost = prior_trial_cost_s(load_config(config))
    assert cost == int(cost), cost  # a budget of exactly one trial passes the check, then the clock has run on
    proc = run_tuner("run", "--config", str(config), "--budget", f"{int(cost)}s", cwd=tmp, timeout_s=150)
    return proc, "stopped by budget"


def _interrupt_while_waiting(served: Served, tmp: Path, calls: Calls) -> tuple[subprocess.CompletedProcess[str], str]:
    config = served.config(tmp, systemctl=calls.systemctl, service=f'window = "{_later_window()}"\n')
    proc, out = _background(config, tmp, "--budget", "24h")
    wait_for(lambda: "waiting" in out.read_text(), 120, "the run to wait for the window", proc)
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), ""), "interrupted"


def _storage_error_while_waiting(served: Served, tmp: Path, calls: Calls) -> tuple[subprocess.CompletedProcess[str], str]:
    window, opens_in_s = _opening_soon()
    config = served.config(tmp, systemctl=calls.systemctl, service=f'window = "{window}"\n')
    proc, out = _background(config, tmp, "--budget", "2h")
    wait_for(lambda: "waiting" in out.read_text(), 120, "the run to wait for the window", proc)
    studies = tmp / "studies"
    with immutable(studies / "sd.db"), immutable(studies):  # the study's database refuses every write
        proc.wait(opens_in_s + 120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), ""), "error: "


EXIT_PATHS = {
    "refused: budget too short": (_refused_budget, 1),
    "window: outside_window stop": (_window_stop, 0),
    "window: no budget to wait": (_window_no_budget_to_wait, 0),
    "pre_restart fails before the first restart": (_drain_fails_first, 1),
    "budget spent before the first trial": (_budget_spent_before_the_first_trial, 0),
    "interrupt before the first start": (_interrupt_while_waiting, 130),
    "storage error before the first start": (_storage_error_while_waiting, 1),
}


@pytest.mark.parametrize("case", list(EXIT_PATHS))
def test_a_run_that_changed_nothing_changes_nothing(served: Served, tmp_path: Path, locks: Path, case: str) -> None:
    make, code = EXIT_PATHS[case]
    before = served.ensure_serving()
    calls = Calls(tmp_path, served)
    proc, needle = make(served, tmp_path, calls)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == code, said[-2000:]
    assert needle in said, said[-2000:]
    assert "Traceback" not in said
    assert calls.changing() == [], f"{case}: systemctl changed the unit\n{said[-1500:]}"
    assert served.pid_state() == before, f"{case}: the unit was restarted\n{served.journal_tail()}"
    assert _left_over(tmp_path, served) == []
    if code in (0, 130):
        assert "service not restarted: the run changed nothing" in said, said[-1500:]
    if case.startswith("pre_restart"):
        assert "was not restarted: it still runs its own flags, and nothing is left to undo" in said, said


def _window_around_now(after_s: float) -> str:
    """A window open now that closes between ``after_s`` and ``after_s + 60`` s from now (local time)."""
    now = datetime.now()
    closes = now.replace(second=0, microsecond=0) + timedelta(minutes=math.ceil((after_s + now.second) / 60))
    return f"{_hhmm(now - timedelta(minutes=2))}-{_hhmm(closes)}"


def test_no_trial_starts_when_it_and_the_restore_would_end_after_the_window(
        served: Served, tmp_path: Path, locks: Path) -> None:
    """The window is open, but closes before the next trial (its estimate) and the restore would
    end: the old check (open at the trial's start) started it, and restored after the close."""
    before = served.ensure_serving()
    calls = Calls(tmp_path, served)
    probe = served.config(tmp_path, systemctl=calls.systemctl, budget="restore_reserve_s = 100\n")
    need_s = prior_trial_cost_s(load_config(probe)) + 100
    window = _window_around_now(5)  # closes 5-65 s from now, well before need_s
    assert need_s > 70
    config = served.config(tmp_path, systemctl=calls.systemctl, budget="restore_reserve_s = 100\n",
                           service=f'window = "{window}"\noutside_window = "stop"\n')
    proc = run_tuner("run", "--config", str(config), "--trials", "2", cwd=tmp_path, timeout_s=150)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0, said[-2000:]
    assert f"the maintenance window {window} (local time) closes in" in said, said
    assert "before the next trial (about" in said and "and the final restore (about 1m40s) would end" in said, said
    assert "stopped by window" in said and calls.changing() == [] and served.pid_state() == before


def test_the_summary_says_the_final_restore_ended_after_the_window(served: Served, tmp_path: Path, locks: Path) -> None:
    """A trial that fits (its estimate and the restore's) starts; its restore is held past the
    window's close (the drain before the restore takes that long): the summary says the restore
    ended after the window closed, and by how much, instead of "restored" alone."""
    served.ensure_serving()
    calls = Calls(tmp_path, served)
    probe = served.config(tmp_path, systemctl=calls.systemctl, budget="restore_reserve_s = 1\n")
    need_s = prior_trial_cost_s(load_config(probe)) + 1
    window = _window_around_now(need_s + 25)
    closes = datetime.strptime(window.split("-")[1], "%H:%M").time()
    close_at = datetime.combine(datetime.now().date(), closes)
    # the drain before the final restore lasts until 2 s after the close
    hook = calls.hook(tmp_path, f'[ "$SGLANG_TUNER_REASON" = restore ] && sleep $(( {int(close_at.timestamp())} + 2 '
                                '- $(date +%s) ))\nexit 0')
    config = served.config(tmp_path, systemctl=calls.systemctl, budget="restore_reserve_s = 1\n",
                           service=f'window = "{window}"\noutside_window = "stop"\npre_restart = ["{hook}"]\n')
    proc = run_tuner("run", "--config", str(config), "--trials", "1", cwd=tmp_path, timeout_s=400)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0, said[-2000:]
    assert "1 trial(s) launched" in said, said[-2000:]
    assert f"after the maintenance window {window} closed (the last trial ran past its estimate)" in said, said[-2000:]
    assert [x for x in calls.lines() if x.startswith("HOOK")] == ["HOOK pre_restart trial", "HOOK pre_restart restore"]


def test_a_drain_failing_at_a_later_trial_restarts_nothing_and_restore_takes_it_from_there(
        served: Served, tmp_path: Path, locks: Path) -> None:
    served.ensure_serving()
    calls = Calls(tmp_path, served)
    count = tmp_path / "drains"
    hook = calls.hook(tmp_path, f'echo x >> {count}\n[ "$(wc -l < {count})" -lt 2 ] || {{ echo "balancer down" >&2; exit 3; }}')
    config = served.config(tmp_path, systemctl=calls.systemctl, service=f'pre_restart = ["{hook}"]\n')
    proc = run_tuner("run", "--config", str(config), "--trials", "3", cwd=tmp_path, timeout_s=300)
    line = one_error_line(proc, "[service] pre_restart hook", "exited 3: balancer down",
                          "was not restarted and still runs a trial's flags", "tuner restore --unit")
    hooks = [i for i, x in enumerate(calls.lines()) if x.startswith("HOOK")]
    assert [calls.lines()[i] for i in hooks] == ["HOOK pre_restart trial"] * 2, calls.lines()  # no drain around a restore
    assert calls.changing(after=hooks[1]) == [], "the unit was restarted after the drain failed"
    serving = served.pid_state()
    assert serving[1] == "active" and "90-tuner-trial.conf" in served.tuner_dropins()
    assert list((tmp_path / "state").glob("*.state.json")), line  # kept for `tuner restore`
    stored = load_study(f"sqlite:///{tmp_path}/studies/sd.db", "sd").trials[1]
    evidence = TrialRecord.model_validate(stored.user_attrs["tuner.record"]).failure_evidence or ""
    assert evidence.startswith("not measured: [service] pre_restart hook"), evidence
    # once the drain works, `tuner restore` puts the original back from the state file
    proc = run_tuner("restore", "--config", str(config), cwd=tmp_path, timeout_s=200)
    assert proc.returncode == 0 and "restored" in proc.stdout, proc.stderr[-2000:]
    assert served.tuner_dropins() == [] and is_healthy(served.url, 60) and served.pid_state()[0] != serving[0]


def test_a_drain_failing_before_the_final_restore_restarts_nothing(served: Served, tmp_path: Path, locks: Path) -> None:
    """The run ends (its trial cap) and the drain before the final restore fails: the unit is not
    restarted (it was restarted undrained, with the failure a warning), it keeps the trial's flags
    and the state file for `tuner restore`, and the run exits 1 saying so."""
    served.ensure_serving()
    calls = Calls(tmp_path, served)
    hook = calls.hook(tmp_path, '[ "$SGLANG_TUNER_REASON" = restore ] && { echo "balancer down" >&2; exit 3; }\nexit 0')
    config = served.config(tmp_path, systemctl=calls.systemctl, service=f'pre_restart = ["{hook}"]\n')
    proc = run_tuner("run", "--config", str(config), "--trials", "1", cwd=tmp_path, timeout_s=300)
    one_error_line(proc, "exited 3: balancer down before the final restore",
                   "was not restarted and still runs a trial's flags", "tuner restore --unit")
    lines = calls.lines()
    drain = lines.index("HOOK pre_restart restore")
    assert calls.changing(after=drain) == [], lines[drain:]
    assert "90-tuner-trial.conf" in served.tuner_dropins() and served.pid_state()[1] == "active"
    assert list((tmp_path / "state").glob("*.state.json"))
    proc = run_tuner("restore", "--config", str(config), cwd=tmp_path, timeout_s=200)
    assert proc.returncode == 0 and served.tuner_dropins() == [] and is_healthy(served.url, 60), proc.stderr[-2000:]


def test_a_hanging_drain_is_killed_with_its_children_and_restarts_nothing(
        served: Served, tmp_path: Path, locks: Path) -> None:
    before = served.ensure_serving()
    calls = Calls(tmp_path, served)
    pids = tmp_path / "children"
    hook = calls.hook(tmp_path, f"sleep 300 &\necho $! >> {pids}\nsleep 300")
    config = served.config(tmp_path, systemctl=calls.systemctl, service=f'pre_restart = ["{hook}"]\nhook_timeout_s = 2\n')
    begun = time.monotonic()
    proc = run_tuner("run", "--config", str(config), "--trials", "2", cwd=tmp_path, timeout_s=150)
    took = time.monotonic() - begun
    one_error_line(proc, "[service] pre_restart hook", "did not finish in 2 s", "its process group was killed",
                   "was not restarted: it still runs its own flags")
    assert [x for x in calls.lines() if x.startswith("HOOK")] == ["HOOK pre_restart trial"]  # hung once, not twice
    assert took < 60, took
    child = int(pids.read_text().split()[0])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE, "a hook's child was left"
    assert calls.changing() == [] and served.pid_state() == before and _left_over(tmp_path, served) == []


def test_a_failing_post_ready_is_stored_as_such_and_the_service_restored(served: Served, tmp_path: Path, locks: Path) -> None:
    served.ensure_serving()
    calls = Calls(tmp_path, served)
    hook = calls.hook(tmp_path, '[ "$SGLANG_TUNER_REASON" = trial ] && { echo "pool add failed" >&2; exit 4; }\nexit 0')
    config = served.config(tmp_path, systemctl=calls.systemctl, service=f'post_ready = ["{hook}"]\n')
    proc = run_tuner("run", "--config", str(config), "--trials", "2", cwd=tmp_path, timeout_s=300)
    one_error_line(proc, "[service] post_ready hook", "exited 4: pool add failed", "once the trial's server was ready")
    stored = load_study(f"sqlite:///{tmp_path}/studies/sd.db", "sd").trials[0]
    evidence = TrialRecord.model_validate(stored.user_attrs["tuner.record"]).failure_evidence or ""
    assert evidence.startswith("not measured: [service] post_ready hook") and "could not be changed" not in evidence
    assert served.tuner_dropins() == [] and is_healthy(served.url, 60)  # restored
    assert [x for x in calls.lines() if x.startswith("HOOK")] == ["HOOK post_ready trial", "HOOK post_ready restore"]


def test_no_file_the_run_writes_and_no_refusal_holds_the_storage_password(
        served: Served, tmp_path: Path, locks: Path, postgres_url: str) -> None:
    """A run on the fleet's PostgreSQL storage, its password in ``--storage`` as the README tells
    every host: while it holds the unit, its lock file (0600) and state file, and the "being tuned
    by another tuner" refusals of ``run``, ``restore`` and ``apply``, hold no password; after it,
    no file it wrote (state folder, lock folder, artifacts, its output) does."""
    assert f":{PASSWORD}@" in postgres_url
    served.ensure_serving()
    config = served.config(tmp_path, measure_s=15)
    proc, out = _background(config, tmp_path, "--storage", postgres_url, "--trials", "2")
    try:
        wait_for(lambda: _finished(postgres_url) >= 1, 240, "the baseline to be stored", proc)
        lock = next(locks.glob("*.lock"))
        assert oct(lock.stat().st_mode & 0o777) == "0o600"
        held = {"lock file": lock.read_text(), "state file": next((tmp_path / "state").glob("*.state.json")).read_text()}
        assert "***@" in held["lock file"] and "***@" in held["state file"], held
        for name, argv in {"run": ("run", "--config", str(config), "--storage", postgres_url, "--trials", "1"),
                           "restore": ("restore", "--config", str(config)),
                           "apply": ("apply", "0", "--config", str(config), "--study", "sd", "--storage", postgres_url,
                                     "--yes")}.items():
            refused = run_tuner(*argv, cwd=tmp_path, timeout_s=120)
            held[name] = refused.stdout + refused.stderr
            assert refused.returncode == 1 and "is being tuned by another tuner" in held[name], (name, held[name])
        for name, text in held.items():
            assert PASSWORD not in text, (name, text)
        assert proc.wait(300) == 0, out.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any("artifacts" in p.parts for p in written) and (tmp_path / "run.out") in written  # what the run wrote
    leaks = [str(p) for p in written if PASSWORD.encode() in p.read_bytes()]
    assert leaks == [], leaks
    assert list(locks.glob("*.lock")) == []  # released by its owner: removed


def _finished(url: str) -> int:
    try:
        study = optuna.load_study(study_name="sd", storage=url)
    except KeyError:
        return 0
    return sum(1 for t in study.get_trials(deepcopy=False) if t.state.is_finished())
