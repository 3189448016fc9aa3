"""The launcher contract: how a trial restarts the SGLang server with candidate flags, and
:class:`GuardedLauncher`, the base every launcher extends: it owns the session (lock → state file
→ signals → restore, from :mod:`tuner.launch.session`) and the fail-fast watch loop
(``wait``/``state``) that feeds the server's output to :class:`tuner.sglang.logs.LogWatcher`.
Subclasses supply only how to check, read, start, poll, stop and put back their service.

What it never does: stop a service it then cannot start again. :meth:`GuardedLauncher.preflight`
checks, changing nothing, everything a session will need (manager, unit, drop-in folder, journal,
state and lock folders); :meth:`GuardedLauncher.start` checks it can write the trial's change
before it stops the server; :meth:`GuardedLauncher.restore` checks it can write what it must put
back before it stops anything, and otherwise leaves the running service alone and says what to fix.

Implementations: :mod:`tuner.launch.systemd` (production) and :mod:`tuner.launch.process`
(hosts without systemd, the demo). Both pass one conformance test class
(``tests/support/conformance.py``).

Lifecycle used by a trial::

    launcher = SystemdLauncher(...)          # or ProcessLauncher(...)
    with launcher.session():                 # lock + state file; restores on exit/SIGINT/SIGTERM
        base = launcher.current_argv()
        argv = replace_flags(base, candidate)   # tuner.sglang.flags
        print(launcher.dry_run(argv))
        launcher.start(argv)
        state = launcher.wait(timeout_s=900)    # READY, or FAILED with a classified Failure
        lines = launcher.logs()                 # every server line since start()
    # the original service is back and healthy here

Lifecycle used by ``tuner apply`` (a change that stays)::

    with launcher.session(restore_on_exit=False):  # lock + state file; refuses a killed run's leftovers
        launcher.start(argv)
        if launcher.wait(timeout_s=900).phase is LaunchPhase.READY and verified:
            launcher.commit()                # the change stays: the state file is cleared
        else:
            launcher.restore()               # the rollback: the recorded original, healthy
    # a kill before commit() or restore() leaves the state file: `tuner restore` puts it back
"""

from __future__ import annotations

import abc
import contextlib
import logging
import time
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tuner.errors import LaunchError, TunerError
from tuner.launch.session import (
    LOCK_DIR_ENV,
    SessionState,
    StateStore,
    UnitLock,
    deferred_signals,
    full_folder,
    interrupt_on_signals,
    writable_folder,
)
from tuner.sglang.client import SGLangClient
from tuner.sglang.failures import Failure, FailureClass
from tuner.sglang.logs import LogWatcher

__all__ = ["LaunchPhase", "LaunchState", "Launcher", "GuardedLauncher", "ServerPoll"]

log = logging.getLogger(__name__)


class LaunchPhase(str, Enum):
    """Where a launched server is."""

    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    EXITED = "exited"
    STOPPED = "stopped"


class LaunchState(BaseModel):
    """A launcher's view of the server.

    Attributes:
        phase: See :class:`LaunchPhase`.
        failure: The classified failure when ``phase`` is FAILED (or EXITED unexpectedly).
        pid: Main PID as the launcher sees it (inside the PID namespace for sandboxed systemd).
        restarts: How many times the service manager restarted it since :meth:`Launcher.start`
            (systemd ``NRestarts``); 0 for the process launcher.
        elapsed_s: Seconds since :meth:`Launcher.start`.
    """

    model_config = ConfigDict(frozen=True)

    phase: LaunchPhase
    failure: Failure | None = None
    pid: int | None = None
    restarts: int = 0
    elapsed_s: float = 0.0


