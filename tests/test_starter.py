"""`tuner init --sim` writes a config whose trials measure something and can be feasible.

Real CLI processes: init, then `tuner run --trials 1` on the simulated server on a free port.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.cli import run_tuner
from tests.support.configs import load_study
from tests.support.net import free_port
from tuner.records import TrialRecord


def test_init_sim_starter_config_runs_a_feasible_measured_trial(workdir: Path) -> None:
    config = workdir / "t.toml"
    init = run_tuner("init", "--sim", "-o", str(config), cwd=workdir, timeout_s=60)
    assert init.returncode == 0, init.stderr
    config.write_text(config.read_text().replace("30000", str(free_port())))
    proc = run_tuner("run", "--config", str(config), "--trials", "1", cwd=workdir, timeout_s=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trial 0: capacity" in proc.stdout and ", feasible" in proc.stdout, proc.stdout
    (trial,) = load_study(f"sqlite:///{workdir / 'studies' / 'sim.db'}", "sim").trials
    record = TrialRecord.model_validate(trial.user_attrs["tuner.record"])
    measure = next(p for p in record.phases if p.name == "measure")
    assert record.outcome == "ok" and record.feasible and measure.completed > 0 and measure.errored == 0
    assert record.output_throughput_tok_s and record.output_throughput_tok_s > 0
