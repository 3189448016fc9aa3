"""The launcher contract: how a trial restarts the SGLang server with candidate flags.

Implementations: :mod:`tuner.launch.systemd` (production) and :mod:`tuner.launch.process`
(hosts without systemd, the demo). Both pass one conformance test class
(``tests/launch/conformance.py``).

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
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from enum import Enum

from pydantic import BaseModel, ConfigDict

from tuner.sglang.failures import Failure

__all__ = ["LaunchPhase", "LaunchState", "Launcher"]


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
    def session(self) -> Iterator[Launcher]:
        """Hold the per-unit lock and the state file; restore the original on exit, SIGINT, SIGTERM.

        Raises:
            LockHeldError: Another tuner holds this unit.
        """
