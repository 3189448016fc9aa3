"""Safety of a tuning session: the per-unit lock, the state file, and signal handling.

A session changes a production service, so three things protect it:

* **Lock** (:class:`UnitLock`): one ``fcntl.flock`` file per unit under the state folder. The
  kernel drops it when the holder dies (even by SIGKILL), so a stale lock never blocks; while it
  is held, a second tuner is refused with the holder's PID and command line.
* **State file** (:class:`StateStore`, :class:`SessionState`): written atomically *before the first
  change*, recording the original command, drop-ins and whether the service was running. After a
  crash or ``kill -9`` it is what ``tuner restore`` (and the next session) put back.
* **Signals** (:func:`interrupt_on_signals`, :func:`deferred_signals`): SIGINT and SIGTERM become
  ``KeyboardInterrupt`` so the session's ``finally`` restores the service; during the restore
  itself further signals are deferred, not allowed to cut it short.

:class:`GuardedLauncher` is where the three meet: the base every launcher extends, owning the
session (lock → state file → signals → restore), and the fail-fast watch loop (``wait``/``state``)
that feeds the server's output to :class:`tuner.sglang.logs.LogWatcher`. Subclasses supply only
how to read, start, poll, stop and put back their service.
"""

from __future__ import annotations

import abc
import contextlib
import datetime as dt
import fcntl
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tuner.errors import LaunchError, LockHeldError, TunerError
from tuner.launch.base import Launcher, LaunchPhase, LaunchState
from tuner.launch.unit import atomic_write_text
from tuner.sglang.client import SGLangClient
from tuner.sglang.failures import Failure, FailureClass
from tuner.sglang.logs import LogWatcher

__all__ = [
    "default_state_dir",
    "UnitLock",
    "SessionState",
    "StateStore",
    "interrupt_on_signals",
    "deferred_signals",
    "GuardedLauncher",
    "ServerPoll",
]

log = logging.getLogger(__name__)


def default_state_dir() -> Path:
    """Where locks and state files live by default.

    ``/var/lib/sglang-tuner`` for root (it drives system units), else
    ``$XDG_STATE_HOME/sglang-tuner`` (``~/.local/state/sglang-tuner``).
    """
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
        raise LaunchError(f"cannot create the state folder {path}: {err.strerror}",
                          hint="set service.state_dir to a writable folder") from err


def _own_command() -> str:
    return " ".join(sys.argv) or sys.executable


