"""Riding out a database outage: every storage call of a run waits for the database, within a limit.

A study shared by many hosts lives in a database server (PostgreSQL). When that server restarts,
fails over or drops off the network for a few seconds, Optuna's ``RDBStorage`` raises on the next
call (``sqlalchemy.exc.OperationalError``: connection refused, "terminating connection due to
administrator command", "the database system is starting up"), and a run that let that through
died with a traceback, its result in flight lost (the fleet review of issue 29).

Here is the one guarded path for a run's storage calls:

- :class:`PatientStorage` is Optuna's ``RDBStorage`` whose every call waits out a *transient*
  database error (:func:`is_transient`), retrying with backoff until the database answers again
  or the run's limit (``[storage] outage_s``) is spent; then :class:`StorageOutage`, one line.
  Writes that are only informational (a trial's current phase, a heartbeat) are made inside
  :func:`impatient`, which fails at once instead, so a trial is never held up by them.
- :class:`ResultJournal` keeps a finished trial's result on local disk (beside the launcher's
  state file) from just before it is told until the database has it. A run that stopped on an
  outage leaves the result there; the next run on that host stores it before anything else,
  exactly once (:meth:`ResultJournal.replay`).

Retrying a write whose commit reached the server but whose answer was lost could store it twice:
the only such write that matters, telling a trial its result, is idempotent here (a second tell
of the same trial raises ``UpdateFinishedTrialError``, which :meth:`ResultJournal.replay` and the
recorder treat as "already stored").
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from optuna.storages import BaseStorage, RDBStorage
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError

from tuner.errors import StudyError, first_line

__all__ = ["DISK_FULL", "READ_ONLY", "PatientStorage", "ResultJournal", "StorageOutage", "chain_text", "db_reason",
           "impatient", "is_transient", "patiently", "storage_refuses"]

_log = logging.getLogger(__name__)
T = TypeVar("T")

DISK_FULL = ("database or disk is full", "no space left on device", "disk i/o error")
"""What SQLite and the OS say of a storage whose disk is full."""
READ_ONLY = ("attempt to write a readonly database", "readonly database", "read-only file system")
"""What SQLite and the OS say of a storage that turned read-only."""
# Errors of the database's own state, not of the link to it: retrying does not help.
_PERMANENT = ("password authentication failed", "does not exist", "permission denied", "no pg_hba.conf entry",
              *DISK_FULL, *READ_ONLY)
_BACKOFF_S = (0.5, 1.0, 2.0, 4.0)
_local = threading.local()


class StorageOutage(StudyError):
    """The study's database did not answer for the whole of the run's outage limit."""


def _chain(err: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    cause: BaseException | None = err
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return chain


def db_reason(err: BaseException) -> str:
    """One line of what the database driver said (``connection refused``, ``server closed the
    connection unexpectedly``), not Optuna's wrapper ("An exception is raised during the commit.
    This typically happens due to invalid data in the commit"), which blames the data."""
    chain = _chain(err)
    driver = [c for c in chain if isinstance(c, OperationalError | InterfaceError | DisconnectionError)]
    found = driver[-1] if driver else chain[-1]
    text = str(getattr(found, "orig", None) or found)
    line = " ".join(text.split("(Background on this error", 1)[0].split())
    return line or first_line(err)


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) is a lost or refused connection to a
    database server: SQLAlchemy's ``OperationalError``, ``InterfaceError`` or
    ``DisconnectionError`` (psycopg's "connection refused", "server closed the connection
    unexpectedly", "terminating connection due to administrator command", "the database system is
    starting up"), and not an error of the database's own state (authentication, a missing
    database, a full disk), which no wait mends."""
    chain = _chain(err)
    if any(p in chain_text(err) for p in _PERMANENT):
        return False
    return any(isinstance(c, OperationalError | InterfaceError | DisconnectionError) for c in chain)


def chain_text(err: BaseException) -> str:
    """``err`` and the errors it was raised from, as one lower-case text (for the phrases above)."""
    return " ".join(str(c) for c in _chain(err)).lower()


def storage_refuses(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) says the storage's disk is full or turned
    read-only: the storage's own state, named by :func:`tuner.study.storage.storage_errors` as such
    (not as a database that stopped answering)."""
    text = chain_text(err)
    return any(p in text for p in (*DISK_FULL, *READ_ONLY))


@contextlib.contextmanager
def impatient() -> Iterator[None]:
    """Storage calls made in this thread inside the block fail at once on an outage (for writes
    that only inform: a trial's phase, a heartbeat; the caller logs and goes on)."""
    before = getattr(_local, "impatient", False)
    _local.impatient = True
    try:
        yield
    finally:
        _local.impatient = before


