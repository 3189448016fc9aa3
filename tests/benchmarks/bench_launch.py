"""Benchmark: how fast the launchers see a server come up or die (figures in docs/real-box.md, Service control).

For each outcome — ready (``--mem-fraction-static 0.85``), startup OOM (``0.1``), invalid flag —
the simulator is first run bare (a subprocess; time until ``/health`` answers and the ready line
is printed, or until it exits), then through each launcher (``start()`` → ``wait()``). The
launcher's **detection overhead** is the difference of the medians. Targets: < 2 s for a failure
(classified from the failure line and exit, never at the timeout) and < 2 s for ready, for the
process launcher and for the systemd launcher under real systemd in a PID namespace (this includes
``daemon-reload``, ``stop`` and the journal round trip).

Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_launch.py --run-benchmarks -s``.
Environment: ``BENCH_LAUNCH_REPEATS`` (3).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.net import free_port
from tests.support.sandbox import boot_sandbox
from tests.support.sim import set_flag, sim_command
from tuner.launch.base import LaunchPhase
from tuner.launch.factory import build_launcher
from tuner.launch.unit import format_exec_command
from tuner.sglang.client import SGLangClient

REPEATS = int(os.environ.get("BENCH_LAUNCH_REPEATS", "3"))
CASES = {"ready": ("--mem-fraction-static", "0.85"), "startup_oom": ("--mem-fraction-static", "0.1"),
         "invalid_flag": ("--no-such-flag", "1")}


def _bare_s(argv: list[str], url: str) -> float:
    """Seconds until the bare simulator is ready (health + ready line) or has exited."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        with SGLangClient(url, timeout_s=1.0) as client:
            for line in proc.stdout:
                if "fired up and ready" in line:
                    while not client.health():
                        time.sleep(0.01)
                    return time.monotonic() - t0
            proc.wait(30)
            return time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait(30)


def _launched_s(launcher, argv: list[str], expect: LaunchPhase) -> float:  # noqa: ANN001
    t0 = time.monotonic()
    launcher.start(argv)
    st = launcher.wait(120)
    assert st.phase is expect, st
    return time.monotonic() - t0


def _measure(launcher, base: list[str], url: str) -> dict[str, tuple[float, float]]:  # noqa: ANN001
    out = {}
    with launcher.session():
        for case, (flag, value) in CASES.items():
            argv = set_flag(base, flag, value)
            expect = LaunchPhase.READY if case == "ready" else LaunchPhase.FAILED
            bare = statistics.median(_bare_s(argv, url) for _ in range(REPEATS)) if launcher.kind == "process" else None
            launched = statistics.median(_launched_s(launcher, argv, expect) for _ in range(REPEATS))
            out[case] = (bare, launched)
    return out


@pytest.mark.benchmark
def test_detection_overhead_process_and_systemd(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base = sim_command(port)
    process = build_launcher({"launcher": "process", "command": base, "url": url, "state_dir": str(tmp_path / "p")})
    results = {"process": _measure(process, base, url)}
    with tempfile.TemporaryDirectory() as tmp, boot_sandbox(Path(tmp)) as box:
        box.add_unit("sim.service", f"[Service]\nEnvironment=PYTHONUNBUFFERED=1\nExecStart={format_exec_command(base)}\n")
        launcher = build_launcher({"launcher": "systemd", "unit": "sim", "url": url, "systemctl": box.systemctl,
                                   "journalctl": box.journalctl, "dropin_dir": str(box.unit_dir),
                                   "runtime_dropin_dir": str(box.runtime_dir),
                                   "state_dir": str(tmp_path / "s")})
        results[f"systemd ({box.kind})"] = _measure(launcher, base, url)
    bare = {case: results["process"][case][0] for case in CASES}
    print(f"\nmedian of {REPEATS}; bare simulator: " + ", ".join(f"{c} {b:.2f} s" for c, b in bare.items()))
    for kind, res in results.items():
        row = ", ".join(f"{c} {launched:.2f} s (+{launched - bare[c]:.2f})" for c, (_, launched) in res.items())
        print(f"{kind}: {row}")
        for case, (_, launched) in res.items():
            assert launched - bare[case] < 2.0, f"{kind} {case}: {launched:.2f} s vs bare {bare[case]:.2f} s"
