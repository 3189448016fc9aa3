"""The session's safety parts: the per-unit lock, the state file, and signal handling.

A session changes a production service, so three things protect it:

* **Lock** (:class:`UnitLock`): one ``fcntl.flock`` file per unit per host
  (``/run/lock/sglang-tuner/<unit>.lock``, whatever the state folder and the study). The kernel
  drops it when the holder dies (even by SIGKILL), so a stale lock never blocks; while it is held,
  a second tuner (``run``, ``apply``, ``restore``) is refused with the holder's PID and command
  line (passwords masked, :func:`mask_secrets`). The file is ``0600`` and removed when its holder
  releases it; one a killed holder left is taken over.
* **State file** (:class:`StateStore`, :class:`SessionState`): written atomically *before the first
  change*, recording the original command, drop-ins and whether the service was running. After a
  crash or ``kill -9`` it is what ``tuner restore`` (and the next session) put back.
* **Signals** (:func:`interrupt_on_signals`, :func:`deferred_signals`): SIGINT and SIGTERM become
  ``KeyboardInterrupt`` so the session's ``finally`` restores the service; during the restore
  itself further signals are deferred, not allowed to cut it short.

They meet in :class:`tuner.launch.base.GuardedLauncher`, the base every launcher extends, which
owns the session (preflight → lock → state file → signals → restore).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import psutil
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tuner.errors import LaunchError, LockHeldError
from tuner.launch.unit import atomic_write_text, disk_full

__all__ = [
    "LOCK_DIR_ENV",
    "mask_secrets",
    "default_lock_dir",
    "default_state_dir",
    "writable_folder",
    "full_folder",
    "UnitLock",
    "SessionState",
    "StateStore",
    "interrupt_on_signals",
    "deferred_signals",
]

log = logging.getLogger(__name__)


def default_state_dir() -> Path:
    """Where state files (the restore recipes) live by default (locks: :func:`default_lock_dir`).

    ``$SGLANG_TUNER_STATE_DIR`` when set (a private folder for a test run or a second
    installation), else ``/var/lib/sglang-tuner`` for root (it drives system units), else
    ``$XDG_STATE_HOME/sglang-tuner`` (``~/.local/state/sglang-tuner``).
    """
    if os.environ.get("SGLANG_TUNER_STATE_DIR"):
        return Path(os.environ["SGLANG_TUNER_STATE_DIR"])
    if os.geteuid() == 0:
        return Path("/var/lib/sglang-tuner")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "sglang-tuner"


def _safe_key(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]", "_", key)


def _ensure_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _write_error(err, path, "the state folder") from err


_FREE_HINT = "free space on it (df -h {folder}), or set service.state_dir to a folder on another disk"


def _write_error(err: OSError, path: Path, what: str) -> LaunchError:
    """A failed write under the state folder as one line: a full disk named as such."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return LaunchError(f"the disk holding {what} {path} is full",
                           hint=_FREE_HINT.format(folder=_nearest_existing(path)))
    return LaunchError(f"cannot write {what} {path}: {err.strerror}",
                       hint="set service.state_dir to a writable folder with free space")


def _nearest_existing(folder: Path) -> Path:
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+@")
_KEY_PASSWORD = re.compile(r"(?P<head>(?:password|passwd|pwd)=)[^&\s]+", re.IGNORECASE)


def mask_secrets(text: str) -> str:
    """``text`` with every password it holds replaced by ``***``: the one of a URL's user part
    (``postgresql+psycopg://tuner:***@db/tuner``, as ``--storage`` takes it) and ``password=...``
    (a libpq query parameter). For any command line the tuner keeps or shows (lock file, state
    file, the "being tuned by another tuner" refusal, logs)."""
    return _KEY_PASSWORD.sub(r"\g<head>***", _URL_PASSWORD.sub(r"\g<head>***@", text))


def _own_command() -> str:
    """This process's command line as the kernel has it (``tuner run --config ...``), one line,
    passwords masked (:func:`mask_secrets`)."""
    try:
        words = psutil.Process().cmdline()
    except psutil.Error:
        words = list(sys.argv)
    text = mask_secrets(" ".join(re.sub(r"[\x00-\x1f\x7f\s]+", " ", w) for w in words).strip())  # one line, always
    return (text[:297] + "...") if len(text) > 300 else (text or sys.executable)


