"""The planner's proposers and every screen on synthetic histories (pure: no server, no study).

A history's memory facts are what the product reads from a real startup log (the simulator's
startup lines for the same command, through :func:`tuner.trial.resolve_facts` and
:func:`tuner.trial.memory_facts`); its windows' latencies and loads are written by hand.
"""

from __future__ import annotations

import pytest

from tests.support.study_factory import simulated_start
from tests.support.views import plan, study_view
from tuner.config import BudgetSection, ObjectiveSection, SpaceSection
from tuner.records import Prediction, TrialRecord
from tuner.sglang.failures import FailureClass
from tuner.sglang.flags import FlagTable
from tuner.sim.evaluate import size_server
from tuner.study.best import choose_best, measured_noise
from tuner.study.calibration import ModelSettings, margin_for
from tuner.study.decide import Skip, first_skip
from tuner.study.decide.memory import MemoryFrontier
from tuner.study.decide.screens import MeasuredAlready, MustFail, Predicted
from tuner.study.slo_bound import SLOBound, SLOPoint, slo_bounds, slo_points
from tuner.study.space import resolve_space
from tuner.trial import render_argv

BASE = ["--model-path", "llama-3.1-70b", "--tp-size", "8", "--sim-gpu", "A100-80GB", "--mem-fraction-static", "0.85"]
TABLE = FlagTable.for_version("0.5.5")
CONTEXT = 1152
MEAN = 832
BUDGET = BudgetSection(max_concurrency=256)


def _record(params: dict, *, running: float | None, slo: float | None, tput: float = 500.0,
            outcome: str = "ok", failure: FailureClass | None = None, base: list[str] = BASE,
            context: int = CONTEXT, limited: str | None = None) -> TrialRecord:
    """A trial of ``params`` as the product records it: the startup's memory facts, and a
    measured window of ``running`` requests with SLO overshoot ``slo`` (of the p99 ``limited``:
    ``"ttft"`` or ``"itl"`` against limits of 3 s and 1 s, the other p99 at half its limit)."""
    argv = render_argv(base, params, TABLE)
    resolved, facts, memory = simulated_start(argv, context, TABLE)
    constraints = {"oom_or_crash": 1.0 if failure else -1.0, "slo": slo if slo is not None else 1.0,
                   "stress": 1.0 if failure else -1.0}
    return TrialRecord(
        params=dict(params), argv=argv, resolved=resolved, outcome=outcome, context_tokens=context,
        context_capacity=facts["context_capacity"], token_capacity=facts["max_total_num_tokens"],
        free_gib_after_graphs=facts["free_gib_after_graphs"], memory=memory,
        output_throughput_tok_s=tput, constraints=constraints, feasible=all(v <= 0 for v in constraints.values()),
        measured_load={"streams": running, "running_requests": running, "chunk_tokens": 8192.0} if running else {},
        failure_class=failure, **_latencies(limited, slo),
    )


def _latencies(limited: str | None, slo: float | None) -> dict:
    """The p99s and the SLO's limits of a window whose worst overshoot ``slo`` is on ``limited``."""
    if limited is None or slo is None:
        return {}
    limits = {"p99_ttft_ms": 3000.0, "p99_itl_ms": 1000.0}
    p99 = {key: limit * (1 + slo if key == f"p99_{limited}_ms" else 0.5) for key, limit in limits.items()}
    return {**p99, "slo_capacity": {"limits": limits}}


def _params(mfs: float, mrr: int, cps: int = 8192) -> dict:
    return {"mem_fraction_static": mfs, "max_running_requests": mrr, "chunked_prefill_size": cps}


@pytest.fixture(scope="module")
def space():
    return resolve_space(SpaceSection(mem_fraction_step=0.01), _params(0.85, 4096), capacity_hint=1300,
                         slots_hint=1300)


def _view(space, history: list, *, tried=(), pending=(), objective: ObjectiveSection | None = None):  # noqa: ANN202 - StudyView
    return study_view(space, history, context_tokens=CONTEXT, budget=BUDGET, mean_request_tokens=MEAN,
                      tried=tried, pending=pending, objective=objective)


