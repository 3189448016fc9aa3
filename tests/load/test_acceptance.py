"""Speculative decoding's acceptance as `tuner load` measures it: per request and per prompt class
from SGLang's ``meta_info``, beside the server's own ``avg_spec_accept_length``, on the simulator
as a real server; text prompts (the shipped chat-like set) against random ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import run_tuner
from tests.support.configs import ROOT
from tests.support.sim import spawn, wait_ready
from tuner.load.metrics import RequestRecord, summarize
from tuner.load.workloads import SHIPPED_PROMPTS, TextSpec, build_workload, read_prompts

SPEC = ["--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB", "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", "/models/eagle3", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--sim-version", "0.5.23"]


def test_text_workload_sends_text_by_class_and_no_two_prompts_share_a_prefix() -> None:
    wl = build_workload(TextSpec(num_requests=40, output_len=32), seed=3)
    reqs = list(wl.make_pass(0))
    assert {r.prompt_class for r in reqs} == {"chat", "code"}
    assert len({r.text.split()[0] for r in reqs if r.text}) == 40  # each starts with its own rid
    assert all(r.text and r.input_len > 10 for r in reqs)
    grown = list(build_workload(TextSpec(num_requests=3, prompt_tokens=2000), seed=3).make_pass(0))
    assert all(r.input_len >= 2000 for r in grown)
    assert len(read_prompts(SHIPPED_PROMPTS)) == 36


def test_summary_pools_accept_length_per_class() -> None:
    def rec(rid: str, ct: int, verify: int | None, cls: str) -> RequestRecord:
        return RequestRecord(rid=rid, send_time_s=0, first_token_time_s=0.1, end_time_s=1, chunk_times_s=[0.1, 1],
                             chunk_tokens=[1, ct - 1], completion_tokens=ct, input_len=10, max_new_tokens=ct,
                             e2e_latency_s=1, spec_verify_ct=verify, prompt_class=cls)

    s = summarize([rec("a", 100, 50, "chat"), rec("b", 90, 30, "code"), rec("c", 60, 30, "chat")], 1.0)
    assert s.accept_length == pytest.approx(250 / 110)
    assert s.accept_length_by_class == {"chat": pytest.approx(2.0), "code": pytest.approx(3.0)}
    assert s.metrics()["accept_length_code"] == pytest.approx(3.0)
    assert summarize([rec("d", 10, None, "raw")], 1.0).accept_length is None


def test_tuner_load_reports_acceptance_beside_latency_and_agrees_with_the_server(tmp_path: Path) -> None:
    sim = spawn(SPEC, tmp_path)
    try:
        wait_ready(sim)
        out = tmp_path / "text.json"
        done = run_tuner("load", "--url", sim.url, "--workload", "text", "--output-len", "200",
                         "--concurrency", "4", "--max-requests", "24", "--json", str(out), timeout_s=180)
        assert done.returncode == 0, done.stderr
        assert "accept length (tokens per verify step)" in done.stdout
        data = json.loads(out.read_text())
        text_len = data["summary"]["accept_length"]
        assert set(data["summary"]["accept_length_by_class"]) <= {"chat", "code"}
        assert data["server_avg_spec_accept_length"] == pytest.approx(text_len, rel=0.05)
        out2 = tmp_path / "random.json"
        done = run_tuner("load", "--url", sim.url, "--input-len", "300", "--output-len", "200", "--vocab-size",
                         "128000", "--concurrency", "4", "--max-requests", "24", "--json", str(out2), timeout_s=180)
        assert done.returncode == 0, done.stderr
        assert "random token ids overstate" in done.stderr
        raw_len = json.loads(out2.read_text())["summary"]["accept_length"]
        assert raw_len > text_len * 1.1  # random prompts overstate acceptance
    finally:
        sim.stop()


def test_a_speculative_service_is_planned_on_text_prompts_of_the_same_lengths() -> None:
    done = run_tuner("run", "--config", str(ROOT / "configs" / "reference-sim.toml"), "--dry-run", timeout_s=120)
    workload = next(line for line in done.stdout.splitlines() if line.startswith("workload: "))
    assert workload.startswith("workload: text(") and "prompt_tokens=6144, output_len=64" in workload
    done = run_tuner("run", "--config", str(ROOT / "configs" / "demo-sim.toml"), "--dry-run", timeout_s=120)
    assert "workload: random(" in done.stdout  # no draft model: the configured random ids stay
