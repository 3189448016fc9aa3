"""The planner and every skip reason on synthetic histories (pure: no server, no study).

A history's memory facts are what the product reads from a real startup log (the simulator's
startup lines for the same command, through :func:`tuner.trial.resolve_facts` and
:func:`tuner.trial.memory_facts`); its windows' latencies and loads are written by hand.
"""

from __future__ import annotations

import pytest

from tuner.config import BudgetSection, SpaceSection
from tuner.records import TrialRecord
from tuner.sglang.client import ServerInfo
from tuner.sglang.failures import FailureClass
from tuner.sglang.flags import FlagTable
from tuner.sglang.logs import parse_log
from tuner.sim.evaluate import size_server
from tuner.study.best import choose_best, measured_noise
from tuner.study.loop import skip_reason
from tuner.study.planner import Planner
from tuner.study.slo_bound import SLOBound, SLOPoint, slo_bounds, slo_points
from tuner.study.space import resolve_space
from tuner.trial import memory_facts, render_argv, resolve_facts

BASE = ["--model-path", "llama-3.1-70b", "--tp-size", "8", "--sim-gpu", "A100-80GB", "--mem-fraction-static", "0.85"]
TABLE = FlagTable.for_version("0.5.5")
CONTEXT = 1152
MEAN = 832
BUDGET = BudgetSection(max_concurrency=256)


def _record(params: dict, *, running: float | None, slo: float | None, tput: float = 500.0,
            outcome: str = "ok", failure: FailureClass | None = None, base: list[str] = BASE,
            context: int = CONTEXT) -> TrialRecord:
    """A trial of ``params`` as the product records it: the startup's memory facts, and a
    measured window of ``running`` requests with SLO overshoot ``slo``."""
    argv = render_argv(base, params, TABLE)
    report = parse_log(size_server(argv).log_lines)
    info = ServerInfo.from_json({})
    resolved, facts = resolve_facts(report, info, argv, TABLE, context)
    constraints = {"oom_or_crash": 1.0 if failure else -1.0, "slo": slo if slo is not None else 1.0,
                   "stress": 1.0 if failure else -1.0}
    return TrialRecord(
        params=dict(params), argv=argv, resolved=resolved, outcome=outcome, context_tokens=context,
        context_capacity=facts["context_capacity"], token_capacity=facts["max_total_num_tokens"],
        free_gib_after_graphs=facts["free_gib_after_graphs"], memory=memory_facts(report, info, facts, resolved),
        output_throughput_tok_s=tput, constraints=constraints, feasible=all(v <= 0 for v in constraints.values()),
        measured_load={"streams": running, "running_requests": running, "chunk_tokens": 8192.0} if running else {},
        failure_class=failure,
    )


def _params(mfs: float, mrr: int, cps: int = 8192) -> dict:
    return {"mem_fraction_static": mfs, "max_running_requests": mrr, "chunked_prefill_size": cps}


@pytest.fixture(scope="module")
def space():
    return resolve_space(SpaceSection(mem_fraction_step=0.01), _params(0.85, 4096), capacity_hint=1300,
                         slots_hint=1300)


def _planner(space) -> Planner:
    return Planner(space, CONTEXT, budget=BUDGET, mean_request_tokens=MEAN)


# ---- where the SLO breaks -----------------------------------------------------------------------


def _point(n: int, running: float, slo: float) -> SLOPoint:
    return SLOPoint(number=n, family=(("chunked_prefill_size", 8192),), running_requests=running, slo=slo)


def test_one_broken_window_aims_where_latency_in_proportion_meets_the_limit() -> None:
    bound = slo_bounds([_point(0, 256, 5.9)])[(("chunked_prefill_size", 8192),)]
    assert bound.binds and bound.safe == 0 and bound.broken == 256
    # latency ∝ running requests: 256 × 0.95 / 6.9 = 35.2
    assert bound.next_count() == 35
    assert bound.violates(256) and bound.violates(300) and not bound.violates(255)


def test_a_safe_and_a_broken_window_interpolate_the_latency_between_them() -> None:
    bound = SLOBound(safe=20, safe_trial=1, broken=256, broken_trial=0,
                     points=(_point(1, 20, -0.3), _point(0, 256, 5.9)))
    # 20 + (0.95 - 0.7) / (6.2 / 236) = 29.5
    assert bound.next_count() == 29


def test_a_flat_latency_falls_back_to_bisection_and_adjacent_counts_converge() -> None:
    flat = SLOBound(safe=20, broken=40, points=(_point(1, 20, -0.1), _point(2, 40, -0.1 + 1e-9)))
    assert flat.next_count() == 30
    done = SLOBound(safe=33, broken=34, points=(_point(1, 33, -0.01), _point(2, 34, 0.01)))
    assert done.converged and done.next_count() is None


