"""The systemd launcher: a trial is a drop-in that replaces the unit's ExecStart, then a restart.

For each candidate the launcher writes ``<runtime_dropin_dir>/<unit>.d/90-tuner-trial.conf``
atomically (systemd's runtime unit folder, ``/run/systemd/system``: a tmpfs systemd forgets at boot,
so a host rebooted in the middle of a trial brings the unit up on its own command without a
``tuner restore``; the operator's drop-ins in ``dropin_dir`` still apply, systemd merging the
drop-ins of every unit folder by file name)
(an empty ``ExecStart=`` then the candidate command, quoted by systemd's rules, see
:mod:`tuner.launch.unit`), runs ``daemon-reload``, stops the unit, waits until the old server's
GPU memory is released (``shared/sglang-reference.md`` §1.2: a server that has not fully exited
lowers the next one's baseline and so its KV pool), and starts it again.

It never trusts ``systemctl start``'s exit code (real systemd returns 0 for a ``Type=simple``
unit that dies right after exec; ``shared/systemd-sandbox.md`` §1). Instead it polls
``systemctl show -p MainPID,ActiveState,SubState,Result,ExecMainStatus,NRestarts`` and reads the
unit's journal from a cursor taken before the start, feeding every line to the SGLang log parser
so a failure line (§4.3) ends the wait at once. A unit that systemd keeps restarting
(``SubState=auto-restart`` or a growing ``NRestarts``) is a crash loop: it is classified and
stopped, not waited out.

Restore removes the trial drop-in (from the runtime folder, and from the persistent one where an
older version of the tuner put it), puts back every persistent drop-in the unit had (byte for
byte) and restarts it on its original command, waiting until ``/health`` answers.

``tuner apply`` uses the same launcher with ``dropin_name="80-tuner.conf"`` (a drop-in meant to
stay, written into the persistent ``dropin_dir``, sorting before the trial's) and :meth:`SystemdLauncher.start`'s ``dropin=`` text, inside a
``session(restore_on_exit=False)`` that it commits (see :mod:`tuner.launch.base`).
"""

from __future__ import annotations

import difflib
import logging
import re
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from tuner.errors import LaunchError, ServiceControlError
from tuner.launch.base import GuardedLauncher, ServerPoll
from tuner.launch.session import SessionState
from tuner.launch.unit import DEFAULT_DROPIN_DIR, DEFAULT_RUNTIME_DROPIN_DIR, SystemdUnit

__all__ = ["TRIAL_DROPIN", "SystemdLauncher"]

log = logging.getLogger(__name__)

TRIAL_DROPIN = "90-tuner-trial.conf"
"""File name of the per-trial drop-in (sorts after the operator's own and ``80-tuner.conf``)."""

_DEAD_STATES = ("inactive", "failed")
_EXITED = re.compile(r"Main process exited, code=\w+, status=(\d+)")
"""systemd's line in the unit's journal when its main process ends (``status=3/NOTIMPLEMENTED``,
``status=9/KILL``): the exit status of a process that a restart has already replaced, whose
``ExecMainStatus`` the new process reset to 0."""
_BETWEEN_RUNS = ("auto-restart", "failed", "dead", "exited")
"""Sub-states in which ``ExecMainStatus`` is the ended process's status (else it is the running one's)."""
_DERIVED: Final = object()
"""``start(argv)`` without ``dropin=``: the drop-in is derived from argv."""


