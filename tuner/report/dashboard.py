"""``tuner dashboard``: optuna-dashboard as a child process in its own session (Ctrl-C stops it).

optuna-dashboard (0.21, the version installed with the tuner) has no read-only mode: no flag in
its ``_cli.py``, and its app serves POST/PUT/DELETE routes that create, rename and delete studies,
tell trials and write notes. ``tuner dashboard --help`` and the README say so.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tuner.errors import ConfigError

__all__ = ['dashboard_argv', 'check_listen_address', 'serve_dashboard', 'name_objectives_in']


def dashboard_argv(storage_url: str, *, host: str, port: int) -> list[str]:
    """The ``optuna-dashboard`` command for a storage (the script next to this Python, else
    ``python -m optuna_dashboard``)."""
    script = Path(sys.executable).with_name("optuna-dashboard")
    head = [str(script)] if script.is_file() else [sys.executable, "-m", "optuna_dashboard"]
    return [*head, storage_url, "--host", host, "--port", str(port)]


def check_listen_address(host: str, port: int) -> None:
    """Check that a server can listen on ``host:port`` by binding it once and closing it.

    The bind uses ``SO_REUSEADDR`` as the dashboard's HTTP server does, so a port held only by
    closed connections passes and a port another program listens on fails.

    Raises:
        ConfigError: The port is in use, out of range, or the host is not a local address.
    """
    if not 0 < port < 65536:
        raise ConfigError(f"--port {port} is not a TCP port", hint="pass --port between 1 and 65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--port {port} on {host} is already in use by another program",
                hint="pass --port with a free port, or stop the program holding it",
            ) from err
        raise ConfigError(
            f"cannot listen on --host {host} --port {port}: {err.strerror or err}",
            hint="pass a local address as --host (e.g. 127.0.0.1) and a free --port",
        ) from err


def serve_dashboard(storage_url: str, *, host: str, port: int, stop_timeout_s: float = 10.0) -> int | None:
    """Run optuna-dashboard (:func:`dashboard_argv`) until it exits, Ctrl-C or SIGTERM.

    The dashboard runs as a child in its own session, so a terminal's Ctrl-C reaches only this
    process, which then stops the child's process group (SIGTERM, ``stop_timeout_s``, SIGKILL):
    no KeyboardInterrupt traceback from the child, and no child left behind.

    Args:
        storage_url: The Optuna storage URL (checked by the caller).
        host: Address to listen on.
        port: Port to listen on.
        stop_timeout_s: How long the dashboard may take to exit after SIGTERM.

    Returns:
        The dashboard's exit status when it ended by itself; ``None`` when it was stopped.

    Raises:
        ConfigError: ``host:port`` cannot be listened on (see :func:`check_listen_address`).
    """
    from tuner.launch.session import interrupt_on_signals

    check_listen_address(host, port)
    child = subprocess.Popen(dashboard_argv(storage_url, host=host, port=port), start_new_session=True)
    try:
        with interrupt_on_signals():
            return child.wait()
    except KeyboardInterrupt:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=stop_timeout_s)
        return None




def name_objectives_in(storage_url: str) -> list[str]:
    """Name the two objectives of every tuner study in a storage that has no names yet, so that
    optuna-dashboard shows "context capacity (requests)" and "output throughput (tok/s)" rather
    than "Objective 0/1" (:func:`tuner.study.optuna_io.name_objectives`; a write to the storage).

    Returns:
        The studies named now.
    """
    import optuna

    from tuner.records import STUDY_ATTR
    from tuner.study.optuna_io import name_objectives

    named = []
    for summary in optuna.get_all_study_summaries(storage_url, include_best_trial=False):
        if STUDY_ATTR not in summary.user_attrs:
            continue  # not a tuner study: leave it as its author wrote it
        study = optuna.load_study(study_name=summary.study_name, storage=storage_url)
        if name_objectives(study):
            named.append(summary.study_name)
    return named
