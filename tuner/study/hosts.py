"""Many hosts, one study: host names, the claim lock, trial heartbeats and the dead-host reaper.

Every host of a fleet runs its own ``tuner run`` against its own local unit, and all of them share
one Optuna study in a PostgreSQL ``RDBStorage`` (SQLite is single-host: Optuna's docs, and
"database is locked" with concurrent writers, optuna/optuna#820). Three things make that safe:

* **Claims.** A host chooses its next config (planner, constant-liar sampler) on its own, then
  checks and claims it in a critical section under a PostgreSQL session-level advisory lock keyed
  on the study (:class:`ClaimLock`): it re-reads the trials, skips the config when another host
  measured it or claimed it first, and otherwise marks the trial with its host before the lock is
  released, so no config is launched twice. Why a lock and not only "ask, re-read, back off": the
  section takes milliseconds against trials of minutes, it adds nothing to Optuna's schema,
  PostgreSQL drops it with the connection of a host that dies (a dead host never holds it), and the
  first claim wins deterministically. A section whose lock's session the server dropped inside it
  (a restart between the read and the claim) is run again (:func:`claim_trial`): another host may
  have held the lock in that gap, and its claim wins.
* **Heartbeats.** Optuna 5 beats only inside ``study.optimize``; the tuner drives trials with
  ask/tell, so :class:`TrialHeartbeat` records the storage's heartbeat for the running trial in a
  thread (``heartbeat_interval``) and, on each beat, runs Optuna's ``fail_stale_trials`` for the
  whole study: a trial whose host stopped beating for ``grace_period`` seconds is marked FAIL by
  whichever host notices first, and the storage's ``heartbeat_stale_trial_callback``
  (:class:`RequeueOnce`, a ``RetryHeartbeatStaleTrialCallback(max_retry=1)``) queues its params
  once more for any host to run.
* **Hosts.** Each trial keeps the host that ran it (user attribute :data:`HOST_ATTR`);
  :func:`host_name` is ``$TUNER_HOST`` or the machine's host name (tests run three "hosts" on one
  machine with distinct ``TUNER_HOST``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import logging
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import optuna
import sqlalchemy
from optuna.storages import BaseStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.exc import SQLAlchemyError

from tuner.errors import StudyError, first_line
from tuner.records import RECORD_ATTR, TrialRecord
from tuner.study.optuna_io import (
    ENVIRONMENT_ATTR,
    ENVIRONMENT_KEYS,
    HOST_ATTR,
    KIND_ATTR,
    constraints_of,
    is_complete,
    record_of,
    study_info,
    tell_record,
)
from tuner.study.outage import db_reason, impatient, is_transient, patiently
from tuner.study.space import config_key

__all__ = [
    "HEARTBEAT_ATTR",
    "HOST_ATTR",
    "HOST_ENV",
    "REQUEUED_ATTR",
    "host_name",
    "is_postgres",
    "rdb_of",
    "heartbeat_interval",
    "same_environment",
    "own_environment",
    "RequeueOnce",
    "study_heartbeat",
    "ClaimLock",
    "Section",
    "claim_trial",
    "Reaped",
    "schema_lock",
    "TrialHeartbeat",
    "storage_of",
    "trial_id",
    "add_record",
    "own",
    "claimed_reason",
    "reap_stale",
    "reaped_text",
    "recover_own",
]

HOST_ENV = "TUNER_HOST"
"""Environment variable overriding the host name (one machine simulating several hosts)."""
HEARTBEAT_ATTR = "tuner.heartbeat"
"""Study user attribute: ``{"interval_s": n, "grace_period_s": m}``, the first host's ``[storage]``
heartbeat settings, which every host of the study uses (:func:`study_heartbeat`)."""
REQUEUED_ATTR = "tuner.requeued_from"
"""User attribute of a re-queued trial: ``{"trial": n, "host": the dead host}``."""
_LOCK_CLASS = 0x53474C54  # "SGLT" (fits an int4): the first key of the advisory lock
_OWN_ATTRS = (RECORD_ATTR, ENVIRONMENT_ATTR, HOST_ATTR)
"""User attributes of a dead trial that describe its own run, not its candidate (not copied)."""

_log = logging.getLogger(__name__)

# The tuner beats itself (ask/tell, not study.optimize): Optuna's notes on that are noise here.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning,
                        message=r".*(heartbeat|fail_stale_trials|RetryHeartbeatStaleTrialCallback).*")
warnings.filterwarnings("ignore", message=r"Heartbeat of storage is supposed to be used with Study\.optimize")


def host_name() -> str:
    """This host's name: ``$TUNER_HOST`` when set, else :func:`socket.gethostname`."""
    return (os.environ.get(HOST_ENV) or "").strip() or socket.gethostname()


