"""`tuner run` against the simulator as a real systemd unit (systemd 252 in a private PID namespace)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from tests.support.cli import run_tuner
from tests.support.configs import load_study
from tests.support.net import free_port
from tests.support.sandbox import SystemdSandbox
from tests.support.sim import sim_command, wait_healthy
from tuner.launch.unit import format_exec_command
from tuner.records import StudyInfo, TrialRecord


@pytest.mark.slow
@pytest.mark.systemd
def test_study_under_systemd_restores_the_unit(systemd_sandbox: SystemdSandbox, tmp_path: Path) -> None:
    box = systemd_sandbox
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = sim_command(port, "0.80", gpu="L4-24GB", time_scale="0.01")
    unit = f"sglang-sim-{port}.service"
    box.add_unit(unit, "[Unit]\nDescription=simulated SGLang (study test)\n[Service]\n"
                       f"Environment=PYTHONUNBUFFERED=1\nExecStart={format_exec_command(argv)}\n")
    box.systemctl_run("daemon-reload")
    box.systemctl_run("start", unit)
    try:
        wait_healthy(url, 60)
        config = tmp_path / "systemd.toml"
        config.write_text(
            f'[study]\nname = "sd"\n\n[service]\nlauncher = "systemd"\nunit = "{unit}"\nurl = "{url}"\n'
            f"systemctl = {json.dumps(box.systemctl)}\njournalctl = {json.dumps(box.journalctl)}\n"
            f'dropin_dir = "{box.unit_dir}"\nruntime_dropin_dir = "{box.runtime_dir}"\nstate_dir = "{tmp_path / "state"}"\nstart_timeout_s = 90\n'
            'gpu_monitor = "sim"\n\n[space]\nmem_fraction_step = 0.01\n\n'
            '[workload]\nkind = "random"\ninput_len = 1000\noutput_len = 16\n\n'
            '[slo]\nitl_ms = { p99 = 5000 }\n\n[objective]\ncontext_tokens = 2048\n\n'
            "[budget]\nwarmup_s = 1\nmeasure_s = 4\nstress_s = 2\nmax_concurrency = 16\n"
        )
        proc = run_tuner("run", "--config", str(config), "--trials", "2", cwd=tmp_path, timeout_s=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        study = load_study(f"sqlite:///{tmp_path}/studies/sd.db", "sd")
        info = StudyInfo.model_validate(study.user_attrs["tuner.study"])
        assert info.baseline_argv == argv and info.target["unit"] == unit
        records = [TrialRecord.model_validate(t.user_attrs["tuner.record"]) for t in study.trials]
        assert [r.kind for r in records][:1] == ["baseline"] and len(records) == 2
        assert records[0].resolved["max_total_num_tokens"]["value"] == records[0].token_capacity
        assert records[1].argv != argv and "--mem-fraction-static" in records[1].argv
        assert records[1].log_excerpt, "the trial's journal lines were not read"
        # Restored: the original command runs again, no trial drop-in is left.
        show = box.systemctl_run("show", "-p", "ActiveState", "-p", "DropInPaths", unit).stdout
        assert "ActiveState=active" in show and "tuner" not in show
        wait_healthy(url, 60)
        served = requests.get(f"{url}/get_server_info", timeout=5).json()
        assert served["mem_fraction_static"] == 0.80
    finally:
        box.systemctl_run("stop", unit, check=False)