def test_a_break_below_a_safe_window_is_noise_and_does_not_close_the_bracket() -> None:
    bound = slo_bounds([_point(0, 30, 0.01), _point(1, 32, -0.02), _point(2, 40, 0.3)])[(("chunked_prefill_size", 8192),)]
    assert (bound.safe, bound.broken, bound.broken_trial) == (32, 40, 2)


def test_only_healthy_measured_windows_teach_the_slo() -> None:
    history = [
        (0, _record(_params(0.85, 4096), running=256, slo=5.9)),
        (1, _record(_params(0.9, 64), running=64, slo=2.0, outcome="failed", failure=FailureClass.RUNTIME_OOM)),
        (2, _record(_params(0.8, 64), running=None, slo=None)),
    ]
    assert [p.number for p in slo_points(history)] == [0]


# ---- the planner ---------------------------------------------------------------------------------


def test_with_no_feasible_trial_the_planner_gets_feasible_first(space) -> None:
    history = [(0, _record(_params(0.85, 4096), running=256, slo=5.9))]
    candidate = _planner(space).next(history, {tuple(sorted(space.snap(history[0][1].params).items()))})
    assert candidate is not None
    assert candidate.params["max_running_requests"] == 35
    assert candidate.params["chunked_prefill_size"] == 8192
    # the smallest fraction whose pool still holds 35 contexts: the bottom of the range here
    assert candidate.params["mem_fraction_static"] == space.mem_fraction_static[0]
    assert candidate.prediction["slo_broken_trial"] == 0 and candidate.prediction["running_requests"] == 35


def test_inside_the_feasible_region_the_planner_narrows_the_bracket_then_stops_below_the_break(space) -> None:
    low = space.mem_fraction_static[0]
    history = [
        (0, _record(_params(0.85, 4096), running=256, slo=5.9)),
        (1, _record(_params(low, 35), running=35, slo=0.002)),
        (2, _record(_params(low, 31), running=31, slo=-0.08)),
    ]
    tried = {tuple(sorted(space.snap(r.params).items())) for _, r in history}
    planner = _planner(space)
    candidate = planner.next(history, tried)
    assert candidate is not None and 31 < candidate.params["max_running_requests"] < 35
    history.append((3, _record(_params(low, 34), running=34, slo=-0.01)))
    tried.add(tuple(sorted(space.snap(history[-1][1].params).items())))
    later = planner.next(history, tried)
    # the 8192 bracket is closed (34 safe, 35 broken): never 35 or more with these knobs again
    assert later is None or later.params["chunked_prefill_size"] != 8192 or later.params["max_running_requests"] <= 34


# ---- every skip reason -----------------------------------------------------------------------------


def test_skip_an_exact_repeat_on_the_grid(space) -> None:
    history = [(4, _record(_params(0.85, 40), running=40, slo=0.1))]
    reason = skip_reason(_params(0.8500000001, 40), history, space)
    assert reason == ("the same config was measured by trial 4", 4)
    assert skip_reason(_params(0.86, 40), history, space) is None


def test_skip_what_a_memory_failure_proves_must_fail(space) -> None:
    history = [(5, _record(_params(0.9, 64), running=None, slo=None, outcome="failed",
                           failure=FailureClass.CUDA_GRAPH_OOM))]
    text, proof = skip_reason(_params(0.92, 64), history, space)
    assert proof == 5 and text.startswith("must fail: trial 5 failed with")


def test_skip_what_the_slo_rule_proves_must_break_the_slo(space) -> None:
    history = [(0, _record(_params(0.85, 4096), running=256, slo=5.9)),
               (1, _record(_params(0.8, 40), running=40, slo=0.2))]
    text, proof = _planner(space).screen(_params(0.9, 48), history)
    assert proof == 1 and text.startswith("must break the SLO: trial 1 broke it running 40 requests")
    # another chunk size is another family: the rule does not hold across it
    assert _planner(space).screen(_params(0.9, 48, 4096), history) is None


def test_skip_slots_the_workload_can_never_run_at_once(space) -> None:
    history = [(0, _record(_params(0.85, 20), running=20, slo=-0.5))]
    planner = _planner(space)
    text, _ = planner.screen(_params(0.8, 2000), history)
    assert "is more than the" in text and "predicted, not launched" in text
    # slots up to the context capacity always count (they are the objective)
    tokens = history[0][1].token_capacity
    assert planner.slots_cap(tokens) >= tokens // CONTEXT


def test_skip_a_capacity_below_the_band_that_cannot_win(space) -> None:
    history = [(0, _record(_params(0.85, 40), running=40, slo=-0.1))]
    text, _ = _planner(space).screen(_params(0.85, 30), history, capacity_floor=38)
    assert "is below 38, the capacity band of the best feasible trial" in text


