"""Where studies live: THE rule for the default storage URL, the ``studies/`` folder and the
artifacts folder, and the checks that a storage exists (readers) or can be created (the run).

Defaults, relative to the working directory: ``sqlite:///studies/<study>.db`` and
``studies/<study>/artifacts``. Only the default ``studies/`` folder is ever created; an explicit
SQLite path must name an existing folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import optuna
import pydantic
import sqlalchemy
from optuna.storages import BaseStorage, RDBStorage
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

from tuner.config import TunerConfig
from tuner.errors import StudyError, first_line
from tuner.launch.unit import disk_full
from tuner.study.hosts import RequeueOnce, host_name, schema_lock
from tuner.study.outage import DISK_FULL, READ_ONLY, PatientStorage, chain_text

__all__ = [
    "STUDIES_DIR",
    "default_storage_url",
    "default_artifacts_dir",
    "study_storage_url",
    "study_artifacts_dir",
    "display_url",
    "is_shared_url",
    "open_storage",
    "show_command",
    "open_artifacts_folder",
    "check_storage_folder",
    "check_artifacts_folder",
    "check_run_storage",
    "storage_errors",
    "check_storage",
    "read_storage",
    "list_studies",
    "copy_study",
]

STUDIES_DIR = Path("studies")
"""Default home of study databases and artifacts, relative to the working directory."""


def default_storage_url(study_name: str) -> str:
    """The default storage of a study: ``sqlite:///studies/<study_name>.db`` (relative path)."""
    return f"sqlite:///{STUDIES_DIR / (study_name + '.db')}"


def default_artifacts_dir(study_name: str) -> Path:
    """The default artifact folder of a study: ``studies/<study_name>/artifacts``."""
    return STUDIES_DIR / study_name / "artifacts"


def show_command(config: TunerConfig, url: str, number: int) -> str:
    """A ``tuner show`` command that finds trial ``number`` of the study stored at ``url`` from
    where the run was started, however many databases ``studies/`` holds: with the run's
    ``--config`` when it names that storage, else with the storage URL."""
    if config.path and url == study_storage_url(config):
        return f"tuner show {number} --config {shlex.quote(config.path)}"
    return f"tuner show {number} --storage {shlex.quote(url)} --study {shlex.quote(config.study.name)}"


def study_storage_url(config: TunerConfig) -> str:
    """The config's Optuna storage URL: ``[storage] url``, else :func:`default_storage_url`."""
    return config.storage.url or default_storage_url(config.study.name)


def study_artifacts_dir(config: TunerConfig, url: str | None = None) -> Path:
    """The study's artifact folder: ``[storage] artifacts_dir`` when the config names one; else
    beside an SQLite storage file (``<its folder>/<study>/artifacts``: ``studies/<study>/artifacts``
    for the default ``studies/<study>.db``, and a ``--storage`` copy elsewhere keeps its own trials'
    files beside it, not in the original's folder); else (a database server, ``:memory:``)
    :func:`default_artifacts_dir`.

    Args:
        config: The tuner config.
        url: The storage URL the run uses (``--storage``); default: the config's.
    """
    if config.storage.artifacts_dir:
        return Path(config.storage.artifacts_dir)
    db = _sqlite_file(url or study_storage_url(config))
    return db.parent / config.study.name / "artifacts" if db is not None else default_artifacts_dir(config.study.name)


