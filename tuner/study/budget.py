"""The wall-clock budget of a tuning run: parse it, estimate what a trial costs, decide what fits.

A trial on a production box costs a restart (minutes for a large model) plus its load phases, so
the run never starts a trial that cannot finish inside the budget. The cost of the next trial is
estimated from the study's own history (the durations of the trials already run, restarts and
load included); before any history exists, from the configured start timeout and load phases.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict

from tuner.config import BudgetSection, TunerConfig
from tuner.errors import ConfigError
from tuner.load.search import context_slo
from tuner.units import format_duration

__all__ = ["prior_trial_cost_s", "restore_cost_s", "slo_bracket_cost_s", "load_concurrency", "reachable_slots", "require_one_trial", "budget_name", "TrialCostEstimate", "Budget"]

def prior_trial_cost_s(config: TunerConfig) -> float:
    """A first trial's expected cost in seconds, before the study has any history: a third of
    ``[service] start_timeout_s`` (at most 10 min) plus the warm-up, measure and stress phases,
    the SLO-safe capacity's bracketing loads and 5 s for the record. The one estimate ``tuner run``
    budgets with and ``--dry-run`` prints.

    The steady windows of the SLO-safe capacity (one, plus up to ``[budget] slo_capacity_steps``
    bracketing ones, each a ramp, ``warmup_s`` and ``stress_s``: :mod:`tuner.load.steady`) are
    counted whenever a trial may run them: the SLO sets a TTFT, ITL or TPOT limit
    (:func:`tuner.load.search.context_slo`) and there is a stress phase. The bracketing ones run
    only when a window breaks the SLO, so the prior is the cost of a trial that brackets (an upper
    estimate: a first trial cut by the budget is worse than one trial fewer); later trials are
    estimated from the study's measured durations (:meth:`Budget.estimate`), which include them.
    """
    budget = config.budget
    return _start_share_s(config) + budget.warmup_s + budget.measure_s + budget.stress_s + slo_bracket_cost_s(config) + 5.0


def _start_share_s(config: TunerConfig) -> float:
    """A start's expected seconds before any is measured: a third of ``[service] start_timeout_s``,
    at most 10 min."""
    return min(config.service.start_timeout_s / 3.0, 600.0)


def restore_cost_s(config: TunerConfig) -> float:
    """Seconds the final restore is expected to take (a restart of the service on its own flags,
    until healthy): ``[budget] restore_reserve_s`` when set, else a start's share of
    ``[service] start_timeout_s`` as in :func:`prior_trial_cost_s`. The maintenance window holds it
    after the last trial (:class:`tuner.study.stops.Window`)."""
    return config.budget.restore_reserve_s or _start_share_s(config)


def slo_bracket_cost_s(config: TunerConfig) -> float:
    """Seconds a trial's steady windows may add after its stress load (``(1 + [budget]
    slo_capacity_steps) ×`` (ramp + ``warmup_s`` + ``stress_s``), :meth:`tuner.config.BudgetSection.steady_window`),
    0 when it runs none: no stress phase, or an SLO that sets no TTFT, ITL or TPOT limit
    (:func:`tuner.load.search.context_slo`)."""
    budget = config.budget
    if budget.stress_s > 0 and context_slo(config.slo) is not None:
        window = budget.steady_window()
        return (1 + budget.slo_capacity_steps) * (window.warmup_s + window.duration_s)
    return 0.0


def load_concurrency(
    budget: BudgetSection, *, capacity: int | None, max_running_requests: int | None, max_total_num_tokens: int | None,
    mean_request_tokens: int,
) -> int:
    """Closed-loop concurrency of the measured window: as many requests as the config admits.

    ``[budget] concurrency`` when set; else the smaller of the effective max_running_requests and
    what the token pool holds at the workload's mean request size, at least the context capacity,
    capped by ``[budget] max_concurrency``.

    Args:
        budget: ``[budget]``.
        capacity: The context capacity (requests of the longest context resident at once).
        max_running_requests: The effective max_running_requests (``None``: unknown).
        max_total_num_tokens: The KV pool (tokens).
        mean_request_tokens: The workload's mean ``input + output`` (tokens).

    Returns:
        Client streams (≥ 1).
    """
    if budget.concurrency:
        return int(budget.concurrency)
    mrr = max_running_requests or capacity or 1
    by_tokens = (max_total_num_tokens or 0) // max(1, mean_request_tokens)
    return max(1, min(budget.max_concurrency, mrr, max(by_tokens, capacity or 1)))


def reachable_slots(
    budget: BudgetSection, *, max_total_num_tokens: int, context_tokens: int, mean_request_tokens: int
) -> int:
    """The most request slots that can change a trial's result: its context capacity
    (``pool // context_tokens``, the objective), or more only as far as the measured window can
    ever run at once (``[budget] max_concurrency`` (or ``concurrency``), and the pool divided by the
    workload's mean request length). Slots beyond it cannot change what is measured.

    Args:
        budget: ``[budget]``.
        max_total_num_tokens: The KV pool (tokens).
        context_tokens: The context length of context capacity (tokens).
        mean_request_tokens: The workload's mean ``input + output`` (tokens).
    """
    streams = int(budget.concurrency or budget.max_concurrency)
    by_mean = max_total_num_tokens // max(1, mean_request_tokens)
    return max(1, max_total_num_tokens // max(1, context_tokens), min(streams, by_mean))


def budget_name(config: TunerConfig, budget_s: float) -> str:
    """Where a run's budget came from, for its messages: ``[budget] total`` when it is the config's
    (no ``--budget`` given, or the same duration), else ``--budget`` (a ``[budget] total = "1s"``
    was told to "give at least --budget 2m", an option the user never passed)."""
    from tuner.units import parse_duration_s

    total = config.budget.total
    return "[budget] total" if total is not None and parse_duration_s(total) == budget_s else "--budget"


def require_one_trial(total_s: float, cost_s: float, *, reserve_s: float = 0.0, name: str = "--budget") -> None:
    """Refuse a budget too short for even one trial (it would stop before doing anything).

    Args:
        total_s: The whole budget in seconds.
        cost_s: The estimated cost of one trial in seconds (see :meth:`Budget.estimate`).
        reserve_s: Seconds kept back for restoring the service.
        name: The option or key the budget came from, named in the error.

    Raises:
        ConfigError: ``total_s`` is below ``cost_s + reserve_s``; the message names the minimum,
            rounded up to whole minutes.
    """
    needed_s = cost_s + reserve_s
    if total_s >= needed_s:
        return
    minimum = f"{max(1, math.ceil(needed_s / 60.0))}m"
    raise ConfigError(
        f"{name} {format_duration(total_s)} is shorter than one trial (about {format_duration(needed_s)}: "
        "restart, warm-up, measure and stress phases)",
        hint=f'set total = "{minimum}" or more in [budget], or pass --budget {minimum}' if name.startswith("[")
        else f"give at least {name} {minimum}",
    )


class TrialCostEstimate(BaseModel):
    """What the next trial is expected to cost.

    Attributes:
        seconds: Expected wall-clock seconds of one trial (restart, probe, load phases, record).
        source: ``history`` (from trials already run) or ``prior`` (from the configured timeouts).
        samples: How many past trials the estimate rests on.
    """

    model_config = ConfigDict(frozen=True)

    seconds: float
    source: str
    samples: int


class Budget:
    """A wall-clock budget that started when the run started.

    Args:
        total_s: The whole budget in seconds, or ``None`` for no time limit (``--trials`` only).
        reserve_s: Seconds kept back at the end for restoring the service.
        clock: A monotonic clock in seconds (injectable for tests).
    """

    def __init__(
        self,
        total_s: float | None,
        *,
        reserve_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_s = total_s
        self.reserve_s = reserve_s
        self._clock = clock
        self._started = clock()

    def elapsed_s(self) -> float:
        """Seconds since the run started."""
        return self._clock() - self._started

    def remaining_s(self) -> float:
        """Seconds left for trials (budget minus elapsed minus the restore reserve); inf if unbounded."""
        if self.total_s is None:
            return float("inf")
        return self.total_s - self.elapsed_s() - self.reserve_s

    @staticmethod
    def estimate(durations_s: Sequence[float], prior_s: float) -> TrialCostEstimate:
        """Estimate the cost of the next trial from past trial durations.

        Uses the upper of the median and the mean of the last five full trials, so one slow
        restart raises the estimate but one quick failure does not lower it much. A trial that
        failed at startup costs less than a measured one; those short ones are ignored once
        longer ones exist.

        Args:
            durations_s: Durations of finished trials in this study and this environment, in order.
            prior_s: The estimate to use with no history (start timeout share plus load phases).

        Returns:
            The estimate and its source.
        """
        usable = [d for d in durations_s if d and d > 0]
        if not usable:
            return TrialCostEstimate(seconds=prior_s, source="prior", samples=0)
        longest = max(usable)
        full = [d for d in usable if d >= 0.5 * longest][-5:]
        seconds = max(statistics.median(full), statistics.fmean(full))
        return TrialCostEstimate(seconds=seconds, source="history", samples=len(full))

    def require_one(self, cost_s: Callable[[], float], config: TunerConfig) -> None:
        """:func:`require_one_trial` of this budget, at the next trial's estimated ``cost_s()`` (s),
        named as :func:`budget_name` says; an unbounded budget is not checked.

        Raises:
            ConfigError: The budget is shorter than one trial and the restore reserve.
        """
        if self.total_s is not None:
            require_one_trial(self.total_s, cost_s(), reserve_s=self.reserve_s, name=budget_name(config, self.total_s))

    def fits(self, cost_s: float) -> bool:
        """Whether a trial expected to take ``cost_s`` seconds can finish inside the budget."""
        return cost_s <= self.remaining_s()

    def trials_left(self, cost_s: float) -> int | None:
        """About how many more trials of ``cost_s`` fit (``None`` when the budget is unbounded)."""
        remaining = self.remaining_s()
        if remaining == float("inf"):
            return None
        return max(0, int(remaining // max(cost_s, 1e-9)))
