"""The planner and the SLO rule know SGLang's CUDA-graph batch sizes (§2.1, :mod:`tuner.sglang.graphs`).

Histories as the product records them (the simulator's startup log read by the product: the
``Capture cuda graph bs [...]`` line gives each launch's captured sizes); windows by hand.
"""

from __future__ import annotations

import pytest

from tests.support.study_factory import simulated_start
from tests.support.views import plan, study_view
from tuner.config import BudgetSection, SpaceSection
from tuner.records import TrialRecord
from tuner.sglang.flags import FlagTable
from tuner.study.decide.screens import Predicted
from tuner.study.space import resolve_space
from tuner.trial import render_argv

# An 8B on an L40S: SGLang's default cuda_graph_max_bs there is 32 (§2.1), so the unit sets 24.
BASE = ["--model-path", "llama-3.1-8b", "--sim-gpu", "L40S-48GB", "--mem-fraction-static", "0.85",
        "--cuda-graph-max-bs", "24"]
TABLE = FlagTable.for_version("0.5.5")
CONTEXT = 2048
BUDGET = BudgetSection(max_concurrency=256)


def _record(params: dict, *, running: float, slo: float) -> TrialRecord:
    argv = render_argv(BASE, params, TABLE)
    resolved, facts, memory = simulated_start(argv, CONTEXT, TABLE)
    constraints = {"oom_or_crash": -1.0, "slo": slo, "stress": -1.0}
    return TrialRecord(
        params=dict(params), argv=argv, resolved=resolved, outcome="ok", context_tokens=CONTEXT,
        context_capacity=facts["context_capacity"], token_capacity=facts["max_total_num_tokens"],
        free_gib_after_graphs=facts["free_gib_after_graphs"], memory=memory, output_throughput_tok_s=900.0,
        constraints=constraints, feasible=all(v <= 0 for v in constraints.values()),
        measured_load={"streams": running, "running_requests": running, "chunk_tokens": 8192.0},
    )


def _params(mfs: float, mrr: int, graph_bs: int | None = 24) -> dict:
    out = {"mem_fraction_static": mfs, "max_running_requests": mrr, "chunked_prefill_size": 4096}
    return {**out, "cuda_graph_max_bs": graph_bs} if graph_bs else out


@pytest.fixture(scope="module")
def space():
    return resolve_space(SpaceSection(mem_fraction_step=0.01, cuda_graph_max_bs=[24, 32, 48, 64]),
                         _params(0.85, 256), capacity_hint=200, slots_hint=256)


def _view(space, history):  # noqa: ANN001, ANN202
    return study_view(space, history, context_tokens=CONTEXT, budget=BUDGET, mean_request_tokens=1200)


def test_the_log_gives_each_launch_its_captured_sizes(space) -> None:
    record = _record(_params(0.85, 31), running=31, slo=0.1)
    assert record.resolved["cuda_graph_bs"]["value"] == [1, 2, 4, 8, 12, 16, 24]
    cal = _view(space, [(0, record)]).calibration
    assert cal.coverages[0].largest == 24 and cal.graphs is not None and cal.graphs.default_max_bs == 24
    # below cuda_graph_max_bs the request table's own size is captured: every batch has a graph
    assert cal.coverage((("chunked_prefill_size", 4096), ("cuda_graph_max_bs", 24)), 20).largest == 20


def test_a_break_with_eager_batches_proves_nothing_of_a_config_that_graphs_them(space) -> None:
    """31 slots under 24-wide graphs decode batches 25-31 eagerly and broke the ITL; 32 slots
    with 32-wide graphs decode every batch on a graph: the rule does not cross the captured size."""
    history = [(0, _record(_params(0.85, 31), running=31, slo=0.1))]
    view = _view(space, history)
    assert Predicted().why_not(_params(0.84, 32, 32), view) is None
    assert Predicted().why_not(_params(0.84, 48, 64), view) is None
    # equal coverage (the same 24-wide graphs) and more requests: the monotone rule holds
    skip = Predicted().why_not(_params(0.84, 32, 24), view)
    assert skip is not None and skip.proof == 0 and "no fewer of those batches on CUDA graphs" in skip.reason
    # worse coverage (narrower graphs) and more requests: proved too
    assert Predicted().why_not(_params(0.84, 40, 24), _view(space, [(0, _record(_params(0.85, 32, 32), running=32,
                                                                                     slo=0.1))])) is not None


