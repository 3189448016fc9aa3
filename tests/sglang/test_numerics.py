"""The numerics key: which flag changes need the quality gate."""

from tuner.sglang.numerics import LOSSLESS_UNDER_GREEDY, numerics_changes, numerics_key


def test_memory_knobs_do_not_change_numerics():
    base = {"mem_fraction_static": 0.88, "kv_cache_dtype": "auto"}
    cand = {"mem_fraction_static": 0.95, "max_running_requests": 64, "chunked_prefill_size": 4096,
            "enable_hierarchical_cache": True}
    assert numerics_changes(cand, base) == []
    assert numerics_key(cand) == numerics_key(base) == ()


def test_fp8_kv_and_dcp_change_numerics_and_defaults_are_one_value():
    base = {"kv_cache_dtype": "auto", "dcp_size": 1}
    assert numerics_changes({"kv_cache_dtype": "fp8_e4m3"}, base) == ["kv_cache_dtype"]
    assert numerics_changes({"dcp_size": 8}, base) == ["dcp_size"]
    assert numerics_changes({"dcp_size": 1, "kv_cache_dtype": None}, base) == []
    assert numerics_key({"kv_cache_dtype": "FP8_E4M3", "dcp_size": 4}) == (("dcp_size", 4), ("kv_cache_dtype", "fp8_e4m3"))


def test_speculative_changes_are_probed_but_lossless_under_greedy():
    changes = numerics_changes({"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3}, {})
    assert changes == ["speculative_algorithm", "speculative_num_steps"]
    assert set(changes) <= LOSSLESS_UNDER_GREEDY
    assert "kv_cache_dtype" not in LOSSLESS_UNDER_GREEDY


def test_the_key_is_of_what_sglang_runs_after_its_own_resolution() -> None:
    """Issue 38: the shape SGLang chooses (``auto_choose_speculative_params``: (3, 1, 4) for a
    DeepSeek-V3-like model) and the draft tokens it forces at topk 1 are the key's; NEXTN is EAGLE."""
    from tuner.sglang.numerics import resolve_numerics

    bare = {"speculative_algorithm": "EAGLE3"}
    named = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
             "speculative_num_draft_tokens": 4}
    assert numerics_changes(named, bare, model_class="DeepseekV3ForCausalLM") == []
    assert numerics_changes(named, bare) != []  # the model's class unknown: the shape is not guessed
    assert numerics_changes(named, bare, model_class="LlamaForCausalLM") != []  # (5, 4, 8) there
    forced = {**named, "speculative_num_steps": 2, "speculative_num_draft_tokens": 4}
    assert dict(numerics_key(forced))["speculative_num_draft_tokens"] == 3  # topk 1: steps + 1
    assert resolve_numerics({"speculative_algorithm": "nextn"})["speculative_algorithm"] == "EAGLE"
    assert numerics_changes({"kv_cache_dtype": "bfloat16"}, {"kv_cache_dtype": "bf16"}) == []
    # a study's dp_size knob is DP attention's size: rendered, 4 over 1 is a change; SGLang's plain --dp-size is not
    from tuner.study.launch import launch_fields

    assert numerics_changes(launch_fields({"dp_size": 4}, {}), launch_fields({"dp_size": 1}, {})) == [
        "dp_size", "enable_dp_attention"]
    assert numerics_changes({"dp_size": 4}, {"dp_size": 1}) == []


def test_an_old_record_s_key_is_rebuilt_from_its_launch() -> None:
    """A speculative baseline stored before the key was resolved keyed ``speculative_algorithm``
    alone; its params hold the shape SGLang resolved, and the rebuilt key has it."""
    from tuner.records import QualityFacts, TrialRecord
    from tuner.study.launch import record_numerics

    params = {"mem_fraction_static": 0.88, "speculative_algorithm": True, "speculative_num_steps": 3,
              "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
    old = TrialRecord(kind="baseline", params=params,
                      quality=QualityFacts(numerics={"speculative_algorithm": "eagle3"}, status="reference"))
    candidate = TrialRecord(kind="sampled", params={**params, "mem_fraction_static": 0.9}, quality=QualityFacts(
        numerics=dict(numerics_key({"speculative_algorithm": "EAGLE3", **{k: v for k, v in params.items()
                                                                          if k.startswith("speculative_num") or k.endswith("topk")}})),
        status="unprobed"))
    assert record_numerics(old) == record_numerics(candidate) == {
        "speculative_algorithm": "eagle3", "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
        "speculative_num_steps": 3}
    assert record_numerics(candidate) == dict(candidate.quality.numerics)  # a new record's key is its own
