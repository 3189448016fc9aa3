"""What a run tells while it works: progress events, the launch estimate, and the run's summary.

The loop reports each step of a run to a :class:`RunProgress` (one hook per lifecycle step, the
shape of GuideLLM's ``BenchmarkerProgress``: a trial starts, a phase begins or advances, a trial
ends, a config is skipped, a note, the stop); it turns them into :class:`Progress` events for the
CLI's live line and ``tuner run --json-progress`` (one JSON object per event), with the launch
count, the estimate of launches to come and the budget left.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tuner.config import ObjectiveSection
from tuner.records import TrialRecord
from tuner.study.best import BestChoice, best_by
from tuner.study.budget import Budget
from tuner.study.job import PhaseProgress, TrialJob

__all__ = ["Progress", "RunSummary", "RunProgress", "describe", "result_fields"]


class Progress(BaseModel):
    """A progress event for the CLI (and ``tuner run --json-progress``, one JSON object per event).

    Attributes:
        event: ``trial_start``, ``phase`` (a phase begins or advances), ``trial_end``, ``skip``,
            ``stop``, ``note`` (a decision worth a line, e.g. whether the hierarchical cache is
            searched and why).
        number: Trial number (Optuna); ``None`` for a note about the shared study (waiting for
            another host's baseline, another host's dead trial reaped).
        kind: ``baseline``, ``predicted``, ``sampled`` or ``enqueued`` (trial events).
        index: This run's trial count so far (1-based; skips included).
        launch: This run's launches (restarts) so far, the one in flight included.
        expected: About how many launches this run will make in all (``None``: unbounded): from
            the budget left and the study's measured trial costs, recomputed only when a trial
            starts, ends or is skipped (never mid-trial), and never below ``launch``.
        flags: The tuned flags of the trial under test (SGLang field names; empty for the
            baseline before it resolved them).
        phase: The current phase (``render``, ``start``, ``probe``, ``measure``, ``stress``, ``record``).
        detail: How far the phase has come (:class:`PhaseProgress`), when the runner says.
        eta_s: Seconds left in the budget.
        message: One line for the user.
        result: ``trial_end``: the trial's figures (:func:`result_fields`); ``skip``:
            ``{"skipped_reason": ...}``; else ``None``.
    """

    model_config = ConfigDict(frozen=True)

    event: str
    number: int | None = None
    kind: str | None = None
    index: int = 0
    launch: int = 0
    expected: int | None = None
    flags: dict[str, Any] = Field(default_factory=dict)
    phase: str | None = None
    detail: PhaseProgress | None = None
    eta_s: float | None = None
    message: str = ""
    result: dict[str, Any] | None = None


class RunSummary(BaseModel):
    """What a run did and found.

    Attributes:
        study_name: The study.
        storage_url: Where it is stored.
        trials_run: Trials launched in this run (a restart each).
        trials_skipped: Trials skipped without a restart in this run.
        recovered: Trials a killed run of this host left RUNNING, or another host's trials silent for
            the grace period, marked FAIL (their params re-queued once).
        host: The host name this run recorded on its trials (:func:`tuner.study.hosts.host_name`).
        stop_reason: ``budget``, ``trials``, ``interrupted``, ``exhausted`` or ``window`` (outside
            ``[service] window``, no wait possible or wanted).
        stop_detail: Why, in words, where the reason alone does not say (``exhausted``: which
            streak of the loop stopped it); empty otherwise.
        baseline: The baseline's record (trial number, record).
        best: The chosen best and why (:func:`tuner.study.best.choose_best` under the config's
            ``[objective]``, over every trial of the study).
        elapsed_s: Wall-clock seconds of the run.
        skip_reasons: Skips of this run by reason (:func:`skip_kind` → count).
        service: What the run's end did to the service, in words: ``restored to its original
            flags`` (with, under ``[service] window``, when the restore ended and whether inside
            the window), or ``not restarted: ...`` when the run changed nothing.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    study_name: str
    storage_url: str
    trials_run: int = 0
    trials_skipped: int = 0
    recovered: list[int] = Field(default_factory=list)
    host: str = ""
    stop_reason: str = "exhausted"
    stop_detail: str = ""
    baseline: tuple[int, TrialRecord] | None = None
    best: BestChoice | None = None
    elapsed_s: float = 0.0
    skip_reasons: dict[str, int] = Field(default_factory=dict)
    service: str = ""

    def finish(self, finished: Sequence[tuple[int, TrialRecord]], objective: ObjectiveSection, elapsed_s: float) -> None:
        """The run's end: :attr:`best` chosen from the study's ``finished`` trials by ``objective``'s
        policy (:func:`tuner.study.best.best_by`), and the run's ``elapsed_s`` (s)."""
        self.best = best_by(finished, objective)
        self.elapsed_s = elapsed_s

    def count_skip(self, reason: str) -> None:
        """Count one skip of this run under its :func:`skip_kind`."""
        self.trials_skipped += 1
        kind = skip_kind(reason)
        self.skip_reasons[kind] = self.skip_reasons.get(kind, 0) + 1

    def skips_text(self) -> str | None:
        """``39 skipped without a restart: 31 below the best capacity's band, 8 predicted ...``
        (most frequent first), or ``None`` when nothing was skipped."""
        if not self.trials_skipped:
            return None
        parts = sorted(self.skip_reasons.items(), key=lambda item: (-item[1], item[0]))
        return f"{self.trials_skipped} skipped without a restart: " + ", ".join(f"{n} {kind}" for kind, n in parts)

    @property
    def handled(self) -> int:
        """Trials this run launched or skipped (``--trials`` caps the launched ones: ``trials_run``)."""
        return self.trials_run + self.trials_skipped

    def as_json(self) -> dict[str, Any]:
        """The run's summary for machines (``tuner run --json-progress``'s last object, ``event``
        ``summary``): study, storage (password masked), host, trials_run, trials_skipped,
        recovered, stop_reason, stop_detail, service, elapsed_s, skip_reasons (reason → count), and the baseline and the best as ``{"number": n,
        **result_fields}`` (the best with ``reason`` and ``tied``), ``None`` when there is none."""
        from tuner.study.storage import display_url

        baseline = {"number": self.baseline[0], **result_fields(self.baseline[1])} if self.baseline else None
        best = ({"number": self.best.number, "reason": self.best.reason, "tied": self.best.tied,
                 **result_fields(self.best.record)} if self.best is not None else None)
        return {"study": self.study_name, "storage": display_url(self.storage_url), "host": self.host,
                "trials_run": self.trials_run, "trials_skipped": self.trials_skipped, "recovered": self.recovered,
                "stop_reason": self.stop_reason, "stop_detail": self.stop_detail, "service": self.service,
                "elapsed_s": round(self.elapsed_s, 3), "baseline": baseline,
                "best": best, "skip_reasons": dict(self.skip_reasons)}