def _screen(space, params: dict, history: list, **options) -> tuple[str, int] | None:  # noqa: ANN003
    """The predicted screen's answer for ``params`` as ``(reason, proof)``."""
    skip = Predicted().why_not(params, _view(space, history, **options))
    return (skip.reason, skip.proof) if skip else None


def _proofs(space, params: dict, history: list) -> tuple[str, int] | None:
    skip = first_skip([MeasuredAlready(), MustFail()], params, _view(space, history))
    return (skip.reason, skip.proof) if skip else None


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


def test_a_latency_that_bends_up_toward_the_break_is_bisected_not_crept_up_on() -> None:
    """p99 ITL flat at 94-95 % of the limit from 18 to 21 requests, 22 % over at 38: the line from
    21 to 38 would aim at 24 (then 26, 27, ...: the creep seen in the search benchmark); the bend
    sends the next step to the middle of the bracket instead."""
    bound = slo_bounds([_point(0, 38, 0.2185), _point(1, 18, -0.048), _point(2, 21, -0.056)])[
        (("chunked_prefill_size", 8192),)]
    assert (bound.safe, bound.broken) == (21, 38)
    assert bound.next_count() == 29
    # a line that keeps rising at the secant's rate is still interpolated
    straight = slo_bounds([_point(0, 40, 0.2), _point(1, 20, -0.2), _point(2, 30, 0.0 - 1e-9)])[
        (("chunked_prefill_size", 8192),)]
    assert straight.next_count() == 31


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
    candidate = plan(_view(space, history))
    assert candidate is not None
    assert candidate.params["max_running_requests"] == 35
    assert candidate.params["chunked_prefill_size"] == 8192
    # the smallest fraction whose pool still holds 35 contexts: the bottom of the range here
    assert candidate.params["mem_fraction_static"] == space.mem_fraction_static[0]
    assert candidate.prediction.slo_broken_trial == 0 and candidate.prediction.running_requests == 35


def test_inside_the_feasible_region_the_planner_narrows_the_bracket_then_stops_below_the_break(space) -> None:
    low = space.mem_fraction_static[0]
    history = [
        (0, _record(_params(0.85, 4096), running=256, slo=5.9)),
        (1, _record(_params(low, 35), running=35, slo=0.002)),
        (2, _record(_params(low, 31), running=31, slo=-0.08)),
    ]
    candidate = plan(_view(space, history))
    assert candidate is not None and 31 < candidate.params["max_running_requests"] < 35
    history.append((3, _record(_params(low, 34), running=34, slo=-0.01)))
    later = plan(_view(space, history))
    # the 8192 bracket is closed (34 safe, 35 broken): never 35 or more with these knobs again
    assert later is None or later.params["chunked_prefill_size"] != 8192 or later.params["max_running_requests"] <= 34


@pytest.mark.parametrize(("limited", "chunk"), [("ttft", 16384), ("itl", 4096)])
def test_a_closed_bracket_tries_the_chunk_size_that_eases_its_limit_at_the_break_first(space, limited, chunk) -> None:
    """The 8192-token bracket is closed (34 requests hold the SLO, 35 break it by 0.2 %): only a
    hold at 35 can beat the incumbent, so the other chunk sizes are measured there first (not at
    the safe 34, which at best ties), the one that eases the binding limit first: a larger chunk
    prefills a prompt in fewer steps (TTFT), a smaller one lengthens the decode steps it joins
    less (ITL). Before, 4096 at 34 came first whichever limit bound. A chunk size that then breaks
    at the incumbent's safe load too is not bracketed further down (fewer requests cannot win)."""
    low = space.mem_fraction_static[0]

    def measured(params: dict, running: int, slo: float) -> TrialRecord:  # with the GPU monitor's activation peak
        record = _record(params, running=running, slo=slo, limited=limited)
        return record.model_copy(update={"memory": record.memory.model_copy(update={"peak_activation_gib": 2.0})})

    history = [(0, measured(_params(0.85, 4096), 256, 5.9)), (1, measured(_params(low, 35), 35, 0.002)),
               (2, measured(_params(low, 34), 34, -0.01))]
    candidate = plan(_view(space, history))
    assert candidate is not None
    assert (candidate.params["chunked_prefill_size"], candidate.params["max_running_requests"]) == (chunk, 35)
    assert "at the load that broke the SLO on trial 1" in candidate.prediction.why
    history.append((3, measured(_params(low, 35, chunk), 35, 0.01)))
    then = plan(_view(space, history))  # it broke at 35 too: its safe load is the incumbent's
    assert then is not None
    assert (then.params["chunked_prefill_size"], then.params["max_running_requests"]) == (chunk, 34)
    history.append((4, measured(_params(low, 34, chunk), 34, 0.01)))
    later = plan(_view(space, history))  # it breaks at 34 as well: no count below is tried
    assert later is None or later.params["chunked_prefill_size"] != chunk


