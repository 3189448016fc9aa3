"""`tuner explain` as a new user meets it (issue 16, rough edges 5, 11 and 14), against the simulator
run as a real server process and real journalctl/systemd."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.sim import spawn, wait_ready

TUNER = str(Path(sys.executable).with_name("tuner"))


def _tuner(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TUNER, *args], capture_output=True, text=True, timeout=120, check=False, input=stdin,
                          env={"PATH": "/usr/bin:/bin", "COLUMNS": "120", "NO_COLOR": "1"})


@pytest.fixture(scope="module")
def demo_best_server(tmp_path_factory: pytest.TempPathFactory):
    """The README demo's winner: Llama-3.1-8B on a simulated L4 at 0.95, 23 request slots, 2k chunks;
    and a second server on SGLang's defaults (no --max-running-requests, no --context-length)."""
    tmp = tmp_path_factory.mktemp("explain-edges")
    tuned = spawn(["--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB", "--mem-fraction-static", "0.95",
                   "--max-running-requests", "23", "--chunked-prefill-size", "2048"], tmp)
    default = spawn(["--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB"], tmp)
    try:
        wait_ready(tuned)
        wait_ready(default)
        yield tuned, default
    finally:
        tuned.stop()
        default.stop()


def test_waterfall_has_no_rounding_residue_as_memory(demo_best_server) -> None:
    """0.95 × 21.91 − 14.96 − 5.86 = −0.005 GiB: the two-decimal rounding of SGLang's own figures,
    not an allocation; it must not be shown as a −0.01 GiB row."""
    tuned, _ = demo_best_server
    proc = _tuner("explain", "--log", "-", "--json", stdin=tuned.log())
    assert proc.returncode == 0, proc.stderr
    steps = json.loads(proc.stdout)["waterfall"]
    assert [s for s in steps if s["gib"] is not None and s["gib"] < 0] == [], steps
    assert "other_static" not in [s["item"] for s in steps]
    text = _tuner("explain", "--log", "-", stdin=tuned.log()).stdout
    assert "-0.01" not in text and "other static" not in text


def test_url_of_a_server_on_defaults_names_its_max_running_requests(demo_best_server) -> None:
    """A server started without --max-running-requests reports None in /get_server_info; SGLang
    0.5.5 runs it with min(tokens // 2, the §2.3 estimate), and max_req_input_len bounds the context
    length enough to tell which."""
    _, default = demo_best_server
    proc = _tuner("explain", "--url", default.url, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["capacity"]["effective_max_running_requests"] == 2048, doc["capacity"]
    assert "unknown" not in doc["capacity"]["statement"]
    text = _tuner("explain", "--url", default.url).stdout
    assert "max_running_requests unknown" not in text and "max_running_requests=2048" in " ".join(text.split())


def test_unit_without_any_journal_entry_is_not_called_a_log_without_sglang_lines() -> None:
    proc = _tuner("explain", "--unit", "no-such-unit-4711.service")
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert "no-such-unit-4711.service" in line and "no SGLang line" not in line, line
    assert "no such unit" in line and "—" in line, line


@pytest.mark.systemd
def test_unknown_unit_under_real_systemd_says_no_such_unit(tmp_path: Path) -> None:
    from tests.support.sandbox import boot_sandbox

    with boot_sandbox(tmp_path) as box:
        box.require_real()
        proc = _tuner("explain", "--unit", "no-such-unit-4711.service", "--journalctl", shlex.join(box.journalctl))
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: no such unit no-such-unit-4711.service: systemd does not know it"), line
