"""Where studies live: THE rule for the default storage URL, the ``studies/`` folder and the
artifacts folder, and the checks that a storage exists (readers) or can be created (the run).

Defaults, relative to the working directory: ``sqlite:///studies/<study>.db`` and
``studies/<study>/artifacts``. Only the default ``studies/`` folder is ever created; an explicit
SQLite path must name an existing folder.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import optuna
import sqlalchemy
from optuna.storages import BaseStorage, RDBStorage
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

from tuner.config import TunerConfig
from tuner.errors import StudyError

__all__ = [
    "STUDIES_DIR",
    "default_storage_url",
    "default_artifacts_dir",
    "study_storage_url",
    "study_artifacts_dir",
    "open_storage",
    "check_storage_folder",
    "check_artifacts_folder",
    "check_run_storage",
    "storage_errors",
    "check_storage",
    "read_storage",
    "list_studies",
]

STUDIES_DIR = Path("studies")
"""Default home of study databases and artifacts, relative to the working directory."""


def default_storage_url(study_name: str) -> str:
    """The default storage of a study: ``sqlite:///studies/<study_name>.db`` (relative path)."""
    return f"sqlite:///{STUDIES_DIR / (study_name + '.db')}"


def default_artifacts_dir(study_name: str) -> Path:
    """The default artifact folder of a study: ``studies/<study_name>/artifacts``."""
    return STUDIES_DIR / study_name / "artifacts"


def study_storage_url(config: TunerConfig) -> str:
    """The config's Optuna storage URL: ``[storage] url``, else :func:`default_storage_url`."""
    return config.storage.url or default_storage_url(config.study.name)


def study_artifacts_dir(config: TunerConfig) -> Path:
    """The config's artifact folder: ``[storage] artifacts_dir``, else :func:`default_artifacts_dir`."""
    return Path(config.storage.artifacts_dir) if config.storage.artifacts_dir else default_artifacts_dir(config.study.name)


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
            f"storage {url!r}: folder {str(folder)!r} does not exist",
            hint="create it first, or use an existing folder (the default sqlite:///studies/<study>.db is created)",
        )


def check_storage(storage_url: str) -> None:
    """Check that ``storage_url`` names an existing Optuna storage, creating nothing.

    An SQLite URL must name an existing file; any other URL must connect and hold Optuna's
    ``studies`` table (Optuna would otherwise create an empty schema on open).

    Raises:
        StudyError: The URL is malformed, the file is missing, the database is unreachable, or it
            holds no Optuna study tables.
    """
    try:
        url = make_url(storage_url)
    except ArgumentError as err:
        raise StudyError(
            f"storage URL {storage_url!r} is not a SQLAlchemy URL",
            hint="use e.g. --storage sqlite:///studies/demo.db",
        ) from err
    if url.get_backend_name() == "sqlite":
        database = url.database or ""
        if database in ("", ":memory:") or not Path(database).is_file():
            raise StudyError(
                f"storage {storage_url} does not exist (no file {database or '(none)'})",
                hint="check --storage/--study, or run `tuner run` first to create the study",
            )
    engine = _engine(storage_url, url)
    try:
        with engine.connect() as conn:
            has_studies = sqlalchemy.inspect(conn).has_table("studies")
    except SQLAlchemyError as err:
        raise StudyError(
            f"storage {storage_url} cannot be read: {_first_line(err)}",
            hint="check the URL, that the database server is up, and its credentials",
        ) from err
    finally:
        engine.dispose()
    if not has_studies:
        raise StudyError(
            f"storage {storage_url} holds no Optuna study",
            hint="point --storage at the database `tuner run` wrote",
        )


def _first_line(err: BaseException) -> str:
    """The first line of an exception's text (SQLAlchemy appends SQL and a link on more lines)."""
    return (str(err).splitlines() or [type(err).__name__])[0]


def _engine(storage_url: str, url: sqlalchemy.URL) -> sqlalchemy.Engine:
    """A SQLAlchemy engine for ``url``, mapping an unknown dialect or a missing driver.

    Raises:
        StudyError: The URL's dialect is unknown to SQLAlchemy, or its DBAPI driver (``psycopg``,
            ``pymysql``, ...) is not installed.
    """
    try:
        return sqlalchemy.create_engine(url)
    except NoSuchModuleError as err:
        raise StudyError(
            f"storage URL {storage_url} names an unknown database kind {url.drivername!r}",
            hint="check the URL, e.g. --storage sqlite:///studies/demo.db or postgresql+psycopg://...",
        ) from err
    except ImportError as err:
        driver = err.name or _first_line(err)
        raise StudyError(
            f"storage {storage_url} needs the database driver {driver!r}, which is not installed",
            hint=f"install it into the tuner's Python (pip install {driver}), or check the URL",
        ) from err


def read_storage(storage_url: str) -> optuna.storages.RDBStorage:
    """Open an existing storage for reading (:func:`check_storage` first; no schema is created).

    Raises:
        StudyError: See :func:`check_storage`, or Optuna cannot open it (an older schema).
    """
    check_storage(storage_url)
    try:
        return optuna.storages.RDBStorage(storage_url, skip_table_creation=True)
    except (SQLAlchemyError, RuntimeError, ValueError) as err:
        raise StudyError(
            f"storage {storage_url} cannot be opened by Optuna: {str(err).splitlines()[0]}",
            hint="run `optuna storage upgrade --storage URL` if it was written by an older Optuna",
        ) from err


