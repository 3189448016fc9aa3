"""`tuner apply` end to end under real systemd (PID namespace) with the simulator as the unit.

Scenario, in order, on one sandboxed systemd:

1. The host has a foreign process holding 20 GiB of GPU 0 (the unit runs the simulator with
   ``--sim-foreign-gib 20``): ``tuner apply best`` restarts with the trial's flags, the token
   capacity comes out far below the trial's, so it rolls back: no ``80-tuner.conf``, the service
   healthy on its previous flags, the attempt and the rollback recorded.
2. The foreign memory is gone: ``--dry-run`` shows the drop-in and diff and changes nothing;
   ``tuner apply best`` changes the running server's flags and verifies (capacity ± 1 %, flags,
   a load check against the SLO).
3. ``tuner apply --undo`` returns to the unit's own command.

A second test covers the launcher session apply drives (``session(restore_on_exit=False)``): a
trial drop-in left by a run and a state file left by a killed apply are refused, changing nothing,
and ``tuner restore --unit`` puts back what a ``kill -9`` mid-apply left.

The trial's token capacity is measured, not invented: the simulator is started with the trial's
command line as a plain process and ``/get_server_info`` is read, as a trial does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests

from tests.support.cli import TUNER, one_error_line, run_tuner
from tests.support.net import free_port
from tests.support.sim import sim_command, wait_healthy
from tests.support.study_factory import failed_trial, make_study, ok_trial
from tuner.launch.unit import format_exec_command
from tuner.sglang.flags import FlagTable, replace_flags

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

TRIAL = {"mem_fraction_static": 0.85, "max_running_requests": 32, "chunked_prefill_size": 4096}


def _sim_argv(port: int, *extra: str) -> list[str]:
    return sim_command(port, "0.80", *extra, time_scale="0")


def _server_info(url: str, timeout_s: float = 60.0) -> dict:
    wait_healthy(url, timeout_s)
    return requests.get(f"{url}/get_server_info", timeout=5).json()


def _measure_tokens(argv: list[str], port: int) -> int:
    """Start the simulator with ``argv`` as a process, read its token capacity, stop it by PID."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return int(_server_info(f"http://127.0.0.1:{port}")["max_total_num_tokens"])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _unit_text(argv: list[str]) -> str:
    return (
        "[Unit]\nDescription=simulated SGLang server\n[Service]\nType=simple\n"
        f"Environment=PYTHONUNBUFFERED=1\nExecStart={format_exec_command(argv)}\nRestart=no\n"
    )


def _config(tmp_path: Path, box, url: str) -> Path:
    """The study's config: the sandboxed ``sim.service``, a short load check against an SLO."""
    config = tmp_path / "sandbox.toml"
    config.write_text(
        f"""
[study]
name = "applied"
[service]
launcher = "systemd"
unit = "sim.service"
url = "{url}"
systemctl = {json.dumps(box.systemctl)}
journalctl = {json.dumps(box.journalctl)}
dropin_dir = "{box.unit_dir}"
runtime_dropin_dir = "{box.runtime_dir}"
sglang_version = "0.5.5"
start_timeout_s = 120
gpu_monitor = "sim"
[workload]
kind = "random"
input_len = 256
output_len = 16
[slo]
ttft_ms = {{p99 = 20000}}
[budget]
concurrency = 4
[storage]
url = "sqlite:///{tmp_path / 'applied.db'}"
""",
        encoding="utf-8",
    )
    return config


