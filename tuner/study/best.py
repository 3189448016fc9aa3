"""The one "best" rule: which feasible trial a study recommends under its ``[objective]`` policy.

The run's closing summary, ``tuner best``, the HTML report and ``tuner apply best`` all call
:func:`choose_best` (the readers through :meth:`tuner.results.StoredStudy` views), so they agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from optuna.trial import FrozenTrial
from pydantic import BaseModel, ConfigDict

from tuner.records import TrialRecord

__all__ = ["BestChoice", "choose_best"]


class BestChoice(BaseModel):
    """The trial chosen as best and why.

    Attributes:
        number: The Optuna trial number.
        record: Its record.
        reason: One sentence on why it won under the policy.
    """

    model_config = ConfigDict(frozen=True)

    number: int
    record: TrialRecord
    reason: str


def choose_best(
    finished: Sequence[tuple[FrozenTrial, TrialRecord]] | Sequence[tuple[int, TrialRecord]],
    *,
    policy: str = "throughput_within_capacity",
    capacity_tolerance: float = 0.05,
    throughput_noise: float = 0.03,
) -> BestChoice | None:
    """Pick "best" among feasible, fully measured trials by the configured policy.

    ``throughput_within_capacity`` keeps the trials whose context capacity is within
    ``capacity_tolerance`` of the best (the band); among them, every trial whose output throughput
    is within ``throughput_noise`` of the band's highest counts as tied (a short measured window
    cannot tell such throughputs apart), and the tie goes to the higher context capacity, then the
    higher throughput, then the earlier trial.

    Args:
        finished: ``(trial or number, record)`` pairs; only feasible ``ok`` records compete.
        policy: ``throughput_within_capacity`` (see above), ``max_capacity`` (highest capacity;
            throughput breaks ties) or ``max_throughput``.
        capacity_tolerance: Relative capacity band of ``throughput_within_capacity`` (0.05 = 5 %).
        throughput_noise: Relative throughput margin of ``throughput_within_capacity`` treated as
            a tie (0.03 = 3 %).

    Returns:
        The choice, or ``None`` when no trial is feasible.
    """
    pool = []
    for item, record in finished:
        number = item if isinstance(item, int) else item.number
        if record.feasible and record.outcome == "ok" and record.context_capacity is not None:
            pool.append((number, record))
    if not pool:
        return None
    top_capacity = max(r.context_capacity or 0 for _, r in pool)
    tput = lambda r: r.output_throughput_tok_s or 0.0  # noqa: E731
    if policy == "max_throughput":
        number, record = max(pool, key=lambda p: (tput(p[1]), p[1].context_capacity, -p[0]))
        reason = f"highest output throughput ({tput(record):.1f} tok/s) among feasible trials"
    elif policy == "max_capacity":
        number, record = max(pool, key=lambda p: (p[1].context_capacity, tput(p[1]), -p[0]))
        reason = (
            f"highest context capacity ({record.context_capacity} requests) among feasible trials"
        )
    else:
        floor = math.ceil(top_capacity * (1.0 - capacity_tolerance) - 1e-9)
        band = [p for p in pool if (p[1].context_capacity or 0) >= floor]
        fastest_number, fastest = max(band, key=lambda p: (tput(p[1]), p[1].context_capacity, -p[0]))
        ties = [p for p in band if tput(p[1]) >= tput(fastest) * (1.0 - throughput_noise) - 1e-9]
        number, record = max(ties, key=lambda p: (p[1].context_capacity, tput(p[1]), -p[0]))
        among = (
            f"among the {len(band)} feasible trial(s) within {capacity_tolerance:.0%} of the best "
            f"context capacity ({top_capacity} requests)"
        )
        if number == fastest_number:
            reason = f"highest output throughput ({tput(record):.1f} tok/s) {among}"
            if len(ties) > 1:
                reason += (
                    f"; {len(ties) - 1} other(s) within the {throughput_noise:.0%} throughput noise "
                    "margin have no higher context capacity"
                )
        else:
            reason = (
                f"highest context capacity ({record.context_capacity} requests) of the {len(ties)} "
                f"trial(s) whose output throughput is within the {throughput_noise:.0%} noise margin "
                f"of the highest ({tput(fastest):.1f} tok/s, trial {fastest_number}; this one "
                f"{tput(record):.1f} tok/s), {among}"
            )
    return BestChoice(number=number, record=record, reason=reason)
