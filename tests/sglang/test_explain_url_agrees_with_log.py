"""One truth for ``tuner explain`` (issue 28, review N1): ``--url`` and ``--log`` of one running
simulated server give the same free memory after CUDA graphs (within 0.1 GiB) and agree on which
fractions start (the URL reads the GPU's free memory, as the log's ``available_gpu_mem`` states it,
instead of predicting it from SGLang's reserve rule: that gave −13 GiB and "does not start" for
every fraction, the running one included)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.sim import spawn, wait_ready

TUNER = str(Path(sys.executable).with_name("tuner"))


def _explain(*args: str) -> dict:
    proc = subprocess.run([TUNER, "explain", *args, "--json"], capture_output=True, text=True, timeout=120,
                          check=False, env={"PATH": "/usr/bin:/bin", "COLUMNS": "120", "NO_COLOR": "1"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(("gpu", "fraction"), [("H100-80GB", "0.835"), ("L4-24GB", "0.9")])
def test_url_and_log_of_one_server_agree(tmp_path: Path, gpu: str, fraction: str) -> None:
    sim = spawn(["--model-path", "llama-3.1-8b", "--sim-gpu", gpu, "--mem-fraction-static", fraction], tmp_path)
    try:
        wait_ready(sim)
        by_url = _explain("--url", sim.url)
        log = tmp_path / "server.log"
        log.write_text(sim.log(), encoding="utf-8")
        by_log = _explain("--log", str(log))
    finally:
        sim.stop()
    url_rows = {p["mem_fraction_static"]: p for p in by_url["predictions"]}
    log_rows = {p["mem_fraction_static"]: p for p in by_log["predictions"]}
    assert url_rows.keys() == log_rows.keys() and float(fraction) in url_rows
    for f, row in url_rows.items():
        assert row["free_after_graphs_gib"] is not None, row
        assert abs(row["free_after_graphs_gib"] - log_rows[f]["free_after_graphs_gib"]) <= 0.1, (f, row, log_rows[f])
        assert row["starts"] == log_rows[f]["starts"], (f, row, log_rows[f])
    assert url_rows[float(fraction)]["starts"]  # the fraction it runs at starts
    assert any("simulator's device ledger" in s for s in by_url["sources"])
