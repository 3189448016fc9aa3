"""Production habits around a restart: ``[service]`` hooks (drain the server from a load balancer
before a restart, return it once ready); the maintenance window is :class:`tuner.units.MaintenanceWindow`.

A hook is a command the operator names (argv, or one string split like a shell would, never run
through a shell); it gets the restart's context in its environment (``SGLANG_TUNER_HOOK``: the
hook's name, ``SGLANG_TUNER_URL``: the server's URL, ``SGLANG_TUNER_REASON``: ``trial`` or
``restore``). A hook that exits non-zero, times out or cannot be run raises
:class:`~tuner.errors.ServiceControlError`: the run stops in one line and the service is restored.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence

from tuner.errors import ServiceControlError

__all__ = ["run_hook"]

_OUTPUT_TAIL = 300


def run_hook(name: str, command: Sequence[str], *, timeout_s: float, context: Mapping[str, str]) -> None:
    """Run one hook to its end.

    Args:
        name: ``pre_restart`` or ``post_ready`` (the ``[service]`` key, for the messages).
        command: The argv.
        timeout_s: How long it may take, seconds.
        context: Extra environment (``SGLANG_TUNER_*``).

    Raises:
        ServiceControlError: It exited non-zero (with its output's last characters), timed out, or
            could not be started.
    """
    env = {**os.environ, "SGLANG_TUNER_HOOK": name, **context}
    shown = " ".join(command)
    hint = f"fix [service] {name} (it must exit 0), or remove it; the service was restored"
    try:
        proc = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except FileNotFoundError as err:
        raise ServiceControlError(f"[service] {name} hook {shown!r} cannot be run: {err.strerror}", hint=hint) from err
    except PermissionError as err:
        raise ServiceControlError(f"[service] {name} hook {shown!r} is not executable", hint=hint) from err
    except subprocess.TimeoutExpired as err:
        raise ServiceControlError(f"[service] {name} hook {shown!r} did not finish in {timeout_s:g} s",
                                  hint="raise [service] hook_timeout_s or fix the hook; the service was restored") from err
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout or "").split())[-_OUTPUT_TAIL:]
        raise ServiceControlError(f"[service] {name} hook {shown!r} exited {proc.returncode}"
                                  + (f": {tail}" if tail else ""), hint=hint)
