"""Production habits (issue 28): ``[service]`` pre-restart and post-ready hooks around every restart
and the final restore (a failing hook stops the run in one line, the service restored), and a
maintenance window outside which no restart starts (the run waits or stops and says which). Real
runs of the demo config on the simulator (the process launcher, real SQLite)."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.support.cli import one_error_line, run_tuner
from tests.support.configs import config_copy
from tuner.config import load_config
from tuner.errors import ConfigError
from tuner.units import MaintenanceWindow

PHASES = {"warmup_s": 1, "measure_s": 3, "stress_s": 2}


def test_a_window_is_local_minutes_and_may_wrap_midnight() -> None:
    night = MaintenanceWindow.parse("22:00-04:00")
    assert night.contains(datetime(2026, 1, 1, 23, 30)) and night.contains(datetime(2026, 1, 1, 3, 59))
    assert not night.contains(datetime(2026, 1, 1, 4, 0)) and not night.contains(datetime(2026, 1, 1, 12, 0))
    assert night.seconds_until_open(datetime(2026, 1, 1, 21, 0)) == 3600
    early = MaintenanceWindow.parse("02:00-05:00")
    assert early.seconds_until_open(datetime(2026, 1, 1, 6, 0)) == 20 * 3600  # tomorrow at 02:00
    assert early.seconds_until_open(datetime(2026, 1, 1, 2, 30)) == 0


@pytest.mark.parametrize(("line", "needle"), [
    ('window = "25:00-03:00"', "service.window"),
    ('window = "2am-5am"', "HH:MM-HH:MM"),
    ("pre_restart = []", "empty hook"),
    ('outside_window = "later"', "service.outside_window"),
])
def test_bad_hook_or_window_values_are_one_line(tmp_path: Path, line: str, needle: str) -> None:
    config = config_copy("demo-sim.toml", tmp_path, extra_service=line + "\n", slo=False)
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert needle in str(err.value)


def _hook(tmp_path: Path, log: Path, code: int = 0) -> str:
    script = tmp_path / f"hook-{code}.sh"
    script.write_text(f'#!/bin/sh\necho "$SGLANG_TUNER_HOOK $SGLANG_TUNER_REASON $SGLANG_TUNER_URL" >> {log}\n'
                      f'echo "drain refused by the balancer" >&2\nexit {code}\n', encoding="utf-8")
    script.chmod(0o755)
    return str(script)


@pytest.mark.slow
def test_hooks_run_around_every_restart_and_the_final_restore(workdir: Path) -> None:
    log = workdir / "hooks.log"
    hook = _hook(workdir, log)
    config = config_copy("demo-sim.toml", workdir, phases=PHASES,
                         extra_service=f'pre_restart = ["{hook}"]\npost_ready = "{hook}"\n', slo=False)
    proc = run_tuner("run", "--config", str(config), "--trials", "2", cwd=workdir, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    calls = [line.split()[:2] for line in log.read_text().splitlines()]
    assert calls[:4] == [["pre_restart", "trial"], ["post_ready", "trial"]] * 2
    assert calls[-2:] == [["pre_restart", "restore"], ["post_ready", "restore"]]
    assert all(line.split()[2].startswith("http://127.0.0.1:") for line in log.read_text().splitlines())


def test_a_failing_drain_stops_the_run_in_one_line_and_restarts_nothing(workdir: Path) -> None:
    log = workdir / "hooks.log"
    config = config_copy("demo-sim.toml", workdir, phases=PHASES,
                         extra_service=f'pre_restart = ["{_hook(workdir, log, code=3)}"]\n', slo=False)
    proc = run_tuner("run", "--config", str(config), "--trials", "3", cwd=workdir, timeout_s=300)
    line = one_error_line(proc, "[service] pre_restart hook", "exited 3", "drain refused by the balancer",
                          "nothing is left to undo")
    assert "Traceback" not in line
    # the drain before the baseline's restart failed: no restart, so no drain around a final restore either
    assert [entry.split()[:2] for entry in log.read_text().splitlines()] == [["pre_restart", "trial"]]


def test_outside_the_window_no_restart_starts_and_the_run_says_so(workdir: Path) -> None:
    later = datetime.now() + timedelta(hours=3)
    window = f"{later:%H}:00-{(later + timedelta(hours=1)):%H}:00"
    log = workdir / "hooks.log"
    config = config_copy("demo-sim.toml", workdir, phases=PHASES, extra_service=(
        f'window = "{window}"\noutside_window = "stop"\npre_restart = ["{_hook(workdir, log)}"]\n'), slo=False)
    proc = run_tuner("run", "--config", str(config), "--trials", "2", cwd=workdir, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = " ".join((proc.stdout + proc.stderr).split())
    assert f"outside the maintenance window {window}" in out and "stopping, no restart started" in out
    assert "stopped by window" in out
    assert not log.exists()  # no restart, so no hook either
    # the budget cannot hold the wait: "wait" stops too, saying why
    config = config_copy("demo-sim.toml", workdir, phases=PHASES, extra_service=f'window = "{window}"\n', slo=False)
    proc = run_tuner("run", "--config", str(config), "--budget", "5m", cwd=workdir, timeout_s=300)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0 and "the budget does not hold the" in out and "stopped by window" in out


def test_a_hook_that_cannot_run_is_refused_before_anything_changes(workdir: Path) -> None:
    config = config_copy("demo-sim.toml", workdir, phases=PHASES, extra_service='post_ready = ["/nonexistent/drain"]\n', slo=False)
    for args in (("--dry-run",), ("--trials", "1")):
        proc = run_tuner("run", "--config", str(config), *args, cwd=workdir, timeout_s=120)
        one_error_line(proc, "[service] post_ready program '/nonexistent/drain'")
    assert not (workdir / "studies" / "demo-sim.db").exists()  # refused before the study was created
