"""The Optuna study: storage, sampler, telling trials, resume, environment tags and "best".

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
import math
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.samplers import BaseSampler, NSGAIISampler, RandomSampler, TPESampler
from optuna.storages import BaseStorage, RDBStorage
from optuna.trial import FrozenTrial, TrialState
from pydantic import BaseModel, ConfigDict
from sqlalchemy.exc import SQLAlchemyError

from tuner.errors import StudyError
from tuner.records import CONSTRAINT_NAMES, RECORD_ATTR, STUDY_ATTR, StudyInfo, TrialRecord

__all__ = [
    "DIRECTIONS",
    "ENVIRONMENT_KEYS",
    "KIND_ATTR",
    "open_storage",
    "open_study",
    "make_sampler",
    "constraints_of",
    "record_of",
    "study_info",
    "save_study_info",
    "check_environment",
    "records",
    "tell_record",
    "recover_interrupted",
    "choose_best",
    "BestChoice",
]

DIRECTIONS = ("maximize", "maximize")
"""Context capacity (requests of the workload's context length), output throughput (tok/s)."""
ENVIRONMENT_KEYS = ("sglang_version", "gpu_name", "gpu_count", "driver_version", "model")
"""The environment facts a study refuses to mix (:func:`check_environment`)."""
KIND_ATTR = "tuner.kind"
"""User attribute set by ``enqueue_trial`` so an enqueued trial knows why it was enqueued."""

_log = logging.getLogger(__name__)


def open_storage(url: str) -> BaseStorage:
    """Open an Optuna storage from a SQLAlchemy URL, creating a SQLite file's folder if needed.

    Args:
        url: ``sqlite:///studies/x.db``, ``postgresql://...``, or ``:memory:`` (in-memory, for
            the offline benchmark).

    Raises:
        StudyError: The database cannot be opened.
    """
    if url == ":memory:":
        return optuna.storages.InMemoryStorage()
    if url.startswith("sqlite:///"):
        from pathlib import Path

        path = Path(url.removeprefix("sqlite:///"))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StudyError(
                f"storage folder {str(path.parent)!r} cannot be created: {err.strerror}",
                hint="set [storage] url to a writable place",
            ) from err
    try:
        return RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {})
    except (SQLAlchemyError, ValueError, ImportError) as err:
        raise StudyError(
            f"storage {url!r} cannot be opened: {str(err).splitlines()[0]}",
            hint="check [storage] url (e.g. sqlite:///studies/demo.db)",
        ) from err


def constraints_of(record: TrialRecord) -> dict[str, float]:
    """The constraint values of a record by :data:`CONSTRAINT_NAMES` (≤ 0 holds).

    A constraint the trial never got to measure counts as violated (1.0).
    """
    return {name: float(record.constraints.get(name, 1.0)) for name in CONSTRAINT_NAMES}


def make_sampler(kind: str, seed: int) -> BaseSampler:
    """The sampler of the study.

    Args:
        kind: ``tpe`` (multivariate multi-objective TPE with constraints), ``nsga2`` or ``random``.
        seed: Sampler seed.
    """
    if kind == "random":
        return RandomSampler(seed=seed)
    if kind == "nsga2":
        return NSGAIISampler(seed=seed, population_size=8)
    return TPESampler(
        seed=seed,
        multivariate=True,
        n_startup_trials=4,
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
    return study


def study_info(study: optuna.Study) -> StudyInfo | None:
    """The stored :class:`StudyInfo`, or ``None`` for a new study."""
    data = study.user_attrs.get(STUDY_ATTR)
    return StudyInfo.model_validate(data) if data else None


def save_study_info(study: optuna.Study, info: StudyInfo) -> None:
    """Store :class:`StudyInfo` as the study user attribute :data:`STUDY_ATTR`."""
    study.set_user_attr(STUDY_ATTR, info.model_dump(mode="json"))


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
    as COMPLETE with ``values = [context_capacity or 0, output_throughput_tok_s or 0]``, so a failed
    start is a COMPLETE trial with a violated ``oom_or_crash`` constraint.

    Args:
        study: The study.
        trial: The running trial from ``study.ask()``.
        record: The finished record (constraints filled).

    Returns:
        The finished trial.
    """
    trial.set_user_attr(RECORD_ATTR, record.model_dump(mode="json"))
    for name, value in constraints_of(record).items():
        trial.set_constraint(name, value)
    if record.outcome in ("skipped", "budget"):
        frozen = study.tell(trial, state=TrialState.PRUNED)
    else:
        values = [float(record.context_capacity or 0), float(record.output_throughput_tok_s or 0.0)]
        frozen = study.tell(trial, values)
    return frozen


def recover_interrupted(study: optuna.Study) -> list[int]:
    """Mark RUNNING trials left by a killed run as FAIL and enqueue their params again.

    Call at the start of a run, before any new trial is asked for. (Only one tuner may drive a
    unit at a time: the launcher's session lock guarantees no RUNNING trial is live.)

    Returns:
        The numbers of the trials that were marked FAIL and re-enqueued.
    """
    recovered = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)  # noqa: SLF001
        if trial.params:
            study.enqueue_trial(dict(trial.params), user_attrs={KIND_ATTR: "enqueued"})
        recovered.append(trial.number)
    return recovered


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
