"""The noise repeat: "best" rests on the measured throughput noise, not on one window.

Capacity is exact (the pool is sized at startup); throughput is what needs a repeat. When the
planner has nothing left and the two fastest configs of the best capacity band differ by less than
twice the noise margin (the measured spread once a config was measured twice, else ``[objective]
throughput_noise``), the chosen one, then the runner-up, is measured once more, but only when a
re-measurement can change the choice: the chosen config measured a margin lower and the others a
margin higher would make another config "best", and that config is not an equal of the chosen one
(the same context capacity and a throughput within :data:`EQUAL_THROUGHPUT`: either is as good,
so telling them apart buys nothing).
"""

from __future__ import annotations

import math

from tuner.config import ObjectiveSection
from tuner.records import Prediction, TrialRecord
from tuner.study.best import best_by, measured_noise
from tuner.study.decide import Proposal
from tuner.study.space import config_key
from tuner.study.view import ConfigKey, StudyView

__all__ = ["EQUAL_THROUGHPUT", "MAX_NOISE_REPEATS", "NoiseRepeat"]

MAX_NOISE_REPEATS = 2
"""Configs a study re-measures at most to measure the throughput noise."""

EQUAL_THROUGHPUT = 0.01
"""Relative throughput difference below which two configs of one capacity are equals."""


class NoiseRepeat:
    """A config to measure once more (a :class:`~tuner.study.decide.Proposer`).

    The margin is the measured spread once a config was measured twice, else ``[objective]
    throughput_noise``; :data:`MAX_NOISE_REPEATS` in a study, every host's counted (a repeat
    running or queued anywhere counts as made: two hosts never re-measure at once). Only under the
    ``throughput_within_capacity`` policy (the others do not compare throughputs in a band).

    Args:
        objective: ``[objective]``.
    """

    def __init__(self, objective: ObjectiveSection) -> None:
        self.objective = objective

    def propose(self, view: StudyView) -> Proposal | None:
        """The trial to re-measure, its params on the grid and why, or ``None``."""
        objective, done = self.objective, view.finished
        repeated = view.repeats
        if objective.policy != "throughput_within_capacity" or len(repeated) >= MAX_NOISE_REPEATS:
            return None
        choice = best_by(done, objective)
        if choice is None:
            return None
        top = max(r.capacity(choice.basis) or 0 for _, r in done if r.feasible and r.outcome == "ok")
        floor = math.ceil(top * (1.0 - objective.capacity_tolerance) - 1e-9)
        band: dict[ConfigKey, tuple[int, TrialRecord]] = {}
        for number, record in done:
            if record.feasible and record.outcome == "ok" and (record.capacity(choice.basis) or 0) >= floor:
                band.setdefault(config_key(view.space.snap(record.params)), (number, record))
        ranked = sorted(band.values(), key=lambda item: -(item[1].output_throughput_tok_s or 0.0))
        if len(ranked) < 2:
            return None
        first, second = (r.output_throughput_tok_s or 0.0 for _, r in ranked[:2])
        # Once a config was measured twice, the measured spread is the noise (a quiet box's may be
        # below the configured margin); before that, the configured margin.
        spread = measured_noise([(n, r) for n, r in done if r.feasible and r.outcome == "ok"])
        margin = spread if spread is not None else objective.throughput_noise
        if first <= 0 or (first - second) / first >= 2 * margin:
            return None
        if not _can_change(done, choice.number, ranked, margin, objective):
            return None
        others = [item for item in ranked[:2] if item[0] != choice.number]
        chosen = next((item for item in ranked if item[0] == choice.number), None)
        for number, record in ([chosen] if chosen else []) + others:
            if number not in repeated:
                why = (f"re-measure trial {number}: the band's two fastest configs differ by "
                       f"{(first - second) / first:.1%} in throughput, within twice the {margin:.1%} noise margin")
                return Proposal(params=view.space.snap(record.params), prediction=Prediction(why=why), repeat_of=number)
        return None


def _can_change(done: tuple[tuple[int, TrialRecord], ...], chosen: int, ranked: list[tuple[int, TrialRecord]],
                margin: float, objective: ObjectiveSection) -> bool:
    """Whether a re-measurement within ``margin`` can change the choice for a config that is not
    an equal of the chosen one: the chosen trial measured ``margin`` lower and the band's others
    ``margin`` higher."""
    band = {number for number, _ in ranked}

    def shifted(number: int, record: TrialRecord) -> TrialRecord:
        if number not in band or record.output_throughput_tok_s is None:
            return record
        factor = 1.0 - margin if number == chosen else 1.0 + margin
        return record.model_copy(update={"output_throughput_tok_s": record.output_throughput_tok_s * factor})

    other = best_by([(n, shifted(n, r)) for n, r in done], objective)
    if other is None or other.number == chosen:
        return False
    mine = next(r for n, r in done if n == chosen)
    theirs = next(r for n, r in done if n == other.number)
    a, b = mine.output_throughput_tok_s or 0.0, theirs.output_throughput_tok_s or 0.0
    equal = mine.objective_capacity == theirs.objective_capacity and abs(a - b) <= EQUAL_THROUGHPUT * max(a, b, 1e-9)
    return not equal
