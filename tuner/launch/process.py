"""The process launcher: the server as a plain child process, for hosts without systemd and the demo.

Each start runs the command in its own session and process group (``start_new_session``), with
stdout and stderr going to ``<log_dir>/<name>.log``, and records the server (PID, process group,
start time, command, log file) in ``<state_dir>/<name>.server.json`` so that a later tuner — one
run after a ``kill -9`` of this one, or ``tuner restore`` — finds and stops it. Stopping sends
SIGTERM to the process group, waits a grace period for the whole group to exit, then SIGKILLs it;
a process is never looked up or killed by name, and a recorded PID is trusted only when its start
time still matches (PIDs are reused).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

from tuner.errors import LaunchError
from tuner.launch.base import GuardedLauncher, ServerPoll
from tuner.launch.session import SessionState, writable_folder
from tuner.launch.unit import atomic_write_text

__all__ = ["ProcessLauncher"]

log = logging.getLogger(__name__)


def _exit_status(returncode: int | None) -> int | None:
    """A Popen return code as a shell would show it (signal N → 128 + N)."""
    if returncode is None:
        return None
    return 128 - returncode if returncode < 0 else returncode


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, exited but not reaped, do not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


class ProcessLauncher(GuardedLauncher):
    """Run the server command as a child process group; watch its log file; stop by group.

    Args:
        command: The original server command (what runs before and after the study).
        url: Base URL of the server.
        state_dir: Folder for the lock, the state file and the server record.
        name: Key of the lock and files; default ``process-<port of url>``.
        log_dir: Folder for the server log (default ``<state_dir>/logs``).
        stop_grace_s: How long SIGTERM may take before the group is SIGKILLed.
        cwd: Working folder of the server (default: the tuner's).
        **kwargs: Passed to :class:`~tuner.launch.base.GuardedLauncher`.

    .. note:: Starting and stopping end the server it recorded; use inside :meth:`session`.
    """

    kind = "process"

    def __init__(
        self,
        command: Sequence[str],
        *,
        url: str,
        state_dir: Path | str,
        name: str | None = None,
        log_dir: Path | str | None = None,
        stop_grace_s: float = 30.0,
        cwd: Path | str | None = None,
        **kwargs: Any,
    ) -> None:
        if not command:
            raise LaunchError("empty server command", hint="set service.command to the full server command line")
        port = re.search(r":(\d+)", url.split("//", 1)[-1])
        key = name or f"process-{port.group(1) if port else 'server'}"
        super().__init__(key=key, url=url, state_dir=state_dir, **kwargs)
        self.command = list(command)
        self.log_dir = Path(log_dir) if log_dir else self.state_dir / "logs"
        self.log_path = self.log_dir / f"{key}.log"
        self.record_path = self.state_dir / f"{key}.server.json"
        self.stop_grace_s = stop_grace_s
        self.cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None
        self._offset = 0
        self._partial = b""
        self._stopped_by_us = False

    # ---- the recorded server -------------------------------------------------------------

    def _record(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.record_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def _live_group(self) -> int | None:
        """Process group of the recorded server if its leader (same start time) or group lives."""
        rec = self._record()
        if not rec:
            return None
        try:
            proc = psutil.Process(rec["pid"])
            if abs(proc.create_time() - rec["create_time"]) < 0.5 and proc.status() != psutil.STATUS_ZOMBIE:
                return int(rec["pgid"])
        except (psutil.Error, KeyError, TypeError):
            pass
        try:  # leader gone: are members of its group left?
            pgid = int(rec["pgid"])
        except (KeyError, TypeError, ValueError):
            return None
        return pgid if _group_alive(pgid) else None

    # ---- Launcher ------------------------------------------------------------------------

    def _own_settings(self) -> dict[str, Any]:
        return {"launcher": "process", "unit": self.key, "url": self.url, "command": self.command,
                "state_dir": str(self.state_dir), "log_dir": str(self.log_dir),
                "workdir": str(self.cwd) if self.cwd else None}

    def _read_argv(self) -> list[str]:
        return list(self.command)

    def _record_original(self) -> SessionState:
        return SessionState(
            launcher="process",
            key=self.key,
            original_argv=list(self.command),
            was_running=self._live_group() is not None,
            extra={"url": self.url, "log_path": str(self.log_path)},
        )

    def dry_run(self, argv: list[str]) -> str:
        """What :meth:`start` with ``argv`` would do, as text (nothing is changed)."""
        diff = difflib.unified_diff([f"{a}\n" for a in self.current_argv()], [f"{a}\n" for a in argv],
                                    "current argv", "trial argv", n=1)
        group = self._live_group()
        if group:
            stop = (f"Would stop the running server's process group {group} (SIGTERM, then SIGKILL "
                    f"after {self.stop_grace_s:.0f} s).")
        else:
            stop = "No server of this launcher is running, so there is nothing to stop."
        return (f"{stop}\nWould start this command in a new process group, logging to {self.log_path}:\n"
                f"  {shlex.join(argv)}\nCommand change:\n{''.join(diff) or '(none)'}")

    def _check_startable(self) -> None:
        self._check_url_is_here()
        self._check_port_free()

    def _check_url_is_here(self) -> None:
        """The URL's host is this machine: the process launcher starts the server here, and a trial
        would wait its whole start timeout for one elsewhere (and a host that answers, say a proxy,
        read as "port in use").

        Raises:
            LaunchError: The host does not resolve, or resolves to no address of this machine.
        """
        host = urlsplit(self.url).hostname or "127.0.0.1"
        if host in ("0.0.0.0", "::", "localhost"):
            return
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as err:
            raise LaunchError(f"service.url {self.url}: host {host!r} does not resolve ({err.strerror or err})",
                              hint="the process launcher starts the server on this machine: use http://127.0.0.1:PORT") from None
        for family, _type, _proto, _name, address in infos:
            try:
                with socket.socket(family, socket.SOCK_STREAM) as probe:
                    probe.bind((address[0], 0))  # binds only to an address of this machine
                return
            except OSError:
                continue
        raise LaunchError(f"service.url {self.url} is not this machine ({host} is no address of it)",
                          hint="the process launcher starts the server here: use http://127.0.0.1:PORT (the command's --port)")

    def _check_service(self, *, restore: bool) -> None:
        """The server log's folder can be written and the command's executable exists (the state
        and lock folders are checked by :meth:`preflight`)."""
        blocked = writable_folder(self.log_dir)
        if blocked is not None and not restore:
            raise LaunchError(f"the server log folder {self.log_dir} cannot be written ({blocked} is not writable)",
                              hint="set [service] state_dir to a writable folder (the log goes in its logs/)"
                              if self.log_dir == self.state_dir / "logs" else "pass a writable log folder")
        executable = self.command[0] if self.command else ""
        if not restore and shutil.which(executable) is None:
            raise LaunchError(f"server command not found or not executable: {executable!r}",
                              hint="set service.command to an existing executable (absolute path)")

    def _check_port_free(self, timeout_s: float = 1.0) -> None:
        """Raise when a server this launcher did not start accepts connections on the URL's port.

        Such a server would make the trial's own one exit with "address already in use", and its
        answers would be measured in place of the trial's.

        Args:
            timeout_s: Limit of the connection attempt.

        Raises:
            LaunchError: The port is taken; the message names it and the fix.
        """
        if self._live_group() is not None:
            return  # our own server: start() stops it first
        parts = urlsplit(self.url)
        host = parts.hostname or "127.0.0.1"
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                pass
        except OSError:
            return
        raise LaunchError(
            f"port {port} of {self.url} is already in use by a program this tuner did not start",
            hint=f"stop it (see `ss -ltnp 'sport = :{port}'`), or give service.url and the "
            "command's --port a free port",
        )

    def _launch(self, argv: list[str]) -> None:
        self._check_port_free()
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            logf = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child
        except OSError as err:
            raise LaunchError(f"cannot write the server log {self.log_path}: {err.strerror}",
                              hint="set [service] state_dir to a writable folder (the log goes in its logs/)"
                              if self.log_dir == self.state_dir / "logs" else "pass a writable log folder") from err
        try:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.cwd,
            )
        except FileNotFoundError as err:
            raise LaunchError(f"server command not found: {argv[0]!r}",
                              hint="set service.command to an existing executable (absolute path)") from err
        except PermissionError as err:
            raise LaunchError(f"server command not executable: {argv[0]!r}",
                              hint="check its permissions") from err
        finally:
            logf.close()
        self._offset, self._partial, self._stopped_by_us = 0, b"", False
        rec = {"pid": self._proc.pid, "pgid": self._proc.pid, "argv": argv, "log_path": str(self.log_path),
               "create_time": psutil.Process(self._proc.pid).create_time()}
        self.state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.record_path, json.dumps(rec) + "\n", mode=0o600)
        log.info("started %s (pgid %d): %s", self.key, self._proc.pid, shlex.join(argv))

    def stop(self) -> None:
        """Stop the recorded server's process group: SIGTERM, grace, SIGKILL. Never by name."""
        self._stopped_by_us = True
        pgid = self._live_group()
        if pgid is not None:
            self._signal_group(pgid, signal.SIGTERM)
            if not self._wait_group_gone(pgid, self.stop_grace_s):
                log.warning("process group %d ignored SIGTERM for %.0f s; sending SIGKILL", pgid,
                            self.stop_grace_s)
                self._signal_group(pgid, signal.SIGKILL)
                self._wait_group_gone(pgid, 10.0)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                log.warning("server PID %d did not exit after SIGKILL", self._proc.pid)
        self.record_path.unlink(missing_ok=True)

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    def _wait_group_gone(self, pgid: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.pid == pgid:
                self._proc.poll()  # reap our own leader
            if not _group_alive(pgid):
                return True
            time.sleep(0.05)
        return False

    def _read_lines(self) -> list[str]:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        return [x.decode("utf-8", "replace").rstrip("\r") for x in complete]

    def _poll(self) -> ServerPoll:
        if self._proc is not None:
            alive = self._proc.poll() is None
            status = _exit_status(self._proc.returncode)
            pid: int | None = self._proc.pid
        else:  # a server started by an earlier tuner: not our child
            alive = self._live_group() is not None
            status, pid = None, (self._record() or {}).get("pid")
        lines = self._read_lines()
        if not alive:
            lines += self._read_lines()
            if self._partial:
                lines.append(self._partial.decode("utf-8", "replace"))
                self._partial = b""
        return ServerPoll(lines=lines, alive=alive, pid=pid if alive else None, exit_status=status,
                     stopped_by_us=not alive and self._stopped_by_us)

    def _put_back(self, state: SessionState) -> None:
        if state.was_running:
            self._launch(list(state.original_argv))
        else:
            self.stop()