# ---- the noise ---------------------------------------------------------------------------------------


def _measured(params: dict, capacity: int, tput: float) -> TrialRecord:
    return TrialRecord(params=params, context_capacity=capacity, output_throughput_tok_s=tput, feasible=True,
                       constraints={"oom_or_crash": -1.0, "slo": -0.1, "stress": -1.0})


def test_the_measured_noise_widens_the_fixed_margin_and_capacity_decides_ties() -> None:
    a, b = _params(0.9, 67), _params(0.88, 64)
    history = [(1, _measured(a, 67, 380.0)), (2, _measured(b, 64, 398.0))]
    # a fixed 3 % margin: 380 is 4.5 % below 398, so the lower capacity wins
    assert choose_best(history).number == 2
    # a's window re-measured at 400: the spread of one config is 5.1 %, a's mean 390 ties with 398
    history.append((3, _measured(a, 67, 400.0).model_copy(update={"repeat_of": 1})))
    assert measured_noise(history) == pytest.approx(20 / 390)
    choice = choose_best(history)
    assert choice.number == 1 and choice.tied == [2] and choice.noise_measured
    assert "statistically tied" in choice.reason and "mean of 2 measured windows" in choice.reason


# ---- activation headroom on a small GPU ------------------------------------------------------------
# An 8B on an L4: weights fill 2/3 of the GPU, so the activation peak of a prefill chunk is a
# large part of what a high fraction leaves free.

L4 = ["--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB", "--mem-fraction-static", "0.85",
      "--chunked-prefill-size", "8192"]
L4_CONTEXT = 4096


def _l4(params: dict, *, peak_gib: float, prediction: dict | None = None) -> TrialRecord:
    """An L4 trial that survived its load with the GPU monitor's activation peak ``peak_gib``."""
    record = _record(params, running=8, slo=-0.5, base=L4, context=L4_CONTEXT)
    return record.model_copy(update={"memory": {**record.memory, "peak_activation_gib": peak_gib},
                                     "prediction": prediction or {}})


@pytest.fixture(scope="module")
def l4_space():
    return resolve_space(SpaceSection(mem_fraction_step=0.01, mem_fraction_static=(0.80, 0.99),
                                      chunked_prefill_size=[2048, 4096, 8192, 16384]),
                         _params(0.85, 2048), capacity_hint=12, slots_hint=37)


def _l4_planner(space) -> Planner:
    return Planner(space, L4_CONTEXT, budget=BudgetSection(max_concurrency=64), mean_request_tokens=1360)


def test_the_margin_is_what_checked_predictions_missed_and_the_prior_before_any(l4_space) -> None:
    planner = _l4_planner(l4_space)
    baseline = _l4(_params(0.85, 2048), peak_gib=1.0)
    assert planner.margin_now_gib([(0, baseline)]) == planner.margin_gib  # nothing checked yet
    free = _l4(_params(0.94, 11, 2048), peak_gib=0.25).free_gib_after_graphs
    over = _l4(_params(0.94, 11, 2048), peak_gib=0.25, prediction={"free_gib_after_graphs": free + 0.12})
    under = _l4(_params(0.94, 11, 2048), peak_gib=0.25, prediction={"free_gib_after_graphs": free - 0.3})
    assert planner.margin_now_gib([(0, baseline), (1, under)]) == planner.min_margin_gib
    assert planner.margin_now_gib([(0, baseline), (1, under), (2, over)]) == pytest.approx(0.12)


def test_skip_a_sampled_config_whose_headroom_cannot_hold_the_scaled_activation_peak(l4_space) -> None:
    history = [(0, _l4(_params(0.85, 2048), peak_gib=1.0))]
    planner = _l4_planner(l4_space)
    # 0.97 leaves ~0.3 GiB after graphs; a 16k chunk needs twice the 8k chunk's measured 1 GiB
    text, proof = planner.screen(_params(0.97, 12, 16384), history)
    assert proof == 0 and "measured activation peak scaled to this prefill chunk (2.00 GiB" in text
    assert "predicted, not launched" in text
    # a small chunk at a moderate fraction keeps room for its (quartered) peak: launched
    assert planner.screen(_params(0.9, 9, 2048), history) is None