def display_url(url: str) -> str:
    """``url`` with its password hidden (``postgresql+psycopg://tuner:***@db:5432/tuner``), for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def is_shared_url(url: str) -> bool:
    """Whether ``url`` names a database server (PostgreSQL, MySQL) that many hosts can share."""
    return url != ":memory:" and not url.startswith("sqlite")


def _engine_kwargs(url: str) -> dict:
    """SQLAlchemy engine options: SQLite's lock timeout; for a server, a 10 s connect timeout, a
    pre-ping of pooled connections (a heartbeat thread keeps one for hours) and, on PostgreSQL,
    the host name as ``application_name`` (shown in ``pg_stat_activity`` and the claim lock's
    holder)."""
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 30}}
    kwargs: dict = {"pool_pre_ping": True}
    if url.startswith("postgresql"):
        kwargs["connect_args"] = {"connect_timeout": 10, "application_name": f"sglang-tuner {host_name()}"[:63]}
    return kwargs


def open_storage(url: str, *, heartbeat_interval_s: int | None = None, grace_period_s: int | None = None,
                 outage_s: float | None = None) -> BaseStorage:
    """Open an Optuna storage from a SQLAlchemy URL, creating a SQLite file's folder if needed.

    On a database server the schema is created under the study's schema lock
    (:func:`tuner.study.hosts.schema_lock`), so hosts that start together do not race Optuna's
    ``CREATE TABLE``. With ``heartbeat_interval_s`` the storage keeps trial heartbeats and fails
    trials silent for ``grace_period_s``, re-queueing them once
    (:class:`tuner.study.hosts.RequeueOnce`).

    Args:
        url: ``sqlite:///studies/x.db``, ``postgresql+psycopg://user:pw@host/db``, or
            ``:memory:`` (in-memory, for the offline benchmark).
        heartbeat_interval_s: Optuna's ``heartbeat_interval`` (whole seconds), or ``None``.
        grace_period_s: Optuna's ``grace_period`` (whole seconds), or ``None`` (2 × interval).
        outage_s: On a database server, seconds each call waits out an outage
            (:class:`tuner.study.outage.PatientStorage`); ``None``: a call fails at once.

    Raises:
        StudyError: The database cannot be opened (one line naming the fix: driver, server,
            credentials, database).
    """
    if url == ":memory:":
        return optuna.storages.InMemoryStorage()
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StudyError(
                f"storage folder {str(path.parent)!r} cannot be created: {err.strerror}",
                hint="set [storage] url to a writable place",
            ) from err
    heartbeat: dict = {}
    if heartbeat_interval_s is not None:
        heartbeat = {"heartbeat_interval": int(heartbeat_interval_s), "grace_period": grace_period_s,
                     "heartbeat_stale_trial_callback": RequeueOnce()}
    try:
        with schema_lock(url, _engine_kwargs(url)):
            if outage_s is not None and is_shared_url(url):
                return PatientStorage(url, outage_s=outage_s, engine_kwargs=_engine_kwargs(url), **heartbeat)
            return RDBStorage(url, engine_kwargs=_engine_kwargs(url), **heartbeat)
    except ImportError as err:
        raise _driver_error(url, err) from err
    except (SQLAlchemyError, ValueError, RuntimeError) as err:
        raise _connect_error(url, err, hint="check [storage] url (e.g. sqlite:///studies/demo.db)") from err


def _check_server_storage(url: str) -> bool:
    """Check, creating nothing, that a database server can keep the study (the part of
    :func:`check_run_storage` for a shared URL; SQLite and ``:memory:`` pass).

    Returns whether the database already holds Optuna's tables. A database
    server must be reachable with the URL's credentials, and be either empty or an Optuna storage:
    a database holding other tables and no Optuna ``studies`` table is someone else's.

    Raises:
        StudyError: Malformed URL, unknown dialect, missing driver, unreachable server, wrong
            credentials, missing database, or a database that is not a study storage.
    """
    if not is_shared_url(url):
        return False
    try:
        parsed = make_url(url)
    except ArgumentError as err:
        raise StudyError(f"storage URL {display_url(url)!r} is not a SQLAlchemy URL",
                         hint="write it like postgresql+psycopg://user:password@host:5432/database") from err
    engine = _engine(url, parsed)
    try:
        with engine.connect() as conn:
            tables = set(sqlalchemy.inspect(conn).get_table_names())
    except SQLAlchemyError as err:
        raise _connect_error(url, err) from err
    finally:
        engine.dispose()
    if tables and "studies" not in tables:
        shown = ", ".join(sorted(tables)[:3]) + (", ..." if len(tables) > 3 else "")
        raise StudyError(
            f"storage {display_url(url)} is not a study storage: it holds {len(tables)} other table(s) ({shown}) "
            "and no Optuna studies table",
            hint="point [storage] url / --storage at an empty database (e.g. createdb tuner) or one `tuner run` wrote",
        )
    return "studies" in tables


def _connect_error(url: str, err: BaseException, *, hint: str | None = None) -> StudyError:
    """One line for a database that refused us: which of server, credentials, database, and the fix."""
    text = first_line(err)
    shown = display_url(url)
    low = text.lower()
    try:
        parsed = make_url(url)
        where, user, database = f"{parsed.host or 'localhost'}:{parsed.port or 5432}", parsed.username, parsed.database
    except ArgumentError:
        where, user, database = "the server", None, None
    if "password authentication failed" in low or "no password supplied" in low or "access denied" in low:
        return StudyError(f"storage {shown}: the database refused the credentials of user {user!r}",
                          hint="check the user and password in the URL ([storage] url or --storage)")
    if "does not exist" in low and "database" in low:
        return StudyError(f"storage {shown}: database {database!r} does not exist on {where}",
                          hint=f"create it first (createdb {database}) or fix the database name in the URL")
    if any(word in low for word in ("connection refused", "could not translate host name", "timeout expired",
                                    "no route to host", "network is unreachable", "name or service not known",
                                    "ssl negotiation", "could not connect", "connection timed out")):
        return StudyError(f"storage {shown}: the database server at {where} is unreachable ({_reason(text)})",
                          hint="check the host and port in the URL, and that PostgreSQL runs and accepts connections there")
    return StudyError(f"storage {shown} cannot be opened: {text}",
                      hint=hint or "check the URL, that the database server is up, and its credentials")


def _reason(text: str) -> str:
    """The driver's reason without its "connection to server at ... failed:" preamble."""
    return text.rsplit("failed: ", 1)[-1].strip() if "failed: " in text else text


