"""A trace sends its text to a speculative deployment (never random ids): the ShareGPT / OpenAI
trace's own messages, a JSONL trace the shipped prompts at each block's length; turns keep their
common prefix as text. On the simulator as a real server, the text reaches ``/generate`` (the
server counts its words, not the ids) and the draft is accepted as on chat, not as on random ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import run_tuner
from tests.support.sim import spawn, wait_ready
from tuner.load.runner import run_load_sync
from tuner.load.workloads import TraceSpec, build_workload, for_speculation

SPEC = ["--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB", "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", "/models/eagle3", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--sim-version", "0.5.23"]

QUESTIONS = [
    "How should I size the batch for a chat service that mostly answers short questions from support agents?",
    "Please summarise the trade offs between a larger prefill chunk and the latency of the requests already decoding.",
    "What happens to the queue when the cache pool is nearly full and a long prompt arrives at the same time?",
    "Can you explain why the first token takes longer when many users start a conversation at once in the morning?",
]
ANSWER = ("It depends on how long the prompts are and how many of them arrive together, so measure the "
          "longest ones first and then raise the limit while the latency stays within the target.")


def _sharegpt(path: Path, conversations: int) -> Path:
    data = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"{QUESTIONS[i % len(QUESTIONS)]} (case {i})"},
        {"from": "gpt", "value": ANSWER},
        {"from": "human", "value": "Thank you, and what would you change first if the service got twice as busy?"},
        {"from": "gpt", "value": ANSWER}]} for i in range(conversations)]
    path.write_text(json.dumps(data))
    return path


def test_a_speculative_trace_sends_its_own_text_with_the_turns_prefix(tmp_path: Path) -> None:
    spec = TraceSpec(path=_sharegpt(tmp_path / "chat.json", 3))
    assert not spec.send_text and for_speculation(spec).send_text
    plain = list(build_workload(spec, seed=1).make_pass(0))
    sent = list(build_workload(for_speculation(spec), seed=1).make_pass(0))
    assert all(r.text is None for r in plain)
    assert [r.input_ids for r in sent] == [r.input_ids for r in plain]  # the ids still stand for the text
    first, second = sent[0], next(r for r in sent if r.after == sent[0].rid)
    assert first.text is not None and first.text.startswith("user: How should I size the batch")
    assert second.text is not None and second.text.startswith(first.text + "assistant: It depends")
    assert {r.prompt_class for r in sent} == {"trace"}


def test_a_jsonl_trace_without_text_gets_shipped_text_equal_where_its_blocks_are(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp_s": i * 0.1, "input_len": 600, "output_len": 16,
                                          "prefix_group": "sys", "prefix_len": 400}) for i in range(3)))
    reqs = list(build_workload(for_speculation(TraceSpec(path=path)), seed=0).make_pass(0))
    texts = [r.text or "" for r in reqs]
    shared = texts[0][:1200]
    assert len(shared) > 1000 and all(t.startswith(shared) for t in texts)  # the group's 400 tokens
    assert texts[0] != texts[1]  # each request's own 200 tokens differ
    assert all(len(t.encode()) == pytest.approx(600 * 4, rel=0.05) for t in texts)


def test_on_the_simulator_the_text_reaches_generate_and_is_accepted_as_chat(tmp_path: Path) -> None:
    spec = TraceSpec(path=_sharegpt(tmp_path / "chat.json", 8))
    sim = spawn(SPEC, tmp_path)
    try:
        wait_ready(sim)
        results = {}
        for label, s in (("ids", spec), ("text", for_speculation(spec))):
            wl = build_workload(s, seed=2)
            result = run_load_sync(sim.url, wl, concurrency=4)
            assert result.summary.completed == 16
            sent = {r.rid: r for r in wl.make_pass(0)}
            for rec in result.records:
                req = sent[rec.rid]
                # The simulator counts a text prompt's words; token ids, one each.
                expected = len(req.text.split()) if req.text is not None else req.input_len
                assert rec.prompt_tokens == expected
            results[label] = result.summary.accept_length
    finally:
        sim.stop()
    assert results["text"] is not None and results["ids"] is not None
    assert results["ids"] > 1.1 * results["text"]  # random ids overstate the draft's acceptance


def test_tuner_load_sends_a_trace_as_text_when_asked(tmp_path: Path) -> None:
    trace = _sharegpt(tmp_path / "chat.json", 4)
    sim = spawn(SPEC, tmp_path)
    try:
        wait_ready(sim)
        for extra, cls in (([], "unknown"), (["--send-text"], "trace")):
            out = tmp_path / f"{cls}.json"
            done = run_tuner("load", "--url", sim.url, "--workload", "trace", "--trace", str(trace), *extra,
                             "--concurrency", "2", "--json", str(out), timeout_s=180)
            assert done.returncode == 0, done.stderr
            assert set(json.loads(out.read_text())["summary"]["accept_length_by_class"]) == {cls}
            assert ("random token ids overstate" in done.stderr) is (cls == "unknown")
    finally:
        sim.stop()
