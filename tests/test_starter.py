"""`starter_config` / `tuner init`: a config that validates, and whose trials measure something.

Unit tests of the simulator's template and of the unit path's refusal (docker-systemctl-replacement
put first on PATH as ``systemctl``; reading a unit's ExecStart needs systemd's real unit paths,
which ``starter_config`` offers no seam for), then real CLI processes: init, then
`tuner run --trials 1` on the simulated server on a free port.
"""

from __future__ import annotations

import os
import stat
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.cli import run_tuner
from tests.support.configs import load_study
from tests.support.net import free_port
from tests.support.sandbox import boot_sandbox
from tuner.config import parse_config
from tuner.errors import LaunchError
from tuner.records import TrialRecord
from tuner.starter import starter_config


def test_sim_starter_validates_and_runs_this_python() -> None:
    text = starter_config(unit=None, sim=True)
    config = parse_config(tomllib.loads(text), source="starter")
    assert config.service.launcher == "process" and config.service.command[0] == sys.executable
    assert "tuner.sim" in config.service.command and config.service.url == "http://127.0.0.1:30000"
    assert config.budget.measure_s > config.budget.warmup_s > 0
    assert config.slo.ttft_ms and config.slo.itl_ms  # both latency limits are set: feasible means something
    assert starter_config(unit="ignored.service", sim=True) == text


@pytest.fixture()
def systemctl_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The emulator's systemctl first on PATH (``starter_config`` calls plain ``systemctl``)."""
    with pytest.warns(UserWarning, match="starter reads a unit file"), \
            boot_sandbox(tmp_path / "emu", force_emulator="starter reads a unit file") as box:
        shim = tmp_path / "bin" / "systemctl"
        shim.parent.mkdir()
        shim.write_text("#!/bin/sh\nexec " + " ".join(f"'{w}'" for w in box.systemctl) + ' "$@"\n')
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("PATH", f"{shim.parent}:{os.environ['PATH']}")
        yield box


def test_unit_starter_for_an_unknown_unit_is_one_line(systemctl_on_path) -> None:
    with pytest.raises(LaunchError, match="unit nosuch.service is unknown to systemd") as err:
        starter_config(unit="nosuch.service", sim=False)
    assert "\n" not in str(err.value)


@pytest.mark.serial  # p99 ITL against the starter's SLO: 4 workers on 2 cores would starve the client
def test_init_sim_starter_config_runs_a_feasible_measured_trial(workdir: Path) -> None:
    config = workdir / "t.toml"
    init = run_tuner("init", "--sim", "-o", str(config), cwd=workdir, timeout_s=60)
    assert init.returncode == 0, init.stderr
    config.write_text(config.read_text().replace("30000", str(free_port())))
    proc = run_tuner("run", "--config", str(config), "--trials", "1", cwd=workdir, timeout_s=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trial 0: capacity" in proc.stdout and ", feasible" in proc.stdout, proc.stdout
    (trial,) = load_study(f"sqlite:///{workdir / 'studies' / 'llama-3.1-8b-l40s-sim.db'}", "llama-3.1-8b-l40s-sim").trials
    record = TrialRecord.model_validate(trial.user_attrs["tuner.record"])
    measure = next(p for p in record.phases if p.name == "measure")
    assert record.outcome == "ok" and record.feasible and measure.completed > 0 and measure.errored == 0
    assert record.output_throughput_tok_s and record.output_throughput_tok_s > 0