# ---- every skip reason -----------------------------------------------------------------------------


def test_skip_an_exact_repeat_on_the_grid(space) -> None:
    history = [(4, _record(_params(0.85, 40), running=40, slo=0.1))]
    reason = _proofs(space, _params(0.8500000001, 40), history)
    assert reason == ("the same config was measured by trial 4", 4)
    assert _proofs(space, _params(0.86, 40), history) is None


def test_skip_what_a_memory_failure_proves_must_fail(space) -> None:
    history = [(5, _record(_params(0.9, 64), running=None, slo=None, outcome="failed",
                           failure=FailureClass.CUDA_GRAPH_OOM))]
    text, proof = _proofs(space, _params(0.92, 64), history)
    assert proof == 5 and text.startswith("must fail: trial 5 failed with")


def test_skip_what_the_slo_rule_proves_must_break_the_slo(space) -> None:
    history = [(0, _record(_params(0.85, 4096), running=256, slo=5.9)),
               (1, _record(_params(0.8, 40), running=40, slo=0.2))]
    text, proof = _screen(space, _params(0.9, 48), history)
    assert proof == 1 and text.startswith("must break the SLO: trial 1 broke it running 40 requests")
    # another chunk size is another family: the rule does not hold across it
    assert _screen(space, _params(0.9, 48, 4096), history) is None


def test_a_break_that_a_safe_window_at_more_requests_contradicts_proves_nothing(space) -> None:
    """The p99 of a window near the limit is noise (its ITL lands in the prefill-joined steps or
    not by a handful of steps): 32 requests broke the SLO, 33 held it with the same knobs. The
    monotone rule cannot hold for both, so 33 and 34 slots on another fraction are launched, not
    skipped as must-break; a break above the safe window (36) still proves."""
    history = [(0, _record(_params(0.85, 4096), running=256, slo=5.9)),
               (1, _record(_params(0.8, 32), running=32, slo=0.4)),
               (2, _record(_params(0.8, 33), running=33, slo=-0.02))]
    assert _screen(space, _params(0.86, 33), history) is None
    assert _screen(space, _params(0.86, 34), history) is None
    history.append((3, _record(_params(0.8, 36), running=36, slo=0.4)))
    text, proof = _screen(space, _params(0.86, 40), history)
    assert proof == 3 and text.startswith("must break the SLO: trial 3 broke it running 36 requests")


def test_no_slo_proof_for_a_smaller_pool_that_cannot_surely_run_the_broken_load(space) -> None:
    """Contexts of 8192 tokens: a window broke the SLO running 160 requests on a pool of 173 such
    contexts (mem_fraction_static 0.9); a config with more slots (170) on a pool of 148 (0.8)
    cannot run 160 of them at once when they are long (it runs fewer, retracting), so the monotone
    rule proves nothing about it: launched, not skipped as must-break. The same slots on the
    window's own pool are still proved."""
    history = [(1, _record(_params(0.9, 160), running=160, slo=0.2, context=8192))]

    def screen(params: dict) -> str:
        view = study_view(space, history, context_tokens=8192, budget=BUDGET, mean_request_tokens=MEAN)
        skip = Predicted().why_not(params, view)
        return skip.reason if skip else ""

    assert not screen(_params(0.8, 170)).startswith("must break the SLO")
    assert screen(_params(0.9, 170)).startswith("must break the SLO: trial 1 broke it running 160 requests")