def patiently(call: Callable[[], T], *, limit_s: float, what: str, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> T:
    """``call()``, retried with backoff (0.5, 1, 2, then every 4 s) while it raises a transient
    database error (:func:`is_transient`) and ``limit_s`` seconds have not passed since the first.

    Args:
        call: The storage call.
        limit_s: Seconds to wait for the database (the run's ``[storage] outage_s``).
        what: The call, for the log and the error line (e.g. ``"set_trial_state_values"``).

    Raises:
        StorageOutage: The database still did not answer after ``limit_s`` (chained to its error).
        Exception: Any error that is not transient, unchanged.
    """
    if getattr(_local, "impatient", False):
        return call()
    began: float | None = None
    attempt = 0
    while True:
        try:
            result = call()
        except StorageOutage:
            raise  # an inner call already waited the whole limit
        except Exception as err:
            if not is_transient(err):
                raise
            now = clock()
            if began is None:
                began = now
                _log.warning("the study's database does not answer (%s); waiting up to %.0f s for it",
                             db_reason(err), limit_s)
            if now - began >= limit_s:
                raise StorageOutage(
                    f"the study's database did not answer for {limit_s:.0f} s ({db_reason(err)})",
                    hint="check the database server and the network to it, then run the same command to "
                    "resume (a result in flight is kept on this host and stored first); [storage] outage_s "
                    "sets how long a run waits",
                ) from err
            sleep(min(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)], max(0.0, limit_s - (now - began))))
            attempt += 1
            continue
        if began is not None:
            _log.warning("the study's database answers again after %.0f s", clock() - began)
        return result


class PatientStorage(RDBStorage):
    """Optuna's ``RDBStorage`` whose calls wait out a database outage (:func:`patiently`).

    Args:
        url: The SQLAlchemy URL of a database server.
        outage_s: Seconds a call waits for the database before :class:`StorageOutage`.
        **options: ``RDBStorage``'s own (``engine_kwargs``, ``heartbeat_interval``, ...).
    """

    def __init__(self, url: str, *, outage_s: float, **options: Any) -> None:
        self.outage_s = float(outage_s)
        super().__init__(url, **options)

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if name not in _WAITED or not callable(value):
            return value
        limit_s = super().__getattribute__("outage_s")

        @functools.wraps(value)
        def waited(*args: Any, **kwargs: Any) -> Any:
            return patiently(lambda: value(*args, **kwargs), limit_s=limit_s, what=name)

        return waited


# Every call of Optuna's storage API (``BaseStorage``'s public methods) is waited for, and the
# ``RDBStorage`` methods Optuna's own cache in front of it calls (``optuna/storages/_cached_storage.py``).
_WAITED = frozenset(k for k, v in vars(BaseStorage).items() if callable(v) and not k.startswith("_")) | {
    "get_all_versions", "get_current_version", "_create_new_trial", "_get_best_trial_id", "_get_stale_trial_ids",
    "_get_trials", "_set_trial_param"}


class ResultJournal:
    """Finished trials' results kept on local disk until the study's database has them.

    One JSON line per result in a file of the launcher's state folder (beside the unit's lock and
    state file: :class:`tuner.launch.session.StateStore`). A line names the study and a hash of
    the storage URL (never the URL: it may hold a password), so a run stores only its own study's
    results.

    Args:
        path: The journal file.
        study_name: The study's name.
        storage_url: The storage URL (hashed).
    """

    def __init__(self, path: Path, study_name: str, storage_url: str) -> None:
        self.path = Path(path)
        self._study = study_name
        self._storage = hashlib.sha256(storage_url.encode()).hexdigest()[:16]
        self._lock = threading.Lock()

    def keep(self, number: int, entry: dict[str, Any]) -> None:
        """Write trial ``number``'s ``entry`` (the record and what storing it needs), synced to disk.

        Raises:
            StudyError: The state folder cannot be written (a full disk named as such).
        """
        line = json.dumps({"study": self._study, "storage": self._storage, "number": number, **entry},
                          sort_keys=True, default=str)
        with self._lock:
            try:
                with self.path.open("a", encoding="utf-8") as out:
                    out.write(line + "\n")
                    out.flush()
                    os.fsync(out.fileno())
            except OSError as err:
                if err.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise StudyError(f"trial {number}'s result cannot be kept: the disk holding {self.path} is full",
                                     hint="free space on the state folder's disk (df -h "
                                     f"{self.path.parent}) and run again") from err
                raise StudyError(f"trial {number}'s result cannot be kept in {self.path}: {err.strerror}",
                                 hint="free space on the state folder's disk (df -h "
                                 f"{self.path.parent}) and run again") from err

    def stored(self, number: int) -> None:
        """Forget trial ``number``'s result: the database has it."""
        with self._lock:
            kept = [e for e in self._read() if not self._ours(e) or e.get("number") != number]
            self._write(kept)

    def pending(self) -> list[dict[str, Any]]:
        """This study's results kept by an earlier run, oldest first."""
        with self._lock:
            return [e for e in self._read() if self._ours(e)]

    def _ours(self, entry: dict[str, Any]) -> bool:
        return entry.get("study") == self._study and entry.get("storage") == self._storage

    def _read(self) -> list[dict[str, Any]]:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        except OSError as err:
            raise StudyError(f"the result journal {self.path} cannot be read: {err.strerror}",
                             hint="check the state folder's permissions") from err
        entries = []
        for line in lines:
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash mid-write: its trial is re-run
                _log.warning("a cut line of %s is ignored", self.path)
        return entries

    def _write(self, entries: list[dict[str, Any]]) -> None:
        if not entries:
            self.path.unlink(missing_ok=True)
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in entries), encoding="utf-8")
        os.replace(tmp, self.path)