class UnitLock:
    """An exclusive, crash-safe lock on one unit (``<state_dir>/<unit>.lock``).

    Args:
        state_dir: Folder for lock files (created if missing).
        key: The unit name (or the process launcher's name).

    Use as a context manager, or :meth:`acquire` / :meth:`release`.
    """

    def __init__(self, state_dir: Path | str, key: str) -> None:
        self.key = key
        self.path = Path(state_dir) / f"{_safe_key(key)}.lock"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def holder(self) -> dict[str, Any]:
        """What the lock file says about its holder (``pid``, ``command``, ``since``); may be stale."""
        try:
            return json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self) -> None:
        """Take the lock without waiting.

        Raises:
            LockHeldError: Another process holds it (the message names its PID and command).
            LaunchError: The state folder is not writable.
        """
        if self._fd is not None:
            return
        _ensure_dir(self.path.parent)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise LaunchError(f"cannot open the lock file {self.path}: {err.strerror}",
                              hint="set service.state_dir to a writable folder") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            h = self.holder()
            raise LockHeldError(
                f"{self.key} is being tuned by another tuner: PID {h.get('pid', '?')} "
                f"({h.get('command', 'unknown command')}) since {h.get('since', '?')}",
                hint=f"wait for it to finish or stop it (kill {h.get('pid', 'PID')}); "
                "it restores the service on exit",
            ) from None
        info = {"pid": os.getpid(), "command": _own_command(),
                "since": dt.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Release the lock (the file stays; its content is cleared)."""
        if self._fd is None:
            return
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
    """The state file of one unit: ``<state_dir>/<unit>.state.json``, written atomically.

    Args:
        state_dir: Folder for state files (created on first save).
        key: Unit name or process launcher name.
    """

    def __init__(self, state_dir: Path | str, key: str) -> None:
        self.path = Path(state_dir) / f"{_safe_key(key)}.state.json"

    def save(self, state: SessionState) -> None:
        """Write the state atomically.

        Raises:
            LaunchError: The state folder is not writable.
        """
        _ensure_dir(self.path.parent)
        try:
            atomic_write_text(self.path, state.model_dump_json(indent=2) + "\n", mode=0o600)
        except OSError as err:
            raise LaunchError(f"cannot write the state file {self.path}: {err.strerror}",
                              hint="set service.state_dir to a writable folder") from err

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


class GuardedLauncher(Launcher):
    """The session discipline and the fail-fast watch loop, written once for every launcher.

    Subclasses (:class:`~tuner.launch.systemd.SystemdLauncher`,
    :class:`~tuner.launch.process.ProcessLauncher`) implement how to read the original, start,
    poll and stop; this class owns the lock, the state file, signals, :meth:`wait` and
    :meth:`state`. Log lines go through :class:`tuner.sglang.logs.LogWatcher`, so a failure line
    ends a wait within one poll (plus :attr:`evidence_grace_s` for more specific evidence).

    Args:
        key: The unit name (or process launcher name) locks and state files are keyed by.
        url: Base URL of the server.
        state_dir: Folder for the lock and the state file.
        gpu: Optional :class:`tuner.gpu.GPUMonitor`: before each start the previous server's GPU
            memory must be released (§1.2) and no foreign process may hold any.
        allow_foreign: Start even when a foreign process holds GPU memory.
        poll_s: Interval of the watch loop.
        release_timeout_s: Limit for the GPU memory of a stopped server to be freed.
        evidence_grace_s: After a first failure line, how long to wait for the process to exit
            and more specific evidence to arrive.
        ready_line_grace_s: READY needs ``/health`` and the ready line (§4.2); after ``/health``
            has answered this long without the line (output not reaching the launcher), READY.
    """

    kind: Literal["systemd", "process"]

    def __init__(
        self,
        *,
        key: str,
        url: str,
        state_dir: Path | str,
        gpu: Any | None = None,
        allow_foreign: bool = False,
        poll_s: float = 0.25,
        release_timeout_s: float = 120.0,
        evidence_grace_s: float = 1.5,
        ready_line_grace_s: float = 10.0,
    ) -> None:
        self.key = key
        self.url = url.rstrip("/")
        self.state_dir = Path(state_dir)
        self.gpu = gpu
        self.allow_foreign = allow_foreign
        self.poll_s = poll_s
        self.release_timeout_s = release_timeout_s
        self.evidence_grace_s = evidence_grace_s
        self.lock = UnitLock(self.state_dir, key)
        self.store = StateStore(self.state_dir, key)
        self._state: SessionState | None = None
        self._watcher = LogWatcher()
        self._lines: list[str] = []
        self._t0 = time.monotonic()
        self._started = False
        self._healthy_since: float | None = None
        self.ready_line_grace_s = ready_line_grace_s
        self._client = SGLangClient(self.url, timeout_s=2.0)
        self.settings: dict[str, Any] = {}
        """Settings this launcher was built from (see :mod:`tuner.launch.factory`); recorded in
        the state file so ``tuner restore`` can rebuild it."""

    # ---- hooks for subclasses -----------------------------------------------------------

    @abc.abstractmethod
    def _record_original(self) -> SessionState:
        """Read the service as it is now (command, drop-ins, running or not), changing nothing."""

    @abc.abstractmethod
    def _own_settings(self) -> dict[str, Any]:
        """Factory settings that rebuild this launcher (used when :attr:`settings` is empty)."""

    @abc.abstractmethod
    def _read_argv(self) -> list[str]:
        """The service's command line as configured now."""

    @abc.abstractmethod
    def _launch(self, argv: list[str]) -> None:
        """Start the (already stopped) server with ``argv``."""

    @abc.abstractmethod
    def _poll(self) -> ServerPoll:
        """New output lines since the last poll and the manager's view of the server."""

    def _check_startable(self) -> None:
        """Refuse a session whose server could not be started (default: nothing to check).

        Raises:
            LaunchError: Something outside the tuner prevents the start.
        """

    def has_leftover_change(self) -> bool:
        """Whether the service carries a tuner change no state file records (a stray trial drop-in)."""
        return False

    @abc.abstractmethod
    def _put_back(self, state: SessionState) -> None:
        """Put the original configuration back; start it when ``state.was_running``, else stop."""

    # ---- shared behaviour ---------------------------------------------------------------

    def current_argv(self) -> list[str]:
        """The original command: the recorded one inside a session, else what runs now.

        Raises:
            LaunchError: The unit is unknown or its command cannot be read.
        """
        if self._state is not None:
            return list(self._state.original_argv)
        return self._read_argv()

    def start(self, argv: list[str]) -> None:
        """Stop the server, wait for its GPU memory to be freed, start it with ``argv``.

        .. note:: Changes the production service; call inside :meth:`session`.

        Raises:
            LaunchError: The start could not be issued.
            GPUError: GPU memory was not released in time, or a foreign process holds some.
        """
        if not argv:
            raise LaunchError("empty server command", hint="pass the full server command line")
        self.stop()
        self._before_start()
        self._watcher = LogWatcher()
        self._lines = []
        self._t0 = time.monotonic()
        self._started = True
        self._healthy_since = None
        self._launch(list(argv))

    def _before_start(self) -> None:
        if self.gpu is None:
            return
        self.gpu.wait_released(timeout_s=self.release_timeout_s, allow_foreign=self.allow_foreign)
        self.gpu.check_foreign(allow_foreign=self.allow_foreign)

    def _feed(self, lines: list[str]) -> None:
        for line in lines:
            self._lines.append(line)
            self._watcher.feed(line)

    def _healthy(self) -> bool:
        try:
            return bool(self._client.health())
        except TunerError:
            return False

    def state(self) -> LaunchState:
        """The server's state now (one poll of the manager, the log and ``/health``).

        Raises:
            LaunchError: The service manager cannot be queried.
        """
        elapsed = time.monotonic() - self._t0
        if not self._started:
            return LaunchState(phase=LaunchPhase.STOPPED, elapsed_s=elapsed)
        poll = self._poll()
        self._feed(poll.lines)
        if not poll.alive and poll.stopped_by_us:
            return LaunchState(phase=LaunchPhase.STOPPED, restarts=poll.restarts, elapsed_s=elapsed)
        if not poll.alive:
            status = poll.exit_status
            failure = self._watcher.report(exit_status=status).failure
            if poll.crash_loop and (failure is None or failure.failure_class is FailureClass.CRASH):
                why = f"; {failure.evidence}" if failure else ""
                failure = Failure(failure_class=FailureClass.CRASH, evidence=poll.crash_loop + why,
                                  exit_status=status)
            if failure is None and status != 0:
                failure = Failure(failure_class=FailureClass.CRASH, exit_status=status,
                                  evidence=f"server exited (status {status}) with no failure line")
            phase = LaunchPhase.FAILED if failure else LaunchPhase.EXITED
            return LaunchState(phase=phase, failure=failure, pid=None, restarts=poll.restarts,
                               elapsed_s=elapsed)
        if self._watcher.failure is not None:
            return LaunchState(phase=LaunchPhase.FAILED, failure=self._watcher.failure,
                               pid=poll.pid, restarts=poll.restarts, elapsed_s=elapsed)
        if self._healthy():
            now = time.monotonic()
            self._healthy_since = self._healthy_since or now
            # SGLang answers /health before its warm-up ends; the ready line marks the end. Output
            # that never reaches the launcher (StandardOutput=file:...) must not block for ever.
            if self._watcher.ready or now - self._healthy_since >= self.ready_line_grace_s:
                return LaunchState(phase=LaunchPhase.READY, pid=poll.pid, restarts=poll.restarts,
                                   elapsed_s=elapsed)
        else:
            self._healthy_since = None
        return LaunchState(phase=LaunchPhase.STARTING, pid=poll.pid, restarts=poll.restarts,
                           elapsed_s=elapsed)

    def wait(self, timeout_s: float) -> LaunchState:
        """Block until READY, FAILED, EXITED or STOPPED, or ``timeout_s`` (FAILED/startup_timeout).

        A failure line ends the wait at once, after at most :attr:`evidence_grace_s` for the
        process to exit and more specific evidence (§4.3) to arrive; the failed server is then
        stopped so that a ``Restart=`` policy cannot loop on it.

        Raises:
            LaunchError: The service manager cannot be queried.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.state()
            if st.phase is LaunchPhase.FAILED and st.pid is not None:
                st = self._settle(st)
            if st.phase is not LaunchPhase.STARTING:
                if st.phase is LaunchPhase.FAILED:
                    self.stop()
                return st
            if time.monotonic() >= deadline:
                last = next((x for x in reversed(self._lines) if x.strip()), "no output")
                return st.model_copy(update={"phase": LaunchPhase.FAILED, "failure": Failure(
                    failure_class=FailureClass.STARTUP_TIMEOUT,
                    evidence=f"not ready after {timeout_s:.0f} s; last line: {last[-300:]}",
                )})
            time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))

    def _settle(self, first: LaunchState) -> LaunchState:
        """After a failure line: wait briefly for the exit and the most specific evidence."""
        end = time.monotonic() + self.evidence_grace_s
        st = first
        while time.monotonic() < end:
            time.sleep(self.poll_s)
            st = self.state()
            if st.pid is None:
                break
        if st.phase is not LaunchPhase.FAILED:
            st = first
        failure = self._watcher.report(exit_status=st.failure.exit_status if st.failure else None).failure
        return st.model_copy(update={"failure": failure or st.failure})

    def logs(self) -> list[str]:
        """Every server output line since the last :meth:`start`, in order."""
        return list(self._lines)

    def restore(self, timeout_s: float = 900.0) -> LaunchState:
        """Put back the recorded original and wait until healthy (when it was running).

        Uses the session's state, else the state file a killed tuner left; without either, a
        leftover trial change (the systemd trial drop-in) is removed and the service restarted,
        and when there is none nothing is touched (so ``tuner restore`` is safe to run at any
        time, e.g. as ``ExecStopPost=``). Takes the unit's lock when not already held. Clears the
        state file on success.

        .. note:: Changes the production service.

        Raises:
            LockHeldError: Another live tuner holds the unit.
            LaunchError: The original could not be put back or did not become healthy.
        """
        owned = not self.lock.held
        if owned and self._state is None and self.store.load() is None:
            self._record_original()  # an unknown unit fails here, before a lock file is created
        if owned:
            self.lock.acquire()
        try:
            state = self._state or self.store.load()
            if state is None:
                state = self._record_original()
                if not self.has_leftover_change():
                    log.info("%s: no state file and no trial change; nothing to restore", self.key)
                    phase = LaunchPhase.READY if self._healthy() else LaunchPhase.STOPPED
                    return LaunchState(phase=phase)
            self._watcher = LogWatcher()
            self._lines = []
            self._t0 = time.monotonic()
            self._started = True
            self._healthy_since = None
            if state.was_running:
                self.stop()
                self._before_start_restore()
            self._put_back(state)
            if state.was_running:
                st = self.wait(timeout_s)
                if st.phase is not LaunchPhase.READY:
                    why = st.failure.evidence if st.failure else st.phase.value
                    raise LaunchError(
                        f"{self.key} did not come back healthy on its original command: {why}",
                        hint=f"the state file {self.store.path} is kept; fix the service, "
                        "then run 'tuner restore' again",
                    )
            else:
                st = LaunchState(phase=LaunchPhase.STOPPED)
            self.store.clear()
            self._state = None
            return st
        finally:
            if owned:
                self.lock.release()

    def _before_start_restore(self) -> None:
        if self.gpu is not None:
            self.gpu.wait_released(timeout_s=self.release_timeout_s, allow_foreign=self.allow_foreign)

    @contextlib.contextmanager
    def session(self) -> Iterator[GuardedLauncher]:
        """Hold the lock and the state file; restore the original on exit, SIGINT or SIGTERM.

        A state file left by a killed tuner is adopted: its recorded original (not the current,
        half-changed service) is what this session restores.

        Raises:
            LockHeldError: Another tuner holds this unit.
            LaunchError: The service cannot be read, the state file written, or the server could
                not be started (e.g. a foreign program holds the process launcher's port).
        """
        self.lock.acquire()
        try:
            self._check_startable()
            left = self.store.load()
            if left is not None:
                log.warning("adopting the state left by tuner PID %s (%s); its original is what "
                            "will be restored", left.tuner_pid, left.created_at)
                self._state = left
            else:
                state = self._record_original()
                recipe = {**self._own_settings(), **self.settings}
                self._state = state.model_copy(update={"extra": {**state.extra, "settings": recipe}})
                self.store.save(self._state)
            with interrupt_on_signals():
                try:
                    yield self
                finally:
                    with deferred_signals():
                        self.restore()
        finally:
            self._state = None
            self.lock.release()


class ServerPoll(BaseModel):
    """One look at the server by its manager (what a launcher's ``_poll`` returns).

    Attributes:
        lines: Output lines since the previous poll.
        alive: The server process exists (starting or serving).
        pid: Its PID as the manager sees it.
        exit_status: Exit status when it ended (``None`` unknown).
        restarts: Restarts by the manager since the start.
        crash_loop: Non-empty evidence when the manager is restarting a dying server.
        stopped_by_us: The server is down because the tuner stopped it.
    """

    lines: list[str] = Field(default_factory=list)
    alive: bool = True
    pid: int | None = None
    exit_status: int | None = None
    restarts: int = 0
    crash_loop: str = ""
    stopped_by_us: bool = False
