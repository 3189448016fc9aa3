"""The planner's memory model charges the draft: from one start of the reference twin (0.5.23,
Kimi-K2.5 INT4 + EAGLE-3 3/1/4 at 0.88 / 48 slots, offline), it predicts the free memory after
graphs of unlaunched candidates with another draft shape, fraction and request slots, and with
speculation off, against the simulator's startup path for the same command line.

The target's verify graphs hold ``num_draft_tokens`` tokens per request for every captured batch
size (§1.5, §2.1): 48 → 104 slots captures 32 sizes instead of 23, +1.2 GiB of verify graphs the
model without the draft did not see (the batch study's runtime OOM at 0.935 / 111).
"""

from __future__ import annotations

from typing import Any

import optuna
import pytest

from tests.support.offline_server import OfflineExecutor
from tests.support.scenarios import spec_scenarios
from tuner.sglang.speculative import DraftMemory
from tuner.sim.evaluate import size_server
from tuner.sim.startup import plan_from_argv
from tuner.study.calibration import Calibration, ModelSettings
from tuner.study.loop import run_study
from tuner.study.optuna_io import SPACE_ATTR
from tuner.study.slo_bound import family_of
from tuner.study.space import Space

TWIN = ["--model-path", "kimi-k2.5-int4", "--trust-remote-code", "--tp-size", "8", "--sim-gpu",
        "RTX-PRO-6000-96GB", "--sim-version", "0.5.23"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Calibration, dict[str, Any]]:
    """The twin's baseline start, calibrated (0.5.23's capture rules)."""
    tmp = tmp_path_factory.mktemp("draft-planner")
    cfg = spec_scenarios()["batch (64 in flight, capacity then throughput)"]
    cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"artifacts_dir": tmp / "artifacts"})})
    runner = OfflineExecutor(cfg, pool_requests=64)
    url = f"sqlite:///{tmp / 'study.db'}"
    run_study(cfg, runner, max_trials=1, storage_url=url)
    space = Space.model_validate(optuna.load_study(study_name=cfg.study.name, storage=url).user_attrs[SPACE_ATTR])
    cal = Calibration.of(runner.history, space, ModelSettings(context_tokens=2048, sglang_version="0.5.23"))
    return cal, dict(runner.history[0][1].params)


def _argv(shape: tuple[int, int, int] | None, mfs: float, mrr: int, dtype: str | None = None) -> list[str]:
    argv = [*TWIN, "--mem-fraction-static", str(mfs), "--max-running-requests", str(mrr)]
    if dtype is not None:
        argv += ["--speculative-draft-kv-cache-dtype", dtype]
    if shape is not None:
        argv += ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", str(shape[0]),
                 "--speculative-eagle-topk", str(shape[1]), "--speculative-num-draft-tokens", str(shape[2])]
    return argv


def test_the_start_stores_the_draft_as_a_typed_fact_the_model_learns(baseline) -> None:  # noqa: ANN001
    cal, params = baseline
    (point,) = cal.points
    assert isinstance(point.draft, DraftMemory) and cal.draft == point.draft
    assert point.draft.num_draft_tokens == 4 and point.draft.capture_sizes == 23 and point.draft.in_budget
    assert point.draft.verify_graph_gib and point.draft.verify_graph_gib > 2.0
    assert params["speculative_num_steps"] == 3


@pytest.mark.parametrize(("shape", "mfs", "mrr", "dtype"), [
    ((3, 1, 4), 0.925, 104, None),  # more slots: more captured sizes, more verify graphs
    ((4, 1, 5), 0.91, 104, None),  # and five verified tokens a request
    ((2, 1, 3), 0.9, 80, None),
    ((5, 1, 6), 0.88, 48, None),  # the baseline's slots, a larger shape
    ((3, 1, 4), 0.925, 104, "fp8_e4m3"),  # the draft's pool at half the bytes: its saving is free memory
])
def test_unlaunched_draft_shapes_are_predicted_within_10_percent_of_the_startup_path(  # noqa: ANN201
        baseline, shape, mfs, mrr, dtype):  # noqa: ANN001
    cal, params = baseline
    candidate = cal.space.snap({**params, "mem_fraction_static": mfs, "max_running_requests": mrr,
                                "speculative_algorithm": True, "speculative_num_steps": shape[0],
                                "speculative_eagle_topk": shape[1], "speculative_num_draft_tokens": shape[2],
                                **({} if dtype is None else {"speculative_draft_kv_cache_dtype": dtype})})
    assert dtype is None or candidate["speculative_draft_kv_cache_dtype"] == dtype
    family = family_of(candidate)
    ref = cal.reference(family, mrr)
    tokens, free = cal.predict(ref, mfs, mrr, family)
    sim = size_server(_argv(shape, mfs, mrr, dtype))
    assert sim.engine_spec is not None
    # What the start leaves free after the draft's and the verify graphs (the runtime headroom).
    assert free == pytest.approx(sim.free_gib_after_graphs, abs=0.1)
    assert tokens == pytest.approx(sim.max_total_num_tokens, rel=0.01)
    # The draft's part of the reserve itself, predicted from the one start.
    assert ref.draft is not None
    predicted = cal.draft_gib(ref, mrr, family, tokens)
    _, plan = plan_from_argv(_argv(shape, mfs, mrr, dtype))
    actual = (plan.graph_bytes + plan.draft_graph_bytes) / 2**30
    assert predicted == pytest.approx(actual, rel=0.10)
    draft = cal.draft_memory(ref, mrr, family, tokens)  # the draft's pool itself, at its dtype
    assert draft is not None and draft.kv_gib == pytest.approx(plan.draft_kv_bytes / 2**30, rel=0.10)


def test_speculation_off_is_predicted_with_no_draft_and_one_token_graphs(baseline) -> None:  # noqa: ANN001
    cal, params = baseline
    off = cal.space.snap({**params, "mem_fraction_static": 0.95, "max_running_requests": 126,
                          "speculative_algorithm": False})
    family = family_of(off)
    tokens, free = cal.predict(cal.reference(family, 126), 0.95, 126, family)
    sim = size_server(_argv(None, 0.95, 126))
    # Conservative: the verify graphs become decode graphs of one token a request (less than
    # predicted), the draft's graphs go; never more free than the start will have.
    assert sim.free_gib_after_graphs - 0.5 <= free <= sim.free_gib_after_graphs
    assert free > 1.0  # not the 3/1/4 reserve at 126 slots (which leaves none)