SKIP_KINDS: tuple[tuple[str, str], ...] = (
    ("the same config was measured", "measured already"),
    ("the same config is running on host", "running on another host"),
    ("must fail:", "proved to fail by an earlier failure"),
    ("must break the SLO", "proved to break the SLO"),
    ("capacity band of the best", "predicted below the best capacity's band"),
    ("requests this config can change the result with", "predicted more request slots than can change the result"),
    ("more than twice any measured config", "request slots beyond the calibrated range"),
    ("GiB the stress load needs", "predicted too little headroom for the stress load"),
    ("less than any config has survived", "predicted below the least headroom that survived"),
    ("runtime OOM under load implies", "predicted below a runtime OOM's headroom"),
)
"""A skip reason's fixed phrase (the screens' sentences, :mod:`tuner.study.decide.screens`) → the
short name the run's end counts it under."""


def skip_kind(reason: str) -> str:
    """The short name of a skip reason (:data:`SKIP_KINDS`); a sentence no phrase matches is named
    by its words before the first figure (a new screen's reason still groups with its own kind)."""
    for phrase, kind in SKIP_KINDS:
        if phrase in reason:
            return kind
    head = re.split(r"[\d(:;]", reason, maxsplit=1)[0].strip()
    return head[:60] or "other"


class RunProgress:
    """The run's progress listener: hooks for each step, events out, and the launch estimate.

    Args:
        emit: Receives each :class:`Progress` event (the CLI's renderer; ``None``: dropped).
        summary: The run's summary, whose counts (launched, skipped) the events carry.
        budget: The run's budget (the time left, what fits).
        cost_s: The next trial's expected cost in seconds (from the study's measured trials).
        max_trials: The trial cap (``--trials``), or ``None``.
        clock: Monotonic clock in seconds.
    """

    def __init__(self, emit: Callable[[Progress], None] | None, summary: RunSummary, budget: Budget,
                 cost_s: Callable[[], float], *, max_trials: int | None, clock: Callable[[], float]) -> None:
        self._emit = emit or (lambda _p: None)
        self._summary = summary
        self._budget = budget
        self._cost_s = cost_s
        self._max_trials = max_trials
        self._clock = clock
        self._started = clock()
        self._current: TrialJob | None = None
        self._expected: int | None = None

    # ---- hooks -----------------------------------------------------------------------------------

    def trial_start(self, job: TrialJob) -> None:
        """A launch begins (its trial is in flight until :meth:`trial_end`)."""
        self._current = job
        self.estimate()
        self._event("trial_start", job.number, index=self._summary.handled + 1,
                    message=f"trial {job.number} ({job.kind})")

    def phase(self, job: TrialJob, name: str, detail: PhaseProgress | None = None) -> None:
        """A phase of the trial in flight begins (``detail`` None) or advances."""
        self._event("phase", job.number, index=self._summary.handled + 1, phase=name, detail=detail,
                    message=f"trial {job.number}: {name}")

    def trial_end(self, job: TrialJob, record: TrialRecord) -> None:
        """The trial in flight ended and was stored (counted as launched by the caller first)."""
        self._current = None
        self.estimate()
        self._event("trial_end", job.number, index=self._summary.handled, kind=job.kind, flags=record.params,
                    message=describe(job.number, record), result=result_fields(record))

    def trial_aborted(self) -> None:
        """The trial in flight ended without a record (interrupted, the service refused the change)."""
        self._current = None

    def skip(self, number: int | None, params: dict[str, Any], kind: str, text: str) -> None:
        """A config was skipped without a restart (trial ``number``; ``None``: a sampler's draw,
        stored in the background), counted by the caller first."""
        self.estimate()
        what = f"trial {number}" if number is not None else f"a {kind} config"
        self._event("skip", number, kind=kind, flags=params, message=f"{what} skipped: {text}",
                    result={"skipped_reason": text})

    def note(self, number: int | None, message: str, *, phase: str | None = None, in_trial: bool = False) -> None:
        """A decision or a wait worth a line: a ``note`` event, or with ``phase`` (``waiting``,
        ``reaped``) a line for the live phase display (``in_trial``: during a launch)."""
        self._event("phase" if phase else "note", number, phase=phase, message=message,
                    index=self._summary.handled + 1 if in_trial else None)

    def stop(self, reason: str, detail: str = "") -> None:
        """The run stops (``budget``, ``trials``, ``exhausted``; ``detail``: why, in words)."""
        self._event("stop", None, message=f"stopped: {reason}" + (f" ({detail})" if detail else ""))

    # ---- the launch estimate ---------------------------------------------------------------------

    def expected(self) -> int | None:
        """About how many launches this run will make in all (``None``: unbounded), as of the last
        :meth:`estimate` (a trial's start, end or skip): stable during a trial."""
        return self._expected

    def estimate(self) -> int | None:
        """Re-estimate the launches of this run from the budget left and the measured costs.

        A launch costs the larger of the study's estimate (``cost_s``) and this run's wall time
        per launch so far. At a trial's start the trial in flight counts as one and only what fits
        after it is added; at its end, what fits in the budget left. A trial cap (``--trials``,
        which counts launches) bounds it. The result is never below the launches so far (the one
        in flight included).

        Returns:
            The estimate (also kept for :meth:`expected`), ``None`` when unbounded.
        """
        in_flight = 1 if self._current is not None else 0
        done = self._summary.trials_run
        launched = done + in_flight
        cost = self._cost_s()
        if done:
            # What a launch has cost this run in wall time: the trials' own durations plus what
            # lies between them (tell, artifacts, the next ask), so the count does not creep down.
            cost = max(cost, (self._clock() - self._started) / done)
        left = self._budget.trials_left(cost)
        total: int | None
        if left is None:
            total = None
        else:
            after = max(0, int((self._budget.remaining_s() - cost) // max(cost, 1e-9))) if in_flight else left
            total = launched + after
        if self._max_trials is not None:
            cap = max(self._max_trials, launched)
            total = cap if total is None else min(total, cap)
        self._expected = None if total is None else max(total, launched)
        return self._expected

    def _event(self, event: str, number: int | None, *, index: int | None = None, **fields: Any) -> None:
        """Emit one :class:`Progress` event (the trial in flight's kind and flags filled in)."""
        job = self._current
        if job is not None and job.number == number:
            fields.setdefault("kind", job.kind)
            fields.setdefault("flags", dict(job.params))
        launch = self._summary.trials_run + (1 if job is not None else 0)
        self._emit(Progress(event=event, number=number, index=self._summary.handled if index is None else index,
                            launch=launch, expected=self._expected, eta_s=self._budget.remaining_s(), **fields))


def result_fields(record: TrialRecord) -> dict[str, Any]:
    """A finished trial's figures for machines: ``outcome``, ``feasible``, ``failure_class``,
    ``context_capacity`` (requests of ``context_tokens`` tokens), ``token_capacity`` (tokens),
    ``output_throughput_tok_s`` (tokens/s), ``p99_ttft_ms`` and ``p99_itl_ms`` (ms, the measured
    window), ``duration_s`` (s), ``quality`` (the quality gate's verdict: ``reference``, ``same``,
    ``passed``, ``failed``, ``unprobed``; ``None`` when the trial did not reach it);
    ``slo_context_capacity`` (the SLO-safe count, ``None`` where not measured) and
    ``stress_slo_met`` (the stress load's SLO verdict, ``None`` without an SLO)."""
    stress = record.slo_capacity.stress
    return {"outcome": record.outcome, "feasible": record.feasible,
            "slo_context_capacity": record.slo_capacity.contexts,
            "stress_slo_met": stress.met if stress is not None else None,
            "failure_class": record.failure_class.value if record.failure_class is not None else None,
            "context_capacity": record.context_capacity, "context_tokens": record.context_tokens,
            "token_capacity": record.token_capacity, "output_throughput_tok_s": record.output_throughput_tok_s,
            "p99_ttft_ms": record.p99_ttft_ms, "p99_itl_ms": record.p99_itl_ms, "duration_s": record.duration_s,
            "quality": record.quality.status}


def describe(number: int, record: TrialRecord) -> str:
    """One progress line for a finished trial (``trial 3: capacity 12 × 4096 tokens, 812 tok/s, feasible``)."""
    if record.outcome == "failed":
        if record.failure_class is not None:
            return f"trial {number}: failed ({record.failure_class.value})"
        return f"trial {number}: failed: {record.failure_evidence or 'no evidence recorded'}"
    tput = f"{record.output_throughput_tok_s:.0f} tok/s" if record.output_throughput_tok_s is not None else "no load"
    slo = record.slo_capacity
    within = (f" (SLO-safe {'≥ ' if slo.at_least else ''}{slo.contexts})"
              if slo.contexts is not None and slo.limits else "")
    return (
        f"trial {number}: capacity {record.context_capacity}{within} × {record.context_tokens} tokens, {tput}, "
        f"{'feasible' if record.feasible else 'infeasible'}"
    )
