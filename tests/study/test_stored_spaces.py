"""Every stored space still loads and still means what it meant when it was written.

A study stores its :class:`~tuner.study.space.Space` as JSON (``Space.model_dump(mode="json")``, the
study attribute ``tuner.space``) and its trials' Optuna params with their distributions; a resumed
study reads both back. ``golden/stored-spaces.json`` was written by the ``Space`` and the planner of
commit 6c4c825 (before the knob table), for six spaces: one of each shape the tuner writes (the
memory knobs alone; the hierarchical cache by ratio with every optional knob; by size; a ratio range
off the 0.5 grid; the cache kept on as a fixed knob) and one stored before ``hicache_size``,
``hicache_io_backend``, ``hicache_mem_layout`` and ``hicache_reason`` existed. For each it holds what
that code answered: the distributions, ``hicache_on``, the ``mem_fraction_static`` grid, ``snap`` of
candidates on and off the grid, ``suggest`` under seeded random samplers (the values, the Optuna
params and their distributions) and the planner's one-step neighbours (``Planner._neighbours``: sorted
``(knob, value)`` pairs of the configs one non-memory step away, as the planner compares them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import distribution_to_json, json_to_distribution

from tuner.study.space import Space, config_key

GOLDEN = Path(__file__).parent / "golden" / "stored-spaces.json"
_CASES: list[dict[str, Any]] = json.loads(GOLDEN.read_text(encoding="utf-8"))["cases"]


def _space(case: dict[str, Any]) -> Space:
    return Space.model_validate(case["stored"])


@pytest.mark.parametrize("case", _CASES, ids=[c["name"] for c in _CASES])
def test_a_stored_space_loads_with_the_same_distributions(case: dict[str, Any]) -> None:
    space = _space(case)
    got = {name: distribution_to_json(dist) for name, dist in space.distributions().items()}
    assert list(got) == list(case["distributions"])  # the order the sampler is asked in
    for name, stored in case["distributions"].items():
        assert json_to_distribution(got[name]) == json_to_distribution(stored), name
    assert space.hicache_on() == case["hicache_on"]
    assert space.fractions() == case["fractions"]


@pytest.mark.parametrize("case", _CASES, ids=[c["name"] for c in _CASES])
def test_a_stored_space_snaps_candidates_as_it_did(case: dict[str, Any]) -> None:
    space = _space(case)
    for item in case["snap"]:
        snapped = space.snap(item["params"])
        assert snapped == item["snapped"], item["params"]
        assert list(snapped) == list(item["snapped"])


@pytest.mark.parametrize("case", _CASES, ids=[c["name"] for c in _CASES])
def test_a_stored_space_suggests_the_same_params_under_the_same_names(case: dict[str, Any]) -> None:
    space = _space(case)
    by_seed: dict[int, list[dict[str, Any]]] = {}
    for item in case["suggest"]:
        by_seed.setdefault(item["seed"], []).append(item)
    for seed, items in by_seed.items():
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
        for item in items:
            trial = study.ask()
            params = space.suggest(trial)
            assert params == item["params"] and list(params) == list(item["params"])
            assert trial.params == item["trial_params"]
            assert {k: json_to_distribution(distribution_to_json(v)) for k, v in trial.distributions.items()} == {
                k: json_to_distribution(v) for k, v in item["trial_distributions"].items()}
            study.tell(trial, 1.0)



@pytest.mark.parametrize("case", _CASES, ids=[c["name"] for c in _CASES])
def test_a_stored_space_has_the_planners_neighbours(case: dict[str, Any]) -> None:
    space = _space(case)
    for item in case["neighbours"]:
        got = [config_key(config) for config in space.neighbours(item["params"])]
        assert got == [tuple(tuple(pair) for pair in family) for family in item["families"]], item["params"]


def test_a_space_stored_with_the_levers_as_fields_loads_them_into_levers() -> None:
    # Before tuner.knobs, a space stored each structural lever as a field of its own (kv_cache_dtype,
    # dcp_size, dp_size; None = not searched). It reads into Space.levers with the same distributions,
    # in the knob table's order, and a model_dump / model_validate round trip keeps them.
    stored = {"mem_fraction_static": [0.8, 0.95, 0.01], "max_running_requests": [1, 64], "chunked_prefill_size": [4096],
              "kv_cache_dtype": ["auto", "fp8_e4m3"], "dcp_size": [1, 8, 4], "dp_size": None, "lever_reasons": ["x"]}
    space = Space.model_validate(stored)
    assert space.levers == {"kv_cache_dtype": ("auto", "fp8_e4m3"), "dcp_size": (1, 8, 4)}
    dists = space.distributions()
    assert list(dists)[-2:] == ["kv_cache_dtype", "dcp_size"] and "dp_size" not in dists
    assert dists["dcp_size"].choices == (1, 8, 4)  # type: ignore[attr-defined]
    again = Space.model_validate(space.model_dump(mode="json"))
    assert again == space and again.distributions() == dists
