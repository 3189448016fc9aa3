"""What the study hands a trial, and what it needs from whatever runs one (the seam it defines).

The study (:mod:`tuner.study.loop`) never restarts a server itself: it hands a :class:`TrialJob`
to a :class:`TrialRunner` and stores the record it gets back. :class:`tuner.trial.TrialExecutor`
is the runner, on a real (or simulated) server or on the simulator's offline evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import optuna
from pydantic import BaseModel, ConfigDict, Field

from tuner.config import TunerConfig
from tuner.records import Prediction, TrialRecord, now_iso
from tuner.sglang.hicache import HostMemory
from tuner.study.best import probe_floor
from tuner.study.optuna_io import KIND_ATTR, PREDICTION_ATTR, REPEAT_ATTR
from tuner.study.view import StudyView

__all__ = ["TrialJob", "TrialRunner", "PhaseProgress", "job_for", "quality_context"]


class TrialJob(BaseModel):
    """What the runner is asked to do for one trial.

    Attributes:
        number: Optuna trial number.
        kind: ``baseline``, ``predicted``, ``sampled`` or ``enqueued``.
        params: Knobs to set by SGLang field name; empty for the baseline (the argv as it is).
        prediction: The planner's prediction (:class:`tuner.records.Prediction`), stored in the record.
        context_tokens: The context length of context capacity (tokens).
        capacity_floor: Capacity-first fidelity: when the boot probe shows a context capacity
            below this, the full load is skipped (0 = always load).
        started_at: ISO time the trial started.
        repeat_of: The trial this one re-measures (the noise), or ``None``.
        quality_reference: The study's reference answers for the quality gate (``trial``,
            ``digest``, ``token_ids``, ``logprobs``, ``task_accuracy``), or ``None`` (then a trial
            of the baseline's numerics records them).
        quality_probes: The study's earlier quality probes (stored :class:`tuner.records.QualityFacts`):
            a trial with the same numerics reuses one instead of probing again.
    """

    model_config = ConfigDict(frozen=True)

    number: int
    kind: str
    params: dict[str, Any] = Field(default_factory=dict)
    prediction: Prediction = Field(default_factory=Prediction)
    context_tokens: int
    capacity_floor: int = 0
    started_at: str = ""
    repeat_of: int | None = None
    quality_reference: dict[str, Any] | None = None
    quality_probes: list[dict[str, Any]] = Field(default_factory=list)


def job_for(trial: optuna.Trial, view: StudyView, config: TunerConfig, context_tokens: int) -> TrialJob:
    """The job of an asked ``trial``: its kind, prediction and the trial it repeats (its
    attributes), its params suggested on ``view``'s space, the capacity floor of capacity-first
    fidelity (:func:`tuner.study.best.probe_floor`; none for a repeat, which measures the noise)
    and the quality gate's context (:func:`quality_context`)."""
    kind = str(trial.user_attrs.get(KIND_ATTR, "sampled"))
    params = view.space.suggest(trial)
    prediction = Prediction.model_validate(trial.user_attrs.get(PREDICTION_ATTR) or {})
    repeat_of = trial.user_attrs.get(REPEAT_ATTR)
    floor = 0 if repeat_of is not None else probe_floor(view.finished, config.budget.probe_only_below,
                                                        config.objective.capacity)
    return TrialJob(number=trial.number, kind=kind, params=params, prediction=prediction, context_tokens=context_tokens,
                    started_at=now_iso(), capacity_floor=floor, repeat_of=None if repeat_of is None else int(repeat_of),
                    **quality_context(view.finished))


def quality_context(finished: Sequence[tuple[int, TrialRecord]]) -> dict[str, Any]:
    """The quality gate's part of a :class:`TrialJob` from the study's finished trials: the last
    recorded reference and every probe made (one per distinct numerics and probe settings)."""
    reference: dict[str, Any] | None = None
    probes: list[dict[str, Any]] = []
    for number, record in finished:
        facts = record.quality
        if facts.status == "reference" and facts.answers:
            reference = {"trial": number, **facts.answers}
        elif facts.probed and facts.probed_on_trial == number:
            probes.append(facts.stored())
    return {"quality_reference": reference, "quality_probes": probes}


class PhaseProgress(BaseModel):
    """How far a long phase has come (what the runner can tell; every field optional).

    Attributes:
        line: The last SGLang log line of a start (``Load weight end. ...``), ANSI and prefixes stripped.
        stage: The startup stage that line marks (:attr:`tuner.sglang.logs.LogWatcher.phase`).
        requests_done: Requests finished (ok or errored) in a load phase so far.
        requests_expected: Requests the phase is expected to finish (a closed loop's measured
            window holds at least one per client stream; ``None`` when not known).
        elapsed_s: Seconds since the phase began.
        duration_s: The phase's planned length in seconds (``None`` when open-ended).
    """

    model_config = ConfigDict(frozen=True)

    line: str | None = None
    stage: str | None = None
    requests_done: int | None = None
    requests_expected: int | None = None
    elapsed_s: float | None = None
    duration_s: float | None = None


class TrialRunner(Protocol):
    """Runs one trial end to end and returns its record (objectives, constraints, everything)."""

    def environment(self) -> dict[str, Any]:
        """``sglang_version``, ``gpu_name``, ``gpu_count``, ``driver_version``, ``model``, and
        ``gpu_total_mib`` when known."""
        ...

    def target(self) -> dict[str, Any]:
        """``launcher``, ``unit`` or ``command``, ``url``."""
        ...

    def baseline_argv(self) -> list[str]:
        """The command line the service runs before the study."""
        ...

    def prior_cost_s(self) -> float:
        """The cost of one trial in seconds before any history exists."""
        ...

    def host_memory(self) -> HostMemory | None:
        """The host's memory before a launch (``MemAvailable``, the unit's ``MemoryMax``, the host
        pools pinned now), or ``None`` when it cannot be read (then no host-memory check)."""
        ...

    def run(self, job: TrialJob, on_phase: Callable[..., None]) -> TrialRecord:
        """Run ``job``; call ``on_phase(name)`` as each phase starts, and ``on_phase(name,
        PhaseProgress(...))`` as a long phase advances (optional). Never raises for a failed
        server: a failure is a record with ``outcome="failed"``.

        Raises:
            KeyboardInterrupt: Ctrl-C or SIGTERM during the trial.
            ServiceControlError: The service could not be changed; the run must stop.
        """
        ...
