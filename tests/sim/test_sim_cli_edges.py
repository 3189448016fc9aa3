"""The simulator's command line as a new user meets it: one line for bad input, one program name,
SGLang's refusal of a head split the tensor-parallel size cannot make, a help that says which
options are the simulator's own (issue 16, rough edges 1, 10, 13, 15)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TUNER = str(Path(sys.executable).with_name("tuner"))


def _run(*argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False,
                          env={"PATH": "/usr/bin:/bin", "COLUMNS": "100"})


@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_a_port_out_of_range_is_one_line_before_any_startup_line(port: str) -> None:
    proc = _run(TUNER, "sim", "serve", "--model-path", "llama-3.1-8b", "--port", port, "--sim-time-scale", "0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"tuner sim serve: error: port={port} is not a TCP port; fix --port (0-65535, e.g. 30000)."], lines
    assert "Traceback" not in proc.stderr and "OverflowError" not in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("--sim-version", "9", "--model-path", "llama-3.1-8b"),  # the version pre-parser
        ("--bogus",),  # the full parser
        ("--model-path", "no-such-model"),  # the simulator's own check
    ],
)
@pytest.mark.parametrize("entry", ["tuner", "module"])
def test_every_error_names_the_program_that_was_run(args: tuple[str, ...], entry: str) -> None:
    argv = [TUNER, "sim", "serve", *args] if entry == "tuner" else [sys.executable, "-m", "tuner.sim", *args]
    prog = "tuner sim serve" if entry == "tuner" else "python -m tuner.sim"
    proc = _run(*argv)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: error: "), proc.stderr
    usage = [line for line in proc.stderr.splitlines() if line.startswith("usage:")]
    assert all(line.startswith(f"usage: {prog} ") for line in usage), usage


def test_tp_that_does_not_split_the_heads_fails_as_sglang_does() -> None:
    """Llama-3.1-8B has 32 query heads and 8 KV heads: SGLang's QKVParallelLinear asserts
    ``32 is not divisible by 3`` while the layers are built; the scheduler dies and the server is
    killed (SIGKILL, status 137) before any weight is loaded."""
    proc = _run(sys.executable, "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB",
                "--tp", "3", "--port", "0", "--sim-time-scale", "0")
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert "AssertionError: 32 is not divisible by 3" in proc.stderr
    assert "Scheduler hit an exception" in proc.stderr and "Load weight end" not in proc.stderr
    assert "KV Cache is allocated" not in proc.stderr


def test_tp_above_the_kv_heads_must_divide_by_them() -> None:
    """8 KV heads at tp 16 are replicated (16 / 8 = 2 per head), at tp 12 they cannot be."""
    from tuner.sim.startup import plan_from_argv

    ok = plan_from_argv(["--model-path", "llama-3.1-70b", "--tp", "16", "--sim-gpu", "H100-80GB"])[1]
    assert ok.failure is None or ok.failure.kind != "tp_not_divisible"
    # 64 query heads split over 16; a tp of 12 leaves 64 % 12 != 0 first.
    bad = plan_from_argv(["--model-path", "llama-3.1-70b", "--tp", "12", "--sim-gpu", "H100-80GB"])[1]
    assert bad.failure is not None and bad.failure.kind == "tp_not_divisible"
    assert (bad.failure.detail["numerator"], bad.failure.detail["denominator"]) == (64, 12)


def test_help_lists_the_simulators_own_options_first_with_defaults() -> None:
    proc = _run(TUNER, "sim", "serve", "--help")
    assert proc.returncode == 0
    out = proc.stdout
    own, sglang = out.index("simulator options:"), out.index("sglang.launch_server flags")
    assert own < sglang < out.index("--mem-fraction-static")
    assert out.index("--sim-gpu") < sglang and "(default: H100-80GB)" in " ".join(out[own:sglang].split())
    assert "python -m sglang.launch_server --help" in " ".join(out[sglang:].split())