def heartbeat_interval(storage: BaseStorage) -> int | None:
    """The storage's heartbeat interval in seconds, or ``None`` when it keeps no heartbeats."""
    getter = getattr(storage, "get_heartbeat_interval", None)
    return getter() if callable(getter) else None


def study_heartbeat(study: optuna.Study, interval_s: int, grace_period_s: int) -> tuple[int, int]:
    """The study's heartbeat interval and grace period in seconds: stored with the study by its
    first host (these values, then), and used by every host that joins it.

    A host that beat every 2 s with a 4 s grace period failed another host's live trial that
    beat every 30 s after 5 s: whether a trial is dead must be judged by one rule per study.
    Call under the schema lock (:func:`schema_lock`) so two first hosts do not both store theirs.
    """
    stored = study.user_attrs.get(HEARTBEAT_ATTR)
    if not isinstance(stored, dict):
        study.set_user_attr(HEARTBEAT_ATTR, {"interval_s": int(interval_s), "grace_period_s": int(grace_period_s)})
        return int(interval_s), int(grace_period_s)
    return int(stored["interval_s"]), int(stored["grace_period_s"])


def same_environment(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Whether two environments agree on every :data:`~tuner.study.optuna_io.ENVIRONMENT_KEYS`
    fact both state (a trial recorded without one counts as the same)."""
    if not a or not b:
        return True
    return all(a.get(k) == b.get(k) for k in ENVIRONMENT_KEYS if a.get(k) is not None and b.get(k) is not None)


def own_environment(study: optuna.Study, environment: Mapping[str, Any]) -> bool:
    """Whether ``environment`` is the study's own (:func:`same_environment` with the one it was
    created in; a study without one: yes), not a host of another environment mixed in."""
    info = study_info(study)
    return info is None or same_environment(info.environment, environment)


def rdb_of(storage: BaseStorage) -> RDBStorage | None:
    """The ``RDBStorage`` behind ``storage`` (a study wraps it in Optuna's cache), or ``None``."""
    backend = getattr(storage, "_backend", storage)
    return backend if isinstance(backend, RDBStorage) else None


def is_postgres(storage: BaseStorage) -> bool:
    """Whether ``storage`` is (or wraps) an ``RDBStorage`` on PostgreSQL (the many-hosts backend)."""
    rdb = rdb_of(storage)
    return rdb is not None and rdb.engine.dialect.name == "postgresql"


class RequeueOnce(RetryHeartbeatStaleTrialCallback):
    """Optuna's retry callback, queueing a dead trial's params once, as an ``enqueued`` trial.

    The copy keeps the candidate (params, distributions, the planner's prediction) and drops what
    described the dead run (its record, environment, host); :data:`REQUEUED_ATTR` names the dead
    trial and its host. A trial re-queued once and dead again is not queued a third time.
    """

    def __init__(self) -> None:
        super().__init__(max_retry=1)

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if not trial.params:
            return  # a baseline that died before its params were stored: the next host measures it anew
        copied = copy.deepcopy(trial)
        attrs = {k: v for k, v in trial.user_attrs.items() if k not in _OWN_ATTRS}
        attrs[KIND_ATTR] = "enqueued"
        attrs[REQUEUED_ATTR] = {"trial": trial.number, "host": trial.user_attrs.get(HOST_ATTR)}
        copied.user_attrs = attrs
        # Optuna's callback copies every system attr: the dead trial's constraints would be the
        # new trial's before it ran ("constraint already set" when it is told).
        copied.system_attrs = {k: v for k, v in trial.system_attrs.items()
                               if k != _CONSTRAINTS_KEY and not k.startswith(f"{_CONSTRAINTS_KEY}:")}
        _log.info("trial %d (host %s) is dead; its params are queued again",
                     trial.number, trial.user_attrs.get(HOST_ATTR))
        super().__call__(study, copied)


def reap_stale(study: optuna.Study) -> list[int]:
    """Mark RUNNING trials whose heartbeat is older than the grace period FAIL (Optuna's
    ``fail_stale_trials``; their params are re-queued once by :class:`RequeueOnce`), and RUNNING
    trials no host claimed (no :data:`HOST_ATTR`, no heartbeat) that started more than the grace
    period ago: a host asked for them and died before its claim, which takes milliseconds.

    Returns:
        The numbers of the trials that were RUNNING before and are FAIL now.
    """
    if heartbeat_interval(storage_of(study)) is None:  # fail_stale_trials reads it too
        return []
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    if not running:
        return []
    optuna.storages.fail_stale_trials(study)
    _fail_unclaimed(study, running)
    still = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    return [t.number for t in running if t.number not in still]


def reaped_text(numbers: Sequence[int], grace_period_s: float) -> str:
    """The line that says :func:`reap_stale` failed other hosts' trials ``numbers`` (``grace_period_s``: the study's)."""
    return (f"trial(s) {list(numbers)} of another host had no heartbeat for {grace_period_s} s: "
            "marked FAIL, params queued again")


def _fail_unclaimed(study: optuna.Study, running: list[FrozenTrial]) -> None:
    """FAIL (and re-queue once) the RUNNING trials no host claimed within the grace period."""
    rdb = rdb_of(storage_of(study))
    interval = heartbeat_interval(storage_of(study))
    if rdb is None or interval is None:
        return
    grace = rdb.grace_period if rdb.grace_period is not None else 2 * interval  # Optuna's own default
    now = datetime.datetime.now()  # Optuna stamps datetime_start with the host's local time
    callback = RequeueOnce()
    for trial in running:
        if HOST_ATTR in trial.user_attrs or trial.datetime_start is None:
            continue
        if (now - trial.datetime_start).total_seconds() <= grace:
            continue
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except (ValueError, RuntimeError, optuna.exceptions.UpdateFinishedTrialError):
            continue  # claimed or reaped by another host meanwhile
        _log.info("trial %d was never claimed by a host (asked %s): marked FAIL", trial.number,
                  trial.datetime_start.isoformat(timespec="seconds"))
        callback(study, trial)


def recover_own(study: optuna.Study, host: str, *, shared: bool) -> list[int]:
    """Finish this host's RUNNING trials a killed run left: keep the measured ones, mark the rest
    FAIL and re-queue their params once.

    Called after this host took its unit's lock, so none of its own trials can be live. On a
    single-host storage (``shared=False``) every RUNNING trial is this host's. Another host's
    RUNNING trial is left to the heartbeat (:func:`reap_stale`): it may be alive. A trial whose
    whole record was stored before the kill (killed inside :func:`~tuner.study.optuna_io.tell_record`,
    between the record and Optuna's finish) is told as ``tell_record`` would have (COMPLETE with
    its values, or PRUNED): measuring it again would cost a restart and change nothing.

    Returns:
        The numbers of the trials marked FAIL.
    """
    callback = RequeueOnce()
    recovered = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial.user_attrs.get(HOST_ATTR)
        if shared and owner != host:
            continue
        record = record_of(trial)
        if record is not None and is_complete(record):
            with warnings.catch_warnings():  # constraints the killed run already set are kept as they were
                warnings.simplefilter("ignore", UserWarning)
                tell_record(study, optuna.trial.Trial(study, trial_id(study, trial.number)), record)
            _log.info("trial %d: its record was stored before the run was killed; kept as measured", trial.number)
            continue
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except (ValueError, RuntimeError, optuna.exceptions.UpdateFinishedTrialError):
            continue  # another host reaped it first
        callback(study, study.get_trials(deepcopy=False)[trial.number])
        recovered.append(trial.number)
    return recovered


@dataclasses.dataclass
class Section:
    """One hold of the claim lock (:meth:`ClaimLock.held`).

    Attributes:
        lost: Set when the hold ends: the lock's database session ended inside it (the server
            restarted, failed over or cut the connection), so the lock was free for a while and
            another host may have held it at the same time. Never set off PostgreSQL.
    """

    lost: bool = False


class ClaimLock:
    """The study's claim lock: one host at a time chooses and creates its next trial.

    On PostgreSQL a session-level advisory lock ``pg_advisory_lock(SGLT, study_id)`` held on one
    pooled connection for the critical section only; elsewhere (SQLite, in-memory: one host) a
    no-op.

    Args:
        storage: The study's storage.
        study_id: The study's id in it.
        timeout_s: How long to wait for another host's critical section (it takes milliseconds;
            a host stopped inside it, e.g. by SIGSTOP, is the only way to wait this long).
        poll_s: Seconds between tries.
    """

    def __init__(self, storage: BaseStorage, study_id: int, *, timeout_s: float = 120.0, poll_s: float = 0.05) -> None:
        rdb = rdb_of(storage)
        self._engine = rdb.engine if rdb is not None and is_postgres(rdb) else None
        self._outage_s = float(getattr(rdb, "outage_s", 0.0))  # a PatientStorage's wait for an outage
        self._study_id = int(study_id)
        self._timeout_s = timeout_s
        self._poll_s = poll_s

    @classmethod
    def of(cls, study: optuna.Study, **options: float) -> ClaimLock:
        """The claim lock of ``study`` (``options``: ``timeout_s``, ``poll_s``)."""
        return cls(storage_of(study), study._study_id, **options)  # noqa: SLF001 - see "Optuna's private attributes"

    @contextlib.contextmanager
    def held(self) -> Iterator[Section]:
        """Hold the lock for a ``with`` block; the :class:`Section` it yields says, once the block
        ends, whether the lock was lost inside it.

        Raises:
            StudyError: The lock was not free within ``timeout_s`` (names the holder), or the
                database failed.
        """
        section = Section()
        if self._engine is None:
            yield section
            return
        keys = {"a": _LOCK_CLASS, "b": self._study_id}
        try:
            conn = patiently(lambda: self._acquire(keys), limit_s=self._outage_s, what="the claim lock")
        except SQLAlchemyError as err:
            raise StudyError(f"the study's claim lock cannot be taken: {first_line(err)}",
                             hint="check that the database server is up") from err
        try:
            yield section
        finally:
            try:  # a server that restarted meanwhile ended the session, and the lock with it
                section.lost = not conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:a, :b)"), keys).scalar()
            except SQLAlchemyError as err:
                if not is_transient(err):
                    raise StudyError(f"the study's claim lock failed: {first_line(err)}",
                                     hint="check that the database server is up") from err
                section.lost = True
            finally:
                conn.close()

    def _acquire(self, keys: dict[str, int]) -> sqlalchemy.Connection:
        """A connection holding the lock (waits up to ``timeout_s`` for another host's section)."""
        assert self._engine is not None
        conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            deadline = time.monotonic() + self._timeout_s
            while not conn.execute(sqlalchemy.text("SELECT pg_try_advisory_lock(:a, :b)"), keys).scalar():
                if time.monotonic() > deadline:
                    raise StudyError(
                        f"another host has held the study's claim lock for over {self._timeout_s:.0f} s "
                        f"({self._holder(conn)})",
                        hint="check that host's tuner (stopped or hung?) and run again",
                    )
                time.sleep(self._poll_s)
        except BaseException:
            conn.close()
            raise
        return conn

    def _holder(self, conn: sqlalchemy.Connection) -> str:
        row = conn.execute(sqlalchemy.text(
            "SELECT a.application_name, a.client_addr, a.pid FROM pg_locks l JOIN pg_stat_activity a "
            "ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.classid = CAST(:a AS oid) AND l.objid = CAST(:b AS oid) "
            "AND l.granted LIMIT 1"), {"a": _LOCK_CLASS, "b": self._study_id}).first()
        if row is None:
            return "holder unknown"
        return f"held by {row[0] or 'a client'} from {row[1] or 'a local socket'}, backend pid {row[2]}"


