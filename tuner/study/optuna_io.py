"""The Optuna side of a study (public API only): sampler, open, tell, resume, attributes.

Two objectives, both maximized: ``values = [context_capacity, output_throughput]``. Constraints
(feasible when every value ≤ 0) follow :data:`tuner.records.CONSTRAINT_NAMES` and are stored with
Optuna 5's ``trial.set_constraint``, which every constrained sampler (TPE, NSGA-II) reads. A failed start or a runtime OOM is told
as COMPLETE with a violated constraint, never FAIL: every Optuna sampler ignores FAIL trials, so an
OOM config told as FAIL would be sampled again. A candidate proved infeasible by an earlier failure
is told as PRUNED with the reason and the proving trial, without a restart.

Every trial's :class:`~tuner.records.TrialRecord` is the JSON user attribute
:data:`~tuner.records.RECORD_ATTR`; study-level facts (:class:`~tuner.records.StudyInfo`) are the
study user attribute :data:`~tuner.records.STUDY_ATTR`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import optuna
from optuna.samplers import BaseSampler, NSGAIISampler, PartialFixedSampler, RandomSampler, TPESampler
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.exc import SQLAlchemyError

from tuner.errors import StudyError
from tuner.records import RECORD_ATTR, STUDY_ATTR, Constraints, StudyInfo, TrialRecord
from tuner.sglang.failures import FailureClass
from tuner.study.space import Space, suggest_param

__all__ = [
    "DIRECTIONS",
    "METRIC_NAMES",
    "ENVIRONMENT_KEYS",
    "KIND_ATTR",
    "SPACE_ATTR",
    "PREDICTION_ATTR",
    "ENVIRONMENT_ATTR",
    "PHASE_ATTR",
    "open_study",
    "name_objectives",
    "make_sampler",
    "constraints_of",
    "record_of",
    "study_info",
    "save_study_info",
    "ensure_study_info",
    "check_environment",
    "environment_binds",
    "records",
    "tell_record",
    "fail_trial",
    "set_baseline_params",
    "is_complete",
    "HOST_ATTR",
    "REPEAT_ATTR",
    "LATE_ATTR",
]

DIRECTIONS: tuple[Literal["minimize", "maximize"], ...] = ("maximize", "maximize")
"""Context capacity (requests of the workload's context length), output throughput (tok/s)."""
METRIC_NAMES = ("context capacity (requests)", "output throughput (tok/s)")
"""The objectives' names as Optuna stores them (``study.set_metric_names``): what optuna-dashboard
shows instead of "Objective 0/1"."""
ENVIRONMENT_KEYS = ("sglang_version", "gpu_name", "gpu_count", "driver_version", "model")
"""The environment facts a study refuses to mix (:func:`check_environment`)."""
KIND_ATTR = "tuner.kind"
"""User attribute set by ``enqueue_trial`` so an enqueued trial knows why it was enqueued."""

SPACE_ATTR = "tuner.space"
"""Study user attribute holding the resolved :class:`tuner.study.space.Space` (stable across resumes)."""
PREDICTION_ATTR = "tuner.prediction"
"""Trial user attribute (set when enqueued): the planner's prediction for the candidate."""
ENVIRONMENT_ATTR = "tuner.environment"
"""Trial user attribute: the SGLang version, GPU, driver and model the trial ran on."""
PHASE_ATTR = "tuner.phase"
"""Trial user attribute: the phase the trial is in now (``render``, ``start``, ``probe``, ``measure``,
``stress``, ``record``), set as each phase starts, so a reader of a RUNNING trial sees it."""
HOST_ATTR = "tuner.host"
"""Trial user attribute: the host name that ran (or runs) the trial (:mod:`tuner.study.hosts`)."""
REPEAT_ATTR = "tuner.repeat_of"
"""Trial user attribute: the trial a deliberate re-measurement repeats (the noise)."""
LATE_ATTR = "tuner.stored_late_for"
"""Trial user attribute: the trial (marked FAIL by another host while this one was cut off from the
database) whose result this trial stores."""

_log = logging.getLogger(__name__)


def constraints_of(record: TrialRecord) -> dict[str, float]:
    """The constraint values Optuna is told for a record, by :data:`CONSTRAINT_NAMES` (≤ 0 holds;
    :class:`tuner.records.Constraints`: one never measured counts as violated)."""
    return Constraints.of(record.constraints).values()


def make_sampler(kind: str, seed: int) -> BaseSampler:
    """The sampler of the study.

    Args:
        kind: ``tpe`` (multivariate multi-objective TPE with constraints and the constant liar for
            trials running on other hosts), ``nsga2`` or ``random``.
        seed: Sampler seed.
    """
    if kind == "random":
        return RandomSampler(seed=seed)
    if kind == "nsga2":
        return NSGAIISampler(seed=seed, population_size=8)
    # constant_liar: trials RUNNING on other hosts count as bad results while they run, so
    # hosts sharing a study do not all sample the same region (no effect with one host).
    return TPESampler(
        seed=seed,
        multivariate=True,
        n_startup_trials=4,
        constant_liar=True,
    )


def open_study(name: str, storage: BaseStorage, sampler: BaseSampler) -> optuna.Study:
    """Create the study, or load it when it exists (a resumed run).

    Raises:
        StudyError: The storage holds a study of that name with other directions.
    """
    try:
        study = optuna.create_study(
            study_name=name,
            storage=storage,
            sampler=sampler,
            directions=list(DIRECTIONS),
            load_if_exists=True,
        )
    except (SQLAlchemyError, ValueError) as err:
        raise StudyError(
            f"study {name!r} cannot be opened: {str(err).splitlines()[0]}",
            hint="choose another [study] name or storage url",
        ) from err
    if [d.name.lower() for d in study.directions] != list(DIRECTIONS):
        raise StudyError(
            f"study {name!r} exists with other objectives",
            hint="choose another [study] name; a tuner study maximizes capacity and throughput",
        )
    name_objectives(study)
    return study


def name_objectives(study: optuna.Study) -> bool:
    """Give a tuner study's two objectives their names (:data:`METRIC_NAMES`) when they have none
    (a study written before names were set, too). A write to the storage.

    Returns:
        Whether the names were set now.
    """
    if study.metric_names is not None or len(study.directions) != len(METRIC_NAMES):
        return False
    with warnings.catch_warnings():  # experimental since Optuna 3.2; stable in use, not worth a line
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(list(METRIC_NAMES))
    return True


def study_info(study: optuna.Study) -> StudyInfo | None:
    """The stored :class:`StudyInfo`, or ``None`` for a new study."""
    data = study.user_attrs.get(STUDY_ATTR)
    return StudyInfo.model_validate(data) if data else None


def save_study_info(study: optuna.Study, info: StudyInfo) -> None:
    """Store :class:`StudyInfo` as the study user attribute :data:`STUDY_ATTR`."""
    study.set_user_attr(STUDY_ATTR, info.model_dump(mode="json"))


def ensure_study_info(study: optuna.Study, new: StudyInfo, *, allow_mixed: bool) -> StudyInfo:
    """The study's stored :class:`StudyInfo` after checking ``new.environment`` against it
    (:func:`check_environment`), or ``new``, stored, for a new study.

    Raises:
        StudyError: The environment differs and ``allow_mixed`` is false.
    """
    info = study_info(study)
    if info is None:
        save_study_info(study, new)
        return new
    if not environment_binds(study):
        if info.environment != new.environment:
            _log.info("the study's trials never started a server: its environment is now this run's")
            info = info.model_copy(update={"environment": new.environment})
            save_study_info(study, info)
        return info
    check_environment(info.environment, new.environment, allow_mixed=allow_mixed)
    return info


def environment_binds(study: optuna.Study) -> bool:
    """Whether the study's stored environment binds later runs: a trial measured a server, or
    read what a started server resolved (its pool). A study whose trials all failed before a
    server reported anything (a typo in the model path) measured nothing in that environment, so
    the run that fixes the typo adopts its own (operator review 2, R3)."""
    return any(record.outcome == "ok" or record.resolved for _, record in records(study))


def check_environment(
    stored: dict[str, Any], current: dict[str, Any], *, allow_mixed: bool
) -> None:
    """Refuse to add trials from another environment to a study.

    Args:
        stored: The study's environment (:attr:`StudyInfo.environment`).
        current: This run's environment.
        allow_mixed: ``--allow-mixed-environment``: only log the difference.

    Raises:
        StudyError: A key of :data:`ENVIRONMENT_KEYS` differs and ``allow_mixed`` is false.
    """
    for key in ENVIRONMENT_KEYS:
        old, new = stored.get(key), current.get(key)
        if old is not None and new is not None and old != new:
            if allow_mixed:
                _log.warning("environment %s changed from %r to %r (allowed)", key, old, new)
                continue
            raise StudyError(
                f"study environment {key} was {old!r}, this run has {new!r}",
                hint="use a new [study] name, or pass --allow-mixed-environment",
            )


def record_of(trial: FrozenTrial) -> TrialRecord | None:
    """The trial's record, or ``None`` when it has none (interrupted before the first write)."""
    data = trial.user_attrs.get(RECORD_ATTR)
    return TrialRecord.model_validate(data) if data else None


def records(study: optuna.Study) -> list[tuple[FrozenTrial, TrialRecord]]:
    """Finished trials (COMPLETE or PRUNED) that carry a record, in trial order."""
    out = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        record = record_of(trial)
        if record is not None:
            out.append((trial, record))
    return out


def tell_record(study: optuna.Study, trial: optuna.Trial, record: TrialRecord) -> FrozenTrial:
    """Store ``record`` on ``trial`` and tell Optuna the outcome.

    Skipped trials (``outcome == "skipped"``) and budget stops are told as PRUNED; everything else
    as COMPLETE with ``values = [objective capacity or 0, output_throughput_tok_s or 0]`` (the
    capacity ``[objective] capacity`` names: :attr:`tuner.records.TrialRecord.objective_capacity`,
    the SLO-safe one where an SLO is set), so a failed
    start is a COMPLETE trial with a violated ``oom_or_crash`` constraint.

    Args:
        study: The study.
        trial: The running trial from ``study.ask()``.
        record: The finished record (constraints filled).

    Returns:
        The finished trial.
    """
    trial.set_user_attr(RECORD_ATTR, record.model_dump(mode="json"))
    with warnings.catch_warnings():
        # A tell cut short (kill -9 inside the write, replayed from the result journal) set some
        # already, from the same record: Optuna keeps those and would warn once per constraint.
        warnings.filterwarnings("ignore", message="The constraint value is ignored because this constraint")
        for name, value in constraints_of(record).items():
            trial.set_constraint(name, value)
    if record.outcome in ("skipped", "budget"):
        frozen = study.tell(trial, state=TrialState.PRUNED)
    else:
        values = [float(record.objective_capacity or 0), float(record.output_throughput_tok_s or 0.0)]
        frozen = study.tell(trial, values)
    return frozen


def fail_trial(study: optuna.Study, trial: optuna.Trial, partial: TrialRecord, *, requeue: bool) -> None:
    """Store an interrupted trial's partial record and tell it FAIL; enqueue its params again.

    Args:
        study: The study.
        trial: The running trial.
        partial: What is known (``outcome="failed"``, the interruption as evidence).
        requeue: Enqueue the trial's params so the next run measures them.
    """
    trial.set_user_attr(RECORD_ATTR, partial.model_dump(mode="json"))
    study.tell(trial, state=TrialState.FAIL)
    if requeue:
        study.enqueue_trial(dict(trial.params), user_attrs={KIND_ATTR: "enqueued"})


def is_complete(record: TrialRecord) -> bool:
    """Whether a RUNNING trial's record is a finished measurement (what :func:`tell_record` stores).

    Partial records (an interruption, a service that could not be changed, a lost journal: what
    :func:`fail_trial` stores) carry no constraints or say the journal was lost; a finished one
    always has its constraints filled.
    """
    return bool(record.constraints) and record.duration_s is not None and (
        record.failure_class is not FailureClass.JOURNAL_UNREADABLE
    )


def set_baseline_params(trial: optuna.Trial, space: Space, params: Mapping[str, Any]) -> None:
    """Record the baseline's resolved knobs as the Optuna params of its (running) trial.

    Through Optuna's public API: the study's sampler is swapped for a
    :class:`~optuna.samplers.PartialFixedSampler` fixed at those values while each knob is
    suggested, then put back. Knobs outside the space (:meth:`Space.contains`) are left out.
    """
    study = trial.study
    fixed = {name: params[name] for name in space.distributions() if space.contains(name, params.get(name))}
    if not fixed:
        return
    sampler = study.sampler
    with warnings.catch_warnings():  # experimental in name only since Optuna 2.4; its interface is public
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.sampler = PartialFixedSampler(fixed, sampler)
    try:
        for name, dist in space.distributions().items():
            if name in fixed:
                suggest_param(trial, name, dist)
    finally:
        study.sampler = sampler
