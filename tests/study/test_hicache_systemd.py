"""Host-memory safety under a systemd unit with ``MemoryMax=`` (systemd 252 in a private PID namespace).

The unit runs the simulator (tp 2, a 60,000-token device pool, a 512 GiB simulated host) with
``MemoryMax=20G``; the simulator charges its pinned pools to that limit (``--sim-memory-max auto``)
the way the kernel charges a real server's. SGLang's own check only sees the host, so a 35 GB pool
would pass it and be OOM-killed: the tuner reads ``MemoryMax`` through ``systemctl show`` and skips
that config with the arithmetic, and runs the one that fits (2 × 7.9 GB).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from optuna.trial import TrialState

from tests.support.cli import run_tuner as tuner
from tests.support.configs import load_study as load
from tests.support.net import free_port
from tests.support.sandbox import SystemdSandbox
from tests.support.sim import is_healthy
from tuner.launch.unit import format_exec_command
from tuner.records import TrialRecord


@pytest.mark.slow
@pytest.mark.systemd
def test_memory_max_of_the_unit_prunes_a_pool_that_would_be_oom_killed(systemd_sandbox: SystemdSandbox,
                                                                        tmp_path: Path) -> None:
    box = systemd_sandbox
    box.require_real()  # MemoryMax is read from real systemd (the emulator has no cgroup properties)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB", "--tp", "2",
            "--mem-fraction-static", "0.80", "--max-total-tokens", "60000", "--sim-version", "0.5.10",
            "--sim-memory-max", "auto", "--sim-time-scale", "0.01", "--enable-metrics",
            "--host", "127.0.0.1", "--port", str(port)]
    unit = f"sglang-hicache-{port}.service"
    box.add_unit(unit, "[Unit]\nDescription=simulated SGLang (HiCache host-memory test)\n[Service]\n"
                       f"Environment=PYTHONUNBUFFERED=1\nMemoryMax=20G\nExecStart={format_exec_command(argv)}\n")
    box.systemctl_run("daemon-reload")
    box.systemctl_run("start", unit)
    try:
        assert is_healthy(url, 60), "the unit did not come up"
        shown = box.systemctl_run("show", "-p", "MemoryMax", unit).stdout
        assert "MemoryMax=21474836480" in shown, shown
        config = tmp_path / "systemd.toml"
        config.write_text(
            f'[study]\nname = "sdmem"\n\n[service]\nlauncher = "systemd"\nunit = "{unit}"\nurl = "{url}"\n'
            f"systemctl = {json.dumps(box.systemctl)}\njournalctl = {json.dumps(box.journalctl)}\n"
            f'dropin_dir = "{box.unit_dir}"\nruntime_dropin_dir = "{box.runtime_dir}"\nstate_dir = "{tmp_path / "state"}"\nstart_timeout_s = 90\n'
            'gpu_monitor = "sim"\n\n[space]\nmem_fraction_step = 0.01\nhierarchical_cache = true\n'
            "hicache_ratio = [2.0, 4.5]\n\n"
            '[workload]\nkind = "multi_turn"\nnum_sessions = 4\nturns = 2\nfirst_input_len = 512\n'
            "turn_input_len = 32\noutput_len = 8\n\n"
            '[slo]\nitl_ms = { p99 = 10000 }\n\n[objective]\ncontext_tokens = 560\n\n'  # what a session reaches
            "[budget]\nwarmup_s = 1\nmeasure_s = 3\nstress_s = 0\nmax_concurrency = 4\n"
        )
        first = tuner("run", "--config", str(config), "--trials", "1", cwd=tmp_path, timeout_s=400)
        assert first.returncode == 0, first.stderr[-3000:]
        storage = f"sqlite:///{tmp_path}/studies/sdmem.db"
        study = load(storage, "sdmem")
        baseline = TrialRecord.model_validate(study.trials[0].user_attrs["tuner.record"])
        common = {"mem_fraction_static": 0.8, "max_running_requests": baseline.params["max_running_requests"],
                  "chunked_prefill_size": baseline.params["chunked_prefill_size"],
                  "enable_hierarchical_cache": True, "hicache_write_policy": "write_through",
                  "hicache_io_backend": "kernel", "hicache_mem_layout": "layer_first"}
        study.enqueue_trial({**common, "hicache_ratio": 4.5})
        study.enqueue_trial({**common, "hicache_ratio": 2.0})
        second = tuner("run", "--config", str(config), "--trials", "2", cwd=tmp_path, timeout_s=400)
        assert second.returncode == 0, second.stderr[-3000:]
        trials = load(storage, "sdmem").trials
        pruned, ran = trials[1], trials[2]
        assert pruned.state == TrialState.PRUNED and ran.state == TrialState.COMPLETE
        reason = TrialRecord.model_validate(pruned.user_attrs["tuner.record"]).skipped_reason or ""
        assert "× 2 ranks" in reason and "does not fit the unit's MemoryMax: 20.0 GiB" in reason, reason
        assert f"systemctl show -p MemoryMax {unit}" in reason, reason
        record = TrialRecord.model_validate(ran.user_attrs["tuner.record"])
        assert record.outcome == "ok" and record.cache.host_pool_ranks == 2
        assert record.cache.host_pool_gb == pytest.approx(15.72, abs=0.02)
        # Restored: the unit runs its own command again, and it was never OOM-killed.
        show = box.systemctl_run("show", "-p", "ActiveState", "-p", "Result", unit).stdout
        assert "ActiveState=active" in show and "oom-kill" not in show
    finally:
        box.systemctl_run("stop", unit, check=False)
