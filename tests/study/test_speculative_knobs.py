"""The speculative knobs: the space searches speculation on/off and the draft shape only when the
baseline runs a draft; the command renders them (off removes every --speculative-* flag); SGLang's
rules between them screen a candidate before any launch (its message and the rule)."""

from __future__ import annotations

import pytest

from tuner.config import SpaceSection
from tuner.sglang.flags import FlagTable, parse_argv
from tuner.sglang.speculative import SpecShape, resolve_shape, shape_refusal
from tuner.study.space import resolve_space
from tuner.trial import render_argv

BASE = {"mem_fraction_static": 0.88, "max_running_requests": 48, "chunked_prefill_size": 8192,
        "speculative_algorithm": True, "speculative_num_steps": 5, "speculative_eagle_topk": 4,
        "speculative_num_draft_tokens": 8}
ARGV = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", "/d", "--mem-fraction-static", "0.88"]


def test_space_searches_the_shape_only_with_a_draft_and_lists_the_baseline_first() -> None:
    space = resolve_space(SpaceSection(), BASE)
    assert space.searches("speculative_algorithm")
    assert space.grid("speculative_num_steps") == [5, 1, 2, 3, 4]
    assert space.grid("speculative_eagle_topk") == [4, 1] and space.grid("speculative_num_draft_tokens") == [8, 4, 6]
    assert space.snap({"mem_fraction_static": 0.88})["speculative_num_steps"] == 5  # left out: the baseline's
    off = space.snap({"speculative_algorithm": False})
    assert "speculative_num_steps" not in off and off["speculative_algorithm"] is False
    plain = {k: v for k, v in BASE.items() if not k.startswith("speculative_")}
    assert not resolve_space(SpaceSection(), plain).searches("speculative_algorithm")
    assert not resolve_space(SpaceSection(speculative=False), BASE).searches("speculative_num_steps")


@pytest.mark.parametrize("version", ["0.5.5.post3", "0.5.23"])
def test_render_off_removes_every_speculative_flag_and_on_sets_the_whole_shape(version: str) -> None:
    table = FlagTable.for_version(version)
    off = parse_argv(render_argv(ARGV, {"speculative_algorithm": False, "mem_fraction_static": 0.9}, table), table)
    assert not any(k.startswith("speculative_") for k in off) and off["mem_fraction_static"] == 0.9
    on = parse_argv(render_argv(ARGV, {"speculative_algorithm": True, "speculative_num_steps": 2,
                                       "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3}, table), table)
    assert on["speculative_algorithm"] == "EAGLE3" and on["speculative_draft_model_path"] == "/d"
    assert (on["speculative_num_steps"], on["speculative_eagle_topk"], on["speculative_num_draft_tokens"]) == (2, 1, 3)


def test_sglang_rules_per_version() -> None:
    assert resolve_shape(3, 1, 8) == SpecShape(3, 1, 4)
    assert "'flashinfer' backend" in shape_refusal("0.5.5.post3", SpecShape(3, 4, 8), page_size=64)
    assert shape_refusal("0.5.5.post3", SpecShape(3, 4, 8), page_size=64, attention_backend="flashinfer") is None
    assert "('flashinfer', 'fa3', 'triton')" in shape_refusal("0.5.23", SpecShape(3, 4, 8), page_size=64,
                                                               attention_backend="flashmla")
    assert shape_refusal("0.5.23", SpecShape(3, 4, 8), page_size=64, attention_backend="fa3") is None
    assert "selected index k out of range" in shape_refusal("0.5.23", SpecShape(1, 4, 8))  # 4 candidates < 7
    assert shape_refusal("0.5.23", SpecShape(2, 4, 8)) is None  # 4 + 16 candidates


def test_the_draft_kv_dtype_is_searched_where_the_version_has_its_flag() -> None:
    # 0.5.23 has --speculative-draft-kv-cache-dtype; 0.5.5 and 0.5.10 do not (shared/sglang-flags).
    assert FlagTable.for_version("0.5.23").has("speculative_draft_kv_cache_dtype")
    assert not FlagTable.for_version("0.5.5.post3").has("speculative_draft_kv_cache_dtype")
    assert not FlagTable.for_version("0.5.10").has("speculative_draft_kv_cache_dtype")
    space = resolve_space(SpaceSection(), BASE, draft_kv_dtype=True)
    assert space.grid("speculative_draft_kv_cache_dtype") == ["auto", "fp8_e4m3"]  # unset follows the target's
    assert space.snap({"mem_fraction_static": 0.88})["speculative_draft_kv_cache_dtype"] == "auto"
    assert "speculative_draft_kv_cache_dtype" not in space.snap({"speculative_algorithm": False})
    assert not resolve_space(SpaceSection(), BASE).searches("speculative_draft_kv_cache_dtype")
    fp8_target = resolve_space(SpaceSection(), {**BASE, "kv_cache_dtype": "fp8_e4m3"}, draft_kv_dtype=True)
    assert fp8_target.grid("speculative_draft_kv_cache_dtype") == ["fp8_e4m3"]
    table = FlagTable.for_version("0.5.23")
    on = parse_argv(render_argv(ARGV, {"speculative_algorithm": True, "speculative_draft_kv_cache_dtype": "fp8_e4m3"},
                                table), table)
    assert on["speculative_draft_kv_cache_dtype"] == "fp8_e4m3"
    off = parse_argv(render_argv([*ARGV, "--speculative-draft-kv-cache-dtype", "fp8_e4m3"],
                                 {"speculative_algorithm": False}, table), table)
    assert "speculative_draft_kv_cache_dtype" not in off