def writable_folder(folder: Path) -> Path | None:
    """``None`` when files can be created under ``folder`` (it, or its nearest existing ancestor, is
    a writable folder on a file system with blocks), else the folder that blocks it. A virtual file
    system (``/proc``, ``/sys``: no blocks) blocks: root's permission check passes there, yet no file
    or folder can be created. Changes nothing."""
    probe = _nearest_existing(folder)
    if probe.is_dir() and os.access(probe, os.W_OK | os.X_OK) and not virtual_fs(probe):
        return None
    return probe


def virtual_fs(folder: Path) -> bool:
    """Whether ``folder`` is on a file system without blocks (procfs, sysfs), where root's
    permission check passes yet no file can be created; ``False`` when it cannot be examined."""
    try:
        return os.statvfs(folder).f_blocks == 0
    except OSError:
        return False


def full_folder(folder: Path) -> tuple[Path, str] | None:
    """``None`` when the disk holding ``folder`` (or its nearest existing ancestor) has room for the
    tuner's files, else ``(that folder, why)`` (e.g. ``"0 KiB free"``; see
    :func:`tuner.launch.unit.disk_full`). Changes nothing."""
    probe = _nearest_existing(folder)
    why = disk_full(probe)
    return (probe, why) if why else None


LOCK_DIR_ENV = "SGLANG_TUNER_LOCK_DIR"
"""Environment variable overriding :func:`default_lock_dir` (tests, hosts without ``/run/lock``)."""