def _driver_error(url: str, err: ImportError) -> StudyError:
    driver = err.name or first_line(err)
    if driver.startswith("psycopg"):
        return StudyError(f"storage {display_url(url)} needs the PostgreSQL driver {driver!r}, which is not installed",
                          hint="pip install 'sglang-tuner[postgres]' (psycopg 3) and write postgresql+psycopg://...")
    package = _DRIVER_PACKAGES.get(driver, driver)
    return StudyError(f"storage {display_url(url)} needs the database driver {driver!r}, which is not installed",
                      hint=f"install it into the tuner's Python (pip install {package}), or check the URL")


_DRIVER_PACKAGES = {"MySQLdb": "mysqlclient", "pymysql": "PyMySQL", "psycopg2": "psycopg2-binary"}
"""Importable DBAPI module → the package that installs it, where the names differ."""


def check_storage_folder(url: str, study_name: str) -> None:
    """Refuse an explicit SQLite URL whose folder does not exist (only ``studies/`` is created).

    Args:
        url: The storage URL the run will write.
        study_name: The study (its :func:`default_storage_url` is always accepted).

    Raises:
        StudyError: The folder of an explicit ``sqlite:///`` path is missing.
    """
    if url == default_storage_url(study_name) or not url.startswith("sqlite:///"):
        return
    folder = Path(url.removeprefix("sqlite:///")).parent
    if not folder.is_dir():
        raise StudyError(
            f"storage {display_url(url)!r}: folder {str(folder)!r} does not exist",
            hint="create it first, or use an existing folder (the default sqlite:///studies/<study>.db is created)",
        )


def _is_folder(url: str, path: Path, flag: str) -> StudyError:
    """An SQLite URL whose path is a folder (``sqlite:////tmp``): one line for the readers and the
    run alike (the readers said "does not exist" where the run said "is a folder")."""
    return StudyError(f"storage {display_url(url)!r}: {str(path)!r} is a folder, not a study file",
                      hint=f"name a .db file in it, e.g. {flag} sqlite:///{path / 'study.db'}")