@contextlib.contextmanager
def schema_lock(url: str, engine_kwargs: dict | None = None, *, timeout_s: float = 120.0) -> Iterator[None]:
    """Serialize opening a study storage on a PostgreSQL server (Optuna's ``CREATE TABLE`` and
    ``create_study`` race when several hosts start at once); a no-op elsewhere.

    Raises:
        SQLAlchemyError, ImportError: The server cannot be reached or its driver is missing (the
            caller maps them).
        StudyError: The lock was not free within ``timeout_s``.
    """
    if not url.startswith("postgresql"):
        yield
        return
    engine = sqlalchemy.create_engine(url, **(engine_kwargs or {}))
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            keys = {"a": _LOCK_CLASS, "b": 0}
            deadline = time.monotonic() + timeout_s
            while not conn.execute(sqlalchemy.text("SELECT pg_try_advisory_lock(:a, :b)"), keys).scalar():
                if time.monotonic() > deadline:
                    raise StudyError(f"another host has held the storage's schema lock for over {timeout_s:.0f} s",
                                     hint="check the other hosts' tuners and run again")
                time.sleep(0.05)
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:a, :b)"), keys)
    finally:
        engine.dispose()


class TrialHeartbeat:
    """Beat for one running trial in a thread, and reap other hosts' dead trials on each beat.

    ``with TrialHeartbeat(study, number):`` records one heartbeat at once (so the trial is never
    without one), then one every ``heartbeat_interval`` seconds until the block ends. Database
    errors in the thread are logged, never raised: a host that cannot beat for the grace period
    has its trial failed by the others, which is the point. A missed beat is logged at INFO; one
    WARNING per streak says when the next miss may let another host fail the trial (the streak
    has reached the grace period less one interval). A shorter streak needs no word: the run's
    own next write reports a failure that lasts (a full disk, a lost server) in one line.

    Args:
        study: The study.
        number: The running trial's number.
        on_reaped: Called with the numbers of other hosts' trials this beat marked FAIL.
    """

    def __init__(self, study: optuna.Study, number: int, *,
                 on_reaped: Callable[[list[int]], None] | None = None) -> None:
        self._study = study
        self._storage = storage_of(study)
        self._trial_id = trial_id(study, number)
        self._on_reaped = on_reaped
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> TrialHeartbeat:
        if heartbeat_interval(self._storage) is None:
            return self
        self._storage.record_heartbeat(self._trial_id)  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{self._trial_id}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30.0)

    def _beat(self) -> None:
        interval = float(heartbeat_interval(self._storage) or 30)
        rdb = rdb_of(self._storage)
        grace = float(rdb.grace_period if rdb is not None and rdb.grace_period is not None else 2 * interval)
        last_beat, warned = time.monotonic(), False
        while not self._stop.wait(interval):
            try:
                with impatient():  # a missed beat is logged; the next one comes in `interval` s
                    self._storage.record_heartbeat(self._trial_id)  # type: ignore[attr-defined]
                    reaped = reap_stale(self._study)
            except Exception as err:  # noqa: BLE001 - never kill the trial for a missed beat
                silent = time.monotonic() - last_beat
                _log.info("heartbeat of trial id %d not recorded: %s", self._trial_id, db_reason(err))
                if not warned and silent >= grace - interval:
                    warned = True
                    _log.warning("heartbeat of trial id %d not recorded for %.0f s of the storage's %.0f s grace "
                                 "period: another host may mark the trial FAIL (%s)", self._trial_id, silent,
                                 grace, db_reason(err))
                continue
            last_beat, warned = time.monotonic(), False
            if reaped and self._on_reaped is not None:
                self._on_reaped(reaped)


