"""The knob table (:data:`tuner.study.space.KNOBS`): well formed, and what derives from it."""

from __future__ import annotations

import optuna
import pytest

from tuner.config import SpaceSection
from tuner.knobs import LEVERS
from tuner.report.tables import KEY_PARAMS
from tuner.study.space import HICACHE_KNOBS, KNOBS, MEMORY_KNOBS, SEARCHED_FIELDS, Space, suggest_param

_BY_NAME = {knob.name: knob for knob in KNOBS}


def test_the_table_is_well_formed() -> None:
    assert len(_BY_NAME) == len(KNOBS)
    for knob in KNOBS:
        assert knob.field in Space.model_fields, knob.name
        if knob.condition is not None:
            assert _BY_NAME[knob.condition].kind == "bool", knob.name
            assert KNOBS.index(_BY_NAME[knob.condition]) < KNOBS.index(knob)  # a switch is asked for first
        if knob.replaces is not None:
            assert _BY_NAME[knob.replaces].condition == knob.condition, knob.name
        if knob.neighbour_step is not None or knob.drawn_digits is not None:
            assert knob.kind == "float", knob.name
        if knob.kind == "float":  # a grid: the knob's step, or a third item in the space's range
            assert knob.step is not None or knob.name == "mem_fraction_static", knob.name
        assert knob.help.strip(), knob.name
    # Every Space field but the reason and the fixed knobs holds one knob's range or choices; the
    # structural levers' choices are in one field, ``levers`` (tuner.knobs.LEVERS).
    assert set(Space.model_fields) - {"hicache_reason", "lever_reasons", "fixed"} == {knob.field for knob in KNOBS}
    assert {knob.name for knob in KNOBS if knob.field == "levers"} == {lever.knob.name for lever in LEVERS}


def test_the_config_space_section_has_one_key_per_knob() -> None:
    # tuner.config sits below tuner.study (the layers contract): it cannot import the table, so this
    # ties the two. [space] adds the grid step of mem_fraction_static.
    keys = {knob.name if knob.field == "levers" else knob.field for knob in KNOBS}
    assert set(SpaceSection.model_fields) == keys | {"mem_fraction_step", "exclude_levers"}


def test_the_names_derive_from_the_table() -> None:
    assert SEARCHED_FIELDS == (
        "mem_fraction_static", "max_running_requests", "chunked_prefill_size", "enable_hierarchical_cache",
        "hicache_ratio", "hicache_size", "hicache_write_policy", "hicache_io_backend", "hicache_mem_layout",
        "page_size", "cuda_graph_max_bs", "speculative_algorithm", "speculative_num_steps",
        "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_draft_kv_cache_dtype",
        "schedule_conservativeness", "kv_cache_dtype",
        "dcp_size", "dp_size",
    )
    assert HICACHE_KNOBS == tuple(n for n in SEARCHED_FIELDS if n.startswith("hicache_"))
    assert MEMORY_KNOBS == ("mem_fraction_static", "max_running_requests")
    assert KEY_PARAMS == SEARCHED_FIELDS[:6]


def _space(**update: object) -> Space:
    base: dict[str, object] = {
        "mem_fraction_static": (0.80, 0.90, 0.01), "max_running_requests": (1, 64),
        "chunked_prefill_size": (2048, 4096, 8192), "hierarchical_cache": True,
        "hicache_write_policy": ("write_through", "write_back"), "page_size": (1, 16),
        "schedule_conservativeness": (0.5, 1.5),
    }
    return Space.model_validate({**base, **update})


def test_the_size_replaces_the_ratio_and_a_switch_off_drops_its_knobs() -> None:
    ratio, size = _space(), _space(hicache_size=(4, 32))
    assert ratio.searches("hicache_ratio") and not ratio.searches("hicache_size")
    assert size.searches("hicache_size") and not size.searches("hicache_ratio")
    off = _space(hierarchical_cache=False)
    assert not any(off.searches(name) for name in ("enable_hierarchical_cache", *HICACHE_KNOBS))
    assert not off.searches("no_such_knob")
    assert list(size.distributions()) == [
        "mem_fraction_static", "max_running_requests", "chunked_prefill_size", "enable_hierarchical_cache",
        "hicache_size", "hicache_write_policy", "page_size", "schedule_conservativeness"]
    assert size.snap({"enable_hierarchical_cache": False, "hicache_size": 8}) == {
        "mem_fraction_static": 0.8, "max_running_requests": 64, "chunked_prefill_size": 2048,
        "enable_hierarchical_cache": False, "page_size": 1, "schedule_conservativeness": 1.0}
    assert size.hicache_on() == {"enable_hierarchical_cache": True, "hicache_size": 4,
                                 "hicache_write_policy": "write_through"}
    assert off.hicache_on() == {}