def check_storage(storage_url: str, *, flag: str = "--storage") -> None:
    """Check that ``storage_url`` names an existing Optuna storage, creating nothing.

    An SQLite URL must name an existing file; any other URL must connect and hold Optuna's
    ``studies`` table (Optuna would otherwise create an empty schema on open). ``flag`` is the
    option that named the URL, for the hints (``--storage``; ``--from`` of ``copy-study``).

    Raises:
        StudyError: The URL is malformed, the file is missing, the database is unreachable, or it
            holds no Optuna study tables.
    """
    try:
        url = make_url(storage_url)
    except ArgumentError as err:
        raise StudyError(
            f"storage URL {display_url(storage_url)!r} is not a SQLAlchemy URL",
            hint=f"use e.g. {flag} sqlite:///studies/demo.db",
        ) from err
    if url.get_backend_name() == "sqlite":
        database = url.database or ""
        if database not in ("", ":memory:") and Path(database).is_dir():  # the run's rule, the run's words
            raise _is_folder(storage_url, Path(database), flag)
        if database in ("", ":memory:") or not Path(database).is_file():
            raise StudyError(
                f"storage {display_url(storage_url)} does not exist (no file {database or '(none)'})",
                hint=f"check {flag}/--study, or run `tuner run` first to create the study",
            )
        tables, problem = _inspect_sqlite(Path(database))
        if problem:
            raise _corrupt(f"storage {display_url(storage_url)}: the file {database!r}", Path(database), problem, flag)
        missing = sorted(_OPTUNA_TABLES - tables)
        if "studies" in tables and missing:
            raise _corrupt(f"storage {display_url(storage_url)}: the file {database!r}", Path(database),
                           f"Optuna's table(s) {', '.join(missing)} are missing", flag)
    engine = _engine(storage_url, url)
    try:
        with engine.connect() as conn:
            has_studies = sqlalchemy.inspect(conn).has_table("studies")
    except SQLAlchemyError as err:
        if url.get_backend_name() == "sqlite":  # a file: no server, no credentials
            raise StudyError(
                f"storage {display_url(storage_url)}: {url.database} is not an SQLite database or is corrupt ({first_line(err)})",
                hint=f"point {flag} at the .db file `tuner run` wrote, or restore that file from a backup",
            ) from err
        raise _connect_error(storage_url, err) from err
    finally:
        engine.dispose()
    if not has_studies:
        raise StudyError(
            f"storage {display_url(storage_url)} holds no Optuna study",
            hint=f"point {flag} at the database `tuner run` wrote",
        )


def _engine(storage_url: str, url: sqlalchemy.URL) -> sqlalchemy.Engine:
    """A SQLAlchemy engine for ``url``, mapping an unknown dialect or a missing driver.

    Raises:
        StudyError: The URL's dialect is unknown to SQLAlchemy, or its DBAPI driver (``psycopg``,
            ``pymysql``, ...) is not installed.
    """
    try:
        return sqlalchemy.create_engine(url, **_engine_kwargs(storage_url))
    except NoSuchModuleError as err:
        raise StudyError(
            f"storage URL {display_url(storage_url)} names an unknown database kind {url.drivername!r}",
            hint="check the URL, e.g. --storage sqlite:///studies/demo.db or postgresql+psycopg://...",
        ) from err
    except ImportError as err:
        raise _driver_error(storage_url, err) from err


def read_storage(storage_url: str, *, flag: str = "--storage", checked: bool = False) -> optuna.storages.RDBStorage:
    """Open an existing storage for reading (:func:`check_storage` first, its hints naming ``flag``,
    unless the caller ``checked`` it already with :func:`check_run_storage`; no schema is created).

    Raises:
        StudyError: See :func:`check_storage`, or Optuna cannot open it (an older schema).
    """
    if not checked:
        check_storage(storage_url, flag=flag)
    try:
        return optuna.storages.RDBStorage(storage_url, skip_table_creation=True,
                                          engine_kwargs=_engine_kwargs(storage_url))
    except (SQLAlchemyError, RuntimeError, ValueError) as err:
        raise StudyError(
            f"storage {display_url(storage_url)} cannot be opened by Optuna: {str(err).splitlines()[0]}",
            hint="run `optuna storage upgrade --storage URL` if it was written by an older Optuna",
        ) from err


