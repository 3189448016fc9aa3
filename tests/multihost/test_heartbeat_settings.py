"""Hosts whose ``[storage]`` heartbeat settings differ judge a trial dead by the study's one rule.

Before: a host beating every 1 s with a 2 s grace period joined a study whose first host beats
every 30 s, and failed that host's live baseline within seconds (the fleet review of issue 29).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.support.cli import TUNER, run_tuner
from tests.support.configs import config_copy
from tests.support.study_factory import stored_trials
from tuner.study.hosts import HEARTBEAT_ATTR, HOST_ATTR


def _config(folder: Path, url: str, interval_s: int, grace_s: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = config_copy("demo-sim.toml", folder, phases={"warmup_s": 1, "measure_s": 6, "stress_s": 2}, slo=False)
    path.write_text(path.read_text() + f'\n[storage]\nurl = "{url}"\nheartbeat_interval_s = {interval_s}\n'
                    f"grace_period_s = {grace_s}\n")
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_host_with_a_shorter_grace_period_fails_no_live_trial(postgres_url: str, tmp_path: Path) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    first = _config(tmp_path / "a", postgres_url, 30, 120)
    log = (tmp_path / "a.log").open("w")
    proc = subprocess.Popen([TUNER, "run", "--config", str(first), "--trials", "2"], cwd=tmp_path / "a",
                            env=dict(os.environ, TUNER_HOST="host-a"), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # host-a's baseline is running: its first beat is 30 s away
            trials = stored_trials(postgres_url)
            if trials and trials[0].state is TrialState.RUNNING and trials[0].user_attrs.get(HOST_ATTR) == "host-a":
                break
            time.sleep(0.2)
        else:
            raise AssertionError("host-a never started its baseline")
        second = _config(tmp_path / "b", postgres_url, 1, 2)
        joined = run_tuner("run", "--config", str(second), "--trials", "1", cwd=tmp_path / "b",
                           env=dict(os.environ, TUNER_HOST="host-b", COLUMNS="200"), timeout_s=300)
        assert joined.returncode == 0, joined.stdout[-2000:] + joined.stderr[-2000:]
        assert "beat every 30 s with a 120 s grace period" in joined.stdout, joined.stdout[-2000:]
        assert proc.wait(timeout=300) == 0, (tmp_path / "a.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    study = optuna.load_study(study_name="demo-sim", storage=postgres_url)
    assert study.user_attrs[HEARTBEAT_ATTR] == {"interval_s": 30, "grace_period_s": 120}
    failed = [(t.number, t.user_attrs.get(HOST_ATTR)) for t in study.trials if t.state is TrialState.FAIL]
    assert not failed, failed
    assert study.trials[0].state is TrialState.COMPLETE and study.trials[0].user_attrs[HOST_ATTR] == "host-a"