def test_cuda_graph_max_bs_moves_with_the_request_slots(space) -> None:
    """The planner's proposals above the captured sizes carry graphs that cover them."""
    history = [(0, _record(_params(0.85, 20), running=20, slo=-0.6))]
    proposal = plan(_view(space, history))
    assert proposal is not None
    mrr, graph_bs = proposal.params["max_running_requests"], proposal.params["cuda_graph_max_bs"]
    assert mrr > 24 and graph_bs >= min(mrr, 64), proposal
    assert "moves with max_running_requests" in proposal.prediction.why


def test_inside_an_slo_bracket_the_next_count_is_launched_on_graphs_that_cover_it(space) -> None:
    """Safe at 24 slots, broken at 31 with batches 25-31 eager: the count between them is
    proposed with graphs up to it (the optimum may sit there), not on the 24-wide graphs."""
    history = [(0, _record(_params(0.85, 24), running=24, slo=-0.3)),
               (1, _record(_params(0.85, 31), running=31, slo=0.1))]
    proposal = plan(_view(space, history))
    assert proposal is not None, "nothing proposed"
    mrr, graph_bs = proposal.params["max_running_requests"], proposal.params["cuda_graph_max_bs"]
    assert mrr > 24 and graph_bs >= mrr, proposal.params


def test_windows_that_differ_in_the_graphs_share_one_slo_bracket(space) -> None:
    """A break at 100 requests under 24-wide graphs and a safe window at 40 under 48-wide graphs
    bracket one curve's boundary (same workload, same scheduler): the next count lies between them,
    on the smallest cuda_graph_max_bs that captures every batch up to it. Keyed by the graphs, the
    48-wide knobs had held everywhere they ran, and the planner re-launched the 100 requests the
    24-wide graphs broke."""
    history = [(0, _record(_params(0.85, 256), running=100, slo=2.0)),
               (1, _record(_params(0.80, 40, 48), running=40, slo=-0.02))]
    proposal = plan(_view(space, history))
    assert proposal is not None, "nothing proposed"
    mrr, graph_bs = proposal.params["max_running_requests"], proposal.params["cuda_graph_max_bs"]
    assert 40 < mrr < 100, proposal.params
    assert graph_bs == min(c for c in (24, 32, 48, 64) if c > mrr), proposal.params
    assert proposal.prediction.slo_broken_trial == 0 and proposal.prediction.slo_safe_trial == 1


def test_a_line_from_the_broken_side_joins_windows_of_one_graph_coverage_only() -> None:
    """Two breaks, one with every batch on a graph (64 requests) and one decoding above 16 eagerly
    (256): they lie on different latency curves (§2.1), so the next count is the nearest one's
    proportional step, not a line through both (which would reach far below)."""
    from tuner.study.slo_bound import SLOPoint, slo_bounds

    key = (("chunked_prefill_size", 8192),)
    full = SLOPoint(number=1, family=key, running_requests=64, slo=0.571, graphed=64)
    eager = SLOPoint(number=0, family=key, running_requests=256, slo=2.788, graphed=16)
    assert slo_bounds([eager, full])[key].next_count() == 38  # 64 · 0.95 / 1.571
    alike = eager.model_copy(update={"graphed": 256})
    assert slo_bounds([alike, full])[key].next_count() == 10  # the line through both


def test_an_unused_wider_cuda_graph_max_bs_lands_on_the_smallest_with_the_same_captures(space) -> None:
    """SGLang adds the request table's size to the capture list and drops every size above it
    (§2.1): 20 slots capture [1, 2, 4, 8, 12, 16, 20] under 24- and 64-wide graphs alike, so the
    planner's count lands on 24 (one server, one launch); above 24 the graphs move with the slots
    to the smallest choice that captures every batch (40 slots: 48, as 64 would)."""
    cal = _view(space, [(0, _record(_params(0.85, 20), running=20, slo=-0.6))]).calibration
    landed, note = cal.land((("chunked_prefill_size", 4096), ("cuda_graph_max_bs", 64)), 20)
    assert dict(landed)["cuda_graph_max_bs"] == 24 and note is None
    landed, note = cal.land((("chunked_prefill_size", 4096), ("cuda_graph_max_bs", 24)), 40)
    assert dict(landed)["cuda_graph_max_bs"] == 48 and note is not None and "moves with" in note