def test_snap_clips_aligns_and_fills_each_kind() -> None:
    space = _space()
    snapped = space.snap({"mem_fraction_static": 0.8349, "max_running_requests": 99.6, "chunked_prefill_size": 5000,
                          "enable_hierarchical_cache": True, "hicache_ratio": 3.3, "hicache_write_policy": "nope",
                          "page_size": 64, "schedule_conservativeness": 0.77, "disable_radix_cache": True})
    assert snapped == {"mem_fraction_static": 0.83, "max_running_requests": 64, "chunked_prefill_size": 4096,
                       "enable_hierarchical_cache": True, "hicache_ratio": 3.5, "hicache_write_policy": "write_through",
                       "page_size": 16, "schedule_conservativeness": 0.8}


def test_suggest_asks_a_switchs_knobs_only_when_it_is_on() -> None:
    space = _space()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(16):
        trial = study.ask()
        params = space.suggest(trial)
        on = params["enable_hierarchical_cache"]
        seen.add(on)
        assert ("hicache_ratio" in params) == on and ("hicache_write_policy" in trial.params) == on
        assert params["mem_fraction_static"] == round(params["mem_fraction_static"], 6)
        assert space.snap(params) == space.snap(trial.params)
        study.tell(trial, 1.0)
    assert seen == {False, True}


def test_neighbours_step_each_non_memory_knob_once() -> None:
    space = _space()
    at = {"mem_fraction_static": 0.85, "max_running_requests": 8, "chunked_prefill_size": 4096,
          "enable_hierarchical_cache": False, "page_size": 1, "schedule_conservativeness": 1.0}
    rest = {"enable_hierarchical_cache": False, "page_size": 1, "schedule_conservativeness": 1.0}
    assert space.neighbours(at) == [
        {"chunked_prefill_size": 2048, **rest},
        {"chunked_prefill_size": 8192, **rest},
        {"chunked_prefill_size": 4096, "enable_hierarchical_cache": True, "hicache_ratio": 2.0,
         "hicache_write_policy": "write_through", "page_size": 1, "schedule_conservativeness": 1.0},
        {"chunked_prefill_size": 4096, **rest, "page_size": 16},
        {"chunked_prefill_size": 4096, **rest, "schedule_conservativeness": 0.7},
        {"chunked_prefill_size": 4096, **rest, "schedule_conservativeness": 1.3},
    ]
    on = space.snap({**at, "enable_hierarchical_cache": True})
    assert {"chunked_prefill_size": 4096, **rest} in space.neighbours(on)  # the switch off drops its knobs
    edge = space.neighbours({**at, "schedule_conservativeness": 1.4})
    assert [n["schedule_conservativeness"] for n in edge][-1:] == [1.1]  # 1.7 is out of range


def test_grid_lists_each_kind_ascending() -> None:
    space = _space(hicache_ratio=(2.0, 3.5))
    assert space.grid("mem_fraction_static") == space.fractions() == [round(0.80 + i / 100, 6) for i in range(11)]
    assert space.grid("hicache_ratio") == [2.0, 2.5, 3.0, 3.5]
    assert _space(hicache_size=(4, 7)).grid("hicache_size") == [4, 5, 6, 7]
    assert space.grid("page_size") == [1, 16] and space.grid("enable_hierarchical_cache") == [False, True]
    assert space.grid("cuda_graph_max_bs") == [] and space.grid("hicache_size") == []
    assert _space(schedule_conservativeness=(0.5, 0.75)).grid("schedule_conservativeness") == [0.5, 0.6, 0.7]


def test_a_copy_with_an_update_reads_the_table_again() -> None:
    space = _space(hierarchical_cache=False)
    assert "hicache_ratio" in space.model_copy(update={"hierarchical_cache": True}).distributions()


def test_suggest_param_refuses_a_distribution_the_space_does_not_make() -> None:
    class Other(optuna.distributions.BaseDistribution):
        def to_internal_repr(self, param_value_in_external_repr: object) -> float:
            return 0.0

        def single(self) -> bool:
            return True

        def _contains(self, param_value_in_internal_repr: float) -> bool:
            return True

    trial = optuna.create_study().ask()
    with pytest.raises(TypeError, match="param x: the space makes categorical, int and float distributions"):
        suggest_param(trial, "x", Other())