def test_calibration_charges_the_slots_the_server_ran_not_the_snapped_count(l4_space) -> None:
    """The baseline ran SGLang's 2048 request slots (a 1 GiB req_to_token table, §1.6), above the
    space's top: calibrating on its snapped count would charge that table to the extra slots of
    every later proposal and predict too little headroom (aiming below the frontier)."""
    baseline = _l4(_params(0.85, 2048), peak_gib=1.0)
    first = _l4(_params(0.92, 10), peak_gib=1.0)
    first = first.model_copy(update={"prediction": {"free_gib_after_graphs": first.free_gib_after_graphs}})
    history = [(0, baseline), (1, first)]
    tried = {tuple(sorted(l4_space.snap(r.params).items())) for _, r in history}
    planner = _l4_planner(l4_space)
    for _ in range(3):
        candidate = planner.next(history, tried)
        assert candidate is not None
        truth = size_server(render_argv(L4, candidate.params, TABLE)).free_gib_after_graphs
        assert abs(candidate.prediction["free_gib_after_graphs"] - truth) < 0.05, candidate
        tried.add(tuple(sorted(candidate.params.items())))


def test_more_request_slots_try_the_reachable_count_first(l4_space) -> None:
    baseline = _l4(_params(0.85, 2048), peak_gib=1.0)
    first = _l4(_params(0.96, 12, 2048), peak_gib=0.25)
    first = first.model_copy(update={"prediction": {"free_gib_after_graphs": first.free_gib_after_graphs}})
    history = [(0, baseline), (1, first)]
    tried = {tuple(sorted(l4_space.snap(r.params).items())) for _, r in history}
    planner = _l4_planner(l4_space)
    candidate = planner.next(history, tried)
    assert candidate is not None and candidate.params["mem_fraction_static"] == 0.96
    assert "more request slots" in candidate.prediction["why"]
    assert candidate.params["max_running_requests"] == planner.slots_cap(candidate.prediction["token_capacity"]) > 12


def test_a_baseline_that_ooms_under_load_still_calibrates_and_bounds_the_need(l4_space) -> None:
    """The unit's own flags die under the stress load: no trial survived, but the start reported
    its pool and free memory, and the OOM with that free memory is a lower bound on the need."""
    started = _l4(_params(0.85, 2048), peak_gib=0.0)
    baseline = started.model_copy(update={
        "outcome": "failed", "failure_class": FailureClass.RUNTIME_OOM, "feasible": False,
        "constraints": {"oom_or_crash": 1.0, "slo": 1.0, "stress": 1.0},
        "memory": {**started.memory, "peak_activation_gib": None}})
    history = [(0, baseline)]
    planner = _l4_planner(l4_space)
    candidate = planner.next(history, {tuple(sorted(l4_space.snap(baseline.params).items()))})
    assert candidate is not None
    ratio = candidate.params["chunked_prefill_size"] / 8192
    # more free memory after graphs than the OOM had, scaled to the candidate's chunk, plus the margin
    assert candidate.prediction["free_gib_after_graphs"] >= baseline.free_gib_after_graphs * ratio + planner.margin_gib
    truth = size_server(render_argv(L4, candidate.params, TABLE)).free_gib_after_graphs
    assert abs(candidate.prediction["free_gib_after_graphs"] - truth) < 0.1
    # a sampled config with less room than the OOM had at its chunk is not launched
    text, proof = planner.screen(_params(0.9, 9, 8192), history)
    assert proof == 0 and "runtime OOM under load implies" in text


def test_screens_calibrate_once_per_history_and_answer_as_a_fresh_planner(l4_space) -> None:
    """The loop hands one history per decision to ``next`` and to the screen of every sampler's
    draw, and the planner calibrates once per history. Its answers must be a fresh planner's: after
    a ``next`` that believed a trial running on another host (which narrows the margin for its own
    proposals only), and again for a longer history."""
    baseline = _l4(_params(0.85, 2048), peak_gib=1.0)
    first = _l4(_params(0.92, 10), peak_gib=1.0)  # no prediction: no checked margin yet
    history = [(0, baseline), (1, first)]
    tried = {tuple(sorted(l4_space.snap(r.params).items())) for _, r in history}
    planner = _l4_planner(l4_space)
    running = planner.next(history, tried)
    assert running is not None
    tried.add(tuple(sorted(running.params.items())))
    planner.next(history, tried, pending=[(running.params, running.prediction)])
    assert planner._margin_gib == planner.min_margin_gib  # the believer's margin was in use
    grid = [_params(mfs / 100, mrr, cps) for mfs in range(80, 100) for mrr in (6, 9, 12, 16)
            for cps in (2048, 8192, 16384)]

    def fresh(history: list) -> list:
        return [_l4_planner(l4_space).screen(params, history, capacity_floor=11) for params in grid]

    answers = [planner.screen(params, history, capacity_floor=11) for params in grid]
    assert answers == fresh(history)
    assert any(a is None for a in answers) and any(a is not None and "GiB free" in a[0] for a in answers)
    longer = [*history, (2, _l4(_params(0.95, 12, 2048), peak_gib=0.25))]
    assert [planner.screen(params, longer, capacity_floor=11) for params in grid] == fresh(longer)
