"""The run's stop rules: each one small object, asked in one place (Optuna's ``MaxTrialsCallback``, GuideLLM's constraints).

Before each decision the run asks its rules in order (:func:`first_stop`): the trial cap
(:class:`TrialCap`), the budget (:class:`BudgetLeft`) and the maintenance window (:class:`Window`,
which may wait for the window to open). The streak rules count what happens between launches
(:class:`Streaks`): the sampler's draws of configs known already, new skips with no launch of
any host between them, and launches rejected as ``invalid_arguments``. Each rule answers with a
:class:`Stop` (the reason :attr:`tuner.study.progress.RunSummary.stop_reason` stores and a line
saying why) or ``None``; the loop (:class:`tuner.study.loop.StudyRun`) stops on the first one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from tuner.config import TunerConfig
from tuner.errors import StudyError
from tuner.records import TrialRecord
from tuner.sglang.failures import FailureClass
from tuner.study.budget import Budget, restore_cost_s
from tuner.study.progress import RunProgress
from tuner.study.record import launch_stopped
from tuner.study.storage import show_command
from tuner.units import MaintenanceWindow, format_duration

__all__ = ["MAX_INVALID_IN_A_ROW", "MAX_REPEATS_IN_A_ROW", "MAX_SKIPS_IN_A_ROW", "Stop", "StopRule", "TrialCap",
           "BudgetLeft", "Window", "Streaks", "first_stop", "require_a_stop", "restored_text"]

MAX_INVALID_IN_A_ROW = 3
"""Launched trials failing with ``invalid_arguments`` one after another that stop the run: the
command itself is wrong (or the environment), not the candidate."""
MAX_REPEATS_IN_A_ROW = 200
"""The sampler's draws in a row of configs measured or skipped already (no launch and no new
skip between them) after which the search counts as exhausted: it finds nothing new in the
space. Skips of new configs do not count: a sampler exploring below the capacity band is not
done (with four hosts, 200 skips in a row happened mid-study)."""
MAX_SKIPS_IN_A_ROW = 50
"""New skips in a row (configs skipped without a restart, each stored once) with no launch
between them, on any host of the study, after which the run stops as exhausted: the planner
has nothing left and every config the sampler draws is proved or predicted not worth a
restart. This is the rule that bounds skips, so the trial cap (``--trials``) counts launches
only. Why 50: with a bound of 100, the decision trace's studies (``tests/study/golden/
decision-trace.txt``, 36 studies at 20 launches) made 33 launches after 50 or more new skips in a
row, and by their figures one changed the chosen best (the planner now proposes that config at
launch 5); the trace was 7.2k lines and 4 CPU minutes, 3.5k and 2 with 50. Without the rule,
studies whose useful configs were spent drew thousands of new skips (every fraction step × chunk
× slot count the screens refuse) before :data:`MAX_REPEATS_IN_A_ROW` stopped them."""


@dataclass(frozen=True)
class Stop:
    """Why a run stops.

    Attributes:
        reason: ``trials``, ``budget``, ``window`` or ``exhausted`` (:attr:`tuner.study.progress.RunSummary.stop_reason`).
        detail: A line saying why (empty where the reason says it all).
    """

    reason: str
    detail: str = ""


class StopRule(Protocol):
    """A rule asked before each decision: a :class:`Stop`, or ``None`` to go on."""

    def check(self) -> Stop | None:
        """Whether the run stops now."""


def first_stop(rules: Iterable[StopRule]) -> Stop | None:
    """The first rule's :class:`Stop`, in order (a later rule is not asked)."""
    return next((stop for rule in rules if (stop := rule.check()) is not None), None)


def require_a_stop(budget_s: float | None, max_trials: int | None) -> None:
    """A run needs a budget or a trial cap (the other stop rules may never fire).

    Raises:
        StudyError: Neither is given.
    """
    if budget_s is None and max_trials is None:
        raise StudyError("no --budget and no --trials given", hint="pass e.g. --budget 4h or --trials 20")


class TrialCap:
    """``--trials``: launches in this run (restarts; a skip costs none and does not count).

    Args:
        max_trials: The cap (``None``: none).
        launched: This run's launches so far.
    """

    def __init__(self, max_trials: int | None, launched: Callable[[], int]) -> None:
        self.max_trials = max_trials
        self.launched = launched

    def check(self) -> Stop | None:
        """``trials`` once the cap is reached."""
        return Stop("trials") if self.max_trials is not None and self.launched() >= self.max_trials else None


class BudgetLeft:
    """``--budget``: room for one more trial of the estimated cost (:meth:`tuner.study.budget.Budget.fits`).

    Args:
        budget: The run's budget.
        cost_s: The next trial's estimated cost (s).
    """

    def __init__(self, budget: Budget, cost_s: Callable[[], float]) -> None:
        self.budget = budget
        self.cost_s = cost_s

    def check(self) -> Stop | None:
        """``budget`` when the next trial does not fit."""
        return None if self.budget.fits(self.cost_s()) else Stop("budget")