def list_studies(storage_url: str) -> list[optuna.study.StudySummary]:
    """The studies in a storage, oldest first.

    Raises:
        StudyError: See :func:`check_storage`.
    """
    return optuna.get_all_study_summaries(read_storage(storage_url), include_best_trial=False)




def copy_study(from_url: str, to_url: str, study_name: str, to_study_name: str | None = None) -> int:
    """Copy a study between storages (SQLite ↔ PostgreSQL) with ``optuna.copy_study``.

    Trials (params, values, states, constraints, user and system attributes, the tuner's records)
    and the study's attributes are copied; artifact files stay in their folder
    (``studies/<study>/artifacts``), referenced by id. Checked before anything is written: the
    source study exists; the target passes the run's own storage checks (:func:`check_run_storage`:
    a new SQLite file in an existing, writable folder, or an Optuna storage, never a file holding
    other tables; a reachable, empty or Optuna database) and holds no study of that name.

    Args:
        from_url: The source storage URL (must exist).
        to_url: The target storage URL (created when it is a new SQLite file or an empty database).
        study_name: The study to copy.
        to_study_name: Its name in the target (default: the same).

    Returns:
        The number of trials copied.

    Raises:
        StudyError: The source or its study is missing, the target is unusable or already holds
            the study.
    """
    target_name = to_study_name or study_name
    source = read_storage(from_url, flag="--from")
    names = [s.study_name for s in optuna.get_all_study_summaries(source, include_best_trial=False)]
    if study_name not in names:
        raise StudyError(f"storage {display_url(from_url)} holds no study {study_name!r} "
                         f"(it holds {', '.join(names) or 'none'})", hint="pass one of those to --study")
    check_run_storage(to_url, target_name, flag="--to")  # as a run checks its storage: nothing written yet
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not Optuna's "A new study created" line
    target = open_storage(to_url)
    existing = [s.study_name for s in optuna.get_all_study_summaries(target, include_best_trial=False)]
    if target_name in existing:
        raise StudyError(f"storage {display_url(to_url)} already holds a study {target_name!r}",
                         hint="pass --to-study NEW_NAME, or copy into another storage")
    optuna.copy_study(from_study_name=study_name, from_storage=source, to_storage=target,
                      to_study_name=target_name)
    return len(optuna.load_study(study_name=target_name, storage=target).trials)


def open_artifacts_folder(config: TunerConfig, url: str) -> Path | None:
    """The study's artifact folder (:func:`study_artifacts_dir` of ``url``, created), checked first; ``None``
    for the in-memory study (``:memory:``, the benchmarks: nothing is uploaded).

    Raises:
        StudyError: See :func:`check_artifacts_folder`.
    """
    if url == ":memory:":
        return None
    check_artifacts_folder(config)
    folder = study_artifacts_dir(config, url)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def check_artifacts_folder(config: TunerConfig) -> None:
    """Refuse an artifacts folder the run could not create or write: an explicit ``[storage]
    artifacts_dir`` whose parent folder does not exist, a path that is a file (``/etc/passwd``: the
    run failed creating it, after its study was created), or one under a folder that is not
    writable (or on ``/proc``). Creates nothing.

    Raises:
        StudyError: Naming the folder and the fix.
    """
    from tuner.launch.session import writable_folder

    folder = study_artifacts_dir(config)
    hint = "create it, or point artifacts_dir at an existing folder"
    if config.storage.artifacts_dir and not folder.parent.is_dir():
        raise StudyError(
            f"[storage] artifacts_dir {str(folder)!r}: its folder {str(folder.parent)!r} does not exist", hint=hint)
    if folder.exists() and not folder.is_dir():
        raise StudyError(f"the artifacts folder {str(folder)!r} is a file, not a folder",
                         hint="point [storage] artifacts_dir at a folder (the run keeps each trial's server log there)")
    blocked = writable_folder(folder)
    if blocked is not None:
        raise StudyError(f"the artifacts folder {str(folder)!r} cannot be created or written "
                         f"({str(blocked)!r} is not a writable folder)", hint=hint)


_SQLITE_MAGIC = b"SQLite format 3\x00"
_OPTUNA_TABLES = frozenset({"studies", "trials", "version_info"})


