"""The noise repeat: "best" rests on the measured throughput noise, not on one window.

Capacity is exact (the pool is sized at startup); throughput is what needs a repeat. When the
planner has nothing left and the two fastest configs of the best capacity band differ by less than
twice the noise margin, the chosen one, then the runner-up, is measured once more.
"""

from __future__ import annotations

import math

from tuner.config import ObjectiveSection
from tuner.records import TrialRecord
from tuner.study.best import choose_best
from tuner.study.decide import Proposal
from tuner.study.space import config_key
from tuner.study.view import ConfigKey, StudyView

__all__ = ["MAX_NOISE_REPEATS", "NoiseRepeat"]

MAX_NOISE_REPEATS = 2
"""Configs a study re-measures at most to measure the throughput noise."""


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
        choice = choose_best(done, policy=objective.policy, capacity_tolerance=objective.capacity_tolerance,
                             throughput_noise=objective.throughput_noise)
        if choice is None:
            return None
        top = max(r.context_capacity or 0 for _, r in done if r.feasible and r.outcome == "ok")
        floor = math.ceil(top * (1.0 - objective.capacity_tolerance) - 1e-9)
        band: dict[ConfigKey, tuple[int, TrialRecord]] = {}
        for number, record in done:
            if record.feasible and record.outcome == "ok" and (record.context_capacity or 0) >= floor:
                band.setdefault(config_key(view.space.snap(record.params)), (number, record))
        ranked = sorted(band.values(), key=lambda item: -(item[1].output_throughput_tok_s or 0.0))
        if len(ranked) < 2:
            return None
        first, second = (r.output_throughput_tok_s or 0.0 for _, r in ranked[:2])
        margin = choice.noise if choice.noise is not None else objective.throughput_noise
        if first <= 0 or (first - second) / first >= 2 * margin:
            return None
        others = [item for item in ranked[:2] if item[0] != choice.number]
        chosen = next((item for item in ranked if item[0] == choice.number), None)
        for number, record in ([chosen] if chosen else []) + others:
            if number not in repeated:
                why = (f"re-measure trial {number}: the band's two fastest configs differ by "
                       f"{(first - second) / first:.1%} in throughput, within twice the {margin:.1%} noise margin")
                return Proposal(params=view.space.snap(record.params), prediction={"why": why}, repeat_of=number)
        return None
