"""`tuner load` as a user runs it (a real subprocess) against the SSE test server."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.support.cli import run_tuner


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_tuner("load", *args, timeout_s=180)


def test_max_under_slo_from_the_cli(start_server, tmp_path: Path) -> None:
    server = start_server("--ttft-ms", "3", "--itl-ms", "2", "--capacity", "4")
    out = tmp_path / "search.json"
    done = _cli("--url", server.url, "--input-len", "16", "--output-len", "20", "--max-under-slo",
                "--slo", "p99_ttft_ms=35", "--start", "2", "--max-value", "8", "--duration", "1",
                "--warmup", "0.3", "--time-budget", "60", "--target-attainment", "0.8", "--json", str(out))
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["knob"] == "concurrency" and data["steps"] and data["steps"][0]["value"] == 2
    assert data["status"] in ("found", "max_value")
    assert data["message"] in done.stdout


def test_max_under_slo_without_an_answer_says_what_duration_decides_and_exits_1(start_server, tmp_path: Path) -> None:
    # ~0.2 s per request: a 1 s window holds ~5 requests; 35 are needed (~9 s), which a 6 s budget cannot hold.
    server = start_server("--ttft-ms", "3", "--itl-ms", "10")
    out = tmp_path / "search.json"
    done = _cli("--url", server.url, "--input-len", "16", "--output-len", "20", "--max-under-slo",
                "--slo", "p99_ttft_ms=5000", "--duration", "1", "--warmup", "0.2", "--time-budget", "6",
                "--json", str(out))
    assert done.returncode == 1, done.stdout
    error = done.stderr.strip().splitlines()[-1]  # the lines above are the live per-level report
    assert error.startswith("error: ") and "(indeterminate)" in error, done.stderr
    assert "needs 35 requests" in error and "--duration" in error
    assert json.loads(out.read_text())["steps"][0]["requests_needed"] == 35


def test_output_paths_are_checked_before_any_load(tmp_path: Path) -> None:
    # The URL is down: an error about --json / --csv proves they were checked first.
    for args, needle in ((["--json", "/nonexistent/x.json"], "--json /nonexistent/x.json is in a folder that does not exist"),
                         (["--csv", str(tmp_path)], f"--csv {tmp_path} is a folder")):
        done = _cli("--url", "http://127.0.0.1:9", "--concurrency", "1", "--duration", "1", *args)
        assert done.returncode == 1 and needle in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_cli_option_errors_are_one_line(sse_url: str) -> None:
    # One case per path: option validation in the CLI, the workload spec, and run_load's own checks
    # (the other messages are unit-tested in test_workloads.py / test_metrics.py).
    cases = [
        (["--max-under-slo"], "--slo"),
        (["--concurrency", "2", "--num-groups", "3", "--duration", "1"], "--num-groups does not apply"),
        (["--concurrency", "2"], "--duration"),
    ]
    for args, needle in cases:
        done = _cli("--url", sse_url, *args)
        assert done.returncode == 1, (args, done.stdout)
        assert needle in done.stderr and len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)


def test_a_window_reports_its_slow_itl_gaps_against_the_limit(start_server, tmp_path: Path) -> None:
    """An ITL limit far below the server's ~2 ms gaps: (nearly) every gap is slow, up to 100× the
    1 % a p99 allows (a chunk of several tokens splits its gap, and two chunks read at once have
    none), in the table and the JSON; one far above them: none is."""
    server = start_server("--ttft-ms", "3", "--itl-ms", "2")
    for limit, low, high in (("0.001", 50.0, 100.0), ("1000", 0.0, 0.0)):
        out = tmp_path / f"window-{limit}.json"
        done = _cli("--url", server.url, "--input-len", "16", "--output-len", "20", "--concurrency", "2",
                    "--duration", "1", "--warmup", "0.2", "--slo", f"p99_itl_ms={limit}", "--json", str(out))
        assert done.returncode == 0, done.stderr
        summary = json.loads(out.read_text())["summary"]
        assert low <= summary["itl_exceedance"] <= high and summary["itl_count"] > 0
        assert f"{summary['itl_exceedance']:.2f}×" in done.stdout and "ITL gaps over the limit" in done.stdout


def test_a_second_run_of_the_same_random_prompts_is_told_it_measured_the_prefix_cache(tmp_path: Path) -> None:
    """The simulator as a real server: the same --seed sends the same random prompts again, the
    radix cache serves them, and ``tuner load`` says so (TTFT reads low); another seed does not."""
    import os
    import signal

    from tests.support.net import free_port
    from tests.support.sim import sim_command, wait_healthy

    port = free_port()
    with (tmp_path / "sim.log").open("w") as log:
        proc = subprocess.Popen(sim_command(port, time_scale="0"), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, exited=lambda: None if proc.poll() is None else f"exit {proc.returncode}")
        args = ("--url", url, "--input-len", "256", "--output-len", "8", "--num-requests", "16",
                "--concurrency", "4", "--duration", "3", "--warmup", "0")
        first, again = _cli(*args), _cli(*args)
        other = _cli(*args, "--seed", "7")
        assert first.returncode == again.returncode == other.returncode == 0, (first.stderr, again.stderr)
        assert "prefix cache served" not in first.stderr and "prefix cache served" not in other.stderr
        assert "prefix cache served" in again.stderr and "--seed 0" in again.stderr
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