def _sqlite_file(url: str) -> Path | None:
    if not url.startswith("sqlite:///"):
        return None
    path = url.removeprefix("sqlite:///").split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def _nearest_existing(folder: Path) -> Path:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def check_run_storage(url: str, study_name: str, *, flag: str = "--storage") -> bool:
    """Everything a run needs of its storage, checked before the run changes anything.

    A database server (PostgreSQL, MySQL) must be reachable with the URL's credentials and be empty
    or an Optuna storage. An explicit SQLite folder must exist (:func:`check_storage_folder`) and be
    writable; an existing file must be an SQLite database that is not 0 bytes, passes ``PRAGMA quick_check``, is
    writable, and is empty or an Optuna storage. Creates and changes nothing (the file is read
    through a read-only connection).

    Args:
        url: The storage URL the run will write.
        study_name: The study (its default URL's ``studies/`` folder is created by the run).
        flag: The option that named ``url``, for the hints (``--storage``; ``--to`` of ``copy-study``).

    Returns:
        Whether the storage may already hold the study (Optuna's tables exist, or a non-SQLite URL).

    Raises:
        StudyError: One line naming the file (or the server: unreachable, wrong credentials, missing
            database or driver, someone else's tables) and the fix.
    """
    if url.startswith("sqlite:") and _sqlite_file(url) is None:  # sqlite://, sqlite:///:memory:
        raise StudyError(f"storage {url!r} keeps the study in memory: every trial would be lost when the run ends",
                         hint=f"point {flag} at a file, e.g. sqlite:///studies/{study_name}.db")
    check_storage_folder(url, study_name)
    if is_shared_url(url):
        return _check_server_storage(url)
    path = _sqlite_file(url)
    if path is None:
        return url != ":memory:"
    folder = _nearest_existing(path.parent)
    full = disk_full(folder)
    if full:
        shown = os.path.abspath(folder)
        raise StudyError(f"storage {url!r}: the disk holding {shown!r} is full ({full})",
                         hint=f"free space on it (df -h {shown}), or point {flag} at a folder on another disk")
    if not path.exists():
        blocked = folder
        if not os.access(blocked, os.W_OK | os.X_OK):
            raise StudyError(f"storage {display_url(url)!r}: no permission to create {str(path)!r} (in {str(blocked)!r})",
                             hint=f"point {flag} at a writable folder")
        return False
    where = f"storage {display_url(url)!r}: the file {str(path)!r}"
    if path.is_dir():
        raise _is_folder(url, path, flag)
    if path.stat().st_size == 0:
        raise StudyError(f"{where} is empty (0 bytes), not a study database",
                         hint=f"delete the empty file to start a new study there, or point {flag} at the study's file")
    try:
        with open(path, "rb") as handle:
            magic = handle.read(len(_SQLITE_MAGIC))
    except OSError as err:
        raise StudyError(f"{where} cannot be read: {err.strerror}", hint="run as the user that owns it") from err
    if magic != _SQLITE_MAGIC:
        raise StudyError(f"{where} is not an SQLite database",
                         hint=f"point {flag} at the study's .db file, or at a new file name")
    tables, problem = _inspect_sqlite(path)
    if problem:
        raise _corrupt(where, path, problem, flag)
    if not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)):
        raise StudyError(f"{where} is read-only (the file or its folder)",
                         hint="run as the user that owns it, or copy it to a writable folder")
    if tables and not _OPTUNA_TABLES <= tables:
        raise StudyError(f"{where} is an SQLite database but not an Optuna study storage",
                         hint=f"point {flag} at the study's file, or at a new file name")
    return bool(tables)


