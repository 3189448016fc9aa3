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