def default_lock_dir() -> Path:
    """The host-wide folder of unit locks: one lock per unit per host, whatever the state folder.

    ``$SGLANG_TUNER_LOCK_DIR`` when set; else ``/run/lock/sglang-tuner`` (a tmpfs, emptied at boot)
    when ``/run/lock`` is writable; else ``$XDG_RUNTIME_DIR/sglang-tuner``, else
    ``<tmp>/sglang-tuner-locks``.
    """
    env = os.environ.get(LOCK_DIR_ENV)
    if env:
        return Path(env)
    run_lock = Path("/run/lock")
    if run_lock.is_dir() and os.access(run_lock, os.W_OK | os.X_OK):
        return run_lock / "sglang-tuner"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "sglang-tuner"
    return Path(tempfile.gettempdir()) / "sglang-tuner-locks"


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the process a lock file names still runs (same PID *and* start time: PIDs are reused)."""
    pid, since = holder.get("pid"), holder.get("start_time")
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    started = _start_time(pid)
    return started is not None and (since is None or abs(started - float(since)) < 1.0)


class UnitLock:
    """The host-wide, crash-safe lock on one unit: ``<lock_dir>/<unit>.lock``.

    One lock per unit per host, whatever the tuner's ``state_dir`` and study: ``tuner run``,
    ``apply``, ``restore`` and ``launch`` all take it before their first change. It is an
    ``fcntl.flock`` the kernel drops when the holder dies (even by SIGKILL); the file records the
    holder's PID, process start time, command line and state file, so a refusal names the holder
    and a lock left by a crash is known stale (its PID gone, or reused by a process started at
    another time).

    Args:
        key: The unit name (or the process launcher's name).
        lock_dir: Folder of lock files (default :func:`default_lock_dir`; created if missing).
        state_file: The holder's state file, recorded for ``tuner restore`` hints.

    Use as a context manager, or :meth:`acquire` / :meth:`release`.
    """

    def __init__(self, key: str, *, lock_dir: Path | str | None = None, state_file: Path | None = None) -> None:
        self.key = key
        self.path = Path(lock_dir or default_lock_dir()) / f"{_safe_key(key)}.lock"
        self.state_file = state_file
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def holder(self) -> dict[str, Any]:
        """What the lock file says about its holder (``pid``, ``start_time``, ``command``, ``since``,
        ``state_file``); empty when released; may be stale."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _held_error(self) -> LockHeldError:
        h = self.holder()
        return LockHeldError(
            f"{self.key} is being tuned by another tuner: PID {h.get('pid', '?')} "
            f"({mask_secrets(str(h.get('command', 'unknown command')))}) since {h.get('since', '?')}",
            hint=f"wait for it to finish or stop it (kill {h.get('pid', 'PID')}); it restores the service on exit",
        )

    def acquire(self) -> None:
        """Take the lock without waiting.

        Raises:
            LockHeldError: Another process holds it (the message names its PID and command); or a
                holder that died (``kill -9``) left a state file in another state folder, which
                ``tuner restore`` must use first (the message names the command).
            LaunchError: The lock folder is not writable.
        """
        if self._fd is not None:
            return
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise LaunchError(f"cannot create the lock folder {folder}: {err.strerror}",
                              hint=f"run as root, or set ${LOCK_DIR_ENV} to a writable folder") from err
        fd = self._open_locked()
        previous = self.holder()
        if previous and _alive(previous):
            # The file was replaced under a live holder (deleted and re-created): still its lock.
            os.close(fd)
            raise self._held_error()
        left = previous.get("state_file")
        if left and left != str(self.state_file) and Path(left).exists():
            # A killed tuner with another state folder left its restore recipe: putting the service
            # back from it first keeps the original (and spares a second restart of the service).
            os.close(fd)
            raise LockHeldError(
                f"{self.key}: tuner PID {previous.get('pid', '?')} ({mask_secrets(str(previous.get('command', '?')))}) ended "
                f"without restoring it and left its state in {left}",
                hint=f"put the service back first: tuner restore --unit {self.key} --state-dir {Path(left).parent}",
            )
        if previous.get("pid"):
            log.info("%s: taking over the lock of tuner PID %s, which ended without releasing it "
                     "(kill -9 or a crash)", self.key, previous["pid"])
        info = {"pid": os.getpid(), "start_time": _start_time(os.getpid()), "command": _own_command(),
                "since": dt.datetime.now().isoformat(timespec="seconds"),
                "state_file": str(self.state_file) if self.state_file else None}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            os.fsync(fd)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise LaunchError(f"the disk holding the lock file {self.path} is full",
                                  hint=f"free space on it (df -h {folder}), or set ${LOCK_DIR_ENV} to a "
                                  "folder on another disk") from err
            raise LaunchError(f"cannot write the lock file {self.path}: {err.strerror}",
                              hint=f"run as root, or set ${LOCK_DIR_ENV} to a writable folder") from err
        self._fd = fd

    def _open_locked(self) -> int:
        """Open (creating it ``0600``: it names the holder's command) and lock the lock file.

        A releasing holder removes the file while it still holds the lock (:meth:`release`), so a
        lock taken on a file that is no longer the one at :attr:`path` (removed or replaced in
        between) is dropped and the open is tried again: two tuners never hold two inodes of one
        path.

        Raises:
            LockHeldError: Another process holds it.
            LaunchError: The lock file cannot be opened.
        """
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            except OSError as err:
                raise LaunchError(f"cannot open the lock file {self.path}: {err.strerror}",
                                  hint=f"run as root, or set ${LOCK_DIR_ENV} to a writable folder") from err
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._held_error() from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                with contextlib.suppress(OSError):
                    os.fchmod(fd, 0o600)  # a lock file an older version made world-readable
                return fd
            os.close(fd)

    def release(self) -> None:
        """Release the lock and remove the lock file: only the file this object locked, while it
        still holds it (a waiting tuner that opened it meanwhile sees it gone and opens anew)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(self._fd), os.stat(self.path, follow_symlinks=False)):
                self.path.unlink()
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> UnitLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SessionState(BaseModel):
    """What a session changed, recorded before the first change (the restore recipe).

    Attributes:
        launcher: ``systemd`` or ``process``.
        key: Unit name (systemd) or the process launcher's name.
        original_argv: The command the service ran before the session.
        original_prefix: systemd executable prefix of the original ``ExecStart=``.
        original_dropins: systemd: every ``*.conf`` in the unit's drop-in folder, name → content.
        dropin_folder_existed: systemd: whether the drop-in folder existed.
        was_running: Whether the service was running (active) before the session; restore brings
            it back up and healthy only then, otherwise leaves it stopped.
        tuner_pid: PID of the tuner that wrote the state.
        tuner_command: Its command line.
        created_at: ISO time the state was written.
        extra: Launcher-specific details (e.g. the process launcher's server record).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    launcher: Literal["systemd", "process"]
    key: str
    original_argv: list[str]
    original_prefix: str = ""
    original_dropins: dict[str, str] = Field(default_factory=dict)
    dropin_folder_existed: bool = False
    was_running: bool = True
    tuner_pid: int = Field(default_factory=os.getpid)
    tuner_command: str = Field(default_factory=_own_command)
    created_at: str = Field(
        default_factory=lambda: dt.datetime.now().isoformat(timespec="seconds")
    )
    extra: dict[str, Any] = Field(default_factory=dict)


class StateStore:
    """The state file of one unit: ``<state_dir>/<unit>.state.json``, written atomically; beside
    it, the run's work folder ``<unit>.work/`` (per-trial files until they are uploaded: removed by
    the next run or ``tuner restore`` when a killed run left it) and the result journal
    ``<unit>.results.jsonl`` (:class:`tuner.study.outage.ResultJournal`).

    Args:
        state_dir: Folder for state files (created on first save).
        key: Unit name or process launcher name.
    """

    def __init__(self, state_dir: Path | str, key: str) -> None:
        self.path = Path(state_dir) / f"{_safe_key(key)}.state.json"
        self.work_dir = Path(state_dir) / f"{_safe_key(key)}.work"
        self.journal_path = Path(state_dir) / f"{_safe_key(key)}.results.jsonl"

    def fresh_work_dir(self) -> Path:
        """The work folder, emptied of what a killed run left (call under the unit's lock).

        Raises:
            LaunchError: The state folder is not writable.
        """
        self.drop_work_dir()
        try:
            self.work_dir.mkdir(parents=True, mode=0o700)
        except OSError as err:
            raise _write_error(err, self.work_dir, "the work folder") from err
        return self.work_dir

    def drop_work_dir(self) -> None:
        """Remove the work folder and what is in it (call under the unit's lock)."""
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def save(self, state: SessionState) -> None:
        """Write the state atomically.

        Raises:
            LaunchError: The state folder is not writable, or its disk is full (named as such).
        """
        _ensure_dir(self.path.parent)
        try:
            atomic_write_text(self.path, state.model_dump_json(indent=2) + "\n", mode=0o600)
        except OSError as err:
            raise _write_error(err, self.path, "the state file") from err

    def load(self) -> SessionState | None:
        """The recorded state, or ``None`` when no session left one.

        Raises:
            LaunchError: The file exists but is unreadable or malformed.
        """
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as err:
            raise LaunchError(f"cannot read the state file {self.path}: {err.strerror}",
                              hint="run as the user that ran the tuner") from err
        try:
            return SessionState.model_validate_json(text)
        except ValidationError as err:
            raise LaunchError(
                f"the state file {self.path} is malformed ({err.error_count()} errors)",
                hint="inspect it, put the service back by hand, then delete the file",
            ) from err

    def clear(self) -> None:
        """Delete the state file (after a successful restore)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into ``KeyboardInterrupt`` inside the block (main thread only).

    The previous handlers come back on exit. Outside the main thread this does nothing (Python
    delivers signals to the main thread only).
    """
    if not _in_main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def deferred_signals() -> Iterator[list[int]]:
    """Hold SIGINT/SIGTERM during a restore; yields the list of signals received meanwhile.

    A restore cut short leaves the service down, which is worse than a slow exit, so signals are
    logged and recorded instead of interrupting.
    """
    received: list[int] = []
    if not _in_main_thread():
        yield received
        return

    def note(signum: int, _frame: object) -> None:
        received.append(signum)
        log.warning("%s received during restore; finishing the restore first",
                    signal.Signals(signum).name)

    previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