def _inspect_sqlite(path: Path) -> tuple[frozenset[str], str]:
    """``(table names, "")``, or ``(…, what is wrong)`` on one line for a damaged file (SQLite's
    ``PRAGMA quick_check``); read-only connection."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    except sqlite3.Error as err:
        return frozenset(), str(err)
    try:
        tables = frozenset(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
        rows = [str(r[0]) for r in conn.execute("PRAGMA quick_check(3)")]
    except sqlite3.DatabaseError as err:
        return frozenset(), str(err)
    finally:
        conn.close()
    return tables, "" if rows == ["ok"] else " ".join("; ".join(rows).split())[:200]


def _salvage(path: Path, flag: str) -> str:
    """The fix for a damaged SQLite study file: a backup, or SQLite's own salvage."""
    return (f"restore it from a backup, or salvage it (sqlite3 {path} .recover | sqlite3 recovered.db) "
            f"and use {flag} sqlite:///recovered.db")


def _corrupt(where: str, path: Path, problem: str, flag: str) -> StudyError:
    """The one line for a damaged SQLite study file: what SQLite found, and how to salvage it."""
    return StudyError(f"{where} is corrupt ({problem})", hint=_salvage(path, flag))


@contextlib.contextmanager
def stored_values(url: str, *, flag: str = "--storage") -> Iterator[None]:
    """Turn a stored value Optuna or the tuner cannot parse, met while reading a study, into one
    line naming the storage and the fix.

    A trial's attribute that is not JSON (``json.JSONDecodeError`` from Optuna's reader) or a
    record that does not validate (``pydantic.ValidationError``) means the database was edited or
    damaged outside Optuna; Optuna reports a failed read of a damaged file as
    ``StorageInternalError``.

    Raises:
        StudyError: For those errors (chained to the cause); others pass through unchanged.
    """
    try:
        yield
    except (json.JSONDecodeError, pydantic.ValidationError, optuna.exceptions.StorageInternalError,
            sqlite3.DatabaseError) as err:
        path = _sqlite_file(url)
        reason = " ".join(first_line(err).split())[:160]
        raise StudyError(
            f"storage {display_url(url)}: a stored value cannot be read ({type(err).__name__}: {reason})",
            hint=_salvage(path, flag) if path else "restore the database from a backup; a value was written outside Optuna",
        ) from err




@contextlib.contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Turn a storage failure during a run into one line naming the file and the fix.

    Optuna reports any failed commit as ``StorageInternalError`` ("... invalid data in the
    commit, e.g. exceeding max length"); the cause SQLite gives (``database or disk is full``,
    ``readonly database``) is what the user needs. Every trial told before the failure is already
    committed (one transaction per tell), so nothing finished is lost.

    Raises:
        StudyError: For a full disk, a storage that became read-only, a disk I/O error on a disk
            that is not full (an immutable file, a failing disk), or a folder that refuses the
            database's journal file (chained to the cause); other errors pass through unchanged.
    """
    try:
        yield
    except (optuna.exceptions.StorageInternalError, SQLAlchemyError, sqlite3.Error, OSError) as err:
        text = chain_text(err)
        path = _sqlite_file(url)
        where = f"the file {str(path)!r}" if path else url
        kept = "every trial finished before is stored (a result in flight is kept on this host and stored first next time)"
        folder = path.parent if path else None
        # SQLite says "disk I/O error" of a full disk and of a file it may not write (chattr +i, a failing disk)
        unwritable = "disk i/o error" in text and folder is not None and not disk_full(folder)
        # ... and "unable to open database file" when it may not create the file's rollback journal
        # beside it (a folder turned read-only or immutable while the run holds the database open)
        no_journal = "unable to open database file" in text and folder is not None and not disk_full(folder)
        if any(k in text for k in DISK_FULL) and not (unwritable or no_journal):
            raise StudyError(
                f"storage {display_url(url)!r}: the disk holding {where} is full; {kept}",
                hint=(f"free space on it (df -h {folder}) " if folder else "free space on it ")
                + "and run the same command again to resume",
            ) from err
        if unwritable or no_journal or any(k in text for k in READ_ONLY):
            cause = ("became read-only" if any(k in text for k in READ_ONLY) else
                     f"could not be written ({'disk I/O error' if unwritable else 'its folder refused the journal file'})")
            raise StudyError(f"storage {display_url(url)!r}: {where} {cause} during the run; {kept}",
                             hint="make it writable again (ls -l, lsattr, dmesg) and run the same command to resume") from err
        raise
