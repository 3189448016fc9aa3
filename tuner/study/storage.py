"""Where studies live: THE rule for the default storage URL, the ``studies/`` folder and the
artifacts folder, and the checks that a storage exists (readers) or can be created (the run).

Defaults, relative to the working directory: ``sqlite:///studies/<study>.db`` and
``studies/<study>/artifacts``. Only the default ``studies/`` folder is ever created; an explicit
SQLite path must name an existing folder.
"""

from __future__ import annotations

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
        if url.get_backend_name() == "sqlite":  # a file: no server, no credentials
            raise StudyError(
                f"storage {storage_url}: {url.database} is not an SQLite database or is corrupt ({_first_line(err)})",
                hint="point --storage at the .db file `tuner run` wrote, or restore that file from a backup",
            ) from err
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