_CONSTRAINTS_KEY = "constraints"
"""Optuna's system attrs of a trial's constraints: ``constraints`` (the values, when told) and one
``constraints:<name>`` per ``Trial.set_constraint`` (``optuna.samplers._base._CONSTRAINTS_KEY``)."""

# ---- Optuna's private attributes --------------------------------------------------------------
# The one place the tuner reaches into Optuna's ``Study``: many hosts need a trial's storage id
# (heartbeats are recorded per trial id, ``RDBStorage.record_heartbeat``) and one-write trial
# creation that returns the new trial (``Study.add_trial`` returns nothing), and Optuna 5 exposes
# neither the storage nor the study id on ``Study`` (``study._storage``, ``study._study_id``).


def storage_of(study: optuna.Study) -> BaseStorage:
    """The storage ``study`` was opened on (Optuna's private ``Study._storage``)."""
    return study._storage  # noqa: SLF001 - see the comment above


def trial_id(study: optuna.Study, number: int) -> int:
    """The storage id of ``study``'s trial ``number`` (heartbeats are keyed on it)."""
    return storage_of(study).get_trial_id_from_study_id_trial_number(study._study_id, number)  # noqa: SLF001


def add_record(study: optuna.Study, params: Mapping[str, Any], distributions: Mapping[str, Any],
               record: TrialRecord, user_attrs: Mapping[str, Any]) -> int:
    """Store a finished trial in one write: a proposal skipped without a restart (the sampler's,
    stored in the background), or a result whose trial another host failed meanwhile.

    The same trial :func:`~tuner.study.optuna_io.tell_record` makes of an asked one (the record,
    the constraints, PRUNED for a skip, COMPLETE with the values otherwise), made with
    ``optuna.trial.create_trial`` and the storage's ``create_new_trial`` (one transaction instead
    of one per param and attribute: on a shared PostgreSQL study a skip costs one round trip).

    Args:
        study: The study.
        params: Optuna params (the knobs as suggested).
        distributions: Their distributions.
        record: The record.
        user_attrs: Further user attributes (the host).

    Returns:
        The new trial's number.
    """
    values = None
    state = TrialState.PRUNED
    if record.outcome not in ("skipped", "budget"):
        state = TrialState.COMPLETE
        values = [float(record.context_capacity or 0), float(record.output_throughput_tok_s or 0.0)]
    frozen = optuna.trial.create_trial(
        state=state, values=values, params=dict(params), distributions=dict(distributions),
        user_attrs={**user_attrs, RECORD_ATTR: record.model_dump(mode="json")}, constraints=constraints_of(record),
    )
    storage = storage_of(study)
    created = storage.create_new_trial(study._study_id, template_trial=frozen)  # noqa: SLF001
    return storage.get_trial_number_from_id(created)