class Launcher(abc.ABC):
    """Restart the SGLang server with a candidate command line, watch it, and put it back.

    .. note:: Every method but :meth:`current_argv` and :meth:`dry_run` touches the production
       service. Call them inside :meth:`session` so the original is restored on any exit.
    """

    url: str
    """Base URL of the server (``http://127.0.0.1:30000``)."""
    store: StateStore
    """The unit's state file, and beside it the run's work folder and result journal."""
    restored_on_exit = False
    """Whether the last :meth:`session`'s exit restored the service, and the restore succeeded
    (``False`` when it changed nothing and so restarted nothing)."""

    @abc.abstractmethod
    def current_argv(self) -> list[str]:
        """The command line the service runs now (before any change by the tuner).

        Raises:
            LaunchError: The unit is unknown or its ExecStart cannot be read.
        """

    @abc.abstractmethod
    def dry_run(self, argv: list[str]) -> str:
        """What :meth:`start` with ``argv`` would change (drop-in text, command diff), as text."""

    @abc.abstractmethod
    def start(self, argv: list[str]) -> None:
        """Stop the running server (waiting until its GPU memory is free), start it with ``argv``.

        Returns as soon as the start was issued; use :meth:`wait` for the outcome.

        Raises:
            LaunchError: The start could not be issued (permission, systemctl missing).
        """

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> LaunchState:
        """Block until READY, FAILED or EXITED, or ``timeout_s`` (then FAILED/startup_timeout).

        Fails fast: a known failure line or a dead process ends the wait within about a second.
        A crash loop (growing restart count) is detected and the unit stopped.
        """

    @abc.abstractmethod
    def state(self) -> LaunchState:
        """The current state without waiting (used during load phases to spot a runtime crash)."""

    @abc.abstractmethod
    def logs(self) -> list[str]:
        """Every server output line since the last :meth:`start`, in order."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the server (by unit or by process group, never by name)."""

    @abc.abstractmethod
    def restore(self, timeout_s: float = 900.0) -> LaunchState:
        """Put back the original command and drop-ins, restart, and wait until healthy."""

    @abc.abstractmethod
    @contextlib.contextmanager
    def session(self, *, restore_on_exit: bool = True) -> Iterator[Launcher]:
        """Hold the per-unit lock and the state file; restore the original on exit, SIGINT, SIGTERM.

        With ``restore_on_exit=False`` the caller ends the session with :meth:`commit` (the change
        stays) or :meth:`restore` (it is undone); see :meth:`GuardedLauncher.session`.

        Raises:
            LockHeldError: Another tuner holds this unit.
        """

    @abc.abstractmethod
    def commit(self) -> None:
        """Keep the session's change: clear the state file; the session's exit restores nothing."""

    @property
    @abc.abstractmethod
    def needs_restore(self) -> bool:
        """Whether the session's exit will restart the service to put it back (see
        :attr:`GuardedLauncher.needs_restore`)."""

    @abc.abstractmethod
    def hold(self) -> str:
        """Restart nothing at the session's exit (see :meth:`GuardedLauncher.hold`); one sentence on
        the service's state and what to do."""


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
        self.store = StateStore(self.state_dir, key)
        self.lock = UnitLock(key, state_file=self.store.path)
        self._preflighted = False
        self._restoring = False
        self._journal_warned = False
        self._state: SessionState | None = None
        self._changed = False  # start() ran in this session (the service may differ from its state file)
        self._adopted = False  # the session adopted a killed run's state file (its change is to undo)
        self._committed = False
        self._held = False  # hold(): the session's exit restarts nothing (a drain refused the restart)
        self._watcher = LogWatcher()
        self._lines: list[str] = []
        self._t0 = time.monotonic()
        self._started = False
        self._healthy_since: float | None = None
        self.ready_line_grace_s = ready_line_grace_s
        self.already_original = False
        """Set by :meth:`restore` when the service already ran its recorded original: only the state
        file was removed."""
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

        Called by :meth:`preflight`; changes nothing.

        Raises:
            LaunchError: Something outside the tuner prevents the start.
        """

    def _check_service(self, *, restore: bool) -> None:
        """Check, changing nothing, that the manager is reachable and the service known and readable
        (and, unless ``restore``, that a trial's change can be written and its log read).

        Raises:
            LaunchError: One line naming what is wrong and the fix.
        """

    def _check_can_change(self) -> None:
        """Refuse, before the running server is stopped, a trial change that cannot be written.

        Raises:
            ServiceControlError: The change cannot be written (e.g. a read-only drop-in folder).
        """

    def _check_can_put_back(self, state: SessionState) -> None:
        """Refuse, before anything is stopped, a restore that could not write what it must.

        Raises:
            LaunchError: Names what to fix; the running service is left as it is.
        """

    def has_leftover_change(self) -> bool:
        """Whether the service carries a tuner change no state file records (a stray trial drop-in)."""
        return False

    def _runs_original(self, state: SessionState) -> bool:
        """Whether the service already is what ``state`` records (its own command and drop-ins, no
        trial change, running and healthy exactly when it was): e.g. after a reboot dropped a
        killed run's runtime drop-in. Changes nothing. Default: not known (``False``)."""
        return False

    @abc.abstractmethod
    def _put_back(self, state: SessionState) -> None:
        """Put the original configuration back; start it when ``state.was_running``, else stop."""

    # ---- shared behaviour ---------------------------------------------------------------

    def preflight(self, *, restore: bool = False) -> None:
        """Check everything a session (or, with ``restore``, a restore) needs, changing nothing.

        The service (:meth:`_check_service`: systemd reachable, unit known, command readable; for a
        session also the drop-in folder writable and not full and the journal readable), the server
        startable (:meth:`_check_startable`, sessions only), and the state folder (state file, work
        folder, result journal) and lock folder writable and on a disk that is not full.
        :func:`tuner.preflight.check_service` and :func:`tuner.preflight.check_run` call it before
        the lock is taken; :meth:`session` and :meth:`restore` call it when nobody did.

        Raises:
            LaunchError: The first check that fails, one line with its fix.
        """
        self._check_service(restore=restore)
        if not restore:
            self._check_startable()
        for folder, what in ((self.state_dir, "state folder (service.state_dir)"),
                             (self.lock.path.parent, f"lock folder (${LOCK_DIR_ENV})")):
            blocked = writable_folder(folder)
            if blocked is not None:
                raise LaunchError(f"the {what} {folder} cannot be written ({blocked} is not writable)",
                                  hint="run as root, or point it at a writable folder")
            full = full_folder(folder)
            if full is not None:
                raise LaunchError(f"the disk holding the {what} {full[0]} is full ({full[1]})",
                                  hint=f"free space on it (df -h {full[0]}), or point it at a folder on another disk")
        self._preflighted = True

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
            ServiceControlError: The change cannot be written (checked before the server is
                stopped, so the running server is left as it is).
            LaunchError: The start could not be issued.
            GPUError: GPU memory was not released in time, or a foreign process holds some.
        """
        if not argv:
            raise LaunchError("empty server command", hint="pass the full server command line")
        self._check_can_change()
        self._changed = True
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
        if poll.journal_error:
            if not self._journal_warned:
                log.warning("warning: %s; %s", poll.journal_error,
                            "restoring on /health alone" if self._restoring else "the trial ends here")
                self._journal_warned = True
            if not self._restoring:
                return LaunchState(phase=LaunchPhase.FAILED, pid=poll.pid, restarts=poll.restarts, elapsed_s=elapsed,
                                   failure=Failure(failure_class=FailureClass.JOURNAL_UNREADABLE,
                                                   evidence=poll.journal_error))
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
            # that never reaches the launcher (StandardOutput=file:...) must not block for ever, and
            # a restore whose journal is broken (no line can come) goes on /health alone at once.
            no_lines = self._restoring and bool(poll.journal_error)
            if self._watcher.ready or no_lines or now - self._healthy_since >= self.ready_line_grace_s:
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
        state file on success. When the service
        already runs the recorded original, healthy (:meth:`_runs_original`: e.g. a reboot dropped
        a killed run's runtime drop-in and the unit came up on its own command), only the state
        file is removed and :attr:`already_original` is set: nothing is restarted.

        .. note:: Changes the production service.

        Never makes things worse: before it stops anything it checks that it can write what it
        must put back (:meth:`_check_can_put_back`); if it cannot, the running service is left as
        it is and the error names what to fix. A journal that fails meanwhile is warned about and
        the restore goes on with ``/health`` alone.

        Raises:
            LockHeldError: Another live tuner holds the unit.
            LaunchError: The unit is unknown or the manager unreachable (before the lock); the
                original cannot be written (before anything is stopped); or it did not become
                healthy.
        """
        owned = not self.lock.held
        self.already_original = False
        if owned:
            self.preflight(restore=True)  # an unknown unit fails here, before a lock file is created
            self.lock.acquire()
            self.store.drop_work_dir()  # the trial files of a run killed before it could remove them
        try:
            state = self._state or self.store.load()
            if state is None:
                state = self._record_original()
                if not self.has_leftover_change():
                    log.info("%s: no state file and no trial change; nothing to restore", self.key)
                    phase = LaunchPhase.READY if self._healthy() else LaunchPhase.STOPPED
                    return LaunchState(phase=phase)
            if not self._changed and self._runs_original(state):
                log.info("%s already runs its own command (%s); removing the state file, restarting nothing",
                         self.key, "healthy" if state.was_running else "stopped")
                self.store.clear()
                self._state = None
                self.already_original = True
                return LaunchState(phase=LaunchPhase.READY if state.was_running else LaunchPhase.STOPPED)
            self._check_can_put_back(state)
            self._watcher = LogWatcher()
            self._lines = []
            self._t0 = time.monotonic()
            self._started = True
            self._healthy_since = None
            self._restoring = True
            try:
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
            finally:
                self._restoring = False
            self.store.clear()
            self._state = None
            self._changed = self._adopted = False  # the service is its original again
            return st
        finally:
            if owned:
                self.lock.release()

    def _before_start_restore(self) -> None:
        if self.gpu is not None:
            self.gpu.wait_released(timeout_s=self.release_timeout_s, allow_foreign=self.allow_foreign)

    @contextlib.contextmanager
    def session(self, *, restore_on_exit: bool = True) -> Iterator[GuardedLauncher]:
        """Hold the lock and the state file; restore the original on exit, SIGINT or SIGTERM.

        A state file left by a killed tuner is adopted: its recorded original (not the current,
        half-changed service) is what this session restores.

        With ``restore_on_exit=False`` (``tuner apply``: a change meant to stay) the caller ends
        the session with :meth:`commit` (keep the change) or :meth:`restore` (undo it). Such a
        session refuses a state file left by a killed tuner and a leftover trial change
        (:meth:`has_leftover_change`), since committing over them would make them permanent. It
        does not catch signals, and its exit restores nothing: left without a commit or a restore
        after :meth:`start`, its state file stays for ``tuner restore``; left before any
        :meth:`start`, the state file is removed (nothing was changed).

        The invariant: a session that changed nothing changes nothing. Its exit restores only
        when :attr:`needs_restore` (this session started the service with another command, or
        adopted a killed run's state file); otherwise it removes its state file and releases the
        lock, and the service is not stopped, started, reloaded or reset.

        Runs :meth:`preflight` first unless it already ran: every refusal comes before the lock.

        Raises:
            LockHeldError: Another tuner holds this unit.
            LaunchError: The service cannot be read, the state file written, or the server could
                not be started (e.g. a foreign program holds the process launcher's port); with
                ``restore_on_exit=False``, a killed tuner's state file or trial change is present.
        """
        if not self._preflighted:
            self.preflight()
        self.lock.acquire()
        try:
            left = self.store.load()
            if not restore_on_exit:
                self._refuse_leftovers(left)
            if left is not None:
                log.warning("adopting the state left by tuner PID %s (%s); its original is what "
                            "will be restored", left.tuner_pid, left.created_at)
                self._state = left
            else:
                state = self._record_original()
                recipe = {**self._own_settings(), **self.settings}
                self._state = state.model_copy(update={"extra": {**state.extra, "settings": recipe}})
                self.store.save(self._state)
            self._changed = self._committed = self._held = self.restored_on_exit = False
            self._adopted = left is not None
            if not restore_on_exit:
                try:
                    yield self
                finally:
                    if not self._changed and not self._committed:
                        self.store.clear()  # nothing was started: the service is its original
                return
            with interrupt_on_signals():
                try:
                    yield self
                finally:
                    if self.needs_restore:
                        with deferred_signals():
                            self.restore()
                        self.restored_on_exit = True
                    elif not self._committed and not self._changed and not self._adopted:
                        self.store.clear()  # nothing was changed: nothing is restarted either
        finally:
            self._state = None
            self._changed = self._adopted = self._held = False
            self.lock.release()

    @property
    def needs_restore(self) -> bool:
        """Whether the session's exit will restart the service to put it back: this session
        changed it (:meth:`start` ran) or adopted a killed run's state file, and neither
        :meth:`commit` nor :meth:`hold` ended that. A session that changed nothing restores
        nothing: no stop, start, ``daemon-reload`` or ``reset-failed``."""
        return (self._changed or self._adopted) and not self._committed and not self._held

    def hold(self) -> str:
        """Leave the service as it is at the session's exit: no restart (a ``pre_restart`` drain
        refused it). The state file stays when the service carries a change (``tuner restore``
        puts it back later) and is removed when it does not.

        Returns:
            One sentence on the service's state and what the operator must do.
        """
        self._held = True
        if self._changed or self._adopted:
            return (f"{self.key} was not restarted and still runs a trial's flags; the state file {self.store.path} "
                    f"is kept: once the drain works, run 'tuner restore --unit {self.key} --state-dir {self.state_dir}'")
        if self._state is not None and not self._state.was_running:
            return f"{self.key} was not started: it stays stopped as it was, and nothing is left to undo"
        return f"{self.key} was not restarted: it still runs its own flags, and nothing is left to undo"

    def commit(self) -> None:
        """Keep the session's change: the service as it runs now becomes its own configuration.

        Clears the state file, so neither the session's exit nor ``tuner restore`` puts the
        original back; :meth:`current_argv` reads the service again.

        .. note:: Call inside :meth:`session`, after the change was verified.

        Raises:
            LaunchError: No session is open on this launcher.
        """
        if self._state is None or not self.lock.held:
            raise LaunchError(f"nothing to commit on {self.key}: no session is open",
                              hint="call commit() inside launcher.session()")
        self.store.clear()
        self._state = None
        self._committed = True

    def _refuse_leftovers(self, left: SessionState | None) -> None:
        """Refuse a lasting change over a killed tuner's state file or trial change."""
        if left is not None:
            raise LaunchError(
                f"a tuning session left its state for {self.key} ({self.store.path})",
                hint=f"put the service back first: tuner restore --unit {self.key}",
            )
        if self.has_leftover_change():
            raise LaunchError(
                f"{self.key} still carries a trial's change: a tuning run is active or was killed",
                hint=f"finish the run, or put the service back: tuner restore --unit {self.key}",
            )


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
        journal_error: Non-empty when the server's log could not be read (its journal stopped
            answering): a trial ends with ``journal_unreadable``; a restore goes on with /health.
    """

    lines: list[str] = Field(default_factory=list)
    alive: bool = True
    pid: int | None = None
    exit_status: int | None = None
    restarts: int = 0
    crash_loop: str = ""
    stopped_by_us: bool = False
    journal_error: str = ""