def test_skip_slots_the_workload_can_never_run_at_once(space) -> None:
    history = [(0, _record(_params(0.85, 20), running=20, slo=-0.5))]
    text, _ = _screen(space, _params(0.8, 2000), history)
    assert "is more than the" in text and "predicted, not launched" in text
    # slots up to the context capacity always count (they are the objective)
    tokens = history[0][1].token_capacity
    assert _view(space, history).calibration.slots_cap(tokens) >= tokens // CONTEXT


def test_skip_a_capacity_below_the_band_that_cannot_win(space) -> None:
    history = [(0, _record(_params(0.85, 40), running=40, slo=-0.1))]
    text, _ = _screen(space, _params(0.85, 30), history)
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
    return record.model_copy(update={"memory": record.memory.model_copy(update={"peak_activation_gib": peak_gib}),
                                     "prediction": Prediction.model_validate(prediction or {})})


@pytest.fixture(scope="module")
def l4_space():
    return resolve_space(SpaceSection(mem_fraction_step=0.01, mem_fraction_static=(0.80, 0.99),
                                      chunked_prefill_size=[2048, 4096, 8192, 16384]),
                         _params(0.85, 2048), capacity_hint=12, slots_hint=37)


L4_SETTINGS = ModelSettings(context_tokens=L4_CONTEXT, budget=BudgetSection(max_concurrency=64), mean_request_tokens=1360)


def _l4_view(space, history: list, *, tried=(), pending=(), objective: ObjectiveSection | None = None):  # noqa: ANN202 - StudyView
    return study_view(space, history, context_tokens=L4_CONTEXT, budget=L4_SETTINGS.budget,
                      mean_request_tokens=L4_SETTINGS.mean_request_tokens, tried=tried, pending=pending,
                      objective=objective)


def _l4_screen(space, params: dict, history: list, **options) -> tuple[str, int] | None:  # noqa: ANN003
    skip = Predicted().why_not(params, _l4_view(space, history, **options))
    return (skip.reason, skip.proof) if skip else None


def test_the_margin_is_what_checked_predictions_missed_and_the_prior_before_any(l4_space) -> None:
    baseline = _l4(_params(0.85, 2048), peak_gib=1.0)
    assert margin_for([(0, baseline)], L4_SETTINGS) == L4_SETTINGS.margin_gib  # nothing checked yet
    free = _l4(_params(0.94, 11, 2048), peak_gib=0.25).free_gib_after_graphs
    over = _l4(_params(0.94, 11, 2048), peak_gib=0.25, prediction={"free_gib_after_graphs": free + 0.12})
    under = _l4(_params(0.94, 11, 2048), peak_gib=0.25, prediction={"free_gib_after_graphs": free - 0.3})
    assert margin_for([(0, baseline), (1, under)], L4_SETTINGS) == L4_SETTINGS.min_margin_gib
    assert margin_for([(0, baseline), (1, under), (2, over)], L4_SETTINGS) == pytest.approx(0.12)


def test_skip_a_sampled_config_whose_headroom_cannot_hold_the_scaled_activation_peak(l4_space) -> None:
    history = [(0, _l4(_params(0.85, 2048), peak_gib=1.0))]
    # 0.97 leaves ~0.3 GiB after graphs; a 16k chunk needs twice the 8k chunk's measured 1 GiB
    text, proof = _l4_screen(l4_space, _params(0.97, 12, 16384), history)
    assert proof == 0 and "measured activation peak scaled to this prefill chunk (2.00 GiB" in text
    assert "predicted, not launched" in text
    # a small chunk at a moderate fraction keeps room for its (quartered) peak: launched
    assert _l4_screen(l4_space, _params(0.9, 9, 2048), history) is None


def test_calibration_charges_the_slots_the_server_ran_not_the_snapped_count(l4_space) -> None:
    """The baseline ran SGLang's 2048 request slots (a 1 GiB req_to_token table, §1.6), above the
    space's top: calibrating on its snapped count would charge that table to the extra slots of
    every later proposal and predict too little headroom (aiming below the frontier)."""
    baseline = _l4(_params(0.85, 2048), peak_gib=1.0)
    first = _l4(_params(0.92, 10), peak_gib=1.0)
    first = first.model_copy(update={"prediction": Prediction(free_gib_after_graphs=first.free_gib_after_graphs)})
    history = [(0, baseline), (1, first)]
    tried: list[dict] = []
    for _ in range(3):
        candidate = plan(_l4_view(l4_space, history, tried=tried))
        assert candidate is not None
        truth = size_server(render_argv(L4, candidate.params, TABLE)).free_gib_after_graphs
        assert abs(candidate.prediction.free_gib_after_graphs - truth) < 0.05, candidate
        tried.append(candidate.params)