def test_apply_rolls_back_then_applies_and_undoes(systemd_sandbox, tmp_path: Path) -> None:
    box = systemd_sandbox
    box.require_real()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base = _sim_argv(port)
    table = FlagTable.for_version("0.5.5")
    # the study: baseline and the winner measured on a clean GPU, an OOM trial
    probe_port = free_port()
    base_tokens = _measure_tokens(_sim_argv(probe_port), probe_port)
    trial_tokens = _measure_tokens(replace_flags(_sim_argv(probe_port), TRIAL, table), probe_port)
    assert trial_tokens > base_tokens
    config = _config(tmp_path, box, url)
    storage = make_study(
        tmp_path / "applied.db",
        "applied",
        [
            ok_trial(0.80, 64, base_tokens // 8192, 900.0, kind="baseline", token_capacity=base_tokens),
            ok_trial(0.85, 32, trial_tokens // 8192, 1000.0, token_capacity=trial_tokens, chunked_prefill_size=4096),
            failed_trial(0.97, "cuda_graph_oom", "Capture cuda graph failed"),
        ],
        info={"config_path": str(config), "target": {"launcher": "systemd", "unit": "sim.service", "url": url}},
    )
    common = ["--config", str(config), "--state-dir", str(tmp_path / "state"), "--timeout-s", "120"]
    dropin = box.unit_dir / "sim.service.d" / "80-tuner.conf"

    # 1. a foreign process holds 20 GiB: the applied server holds fewer tokens -> rollback
    box.add_unit("sim.service", _unit_text([*base, "--sim-foreign-gib", "20"]))
    box.systemctl_run("start", "sim.service")
    foreign_tokens = _server_info(url)["max_total_num_tokens"]
    proc = run_tuner("apply", "best", "--yes", "--verify-s", "3", *common, timeout_s=300)
    line = one_error_line(proc)
    assert "rolled back" in line and "token_capacity" in line and str(trial_tokens) in line, line
    assert not dropin.exists()
    info = _server_info(url)
    assert info["mem_fraction_static"] == 0.80 and info["max_total_num_tokens"] == foreign_tokens
    assert box.systemctl_run("is-active", "sim.service").stdout.strip() == "active"

    # 2. the foreign memory is gone: dry run, then a verified apply
    box.add_unit("sim.service", _unit_text(base))
    box.systemctl_run("restart", "sim.service")
    assert _server_info(url)["max_total_num_tokens"] == base_tokens
    proc = run_tuner("apply", "best", "--dry-run", *common, timeout_s=300)
    assert proc.returncode == 0, proc.stderr
    assert "80-tuner.conf" in proc.stdout and "+ --mem-fraction-static 0.85\n" in proc.stdout
    assert "- --mem-fraction-static 0.80\n" in proc.stdout and "+ --max-running-requests 32\n" in proc.stdout
    assert not dropin.exists()
    proc = run_tuner("apply", "best", "--yes", "--verify-s", "3", *common, timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "applied and verified" in proc.stdout
    assert dropin.is_file() and "--mem-fraction-static 0.85" in dropin.read_text()
    info = _server_info(url)
    assert info["mem_fraction_static"] == 0.85 and info["max_running_requests"] == 32
    assert abs(info["max_total_num_tokens"] - trial_tokens) <= 0.01 * trial_tokens
    assert not (tmp_path / "state" / "sim.service.state.json").exists()

    records = json.loads(run_tuner("applies", "--storage", storage, "--json").stdout)
    assert [(r["action"], r["outcome"]) for r in records] == [
        ("apply", "rolled_back"), ("rollback", "rolled_back"), ("apply", "verified"),
    ]
    assert records[1]["undoes"] == records[0]["id"]
    checks = {c["name"]: c for c in records[2]["checks"]}
    assert checks["token_capacity"]["ok"] and checks["flags"]["ok"] and checks["load"]["ok"]
    assert records[2]["new_command"] != records[2]["previous_command"]

    # 3. undo: back to the unit's own command, no drop-in
    proc = run_tuner("apply", "--undo", "--yes", *common, timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not dropin.exists()
    assert _server_info(url)["mem_fraction_static"] == 0.80
    proc = run_tuner("apply", "--undo", "--yes", *common, timeout_s=300)
    assert proc.returncode == 1 and "no verified apply on sim.service to undo" in proc.stderr


def test_apply_refuses_leftovers_and_a_killed_apply_is_restored(systemd_sandbox, tmp_path: Path) -> None:
    box = systemd_sandbox
    box.require_real()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base = _sim_argv(port)
    config = _config(tmp_path, box, url)
    # the verification is never reached here (refused, or killed before the server is ready)
    make_study(
        tmp_path / "applied.db",
        "applied",
        [ok_trial(0.80, 64, 8, 900.0, kind="baseline"), ok_trial(0.85, 32, 10, 1000.0, chunked_prefill_size=4096)],
        info={"config_path": str(config), "target": {"launcher": "systemd", "unit": "sim.service", "url": url}},
    )
    state = tmp_path / "state"
    common = ["--config", str(config), "--state-dir", str(state), "--timeout-s", "120"]
    folder = box.unit_dir / "sim.service.d"
    dropin, state_file = folder / "80-tuner.conf", state / "sim.service.state.json"
    box.add_unit("sim.service", _unit_text(base))
    box.systemctl_run("restart", "sim.service")
    _server_info(url)

    def main_pid() -> str:
        return box.systemctl_run("show", "-p", "MainPID", "sim.service").stdout.strip()

    # 1. a trial drop-in a run left: refused before anything changes
    folder.mkdir(exist_ok=True)
    stray = folder / "90-tuner-trial.conf"
    stray.write_text("[Service]\nEnvironment=LEFT_BY_A_RUN=1\n")
    box.systemctl_run("daemon-reload")
    pid = main_pid()
    proc = run_tuner("apply", "best", "--yes", *common, timeout_s=300)
    one_error_line(proc, "trial's change", "tuner restore --unit sim.service")
    assert not dropin.exists() and not state_file.exists() and stray.is_file() and main_pid() == pid
    stray.unlink()
    box.systemctl_run("daemon-reload")

    # 2. kill -9 once the apply has written its drop-in (the server is restarting on it)
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1")
    child = subprocess.Popen([TUNER, "apply", "best", "--yes", *common], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=env)  # fmt: skip
    deadline = time.monotonic() + 120
    while not dropin.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    child.kill()
    child.wait(timeout=30)
    assert dropin.is_file() and state_file.is_file(), "the apply ended before it wrote its drop-in"

    # 3. a state file a killed apply left: refused, nothing changes
    proc = run_tuner("apply", "best", "--yes", *common, timeout_s=300)
    one_error_line(proc, "left its state", "tuner restore --unit sim.service")
    assert dropin.is_file() and state_file.is_file()

    # 4. `tuner restore --unit` (the state file alone) puts the previous service back, healthy
    proc = run_tuner("restore", "--unit", "sim.service", "--state-dir", str(state), "--timeout-s", "120",
                     timeout_s=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "from the state file" in proc.stdout
    assert not dropin.exists() and not state_file.exists()
    assert _server_info(url)["mem_fraction_static"] == 0.80
    assert box.systemctl_run("is-active", "sim.service").stdout.strip() == "active"
