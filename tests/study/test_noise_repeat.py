"""Noise re-measurements only where they can change the choice (issue 30)."""

from __future__ import annotations

from tests.support.views import study_view
from tuner.config import ObjectiveSection, SpaceSection
from tuner.records import TrialRecord
from tuner.study.decide.repeat import NoiseRepeat
from tuner.study.space import resolve_space

OBJECTIVE = ObjectiveSection()
SPACE = resolve_space(SpaceSection(mem_fraction_step=0.01), {"mem_fraction_static": 0.85, "max_running_requests": 256,
                                                             "chunked_prefill_size": 8192},
                      capacity_hint=100, slots_hint=256)


def _ok(mfs: float, mrr: int, capacity: int, tput: float, repeat_of: int | None = None) -> TrialRecord:
    return TrialRecord(params={"mem_fraction_static": mfs, "max_running_requests": mrr, "chunked_prefill_size": 8192},
                       context_capacity=capacity, output_throughput_tok_s=tput, feasible=True, outcome="ok",
                       constraints={"oom_or_crash": -1.0, "slo": -0.1, "stress": -1.0}, repeat_of=repeat_of)


def _repeat(history: list[tuple[int, TrialRecord]]) -> int | None:
    proposal = NoiseRepeat(OBJECTIVE).propose(study_view(SPACE, history, context_tokens=4096, objective=OBJECTIVE))
    return proposal.repeat_of if proposal else None


def test_equal_contenders_are_not_re_measured() -> None:
    # the same capacity and throughputs 0.3 % apart: either is as good, a window cannot matter
    assert _repeat([(1, _ok(0.90, 64, 64, 1000.0)), (2, _ok(0.91, 64, 64, 997.0))]) is None


def test_contenders_a_noisy_window_could_swap_are_re_measured_until_the_spread_is_known() -> None:
    # 2 % apart with a 3 % margin and a capacity between them: the lower-capacity, faster config
    # wins only by its window; re-measure the chosen one
    history = [(1, _ok(0.90, 64, 64, 1000.0)), (2, _ok(0.91, 66, 66, 980.0))]
    chosen = _repeat(history)
    assert chosen in (1, 2)
    # the re-measurement shows no spread (a quiet box): 2 % is then far outside the noise, no more
    history.append((3, _ok(*((0.90, 64, 64, 1000.0) if chosen == 1 else (0.91, 66, 66, 980.0)), repeat_of=chosen)))
    assert _repeat(history) is None
