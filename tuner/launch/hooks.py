"""Production habits around a restart: ``[service]`` hooks (drain the server from a load balancer
before a restart, return it once ready); the maintenance window is :class:`tuner.units.MaintenanceWindow`.

A hook is a command the operator names (argv, or one string split like a shell would, never run
through a shell); it gets the restart's context in its environment (``SGLANG_TUNER_HOOK``: the
hook's name, ``SGLANG_TUNER_URL``: the server's URL, ``SGLANG_TUNER_REASON``: ``trial`` or
``restore``). It runs in a process group of its own: on timeout the whole group is killed
(SIGTERM, then SIGKILL after :data:`KILL_GRACE_S`), so no child of it (a ``sleep``, a ``curl``) is
left running. A hook that exits non-zero, is killed by a signal, times out or cannot be run raises
:class:`HookError`; what the run does with the service then is the caller's rule
(:meth:`tuner.served.LaunchedServer.start`: a failed ``pre_restart`` means no restart).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence

from tuner.errors import HookError

__all__ = ["HookError", "KILL_GRACE_S", "run_hook"]

_OUTPUT_TAIL = 300
KILL_GRACE_S = 2.0
"""Seconds a timed-out hook's process group has between SIGTERM and SIGKILL."""


def _ended(code: int) -> str:
    """``exited 3`` or ``killed by SIGKILL`` (a negative return code is the signal's number)."""
    if code >= 0:
        return f"exited {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """End the hook's whole process group (its own: ``start_new_session``), SIGTERM then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            if sig is signal.SIGTERM:  # the leader is gone; its children may not be
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


def run_hook(name: str, command: Sequence[str], *, timeout_s: float, context: Mapping[str, str]) -> None:
    """Run one hook to its end, in a process group of its own.

    Args:
        name: ``pre_restart`` or ``post_ready`` (the ``[service]`` key, for the messages).
        command: The argv.
        timeout_s: How long it may take, seconds; then its whole process group is killed.
        context: Extra environment (``SGLANG_TUNER_*``).

    Raises:
        HookError: It exited non-zero (with its output's last characters), was killed by a signal
            (named: ``killed by SIGKILL``), timed out, or could not be started. The message says
            what the hook did; the caller adds what became of the service.
    """
    env = {**os.environ, "SGLANG_TUNER_HOOK": name, **context}
    shown = " ".join(command)
    hint = f"fix [service] {name} (it must exit 0), or remove it"
    try:
        proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
    except FileNotFoundError as err:
        raise HookError(f"[service] {name} hook {shown!r} cannot be run: {err.strerror}", hook=name, hint=hint) from err
    except PermissionError as err:
        raise HookError(f"[service] {name} hook {shown!r} is not executable", hook=name, hint=hint) from err
    try:
        out, err_text = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        with contextlib.suppress(subprocess.TimeoutExpired, ValueError, OSError):
            proc.communicate(timeout=1.0)
        raise HookError(f"[service] {name} hook {shown!r} did not finish in {timeout_s:g} s (its process group "
                        "was killed)", hook=name, hint="raise [service] hook_timeout_s or fix the hook") from None
    except BaseException:  # Ctrl-C while the hook runs: no hook process is left behind either
        _kill_group(proc)
        raise
    if proc.returncode != 0:
        tail = " ".join((err_text or out or "").split())[-_OUTPUT_TAIL:]
        raise HookError(f"[service] {name} hook {shown!r} {_ended(proc.returncode)}" + (f": {tail}" if tail else ""),
                        hook=name, hint=hint)
