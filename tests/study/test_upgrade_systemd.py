"""``tuner upgrade-check --boot`` under real systemd (a private PID namespace, tests/support/sandbox.py):
the best flags start once on the new version (the simulator's ``--sim-version`` standing in for
an SGLang installation) and the unit is put back; a refused boot leaves MainPID and the drop-ins
as they were (issue 27)."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import pytest

from tests.support.cli import one_error_line, run_tuner
from tests.support.net import free_port
from tests.support.offline_server import OfflineExecutor
from tests.support.sandbox import SystemdSandbox
from tests.support.sim import is_healthy
from tuner.config import parse_config
from tuner.launch.unit import format_exec_command
from tuner.study.loop import run_study


def _snapshot(box: SystemdSandbox, unit: str) -> tuple[dict[str, str], dict[str, str], str]:
    def folder(path: Path) -> dict[str, str]:
        return {p.name: p.read_text() for p in sorted(path.glob("*"))} if path.is_dir() else {}

    return (folder(box.unit_dir / f"{unit}.d"), folder(box.runtime_dir / f"{unit}.d"),
            box.systemctl_run("show", "-p", "MainPID", unit).stdout)


@pytest.mark.slow
@pytest.mark.systemd
def test_boot_on_the_new_version_restores_the_unit_and_a_refusal_changes_nothing(
        systemd_sandbox: SystemdSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    box = systemd_sandbox
    box.require_real()  # MainPID and the unit's drop-ins as real systemd keeps them
    monkeypatch.chdir(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB",
            "--speculative-algorithm", "EAGLE3", "--mem-fraction-static", "0.85", "--sim-version", "0.5.5",
            "--sim-time-scale", "0.01", "--enable-metrics", "--host", "127.0.0.1", "--port", str(port)]
    unit = f"sglang-upgrade-{port}.service"
    box.add_unit(unit, "[Unit]\nDescription=simulated SGLang (upgrade check)\n[Service]\n"
                       f"Environment=PYTHONUNBUFFERED=1\nExecStart={format_exec_command(argv)}\n")
    (box.unit_dir / f"{unit}.d").mkdir(exist_ok=True)
    (box.unit_dir / f"{unit}.d" / "10-operator.conf").write_text("[Service]\nEnvironment=OPERATOR=1\n")
    box.systemctl_run("daemon-reload")
    box.systemctl_run("start", unit)
    try:
        assert is_healthy(url, 60), "the unit did not come up"
        # [space] speculative = false: the draft is kept (memory alone), so the best runs it on both versions
        common = {"study": {"name": "upgrade"}, "space": {"speculative": False},
                  "workload": {"kind": "random", "input_len": 1000, "output_len": 16},
                  "objective": {"context_tokens": 1024},
                  "budget": {"warmup_s": 1, "measure_s": 3, "stress_s": 1, "max_concurrency": 4},
                  "storage": {"url": f"sqlite:///{tmp_path}/upgrade.db", "artifacts_dir": str(tmp_path / "artifacts")}}
        offline = parse_config({**common, "service": {"launcher": "process", "command": argv, "url": url,
                                                     "gpu_monitor": "sim"}})
        run_study(offline, OfflineExecutor(offline, world_seed=0), max_trials=3,
                  storage_url=f"sqlite:///{tmp_path}/upgrade.db")  # the study, as a run would have stored it
        config = tmp_path / "systemd.toml"
        config.write_text(
            f'[study]\nname = "upgrade"\n\n[service]\nlauncher = "systemd"\nunit = "{unit}"\nurl = "{url}"\n'
            f"systemctl = {json.dumps(box.systemctl)}\njournalctl = {json.dumps(box.journalctl)}\n"
            f'dropin_dir = "{box.unit_dir}"\nruntime_dropin_dir = "{box.runtime_dir}"\n'
            f'state_dir = "{tmp_path / "state"}"\nstart_timeout_s = 90\ngpu_monitor = "sim"\n\n'
            '[workload]\nkind = "random"\ninput_len = 1000\noutput_len = 16\n\n[objective]\ncontext_tokens = 1024\n\n'
            "[budget]\nwarmup_s = 1\nmeasure_s = 3\nstress_s = 1\nmax_concurrency = 4\n\n"
            f'[storage]\nurl = "sqlite:///{tmp_path}/upgrade.db"\nartifacts_dir = "{tmp_path / "artifacts"}"\n')
        db = (tmp_path / "upgrade.db").read_bytes()
        before = _snapshot(box, unit)
        now = datetime.datetime.now()
        closed = f"{now + datetime.timedelta(hours=2):%H:%M}-{now + datetime.timedelta(hours=3):%H:%M}"
        one_error_line(run_tuner("upgrade-check", "--config", str(config), "--version", "0.5.23", "--boot",
                                 "--window", closed, cwd=tmp_path), "outside the window")
        assert _snapshot(box, unit) == before  # MainPID and every drop-in as they were

        done = run_tuner("upgrade-check", "--config", str(config), "--version", "0.5.23", "--boot", "--json",
                         cwd=tmp_path, timeout_s=400)
        assert done.returncode == 0, done.stderr[-3000:]
        boot = json.loads(done.stdout)["boot"]
        assert boot["argv"][boot["argv"].index("--sim-version") + 1] == "0.5.23"
        assert boot["token_capacity"] and boot["before"]["token_capacity"]
        assert boot["token_capacity"] != boot["before"]["token_capacity"]  # the draft's KV moved into the cell
        after = _snapshot(box, unit)
        assert after[:2] == before[:2]  # the drop-ins as they were (the trial's runtime drop-in removed)
        assert is_healthy(url, 60)  # restored: the unit serves its own command again
        shown = box.systemctl_run("show", "-p", "ExecStart", unit).stdout
        assert "0.5.5" in shown and "0.5.23" not in shown
        assert (tmp_path / "upgrade.db").read_bytes() == db  # nothing persisted
    finally:
        box.systemctl_run("stop", unit, check=False)
