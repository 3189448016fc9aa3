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
    "display_url",
    "is_shared_url",
    "open_storage",
    "check_run_storage",
    "check_storage_folder",
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


def study_storage_url(config: TunerConfig) -> str:
    """The config's Optuna storage URL: ``[storage] url``, else :func:`default_storage_url`."""
    return config.storage.url or default_storage_url(config.study.name)


def study_artifacts_dir(config: TunerConfig) -> Path:
    """The config's artifact folder: ``[storage] artifacts_dir``, else :func:`default_artifacts_dir`."""
    return Path(config.storage.artifacts_dir) if config.storage.artifacts_dir else default_artifacts_dir(config.study.name)


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
        from tuner.study.hosts import host_name

        kwargs["connect_args"] = {"connect_timeout": 10, "application_name": f"sglang-tuner {host_name()}"[:63]}
    return kwargs


def open_storage(url: str, *, heartbeat_interval_s: int | None = None, grace_period_s: int | None = None) -> BaseStorage:
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
    from tuner.study.hosts import RequeueOnce, schema_lock

    heartbeat: dict = {}
    if heartbeat_interval_s is not None:
        heartbeat = {"heartbeat_interval": int(heartbeat_interval_s), "grace_period": grace_period_s,
                     "heartbeat_stale_trial_callback": RequeueOnce()}
    try:
        with schema_lock(url, _engine_kwargs(url)):
            return RDBStorage(url, engine_kwargs=_engine_kwargs(url), **heartbeat)
    except ImportError as err:
        raise _driver_error(url, err) from err
    except (SQLAlchemyError, ValueError, RuntimeError) as err:
        raise _connect_error(url, err, hint="check [storage] url (e.g. sqlite:///studies/demo.db)") from err


def check_run_storage(url: str) -> None:
    """Check, creating nothing, that ``tuner run`` can keep its study in ``url``: call before any
    lock or restart.

    SQLite and ``:memory:`` pass (the folder rule is :func:`check_storage_folder`). A database
    server must be reachable with the URL's credentials, and be either empty or an Optuna storage:
    a database holding other tables and no Optuna ``studies`` table is someone else's.

    Raises:
        StudyError: Malformed URL, unknown dialect, missing driver, unreachable server, wrong
            credentials, missing database, or a database that is not a study storage.
    """
    if not is_shared_url(url):
        return
    try:
        parsed = make_url(url)
    except ArgumentError as err:
        raise StudyError(f"storage URL {url!r} is not a SQLAlchemy URL",
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


def _connect_error(url: str, err: BaseException, *, hint: str | None = None) -> StudyError:
    """One line for a database that refused us: which of server, credentials, database, and the fix."""
    text = _first_line(err)
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
    driver = err.name or _first_line(err)
    if driver.startswith("psycopg"):
        return StudyError(f"storage {display_url(url)} needs the PostgreSQL driver {driver!r}, which is not installed",
                          hint="pip install 'sglang-tuner[postgres]' (psycopg 3) and write postgresql+psycopg://...")
    return StudyError(f"storage {display_url(url)} needs the database driver {driver!r}, which is not installed",
                      hint=f"install it into the tuner's Python (pip install {driver}), or check the URL")


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
        raise _connect_error(storage_url, err) from err
    finally:
        engine.dispose()
    if not has_studies:
        raise StudyError(
            f"storage {display_url(storage_url)} holds no Optuna study",
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
        return sqlalchemy.create_engine(url, **_engine_kwargs(storage_url))
    except NoSuchModuleError as err:
        raise StudyError(
            f"storage URL {display_url(storage_url)} names an unknown database kind {url.drivername!r}",
            hint="check the URL, e.g. --storage sqlite:///studies/demo.db or postgresql+psycopg://...",
        ) from err
    except ImportError as err:
        raise _driver_error(storage_url, err) from err


def read_storage(storage_url: str) -> optuna.storages.RDBStorage:
    """Open an existing storage for reading (:func:`check_storage` first; no schema is created).

    Raises:
        StudyError: See :func:`check_storage`, or Optuna cannot open it (an older schema).
    """
    check_storage(storage_url)
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
    source study exists; the target is a new SQLite file in an existing folder, an existing
    storage, or an empty database, and holds no study of that name.

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
    source = read_storage(from_url)
    names = [s.study_name for s in optuna.get_all_study_summaries(source, include_best_trial=False)]
    if study_name not in names:
        raise StudyError(f"storage {display_url(from_url)} holds no study {study_name!r} "
                         f"(it holds {', '.join(names) or 'none'})", hint="pass one of those to --study")
    if to_url.startswith("sqlite:///"):
        folder = Path(to_url.removeprefix("sqlite:///")).parent
        if not folder.is_dir():
            raise StudyError(f"storage {to_url!r}: folder {str(folder)!r} does not exist",
                             hint="create it first, or copy into an existing folder")
    else:
        check_run_storage(to_url)
    target = open_storage(to_url)
    existing = [s.study_name for s in optuna.get_all_study_summaries(target, include_best_trial=False)]
    if target_name in existing:
        raise StudyError(f"storage {display_url(to_url)} already holds a study {target_name!r}",
                         hint="pass --to-study NEW_NAME, or copy into another storage")
    optuna.copy_study(from_study_name=study_name, from_storage=source, to_storage=target,
                      to_study_name=target_name)
    return len(optuna.load_study(study_name=target_name, storage=target).trials)