def test_more_request_slots_try_the_reachable_count_first(l4_space) -> None:
    baseline = _l4(_params(0.85, 2048), peak_gib=1.0)
    first = _l4(_params(0.96, 12, 2048), peak_gib=0.25)
    first = first.model_copy(update={"prediction": Prediction(free_gib_after_graphs=first.free_gib_after_graphs)})
    history = [(0, baseline), (1, first)]
    view = _l4_view(l4_space, history)
    candidate = plan(view)
    assert candidate is not None and candidate.params["mem_fraction_static"] == 0.96
    assert "more request slots" in candidate.prediction.why
    assert candidate.params["max_running_requests"] == view.calibration.slots_cap(candidate.prediction.token_capacity) > 12


def test_a_baseline_that_ooms_under_load_still_calibrates_and_bounds_the_need(l4_space) -> None:
    """The unit's own flags die under the stress load: no trial survived, but the start reported
    its pool and free memory, and the OOM with that free memory is a lower bound on the need."""
    started = _l4(_params(0.85, 2048), peak_gib=0.0)
    baseline = started.model_copy(update={
        "outcome": "failed", "failure_class": FailureClass.RUNTIME_OOM,
        "constraints": {"oom_or_crash": 1.0, "slo": 1.0, "stress": 1.0},
        "memory": started.memory.model_copy(update={"peak_activation_gib": None})})
    history = [(0, baseline)]
    candidate = plan(_l4_view(l4_space, history))
    assert candidate is not None
    ratio = candidate.params["chunked_prefill_size"] / 8192
    # more free memory after graphs than the OOM had, scaled to the candidate's chunk, plus the margin
    assert candidate.prediction.free_gib_after_graphs >= baseline.free_gib_after_graphs * ratio + L4_SETTINGS.margin_gib
    truth = size_server(render_argv(L4, candidate.params, TABLE)).free_gib_after_graphs
    assert abs(candidate.prediction.free_gib_after_graphs - truth) < 0.1
    # a sampled config with less room than the OOM had at its chunk is not launched
    text, proof = _l4_screen(l4_space, _params(0.9, 9, 8192), history)
    assert proof == 0 and "runtime OOM under load implies" in text


def test_one_views_screens_answer_as_a_fresh_views_after_the_believer(l4_space) -> None:
    """A decision's proposers and the screens of every sampler's draw share one view and its one
    calibration. The screens' answers must be a fresh view's: after the memory frontier believed a
    trial running on another host (which narrows the margin for its own proposals only), and
    again for a longer history."""
    baseline = _l4(_params(0.85, 2048), peak_gib=1.0)
    first = _l4(_params(0.92, 10), peak_gib=1.0)  # no prediction: no checked margin yet
    history = [(0, baseline), (1, first)]
    running = plan(_l4_view(l4_space, history))
    assert running is not None
    view = _l4_view(l4_space, history, pending=[(running.params, running.prediction)])
    believed = MemoryFrontier().propose(view)
    assert believed is not None and believed.prediction.need_gib < running.prediction.need_gib
    assert view.calibration.margin_gib == L4_SETTINGS.margin_gib  # the believer's margin was its own
    grid = [_params(mfs / 100, mrr, cps) for mfs in range(80, 100) for mrr in (6, 9, 12, 16)
            for cps in (2048, 8192, 16384)]
    screen = Predicted()

    def answers(view) -> list:  # noqa: ANN001 - StudyView
        return [screen.why_not(params, view) for params in grid]

    fresh = _l4_view(l4_space, history, pending=[(running.params, running.prediction)])
    assert answers(view) == answers(fresh)
    assert any(a is None for a in answers(view)) and any(isinstance(a, Skip) and "GiB free" in a.reason
                                                         for a in answers(view))
    longer = [*history, (2, _l4(_params(0.95, 12, 2048), peak_gib=0.25))]
    assert answers(_l4_view(l4_space, longer)) != answers(view)
