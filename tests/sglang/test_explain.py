"""`tuner explain` end to end through the installed CLI (a real subprocess): the reference deployment,
the traps of the cases, --unit via a journalctl command, --url via a real HTTP server, and bad input."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import TUNER, run_tuner
from tests.support.net import free_port
from tests.support.sglang_http import serve
from tuner.sglang.explain import Explanation, waterfall_steps
from tuner.sglang.logs import read_log
from tuner.sglang.memory import KVCapacityModel

HERE = Path(__file__).resolve().parent
REFERENCE = HERE.parents[0] / "fixtures" / "logs" / "reference-0.5.5-tp8.log"
CASES = HERE.parents[0] / "fixtures" / "cases"
def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_tuner("explain", *args)


def _json(*args: str) -> dict[str, Any]:
    proc = _run(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    Explanation.model_validate_json(proc.stdout)  # the documented schema
    return json.loads(proc.stdout)


def _case_log(tmp_path: Path, case_id: str) -> str:
    path = tmp_path / f"{case_id}.log"
    path.write_text(json.loads((CASES / f"{case_id}.json").read_text())["log_excerpt"])
    return str(path)


def _trap(doc: dict[str, Any], trap_id: str) -> dict[str, Any]:
    found = [t for t in doc["traps"] if t["id"] == trap_id]
    assert found, [t["id"] for t in doc["traps"]]
    return found[0]


def test_reference_deployment_is_explained() -> None:
    doc = _json("--log", str(REFERENCE), "--model-config", str(HERE / "models" / "kimi-k2.5-int4"))
    text = " ".join(doc["findings"])
    assert "share of the 94.03 GiB free at the baseline for weights plus the KV pool" in text
    misread = _trap(doc, "fraction_misread")
    assert "not a share of what is left after the weights" in misread["title"] and "19.10 GiB" in misread["detail"]
    idle = _trap(doc, "idle_reserve")
    assert "about 7.4 GiB" in idle["title"]
    assert doc["model"]["tokens_per_hundredth"] == pytest.approx(14_400, rel=0.01)
    assert doc["model"]["cell_source"] == "model_config" and doc["model"]["cell_bytes"] == 70272
    plus = next(p for p in doc["predictions"] if p["mem_fraction_static"] == 0.89)
    assert plus["delta_tokens"] == pytest.approx(14_400, rel=0.01)
    # What limits capacity is the KV pool, not max_running_requests.
    assert doc["capacity"]["limit"] == "kv_pool"
    assert all(f["limited_by"] == "kv_pool" for f in doc["capacity"]["fits"])
    assert "binds only for shorter ones" in doc["capacity"]["statement"]
    graph = _trap(doc, "cuda_graph_bs_below_max_running_requests")
    assert graph["severity"] == "info"  # logged batches (≤ 5 running) never reached the graph limit
    items = [s["item"] for s in doc["waterfall"]]
    assert items[:4] == ["baseline_free", "distributed_init", "weights", "kv_pool"] and items[-1] == "free_after_graphs"
    step = {s["item"]: s for s in doc["waterfall"]}
    assert step["reserve"]["gib"] == 11.28 and step["req_to_token"]["gib"] == 1.25 and step["free_after_graphs"]["gib"] == 7.43
    reserve_parts = sum(step[k]["gib"] for k in ("req_to_token", "cuda_graphs", "draft_model", "other_reserve", "free_after_graphs") if k in step)
    assert reserve_parts == pytest.approx(step["reserve"]["gib"], abs=0.02)


def test_text_view_says_the_same() -> None:
    proc = _run("--log", str(REFERENCE))
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "about 7.4 GiB per GPU sits idle" in out and "14,3" in out and "Traceback" not in out


def test_case_traps(tmp_path: Path) -> None:
    c21 = _json("--log", _case_log(tmp_path, "case-21"))
    assert _trap(c21, "cuda_graph_bs_below_max_running_requests")["severity"] == "warning"
    c16 = _json("--log", _case_log(tmp_path, "case-16"))
    assert "40 GB × 4 ranks = 160 GB" in _trap(c16, "hicache_per_rank")["title"]
    c26 = _json("--log", _case_log(tmp_path, "case-26"))
    assert "59862" in " ".join(_trap(c26, "context_exceeds_pool")["evidence"])
    c03 = _json("--log", _case_log(tmp_path, "case-03"))
    assert _trap(c03, "max_total_tokens_cap")["severity"] == "error" and c03["state"] == "failed"
    assert c03["failure"]["failure_class"] == "startup_kv_oom"


def test_speculative_48_and_context_over_pool(tmp_path: Path) -> None:
    log = tmp_path / "spec.log"
    log.write_text(
        "[2026-01-01 00:00:00] Max running requests is reset to 48 for speculative decoding. You can override it by --max-running-requests\n"
        "[2026-01-01 00:00:01] KV Cache is allocated. #tokens: 500000, KV size: 33.51 GB\n"
        "[2026-01-01 00:00:02] max_total_num_tokens=500000, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=48, context_len=131072, available_gpu_mem=3.10 GB\n"
    )
    doc = _json("--log", str(log))
    assert "reset max_running_requests to 48" in _trap(doc, "speculative_max_running_requests_48")["title"]
    assert doc["capacity"]["limit"] == "max_running_requests"
    assert doc["capacity"]["fits"][0] == {"request_tokens": 1024, "resident_requests": 48, "limited_by": "max_running_requests"}


def test_unit_through_a_journalctl_command(tmp_path: Path) -> None:
    fake = tmp_path / "journalctl"
    fake.write_text(
        "#!/bin/sh\n"
        '[ "$1" = "-u" ] && [ "$2" = "sglang.service" ] && [ "$3" = "-o" ] && [ "$4" = "short-iso" ] || { echo "bad args: $*" >&2; exit 1; }\n'
        f"sed 's/^/2026-11-20T09:00:00+0000 gpu-host python3[4242]: /' '{REFERENCE}'\n"
    )
    fake.chmod(0o755)
    doc = _json("--unit", "sglang.service", "--journalctl", f"{fake}")
    assert doc["capacity"]["max_total_num_tokens"] == 159277 and doc["sources"] == ["journal of unit sglang.service"]
    proc = _run("--unit", "other.service", "--journalctl", f"{fake}")
    assert proc.returncode == 1 and "bad args" in proc.stderr


@pytest.fixture
def server() -> Iterator[str]:
    info = {"version": "0.5.23", "mem_fraction_static": 0.9, "max_running_requests": None, "context_length": 32768, "page_size": 1,
            "tp_size": 1, "cuda_graph_max_bs_decode": 32,
            "internal_states": [{"effective_max_running_requests_per_dp": 4096, "memory_usage": {
                "weight": 15.0, "kvcache": 40.0, "startup_available": 6.95, "token_capacity": 327680, "graph": {"decode": 0.15}}}]}
    metrics = "# TYPE sglang:num_retracted_requests_total counter\nsglang:num_retracted_requests_total{tp_rank=\"0\"} 7.0\n" \
              "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{tp_rank=\"0\"} 12.0\n"
    yield from serve({"/server_info": (200, json.dumps(info)), "/health": (200, ""), "/metrics": (200, metrics)})


def test_url(server: str) -> None:
    doc = _json("--url", server)
    assert doc["sglang_version"] == "0.5.23" and doc["state"] == "ready"
    assert doc["model"]["baseline_gib"] == pytest.approx(55.0 / 0.9, abs=0.01)
    assert _trap(doc, "cuda_graph_bs_below_max_running_requests")["severity"] == "warning"
    assert _trap(doc, "idle_reserve")
    assert "num_retracted_requests_total = 7" in _trap(doc, "retractions")["title"]
    assert any("num_running_reqs=12" in f for f in doc["findings"])


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty.log").write_text("")
    (tmp_path / "bin.log").write_bytes(bytes(range(256)) * 20)
    (tmp_path / "nginx.log").write_text('127.0.0.1 - - [29/Nov/2026:10:00:00 +0000] "GET / HTTP/1.1" 200 612\n')
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 32, "head_dim": 128}))
    cases = [
        (["--log", str(tmp_path / "empty.log")], "is empty"),
        (["--log", str(tmp_path / "bin.log")], "binary"),
        (["--log", str(tmp_path / "nginx.log")], "no SGLang line"),
        (["--url", f"http://127.0.0.1:{free_port()}"], "cannot reach the SGLang server"),
        (["--log", str(REFERENCE), "--model-config", str(tmp_path / "config.json")], "lacks num_hidden_layers"),
        ([], "nothing to explain"),
    ]
    for args, message in cases:
        proc = _run(*args)
        assert proc.returncode == 1, (args, proc.stdout)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr, (args, proc.stderr)


def test_stored_trial_memory_renders_as_a_waterfall() -> None:
    report = read_log(REFERENCE)
    model = KVCapacityModel.from_report(report, None, 0.88)
    memory = {"ranks": {k: v.model_dump(mode="json") for k, v in report.ranks.items()},
              "scheduler": report.scheduler.model_dump(mode="json"), "capacity_model": model.model_dump(mode="json"),
              "server_info": {"weight_gib": None, "kvcache_gib": None, "graph_gib": None, "startup_available_gib": None}}
    steps = {s.item: s.gib for s in waterfall_steps(json.loads(json.dumps(memory)))}
    assert steps["baseline_free"] == 94.03 and steps["free_after_graphs"] == 7.43


@pytest.mark.parametrize("case_id", sorted(p.stem for p in CASES.glob("case-*.json")))
def test_explain_never_breaks_on_a_case(case_id: str) -> None:
    from tuner.sglang.explain import explain
    from tuner.sglang.logs import parse_log

    report = parse_log(json.loads((CASES / f"{case_id}.json").read_text())["log_excerpt"])
    doc = explain(report, sources=[case_id])
    assert Explanation.model_validate_json(doc.model_dump_json()) == doc
    assert (doc.state == "failed") == (report.failure is not None)


def test_startup_kv_oom_names_the_smallest_fraction() -> None:
    from tuner.sglang.explain import explain
    from tuner.sglang.logs import parse_log

    report = parse_log([
        "[2026-01-01 00:00:00] server_args=ServerArgs(model_path='/m', mem_fraction_static=0.9, tp_size=1)",
        "[2026-01-01 00:00:02] Load weight begin. avail mem=79.00 GB",
        "[2026-01-01 00:01:02] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=4.00 GB, mem usage=75.00 GB.",
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: self.server_args.mem_fraction_static=0.9",
    ])
    doc = explain(report)
    trap = next(t for t in doc.traps if t.id == "failure")
    assert doc.state == "failed" and trap.fix is not None and "above 0.949" in trap.fix


def test_gzip_log_and_stdin(tmp_path: Path) -> None:
    import gzip

    gz = tmp_path / "sglang.log.1.gz"
    gz.write_bytes(gzip.compress(REFERENCE.read_bytes()))
    assert _json("--log", str(gz))["capacity"]["max_total_num_tokens"] == 159277
    proc = subprocess.run([TUNER, "explain", "--log", "-", "--json"], input=REFERENCE.read_text(), capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0 and json.loads(proc.stdout)["sources"] == ["log on standard input"]
    (tmp_path / "bad.gz").write_bytes(b"\x1f\x8b" + b"not gzip")
    bad = _run("--log", str(tmp_path / "bad.gz"))
    assert bad.returncode == 1 and "damaged gzip" in bad.stderr


def test_0523_draft_weights_are_static_not_reserve() -> None:
    from tuner.sglang.explain import explain
    from tuner.sglang.logs import parse_log

    report = parse_log([
        "[2026-11-01 12:00:00] server_args=ServerArgs(model_path='/m', mem_fraction_static=0.88, speculative_algorithm='EAGLE')",
        "[2026-11-01 12:00:00] Memory baseline taken. mem usage=0.60 GB",
        "[2026-11-01 12:00:00] Load weight begin. avail mem=94.00 GB",
        "[2026-11-01 12:00:30] Load weight end. elapsed=30.00 s, type=DeepseekV3ForCausalLM, avail mem=21.00 GB, mem usage=73.00 GB.",
        "[2026-11-01 12:00:31] Load weight begin. avail mem=21.00 GB",
        "[2026-11-01 12:00:33] Load weight end. elapsed=2.00 s, type=DeepseekV3ForCausalLMNextN, avail mem=19.80 GB, mem usage=1.20 GB.",
        "[2026-11-01 12:00:34] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 120000, KV size: 8.05 GB",
        "[2026-11-01 12:00:34] Memory pool end. avail mem=10.50 GB",
        "[2026-11-01 12:00:40] Capture target decode CUDA graph end. bs=[1, 2, 4, 8], elapsed=5.00 s, mem usage=0.40 GB, avail mem=10.10 GB.",
        "[2026-11-01 12:00:48] Capture draft decode CUDA graph end. bs=[1, 2, 4, 8], elapsed=4.00 s, mem usage=0.20 GB, avail mem=9.90 GB.",
        "[2026-11-01 12:00:49] max_total_num_tokens=120000, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=48, context_len=163840, available_gpu_mem=9.90 GB",
    ])
    steps = {s.item: s for s in explain(report).waterfall}
    assert steps["other_static"].gib == pytest.approx(1.67, abs=0.02)  # 0.88 × 94 − 73 − 8.05: the draft's 1.20 GiB of weights, and slack
    assert steps["draft_model"].gib == 0.2
    parts = sum(steps[k].gib for k in ("req_to_token", "cuda_graphs", "draft_model", "other_reserve", "free_after_graphs") if k in steps)
    assert parts == pytest.approx(steps["reserve"].gib, abs=0.02)


def test_mem_fraction_static_is_range_checked_and_only_fills_in(tmp_path: Path) -> None:
    for bad in ("1.5", "-0.3", "0", "1"):
        proc = _run("--log", str(REFERENCE), f"--mem-fraction-static={bad}")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, (bad, proc.stdout, proc.stderr)
        assert "--mem-fraction-static" in lines[0] and "outside (0, 1)" in lines[0] and "Traceback" not in proc.stderr
    # The log states 0.88: a different CLI value is not used, and the output says so.
    doc = _json("--log", str(REFERENCE), "--mem-fraction-static", "0.5")
    assert doc["settings"]["mem_fraction_static"] == {"value": 0.88, "source": "log:server_args"}
    assert {s["item"]: s["gib"] for s in doc["waterfall"]}["reserve"] == 11.28
    assert any("--mem-fraction-static 0.5 is not used" in w and "0.88" in w for w in doc["warnings"]), doc["warnings"]
    # A log that does not state it: the CLI value fills in (and a contradicting estimate is reported).
    unstated = tmp_path / "no-args.log"
    unstated.write_text("".join(ln for ln in REFERENCE.read_text().splitlines(keepends=True) if "server_args=" not in ln))
    doc = _json("--log", str(unstated), "--mem-fraction-static", "0.88")
    assert doc["settings"]["mem_fraction_static"] == {"value": 0.88, "source": "cli"} and not any("mem-fraction" in w for w in doc["warnings"])
    doc = _json("--log", str(unstated), "--mem-fraction-static", "0.5")
    assert doc["settings"]["mem_fraction_static"]["source"] == "cli"
    assert any("--mem-fraction-static 0.5 is used" in w and "0.880" in w for w in doc["warnings"]), doc["warnings"]


def test_simulated_startup_oom_in_init_memory_pool(tmp_path: Path) -> None:
    # The tester's reproduction: the simulator at mfs 0.99 on an L4 dies with torch's OOM raised in
    # init_memory_pool, before any scheduler or ready line (§4.3): a startup failure whose fix lowers the fraction.
    log = tmp_path / "sim.log"
    with log.open("w") as err:
        sim = subprocess.run([TUNER, "sim", "serve", "--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB", "--mem-fraction-static", "0.99",
                              "--sim-time-scale", "0", "--host", "127.0.0.1", "--port", str(free_port())],
                             stdout=subprocess.DEVNULL, stderr=err, timeout=120, check=False)
    assert sim.returncode != 0
    doc = _json("--log", str(log))
    assert doc["state"] == "failed" and doc["failure"]["failure_class"] == "cuda_graph_oom"
    trap = _trap(doc, "failure")
    assert "raised in init_memory_pool" in trap["title"] and "reserve" in trap["detail"]
    assert trap["fix"].startswith("lower --mem-fraction-static below 0.95") and "0.99 leaves only" in trap["fix"]
    assert "chunked-prefill" not in trap["fix"]
    text = " ".join(_run("--log", str(log)).stdout.split())
    assert "runtime_oom" not in text and "while serving" not in text