def test_an_itl_bracket_interpolates_the_share_of_slow_gaps_not_the_p99() -> None:
    """Two ITL breaks (38 and 64 requests, one graph coverage): their p99s put the line's 0.95 at
    18 requests, while the share of gaps over the limit (1.31 and 4.79 of the allowed 1 %) rises as
    a power of the requests in flight and reaches 0.95 of the allowed share at 33."""
    from tuner.study.slo_bound import SLOPoint, slo_bounds

    key = (("chunked_prefill_size", 8192),)
    at_38 = SLOPoint(number=2, family=key, running_requests=38, slo=0.2185, graphed=38, limited_by="itl")
    at_64 = SLOPoint(number=1, family=key, running_requests=64, slo=0.5711, graphed=64, limited_by="itl")
    assert slo_bounds([at_38, at_64])[key].next_count() == 18  # the p99 line
    shares = [at_38.model_copy(update={"itl_exceedance": 1.308}), at_64.model_copy(update={"itl_exceedance": 4.792})]
    assert slo_bounds(shares)[key].next_count() == 33  # 38 · (0.95 / 1.308) ** (1 / 2.49)
    # A TTFT-bound break keeps the p99 line (one sample per request: its share is coarse).
    ttft = [p.model_copy(update={"limited_by": "ttft"}) for p in shares]
    assert slo_bounds(ttft)[key].next_count() == 18


def test_the_itl_boundary_of_the_graph_searched_scenario_is_reached_by_launch_seven() -> None:
    """Issue 30's ITL 35 ms scenario with ``cuda_graph_max_bs`` searched, on the product's own
    study loop and trial against the simulator. On issue 37's round-2 clock, prefill on H100 runs
    at ``GPU_COMPUTE_EFF`` 0.72 (real SGLang prefill there is slower than the aiconfigurator fit:
    sglang#1060), so a prefill of the 8B's 512-1,024-token prompts takes 18-36 ms alone (round 1:
    13-26 ms) and more when two arrive together: a prefill step over the 35 ms limit, a slow gap for
    each running request, comes with most arrivals, whatever the chunk size (2,048-8,192 each hold
    a whole prompt), and the share of slow gaps passes 1 % at 6 requests in flight in every chunk
    size the space holds (the study measures 6 at 8,192, 4,096 and 2,048). Round 1's optimum was
    21. The study lands on 5 within seven launches, with no failed launch."""
    from tests.support.offline_server import OfflineExecutor
    from tests.support.scenarios import scenarios
    from tuner.study.loop import run_study

    config = scenarios()["8B on H100, cuda_graph_max_bs searched, p99 ITL 35 ms"]["config"]
    runner = OfflineExecutor(config, world_seed=0)
    run_study(config, runner, max_trials=7, storage_url=":memory:")
    seven = [record for _, record in runner.history[:7]]
    assert len(seven) == 7 and not any(r.outcome == "failed" for r in seven)
    assert max(r.context_capacity or 0 for r in seven if r.feasible) == 5


def test_an_itl_break_within_its_noise_proves_only_loads_it_grows_past_the_limit_at() -> None:
    """32 requests broke the ITL limit with 36 % more slow gaps than allowed, but its ~690 decode
    steps bound that from below at 0.67 of the allowance: as the bracket's lowest break, it proves
    nothing of 33 requests (launched, not skipped); from 48 on, the bound grown with the requests
    in flight passes the allowance."""
    from tuner.study.slo_bound import SLOPoint, slo_bounds

    key = (("chunked_prefill_size", 8192),)
    safe = SLOPoint(number=4, family=key, running_requests=31, slo=-0.04, limited_by="itl",
                    itl_exceedance=0.53, itl_exceedance_low=0.10)
    noisy = SLOPoint(number=3, family=key, running_requests=32, slo=0.40, limited_by="itl",
                     itl_exceedance=1.36, itl_exceedance_low=0.67)
    bound = slo_bounds([safe, noisy])[key]
    assert not bound.proves(noisy, 33) and not bound.proves(noisy, 47)
    assert bound.proves(noisy, 48)
    clear = noisy.model_copy(update={"itl_exceedance_low": 1.2})
    assert slo_bounds([safe, clear])[key].proves(clear, 33)
    ttft = noisy.model_copy(update={"limited_by": "ttft"})  # the ITL bound says nothing of a TTFT break
    assert slo_bounds([safe, ttft])[key].proves(ttft, 33)
    # A second break above it confirms the trend: that one proves from its own load, within noise or not.
    above = noisy.model_copy(update={"number": 5, "running_requests": 35, "itl_exceedance": 1.62, "itl_exceedance_low": 0.85})
    bound = slo_bounds([safe, noisy, above])[key]
    assert bound.proves(above, 35) and not bound.proves(noisy, 34)
