"""Trace import: ShareGPT conversations, OpenAI request logs, the tuner's JSONL; the reuse estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner.errors import LoadError
from tuner.load.workloads import (
    MultiTurnSpec,
    RandomSpec,
    SharedPrefixSpec,
    TraceSpec,
    build_workload,
    estimate_reuse,
    estimate_tokens,
)

SYSTEM = "You are a careful assistant. " * 40  # ~1160 bytes: ~290 tokens at 4 bytes a token


def _sharegpt(path: Path) -> Path:
    convs = [
        {"id": "a", "conversations": [
            {"from": "system", "value": SYSTEM},
            {"from": "human", "value": "What is a radix tree?"},
            {"from": "gpt", "value": "A compressed trie. " * 10},
            {"from": "human", "value": "And a prefix cache?"},
            {"from": "gpt", "value": "Kept KV of shared prefixes."},
        ]},
        {"id": "b", "conversations": [
            {"from": "human", "value": "Hello"},
            {"from": "gpt", "value": "Hi! How can I help?"},
            {"from": "human", "value": "unanswered last turn"},
        ]},
    ]
    path.write_text(json.dumps(convs))
    return path


def test_sharegpt_turns_grow_wait_and_share_exact_prefixes(tmp_path: Path) -> None:
    wl = build_workload(TraceSpec(path=_sharegpt(tmp_path / "sg.json")), seed=1)
    assert wl.trace_format == "sharegpt" and wl.has_dependencies and not wl.has_arrivals
    reqs = list(wl)
    assert len(reqs) == 3  # the unanswered last turn is not a request
    # Turn-major: both conversations' first turns, then a's second.
    a1, b1, a2 = reqs
    assert a1.group == a2.group == "conversation:a" and b1.group == "conversation:b"
    assert a1.after is None and b1.after is None and a2.after == a1.rid
    system = 4 + estimate_tokens(SYSTEM)
    question = 4 + estimate_tokens("What is a radix tree?")
    assert a1.input_len == system + question
    assert a1.max_new_tokens == estimate_tokens("A compressed trie. " * 10)
    answer_block = 4 + estimate_tokens("A compressed trie. " * 10)
    assert a2.input_len == a1.input_len + answer_block + 4 + estimate_tokens("And a prefix cache?")
    assert a2.input_ids[: a1.input_len] == a1.input_ids  # the history is the same token ids
    assert all(r.arrival_s is None for r in reqs)
    # Deterministic, and text never appears: ids only.
    again = list(build_workload(TraceSpec(path=tmp_path / "sg.json"), seed=1))
    assert [r.input_ids for r in again] == [r.input_ids for r in reqs]
    assert all(isinstance(t, int) for t in a2.input_ids)


def test_openai_log_sessions_timestamps_and_shared_system_prompt(tmp_path: Path) -> None:
    sys_msg = {"role": "system", "content": SYSTEM}
    u1 = {"role": "user", "content": "first question"}
    a1 = {"role": "assistant", "content": "first answer, fairly long " * 4}
    u2 = {"role": "user", "content": [{"type": "text", "text": "second question"}]}
    lines = [
        {"timestamp": "2026-11-30T10:00:00Z", "request": {"model": "m", "messages": [sys_msg, u1]},
         "response": {"choices": [{"message": a1}], "usage": {"prompt_tokens": 300, "completion_tokens": 40}}},
        {"created": 1796032810, "messages": [sys_msg, {"role": "user", "content": "another user"}],
         "max_tokens": 64},
        {"ts": 1796032805000, "body": {"messages": [sys_msg, u1, a1, u2]},
         "response": {"choices": [{"message": {"role": "assistant", "content": "ok"}}]}},
    ]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    wl = build_workload(TraceSpec(path=path, time_scale=0.5), seed=0)
    assert wl.trace_format == "openai" and wl.has_arrivals and wl.has_dependencies
    first, turn2, other = list(wl)  # sorted by time: 10:00:00, +5 s, +10 s
    assert [r.arrival_s for r in (first, turn2, other)] == [0.0, 2.5, 5.0]
    assert first.max_new_tokens == 40 and other.max_new_tokens == 64 and turn2.max_new_tokens == 1
    assert turn2.after == first.rid and turn2.group == first.group is not None and other.after is None
    assert turn2.input_ids[: first.input_len] == first.input_ids
    system = 4 + estimate_tokens(SYSTEM)
    assert other.input_ids[:system] == first.input_ids[:system]
    assert other.input_ids[system:] != first.input_ids[system: other.input_len]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}\n', "no timestamp"),
        ('{"timestamp": 5, "messages": [{"role": "user", "content": "x"}]}\n', "no output length"),
        ('{"timestamp": 5, "messages": []}\n', "no messages"),
        ('[{"id": 1}]', "no conversations"),
        ('[{"conversations": [{"from": "human", "value": "x"}]}]', "holds no request"),
    ],
)
def test_bad_text_trace_is_one_line(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(LoadError) as info:
        build_workload(TraceSpec(path=path), seed=0)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_max_requests_keeps_whole_conversations(tmp_path: Path) -> None:
    path = _sharegpt(tmp_path / "sg.json")
    assert len(list(build_workload(TraceSpec(path=path, max_requests=2), seed=0))) == 2
    one = list(build_workload(TraceSpec(path=path, max_requests=1), seed=0))
    assert [r.group for r in one] == ["conversation:a", "conversation:a"]  # never a turn without its first


def test_reuse_estimate_per_kind() -> None:
    none = estimate_reuse(build_workload(RandomSpec(input_len=512, output_len=8), seed=0), max_requests=200)
    assert none.reuse_share == 0 and none.working_set_tokens == 0 and none.sampled
    shared = estimate_reuse(build_workload(SharedPrefixSpec(num_groups=4, prompts_per_group=8, system_prompt_len=1024,
                                                            question_len=64, output_len=8), seed=0))
    # 28 of 32 requests reuse their group's 1024-token system prompt (16 whole 64-token blocks).
    assert shared.reused_tokens == 28 * 1024 and shared.working_set_tokens == 4 * 1024
    assert shared.prefix_groups == 4 and shared.sessions == 0
    turns = estimate_reuse(build_workload(MultiTurnSpec(num_sessions=4, turns=3, first_input_len=1024,
                                                        turn_input_len=64, output_len=64), seed=0))
    # Turn 2 reuses turn 1's 1024, turn 3 turn 2's 1152, per session.
    assert turns.reused_tokens == 4 * (1024 + 1152) and turns.sessions == 4
    assert turns.reuse_share == pytest.approx((1024 + 1152) / (1024 + 1152 + 1280))
    assert "multi-turn" in turns.describe() and "%" in turns.describe()
