"""Production promises (issue 43), under real systemd 252 in a PID namespace (the simulator as the unit).

* **A run that changed nothing changes nothing**: on every exit path before the first restart
  (a refusal, a window stop, a drain that fails, a budget spent, Ctrl-C, a storage error) the unit's
  ``MainPID`` is unchanged and the tuner called no ``systemctl`` verb that changes anything (every
  call goes through a logging wrapper named as ``[service] systemctl``); no state file, drop-in or
  lock file is left.
* **The window bounds restarts**: a trial starts only when it and the final restore end before the
  window closes; the summary says when the restore ended and whether inside the window.
* **Drains guard** (``test_production_drains.py``, beside this module in its own sandbox).
* **Restore after a reboot** sees the unit already on its own command and only removes the state file.
"""

from __future__ import annotations

import math
import signal
import subprocess
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.support.cli import run_tuner
from tests.support.immutable import immutable
from tests.support.served_unit import Calls, Served, left_over, logged_run, wait_for
from tuner.config import load_config
from tuner.study.budget import prior_trial_cost_s

pytestmark = [pytest.mark.slow, pytest.mark.systemd]

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
    proc, out = logged_run(config, tmp, "--budget", "24h")
    wait_for(lambda: "waiting" in out.read_text(), 120, "the run to wait for the window", proc)
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), ""), "interrupted"


def _storage_error_while_waiting(served: Served, tmp: Path, calls: Calls) -> tuple[subprocess.CompletedProcess[str], str]:
    window, opens_in_s = _opening_soon()
    config = served.config(tmp, systemctl=calls.systemctl, service=f'window = "{window}"\n')
    proc, out = logged_run(config, tmp, "--budget", "2h")
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
    assert left_over(tmp_path, served) == []
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