@dataclasses.dataclass(frozen=True)
class Reaped:
    """An asked trial that another host failed before this host claimed it: no host claimed it
    within the grace period (:func:`_fail_unclaimed`: choosing took longer on a loaded host), its
    params re-queued once. Nothing is written to it; the run chooses again."""

    number: int

    def __str__(self) -> str:
        return (f"trial {self.number} was failed by another host before this host claimed it (unclaimed longer "
                "than [storage] grace_period_s; its params are queued again): choosing again")


def own(study: optuna.Study, trial: optuna.Trial, host: str, environment: Mapping[str, Any]) -> None:
    """Mark ``trial`` as ``host``'s: its host name, environment and a first heartbeat (on a storage
    with heartbeats), so no other host reaps it before its own heartbeat thread starts."""
    trial.set_user_attr(HOST_ATTR, host)
    trial.set_user_attr(ENVIRONMENT_ATTR, dict(environment))
    storage = storage_of(study)
    record = getattr(storage, "record_heartbeat", None)  # RDBStorage and its cache (Optuna's BaseHeartbeat)
    if record is not None and heartbeat_interval(storage) is not None:
        record(trial_id(study, trial.number))


def claimed_reason(trial: optuna.Trial, others: Sequence[FrozenTrial]) -> tuple[str, int] | None:
    """Why ``trial`` must not launch: another trial with the same Optuna params was measured
    (COMPLETE) or claimed by a host (RUNNING with :data:`~tuner.study.optuna_io.HOST_ATTR`).

    Read under the claim lock, so of two hosts that drew the same config the first to claim it
    launches it and the other skips it; RUNNING trials not yet claimed (another host still
    choosing) do not count.

    Args:
        trial: This host's asked trial, params suggested, not yet claimed.
        others: The study's COMPLETE and RUNNING trials.

    Returns:
        ``(reason, trial number)``, or ``None`` to launch.
    """
    mine = config_key(trial.params)
    for other in others:
        if other.number == trial.number or not other.params or config_key(other.params) != mine:
            continue
        if other.state is TrialState.COMPLETE:
            return f"the same config was measured by trial {other.number}", other.number
        host = other.user_attrs.get(HOST_ATTR)
        if host is not None:
            return f"the same config is running on host {host} (trial {other.number})", other.number
    return None


