"""Workloads: exact lengths, reproducibility, designed prefix reuse, growing conversations, traces."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from tuner.errors import ConfigError, LoadError
from tuner.load.workloads import (
    MultiTurnSpec,
    RandomSpec,
    SharedPrefixSpec,
    TraceSpec,
    WorkloadSpec,
    build_workload,
    capacity_probe,
    designed_hit_rate,
    spec_from_options,
)


def test_random_is_exact_reproducible_and_ranged() -> None:
    spec = RandomSpec(input_len=300, output_len=40, num_requests=20)
    first = list(build_workload(spec, seed=3))
    assert [r.input_ids for r in first] == [r.input_ids for r in build_workload(spec, seed=3)]
    assert first[0].input_ids != list(build_workload(spec, seed=4))[0].input_ids
    assert all(r.input_len == 300 and r.max_new_tokens == 40 for r in first)
    assert all(100 <= t < 1000 for r in build_workload(spec, seed=3, vocab_size=1000) for t in r.input_ids)
    ranged = list(build_workload(RandomSpec(input_len=300, output_len=40, range_ratio=0.5, num_requests=200), seed=1))
    lens = {r.input_len for r in ranged}
    assert min(lens) >= 150 and max(lens) <= 300 and len(lens) > 50
    assert build_workload(spec, seed=1).context_tokens == 340


def test_endless_random_and_passes_give_fresh_unique_requests() -> None:
    endless = build_workload(RandomSpec(input_len=8, output_len=2), seed=0)
    assert endless.num_requests is None
    assert len(list(itertools.islice(endless, 500))) == 500
    finite = build_workload(RandomSpec(input_len=8, output_len=2, num_requests=3), seed=0)
    six = list(itertools.islice(finite.passes(), 6))
    assert len({r.rid for r in six}) == 6 and six[0].input_ids != six[3].input_ids


def test_shared_prefix_groups_share_exactly_the_system_prompt() -> None:
    spec = SharedPrefixSpec(num_groups=4, prompts_per_group=5, system_prompt_len=64, question_len=16, output_len=8)
    reqs = list(build_workload(spec, seed=9))
    assert len(reqs) == 20 and all(r.input_len == 80 for r in reqs)
    by_group: dict[str, list[list[int]]] = {}
    for r in reqs:
        by_group.setdefault(r.group or "", []).append(r.input_ids)
    assert len(by_group) == 4 and all(len(v) == 5 for v in by_group.values())
    for prompts in by_group.values():
        assert all(p[:64] == prompts[0][:64] for p in prompts)
        assert len({tuple(p[64:]) for p in prompts}) == 5
    systems = {tuple(v[0][:64]) for v in by_group.values()}
    assert len(systems) == 4
    # The order is shuffled, not group after group.
    assert [r.group for r in reqs] != sorted(r.group or "" for r in reqs)
    # A second pass keeps the system prompts and draws new questions.
    second = list(itertools.islice(build_workload(spec, seed=9).passes(), 20, 40))
    assert {tuple(r.input_ids[:64]) for r in second} == systems
    assert {tuple(r.input_ids) for r in second}.isdisjoint({tuple(r.input_ids) for r in reqs})
    assert designed_hit_rate(SharedPrefixSpec()) == pytest.approx(15 / 16 * 2048 / 2176)


def test_multi_turn_history_grows_and_waits_for_the_previous_turn() -> None:
    spec = MultiTurnSpec(num_sessions=3, turns=3, first_input_len=50, turn_input_len=10, output_len=5)
    wl = build_workload(spec, seed=2)
    reqs = {r.rid: r for r in wl}
    assert len(reqs) == 9 and wl.has_dependencies
    t0, t1, t2 = (reqs[f"multi_turn-0-s1-t{k}"] for k in range(3))
    assert (t0.input_len, t1.input_len, t2.input_len) == (50, 65, 80)
    assert t1.input_ids[:50] == t0.input_ids and t2.input_ids[:65] == t1.input_ids
    assert t0.after is None and t1.after == t0.rid and t2.after == t1.rid
    assert wl.context_tokens == 85
    assert wl.designed_hit_rate == pytest.approx((50 + 65) / (50 + 65 + 80))


def test_trace_replay_groups_sessions_and_time_scale(tmp_path: Path) -> None:
    rows = [
        {"timestamp_s": 10.0, "input_len": 40, "output_len": 4, "prefix_group": "a", "prefix_len": 30},
        {"timestamp_s": 12.0, "input_len": 50, "output_len": 4, "prefix_group": "a", "prefix_len": 30},
        {"timestamp_s": 11.0, "input_len": 20, "output_len": 3, "session": 7},
        {"timestamp_s": 13.0, "input_len": 40, "output_len": 3, "session": 7},
        {"timestamp_s": 14.0, "input_len": 9, "output_len": 1},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = TypeAdapter(WorkloadSpec).validate_python({"kind": "trace", "path": str(path), "time_scale": 0.5})
    assert isinstance(spec, TraceSpec)
    reqs = list(build_workload(spec, seed=0))
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 1.5, 2.0]
    a1, s1, a2, s2, plain = reqs
    assert a1.input_ids[:30] == a2.input_ids[:30] and a1.input_len == 40 and a2.input_len == 50
    assert s2.input_ids[:20] == s1.input_ids and s2.after == s1.rid and s2.input_len == 40
    assert plain.group is None and plain.input_len == 9


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"timestamp_s": 0, "input_len": 5}\n', "line 1"),
        ('{"timestamp_s": 0, "input_len": 5, "output_len": 1}\nnot json\n', "line 2"),
        ("", "holds no request"),
        ('{"timestamp_s": 0, "input_len": 5, "output_len": 1, "prefix_group": 1, "prefix_len": 9}\n', "line 1"),
    ],
)
def test_bad_trace_is_one_line_error(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(LoadError) as info:
        build_workload(TraceSpec(path=path), seed=0)
    assert needle in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(LoadError, match="cannot be read"):
        build_workload(TraceSpec(path=tmp_path / "missing.jsonl"), seed=0)


def test_capacity_probe_and_spec_validation() -> None:
    probe = capacity_probe(4, 1000, output_len=10, seed=1)
    reqs = list(probe)
    assert len(reqs) == 4 and all(r.input_len == 990 and r.max_new_tokens == 10 for r in reqs)
    assert probe.context_tokens == 1000 and not probe.repeatable
    assert len({tuple(r.input_ids[:16]) for r in reqs}) == 4
    with pytest.raises(LoadError):
        capacity_probe(0, 1000)
    with pytest.raises(LoadError):
        capacity_probe(2, 10, output_len=10)
    with pytest.raises(ValueError):
        TypeAdapter(WorkloadSpec).validate_python({"kind": "random", "input_len": 0, "output_len": 1})
    with pytest.raises(ValueError):
        TypeAdapter(WorkloadSpec).validate_python({"kind": "bogus"})
    assert "shared_prefix(" in build_workload(SharedPrefixSpec(), seed=0).describe()


def test_spec_from_cli_options() -> None:
    spec = spec_from_options("shared-prefix", {"num_groups": 4, "output_len": 8, "input_len": None})
    assert isinstance(spec, SharedPrefixSpec) and spec.num_groups == 4 and spec.system_prompt_len == 2048
    cases = [
        ("random", {"num_groups": 3}, "--num-groups does not apply to --workload random"),
        ("nope", {}, "--workload 'nope' is unknown"),
        ("random", {"input_len": 0}, "--input-len 0 is invalid"),
        ("trace", {}, "--trace"),
        ("multi-turn", {"turns": -1}, "--turns"),
    ]
    for kind, options, needle in cases:
        with pytest.raises(ConfigError) as info:
            spec_from_options(kind, options)
        assert needle in str(info.value) and "\n" not in str(info.value)


def test_mean_request_tokens_is_the_mean_not_the_longest() -> None:
    from tuner.load.workloads import RandomSpec
    from tuner.load.workloads import build_workload as build

    workload = build(RandomSpec(kind="random", input_len=2000, output_len=200, range_ratio=0.5, num_requests=2000),
                     seed=3)
    sizes = [len(r.input_ids) + r.max_new_tokens for r in workload]
    assert workload.context_tokens == 2200 and max(sizes) <= 2200
    assert abs(workload.mean_request_tokens - sum(sizes) / len(sizes)) <= 0.02 * workload.mean_request_tokens
    assert workload.mean_request_tokens < 0.8 * workload.context_tokens
