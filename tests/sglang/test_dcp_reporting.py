"""A DCP server's reported ``max_total_num_tokens`` (issue 23): from 0.5.21 SGLang's scheduler line,
``/get_server_info`` and ``memory_usage.token_capacity`` print the logical count, one rank's rows ×
``dcp_size`` (``tp_worker.get_worker_info`` → ``ModelRunner.logical_max_total_num_tokens``), while the
KV line's ``#tokens`` stays one rank's. On a real simulated 0.5.23 server with ``--dcp-size 8`` the
product reads one rank's pool from each source, and ``explain --url`` and ``--log`` agree."""

from __future__ import annotations

import json
from pathlib import Path

import requests

from tests.support.cli import run_tuner
from tests.support.sim import spawn, wait_ready
from tuner.sglang.client import ServerInfo
from tuner.sglang.levers import rank_tokens
from tuner.sglang.logs import parse_log

ARGV = ["--model-path", "kimi-k2.5-int4", "--tp-size", "8", "--mem-fraction-static", "0.88",
        "--sim-gpu", "RTX-PRO-6000-96GB", "--sim-version", "0.5.23", "--dcp-size", "8"]


def _explain(*args: str) -> dict:
    proc = run_tuner("explain", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_dcp_servers_logical_count_is_read_as_one_ranks_pool(tmp_path: Path) -> None:
    sim = spawn(ARGV, tmp_path)
    try:
        wait_ready(sim)
        raw = requests.get(f"{sim.url}/get_server_info", timeout=10).json()
        by_url = _explain("--url", sim.url)
        log = tmp_path / "server.log"
        log.write_text(sim.log(), encoding="utf-8")
        by_log = _explain("--log", str(log))
        report = parse_log(sim.log())
    finally:
        sim.stop()
    rows = report.ranks["TP0"].kv_tokens
    assert rows and raw["max_total_num_tokens"] == 8 * rows  # what SGLang 0.5.23 reports: the logical count
    assert raw["internal_states"][0]["memory_usage"]["token_capacity"] == 8 * rows
    assert ServerInfo.from_json(raw).max_total_num_tokens == rows
    assert report.max_total_num_tokens == rows and report.scheduler is not None and report.scheduler.logical_tokens == 8 * rows
    assert by_url["capacity"]["max_total_num_tokens"] == by_log["capacity"]["max_total_num_tokens"] == rows


def test_versions_before_0521_report_one_ranks_rows() -> None:
    assert rank_tokens(26462720, dcp_size=8, version="0.5.23") == 3307840
    assert rank_tokens(26462720, dcp_size=8, version="0.5.21.post1") == 3307840
    assert rank_tokens(3307840, dcp_size=8, version="0.5.20") == 3307840
    assert rank_tokens(3307840, dcp_size=1, version="0.5.23") == 3307840
    assert rank_tokens(3307840, dcp_size=8, version=None) == 3307840
    assert rank_tokens(3307840, dcp_size=8, version="not-a-version") == 3307840