def list_studies(storage_url: str) -> list[optuna.study.StudySummary]:
    """The studies in a storage, oldest first.

    Raises:
        StudyError: See :func:`check_storage`.
    """
    return optuna.get_all_study_summaries(read_storage(storage_url), include_best_trial=False)


def check_artifacts_folder(config: TunerConfig) -> None:
    """Refuse an explicit ``[storage] artifacts_dir`` whose parent folder does not exist.

    Raises:
        StudyError: The parent of the explicit artifacts folder is missing.
    """
    folder = study_artifacts_dir(config)
    if config.storage.artifacts_dir and not folder.parent.is_dir():
        raise StudyError(
            f"[storage] artifacts_dir {str(folder)!r}: its folder {str(folder.parent)!r} does not exist",
            hint="create it, or point artifacts_dir at an existing folder",
        )


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


def check_run_storage(url: str, study_name: str) -> bool:
    """Everything a run needs of its storage, checked before the run changes anything.

    An explicit SQLite folder must exist (:func:`check_storage_folder`) and be writable; an existing
    file must be an SQLite database that is not 0 bytes, passes ``PRAGMA quick_check``, is
    writable, and is empty or an Optuna storage. Creates and changes nothing (the file is read
    through a read-only connection).

    Args:
        url: The storage URL the run will write.
        study_name: The study (its default URL's ``studies/`` folder is created by the run).

    Returns:
        Whether the storage may already hold the study (Optuna's tables exist, or a non-SQLite URL).

    Raises:
        StudyError: One line naming the file and the fix.
    """
    check_storage_folder(url, study_name)
    path = _sqlite_file(url)
    if path is None:
        return url != ":memory:"
    if not path.exists():
        blocked = _nearest_existing(path.parent)
        if not os.access(blocked, os.W_OK | os.X_OK):
            raise StudyError(f"storage {url!r}: no permission to create {str(path)!r} (in {str(blocked)!r})",
                             hint="point [storage] url (or --storage) at a writable folder")
        return False
    where = f"storage {url!r}: the file {str(path)!r}"
    if path.stat().st_size == 0:
        raise StudyError(f"{where} is empty (0 bytes), not a study database",
                         hint="delete the empty file to start a new study there, or point --storage at the study's file")
    try:
        with open(path, "rb") as handle:
            magic = handle.read(len(_SQLITE_MAGIC))
    except OSError as err:
        raise StudyError(f"{where} cannot be read: {err.strerror}", hint="run as the user that owns it") from err
    if magic != _SQLITE_MAGIC:
        raise StudyError(f"{where} is not an SQLite database",
                         hint="point --storage at the study's .db file, or at a new file name")
    tables, problem = _inspect_sqlite(path)
    if problem:
        raise StudyError(
            f"{where} is corrupt ({problem})",
            hint=f"restore it from a backup, or salvage it (sqlite3 {path} .recover | sqlite3 recovered.db) "
            "and run with --storage sqlite:///recovered.db",
        )
    if not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)):
        raise StudyError(f"{where} is read-only (the file or its folder)",
                         hint="run as the user that owns it, or copy it to a writable folder")
    if tables and not _OPTUNA_TABLES <= tables:
        raise StudyError(f"{where} is an SQLite database but not an Optuna study storage",
                         hint="point --storage at the study's file, or at a new file name")
    return bool(tables)


def _inspect_sqlite(path: Path) -> tuple[frozenset[str], str]:
    """``(table names, "")``, or ``(…, what is wrong)`` for a damaged file; read-only connection."""
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
    return tables, "" if rows == ["ok"] else "; ".join(rows)[:200]


_DISK_FULL = ("database or disk is full", "no space left on device", "disk i/o error")
_READ_ONLY = ("attempt to write a readonly database", "read-only file system")


@contextlib.contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Turn a storage failure during a run into one line naming the file and the fix.

    Optuna reports any failed commit as ``StorageInternalError`` ("... invalid data in the
    commit, e.g. exceeding max length"); the cause SQLite gives (``database or disk is full``,
    ``readonly database``) is what the user needs. Every trial told before the failure is already
    committed (one transaction per tell), so nothing finished is lost.

    Raises:
        StudyError: For a full disk or a storage that became read-only (chained to the cause);
            other errors pass through unchanged.
    """
    try:
        yield
    except (optuna.exceptions.StorageInternalError, SQLAlchemyError, sqlite3.Error, OSError) as err:
        chain: list[BaseException] = []
        cause: BaseException | None = err
        while cause is not None and len(chain) < 8:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        text = " ".join(str(c) for c in chain).lower()
        path = _sqlite_file(url)
        where = f"the file {str(path)!r}" if path else url
        if any(k in text for k in _DISK_FULL):
            folder = path.parent if path else None
            raise StudyError(
                f"storage {url!r}: the disk holding {where} is full; every trial finished before is stored",
                hint=(f"free space on it (df -h {folder}) " if folder else "free space on it ")
                + "and run the same command again to resume",
            ) from err
        if any(k in text for k in _READ_ONLY):
            raise StudyError(f"storage {url!r}: {where} became read-only during the run; "
                             "every trial finished before is stored",
                             hint="make it writable again and run the same command to resume") from err
        raise