def claim_trial(study: optuna.Study, trial: optuna.Trial, host: str, environment: Mapping[str, Any], *,
                hold: Callable[[], contextlib.AbstractContextManager[Section]],
                check: bool = True) -> tuple[str, int] | Reaped | None:
    """Claim ``trial`` for ``host`` (:func:`own`) under the claim lock, unless another trial has its
    config (:func:`claimed_reason`, when ``check``; a deliberate noise repeat is not checked).

    When the database dropped the lock's session inside the hold (:attr:`Section.lost`: a server
    restart between the read and the claim), another host may have read the study in that gap,
    not seen this claim, and claimed the same config: the hold is made again, and a claim of the
    same config by another host wins (this trial is then not launched). Of two hosts that both
    lost their holds, each yields to the other: the config is left to a later proposal, never
    launched twice.

    Args:
        study: The study.
        trial: This host's asked trial, params suggested.
        host: This host's name.
        environment: This run's environment (stored with the claim).
        hold: The claim lock's context (:meth:`ClaimLock.held`, or the run's wrapper of it).
        check: Whether to look for another trial of the same config.

    Returns:
        ``None`` (claimed: launch it), ``(reason, trial number)`` of why not, or :class:`Reaped`
        when another host failed the trial before this one claimed it.

    Raises:
        StudyError: The lock or the database failed (see :meth:`ClaimLock.held`).
    """
    while True:
        with hold() as section:
            found = claimed_reason(trial, study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,
                                                                                   TrialState.RUNNING))) if check else None
            if found is None:
                try:
                    own(study, trial, host, environment)
                except optuna.exceptions.UpdateFinishedTrialError:
                    reaped = Reaped(trial.number)
                    _log.warning("%s", reaped)
                    return reaped
        if found is not None or not section.lost or not check:
            return found
        _log.warning("trial %d: the database dropped the claim lock during its claim; checking the claim again",
                     trial.number)