class Window:
    """``[service] window``: whether the next trial may start now.

    It may when the window is open and the trial's estimated cost plus the final restore's
    (:func:`tuner.study.budget.restore_cost_s`) end before it closes, so no restart (the trial's nor
    the restore's) falls outside it. Otherwise the run waits for the next opening
    (``outside_window = "wait"``, the budget holding the wait and a trial, the window long enough
    for both) or stops as ``window``; a progress line says which.

    Args:
        config: The config (its ``[service] window`` and ``outside_window``; the restore's cost).
        budget: The run's budget (the wait must fit it).
        cost_s: The next trial's estimated cost (s).
        progress: Where the line goes.
        sleep: Waits (s); injectable.
    """

    def __init__(self, config: TunerConfig, budget: Budget, cost_s: Callable[[], float], progress: RunProgress,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config
        self.budget = budget
        self.cost_s = cost_s
        self.progress = progress
        self.sleep = sleep

    def check(self) -> Stop | None:
        """``None`` when the window is open for a trial and the restore (or once it opened after a
        wait), else ``window`` after the line saying why."""
        service = self.config.service
        if service.window is None:
            return None
        window = MaintenanceWindow.parse(service.window)
        now = datetime.now()
        trial_s, restore_s = self.cost_s(), restore_cost_s(self.config)
        left_s = window.seconds_until_close(now)
        if left_s >= trial_s + restore_s:
            return None
        if left_s > 0:
            where = (f"the maintenance window {window.text} (local time) closes in {format_duration(left_s)}, before the "
                     f"next trial (about {format_duration(trial_s)}) and the final restore (about "
                     f"{format_duration(restore_s)}) would end")
            wait_s = left_s + window.seconds_until_open(now + timedelta(seconds=left_s + 1)) + 1
        else:
            where = f"outside the maintenance window {window.text} (local time)"
            wait_s = window.seconds_until_open(now)
        fits = window.length_s() >= trial_s + restore_s
        if service.outside_window == "wait" and fits and self.budget.fits(wait_s + trial_s):
            self.progress.note(None, f"{where}: waiting {format_duration(wait_s)} until it opens; no restart before",
                               phase="waiting")
            self.sleep(wait_s)
            return None
        why = ("[service] outside_window = \"stop\"" if service.outside_window == "stop"
               else f"the window ({format_duration(window.length_s())}) is shorter than a trial and the restore" if not fits
               else f"the budget does not hold the {format_duration(wait_s)} until it opens and a trial")
        self.progress.note(None, f"{where} ({why}): stopping, no restart started")
        return Stop("window")


@dataclass
class Streaks:
    """The counts in a row that stop a run, and their rules.

    Attributes:
        invalid: Launches in a row that failed ``invalid_arguments`` (:data:`MAX_INVALID_IN_A_ROW`).
        repeats: Sampler draws in a row of configs measured or skipped already, with no launch and
            no new skip between them (:data:`MAX_REPEATS_IN_A_ROW`).
        skips: New skips in a row with no launch of any host between them (:data:`MAX_SKIPS_IN_A_ROW`).
        launched_seen: The study's launched trials (every host's) when ``skips`` last counted.
    """

    invalid: int = 0
    repeats: int = 0
    skips: int = 0
    launched_seen: int = 0

    def repeat(self) -> Stop | None:
        """A draw of a config measured or skipped already: ``exhausted`` at :data:`MAX_REPEATS_IN_A_ROW`."""
        self.repeats += 1
        if self.repeats >= MAX_REPEATS_IN_A_ROW:
            return Stop("exhausted", f"the sampler drew {self.repeats} configs in a row that were measured "
                                     "or skipped already: nothing new in the space")
        return None

    def skip(self, launched: int) -> Stop | None:
        """A new skip, with ``launched`` the study's launched trials (every host's) now: a change
        since the last skip starts the count again (another host's result may open new configs);
        ``exhausted`` at :data:`MAX_SKIPS_IN_A_ROW`."""
        self.repeats = 0
        if launched != self.launched_seen:
            self.launched_seen, self.skips = launched, 0
        self.skips += 1
        if self.skips >= MAX_SKIPS_IN_A_ROW:
            return Stop("exhausted", f"{self.skips} new configs in a row were skipped without a restart "
                                     "(proved or predicted not worth one) and no host launched one: nothing left "
                                     "worth a launch")
        return None

    def launch(self) -> None:
        """A launch of this run: the draw and skip counts start again."""
        self.repeats = self.skips = 0

    def check(self, number: int, record: TrialRecord, config: TunerConfig, url: str) -> None:
        """Launch ``number``'s ``record`` (:meth:`result`), of the study stored at ``url``.

        Raises:
            StudyError: :data:`MAX_INVALID_IN_A_ROW` launches in a row were rejected as
                ``invalid_arguments``, quoting the server's reason and the ``tuner show`` command that
                has the log.
        """
        if self.result(record):
            raise launch_stopped(f"{self.invalid} trials in a row (the last {number}) were rejected as invalid_arguments",
                                 record, fix="the [space]", show=show_command(config, url, number))

    def result(self, record: TrialRecord) -> bool:
        """A launch's record: whether :data:`MAX_INVALID_IN_A_ROW` launches in a row were rejected as
        ``invalid_arguments`` (the loop then raises, quoting the server)."""
        invalid = record.outcome == "failed" and record.failure_class is FailureClass.INVALID_ARGUMENTS
        self.invalid = self.invalid + 1 if invalid else 0
        return self.invalid >= MAX_INVALID_IN_A_ROW


def restored_text(config: TunerConfig, when: datetime) -> str:
    """How the run's final restore ended, for :attr:`RunSummary.service`: ``restored to its
    original flags``, and under ``[service] window`` the time it ended (``when``, local) and whether
    inside the window or how long after it closed (a trial that ran past its estimate)."""
    text = "restored to its original flags"
    if config.service.window is None:
        return text
    window = MaintenanceWindow.parse(config.service.window)
    late_s = window.seconds_since_close(when)
    if late_s <= 0:
        return f"{text} at {when:%H:%M:%S}, inside the maintenance window {window.text}"
    return (f"{text} at {when:%H:%M:%S}, {format_duration(late_s)} after the maintenance window {window.text} "
            "closed (the last trial ran past its estimate)")