class SystemdLauncher(GuardedLauncher):
    """Relaunch a systemd service with candidate commands through a trial drop-in.

    Args:
        unit: The service name (``sglang`` or ``sglang.service``) or a :class:`SystemdUnit`.
        url: Base URL of the server (``http://127.0.0.1:30000``).
        systemctl: argv prefix of systemctl (ignored when ``unit`` is a :class:`SystemdUnit`).
        journalctl: argv prefix of journalctl (idem).
        dropin_dir: Folder of the unit's persistent drop-in folder (idem).
        runtime_dropin_dir: systemd's runtime unit folder, emptied at boot (idem).
        state_dir: Folder for the lock and the state file.
        dropin_name: File name of the drop-in :meth:`start` writes: :data:`TRIAL_DROPIN` for
            trials (in the runtime folder), ``80-tuner.conf`` for ``tuner apply`` (in the
            persistent one). Whatever the name, a leftover :data:`TRIAL_DROPIN` in either folder
            is never part of the recorded original.
        **kwargs: Passed to :class:`~tuner.launch.base.GuardedLauncher` (``gpu``,
            ``allow_foreign``, ``poll_s``, ``release_timeout_s``, ``evidence_grace_s``).

    .. note:: Writes under ``runtime_dropin_dir`` (``dropin_dir`` for ``tuner apply``) and restarts
       the unit; use inside :meth:`session`.
    """

    kind = "systemd"

    def __init__(
        self,
        unit: str | SystemdUnit,
        *,
        url: str,
        systemctl: Sequence[str] = ("systemctl",),
        journalctl: Sequence[str] = ("journalctl",),
        dropin_dir: Path | str = DEFAULT_DROPIN_DIR,
        runtime_dropin_dir: Path | str = DEFAULT_RUNTIME_DROPIN_DIR,
        state_dir: Path | str,
        dropin_name: str = TRIAL_DROPIN,
        **kwargs: Any,
    ) -> None:
        if not isinstance(unit, SystemdUnit):
            unit = SystemdUnit(unit, systemctl=systemctl, journalctl=journalctl, dropin_dir=dropin_dir,
                               runtime_dropin_dir=runtime_dropin_dir)
        self.unit = unit
        self.dropin_name = dropin_name
        self.runtime = dropin_name == TRIAL_DROPIN
        """Whether :meth:`start` writes into the runtime folder (a trial) or the persistent one."""
        self._dropin_text: Any = _DERIVED
        super().__init__(key=unit.name, url=url, state_dir=state_dir, **kwargs)
        self._cursor = ""
        self._journal_error = ""
        self._journald = ""  # journald's instance at the start ("" when not watched: the emulator)
        self._restarts0 = 0
        self._stopped_by_us = False
        self._exit_seen: int | None = None

    # ---- reading ----------------------------------------------------------------------------

    def _own_settings(self) -> dict[str, Any]:
        return {"launcher": "systemd", "unit": self.unit.name, "url": self.url,
                "systemctl": self.unit.systemctl, "journalctl": self.unit.journalctl,
                "dropin_dir": str(self.unit.dropin_dir), "runtime_dropin_dir": str(self.unit.runtime_dropin_dir),
                "state_dir": str(self.state_dir)}

    def _read_argv(self) -> list[str]:
        return list(self.unit.exec_command().argv)

    def _record_original(self) -> SessionState:
        """Read command, drop-ins and activity (changing nothing; :meth:`preflight` checks the rest)."""
        cmd = self.unit.exec_command()  # also checks the unit exists
        dropins = self.unit.dropins()
        if self.has_leftover_change():
            log.warning("%s already has %s from an earlier run; it is not part of the original",
                        self.unit.name, TRIAL_DROPIN)
            dropins.pop(TRIAL_DROPIN, None)
            cmd = self.unit.exec_command(ignore_dropins=[TRIAL_DROPIN])
        active = self.unit.properties().active_state in ("active", "activating", "reloading")
        return SessionState(
            launcher="systemd",
            key=self.unit.name,
            original_argv=cmd.argv,
            original_prefix=cmd.prefix,
            original_dropins=dropins,
            dropin_folder_existed=self.unit.dropin_folder.is_dir(),
            was_running=active,
            extra={"dropin_dir": str(self.unit.dropin_dir), "runtime_dropin_dir": str(self.unit.runtime_dropin_dir),
                   "url": self.url},
        )

    def _check_service(self, *, restore: bool) -> None:
        """systemctl reachable, the unit known, its ``ExecStart=`` readable; for a session also the
        folder :meth:`start` writes into writable and not full (and the persistent one when it holds
        an older version's trial drop-in to remove), and the journal readable (``journalctl``
        present, answering, and journald running): a trial whose log cannot be read would miss
        OOM and invalid-flag lines."""
        self.unit.exec_command()  # reaches systemctl, checks the unit exists and its command reads exactly
        if not restore:
            self._check_folders()
            self.unit.check_read_by_manager(runtime=self.runtime)
            self.unit.check_journal()

    def _check_folders(self) -> None:
        self.unit.check_writable(runtime=self.runtime)
        if self.runtime and self.unit.read_dropin(TRIAL_DROPIN) is not None:
            self.unit.check_writable()

    def _check_can_change(self) -> None:
        try:
            self._check_folders()
        except LaunchError as err:
            raise ServiceControlError(
                f"{err.message}; {self.unit.name} was not stopped for the trial",
                hint=err.hint,
            ) from err

    def _check_can_put_back(self, state: SessionState) -> None:
        current = self.unit.dropins()
        stale = [n for n in current if n not in state.original_dropins and (n == TRIAL_DROPIN or "tuner" in n)]
        differ = [n for n, text in state.original_dropins.items() if current.get(n) != text]
        runtime_stale = self.unit.read_dropin(TRIAL_DROPIN, runtime=True) is not None
        try:
            if stale or differ:
                self.unit.check_writable()
            if runtime_stale:
                self.unit.check_writable(runtime=True)
                stale.append(str(self.unit.runtime_dropin_folder / TRIAL_DROPIN))
        except LaunchError as err:
            props = self.unit.properties()
            serving = f"{props.active_state} with MainPID {props.main_pid}" if props.main_pid else props.active_state
            what = ", ".join([f"remove {n}" for n in stale] + [f"rewrite {n}" for n in differ])
            raise LaunchError(
                f"cannot restore {self.unit.name}: {err.message} (to {what}); "
                f"{self.unit.name} was left as it is ({serving}) and the state file {self.store.path} is kept",
                hint=f"{err.hint}, then run 'tuner restore --unit {self.unit.name} --state-dir {self.state_dir}'",
            ) from err

    def has_leftover_change(self) -> bool:
        """Whether a trial drop-in is in the runtime folder, or in the persistent one (where versions
        before the runtime folder wrote it)."""
        return any(self.unit.read_dropin(TRIAL_DROPIN, runtime=r) is not None for r in (True, False))

    def _runs_original(self, state: SessionState) -> bool:
        """No trial drop-in in either folder, the persistent drop-ins and the loaded ``ExecStart=``
        as recorded, and the unit active (and ``/health`` answering) exactly when it was: a reboot
        after a killed run brings the unit up this way (the runtime folder is a tmpfs)."""
        if self.has_leftover_change() or self.unit.dropins() != state.original_dropins:
            return False
        cmd = self.unit.exec_command()
        if cmd.argv != state.original_argv or cmd.prefix != state.original_prefix:
            return False
        active = self.unit.properties().active_state == "active"
        return active and self._healthy() if state.was_running else not active

    def dry_run(self, argv: list[str]) -> str:
        """The drop-in :meth:`start` would write and the change of command, as text.

        Raises:
            LaunchError: The unit's current command cannot be read, or ``argv`` is not valid.
        """
        before = self.current_argv()
        prefix = self._state.original_prefix if self._state else self.unit.exec_command().prefix
        text = self.unit.exec_start_dropin(argv, prefix=prefix, header=self._header())
        diff = difflib.unified_diff(
            [f"{a}\n" for a in before], [f"{a}\n" for a in argv], "current argv", "trial argv", n=1
        )
        change = "".join(diff) or "(none)\n"
        return (
            f"Would write {self.unit.folder(runtime=self.runtime) / self.dropin_name}"
            f"{' (a runtime drop-in: systemd forgets it at boot)' if self.runtime else ''}:\n{text}\n"
            f"Then would run systemctl daemon-reload, stop {self.unit.name}, wait until its GPU memory "
            f"is released, and start {self.unit.name}.\nCommand change:\n{change}"
            f"As a shell line: {shlex.join(argv)}"
        )

    def _header(self) -> str:
        return (
            "Written by sglang-tuner for one trial; removed by the tuner at the end of the run.\n"
            f"If it is left over, run: tuner restore --unit {self.unit.name}"
        )

    # ---- control ----------------------------------------------------------------------------

    def start(self, argv: list[str], *, dropin: Any = _DERIVED) -> None:
        """Stop the unit, wait for its GPU memory to be freed, start it on ``argv`` through
        :attr:`dropin_name`.

        Args:
            argv: The command the unit must run.
            dropin: The exact text to write as :attr:`dropin_name` (``tuner apply``'s planned
                drop-in), or ``None`` to remove that file; the unit must then run ``argv`` (checked
                after ``daemon-reload``, before the start). Default: an ``ExecStart=`` drop-in
                for ``argv`` with the trial header.

        .. note:: Changes the production service; call inside :meth:`session`.

        Raises:
            LaunchError: The start could not be issued, or with ``dropin=`` the unit does not run
                ``argv`` after the write (a drop-in sorting after it sets ``ExecStart=``).
            GPUError: GPU memory was not released in time, or a foreign process holds some.
        """
        self._dropin_text = dropin
        try:
            super().start(argv)
        finally:
            self._dropin_text = _DERIVED

    def _launch(self, argv: list[str]) -> None:
        text = self._dropin_text
        if text is _DERIVED:
            prefix = self._state.original_prefix if self._state else ""
            text = self.unit.exec_start_dropin(argv, prefix=prefix, header=self._header())
        try:
            self._check_folders()
            if self.runtime:  # an older version's persistent trial drop-in would mask this one (same name)
                self.unit.remove_dropin(TRIAL_DROPIN)
            if text is None:
                self.unit.remove_dropin(self.dropin_name, runtime=self.runtime)
            else:
                self.unit.write_dropin(self.dropin_name, text, runtime=self.runtime)
        except LaunchError as err:
            # The folder was writable at _check_can_change and is not now (it turned read-only or
            # full while the server stopped): the host refused the change, not the candidate.
            raise ServiceControlError(
                f"{err.message}; {self.unit.name} was stopped for the trial and is put back as it was",
                hint=err.hint,
            ) from err
        self.unit.daemon_reload()
        if self._dropin_text is not _DERIVED:
            now = self.unit.exec_command().argv
            if now != list(argv):
                raise LaunchError(
                    f"after writing {self.dropin_name}, {self.unit.name} runs {shlex.join(now)!r} "
                    "instead of the requested command: a drop-in sorting after it sets ExecStart=",
                    hint=f"move that ExecStart= out of {self.unit.folder(runtime=self.runtime)} or into the unit file",
                )
        self._start_unit()

    def _start_unit(self) -> None:
        """Start (after reset-failed) with a journal cursor and NRestarts baseline taken first."""
        self.unit.reset_failed()
        self._journal_error = self._journald = ""
        try:
            self._cursor = self.unit.journal_cursor()
            if self.unit.journal_has_cursors:
                self._journald = self.unit.journald_instance()
                if not self._journald:
                    self._journal_error = "journald is not running: no log line of the server reaches the journal"
        except LaunchError as err:
            self._cursor, self._journal_error = "", f"the journal of {self.unit.name} stopped answering: {err.message}"
        self._restarts0 = self.unit.properties().n_restarts or 0
        self._stopped_by_us = False
        self._exit_seen = None
        self.unit.start()

    def stop(self) -> None:
        """``systemctl stop`` the unit (never a host ``kill``: MainPID may be in another PID
        namespace).

        Raises:
            LaunchError: systemctl failed.
        """
        self._stopped_by_us = True
        self.unit.stop(timeout_s=max(3 * self.unit.command_timeout_s, self.release_timeout_s + 60))

    def _poll(self) -> ServerPoll:
        props = self.unit.properties()
        self._watch_journald()
        lines = self._read_journal()
        restarts = max(0, (props.n_restarts or 0) - self._restarts0)
        looping = props.sub_state == "auto-restart" or restarts > 0
        dead = props.active_state in _DEAD_STATES or looping
        if dead and not self._journal_error:
            lines += self._drain_journal()
        for line in lines:
            if m := _EXITED.search(line):
                self._exit_seen = int(m.group(1))
        exit_status = props.exec_main_status
        if looping and props.sub_state not in _BETWEEN_RUNS and self._exit_seen is not None:
            exit_status = self._exit_seen  # the restarted process runs: its ExecMainStatus is 0
        crash_loop = ""
        if looping:
            crash_loop = (
                f"crash loop: {self.unit.name} is being restarted by systemd (Restart=; "
                f"NRestarts +{restarts}, SubState={props.sub_state}, last exit status {exit_status})"
            )
            log.warning("%s; stopping it", crash_loop)
        return ServerPoll(
            lines=lines,
            alive=not dead,
            pid=props.main_pid,
            exit_status=exit_status if dead else None,
            restarts=restarts,
            crash_loop=crash_loop,
            stopped_by_us=dead and self._stopped_by_us and not looping,
            journal_error=self._journal_error,
        )

    def _watch_journald(self) -> None:
        """Set ``_journal_error`` when journald stopped (or was restarted) since the start: the
        server's lines since are lost, and a server whose stdout went with it may die of it, which
        is journald's failure, not the candidate's."""
        if not self._journald or self._journal_error:
            return
        try:
            now = self.unit.journald_instance()
        except LaunchError as err:
            now, why = "", err.message
        else:
            why = "systemd-journald.service is not active" if not now else "systemd-journald.service was restarted"
        if now != self._journald:
            self._journal_error = f"journald stopped during the trial ({why}): the server's log lines since are lost"

    def _read_journal(self) -> list[str]:
        """New journal lines since the cursor; a journalctl that fails sets ``_journal_error``."""
        if self._journal_error:
            return []
        try:
            lines, self._cursor = self.unit.journal_after(self._cursor)
        except LaunchError as err:
            self._journal_error = f"the journal of {self.unit.name} stopped answering: {err.message}"
            return []
        return lines

    def _drain_journal(self, rounds: int = 4, pause_s: float = 0.15) -> list[str]:
        """Read the journal until it stops growing (journald may lag the process's death)."""
        out: list[str] = []
        for _ in range(rounds):
            time.sleep(pause_s)
            more = self._read_journal()
            if not more:
                break
            out += more
        return out

    def _put_back(self, state: SessionState) -> None:
        """Remove the trial drop-in (both folders), rewrite the original drop-ins, reload, start or stop."""
        self.unit.remove_dropin(TRIAL_DROPIN, runtime=True)
        current = self.unit.dropins()
        for name in current:
            if name not in state.original_dropins:
                if name == TRIAL_DROPIN or "tuner" in name:
                    self.unit.remove_dropin(name)
                else:
                    log.warning("leaving %s/%s: it appeared during the session and is not the "
                                "tuner's", self.unit.dropin_folder, name)
        for name, text in state.original_dropins.items():
            if current.get(name) != text:
                self.unit.write_dropin(name, text)
        self.unit.daemon_reload()
        now = self.unit.exec_command()
        if now.argv != state.original_argv:
            raise LaunchError(
                f"after restoring the drop-ins, {self.unit.name} runs {shlex.join(now.argv)!r}, "
                f"not the original {shlex.join(state.original_argv)!r}",
                hint=f"check the unit file, {self.unit.dropin_folder} and {self.unit.runtime_dropin_folder}, "
                "then 'tuner restore'",
            )
        if state.was_running:
            self._start_unit()
        else:
            self.stop()
