"""A service manager for tests: real systemd 252 booted in a private PID namespace, or its emulator.

``shared/systemd-sandbox.md`` §1: as root with CAP_SYS_ADMIN this boots ``/lib/systemd/systemd``
as PID 1 of a new PID/mount/UTS/IPC namespace with a private unit folder
(``SYSTEMD_UNIT_PATH``), stub ``sysinit``/``basic``/``shutdown`` targets and the machine's own
journald units, and drives it from outside with ``nsenter -t <host pid> -m -p systemctl ...``.
When that cannot boot (not root, no ``unshare``, no systemd binary, boot failure) it falls back to
``docker-systemctl-replacement`` (§2: ``systemctl3`` / ``journalctl3`` from the venv) and says
why: :attr:`SystemdSandbox.why_emulated` is set, a warning is emitted, and tests that need real
systemd semantics (``NRestarts``, ``Restart=``, journald cursors) call
:meth:`SystemdSandbox.require_real`, which skips them with the reason — never a silent pass.

Boots are serialized across processes (other engineers' test runs too) with an ``fcntl`` lock on
:data:`LOCK_PATH`, held for the sandbox's whole life: two systemd instances would share the root
cgroup folders. The holder writes its PID and command line into the lock file; a waiter prints
who holds it every :data:`_PROGRESS_EVERY_S` seconds and, after ``$TUNER_SANDBOX_WAIT_S``
(default :data:`_LOCK_WAIT_S`), skips with the holder's PID and command line named. A sandbox
left by a killed test run is ended (by its recorded host PID, verified by its command line) when
the next one takes the lock.

Use the module-scoped ``systemd_sandbox`` fixture (``tests/conftest.py``; one boot per module,
reuse it for several scenarios)::

    def test_something(systemd_sandbox):
        box = systemd_sandbox
        box.add_unit("sim.service", "[Service]\\nExecStart=/usr/bin/sleep 100\\n")
        unit = box.unit("sim.service")        # a tuner.launch.unit.SystemdUnit wired to the box
        box.systemctl_run("start", "sim.service")
        # the tuner's config: systemctl=box.systemctl, journalctl=box.journalctl,
        #                     dropin_dir=box.unit_dir, runtime_dropin_dir=box.runtime_dir

The unit path is ``<unit_dir>:<runtime_dir>`` (``/etc/systemd/system`` then ``/run/systemd/system``
on a host: a same-named file in the first masks one in the second). :meth:`SystemdSandbox.reboot`
ends the sandbox's systemd, empties ``runtime_dir`` as a boot empties the ``/run`` tmpfs, and boots
again on the same ``unit_dir``; units made :meth:`SystemdSandbox.enable`-d come up at boot.

or without pytest: ``with boot_sandbox(Path(tmp)) as box: ...``. Units under test start with
``Environment=PYTHONUNBUFFERED=1`` so Python output reaches the journal at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tuner.launch.unit import SystemdUnit

__all__ = ["LOCK_PATH", "SandboxBusy", "SystemdSandbox", "boot_sandbox", "lock_holder"]

log = logging.getLogger(__name__)

LOCK_PATH = Path("/tmp/tuner-systemd-sandbox.lock")
"""Lock serializing sandboxes across processes (held while a sandbox lives)."""
SYSTEMD = Path("/lib/systemd/systemd")
TARGET = "tuner-sandbox.target"
_JOURNALD_UNITS = ("systemd-journald.service", "systemd-journald.socket", "systemd-journald-dev-log.socket")
_LOCK_WAIT_S = 240.0  # under pytest-timeout's 300 s, so a busy sandbox skips with its holder named
_PROGRESS_EVERY_S = 15.0
_BOOT_TIMEOUT_S = 30.0


class SystemdSandbox:
    """A running sandboxed service manager; see the module docstring.

    Attributes:
        kind: ``"systemd"`` (real systemd in a PID namespace) or ``"emulator"``
            (docker-systemctl-replacement).
        why_emulated: Why real systemd could not be used (``None`` when it is).
        unit_dir: Folder of unit files; also the tuner's ``dropin_dir`` (persistent drop-ins).
        runtime_dir: The runtime unit folder (the host's ``/run/systemd/system``), emptied by
            :meth:`reboot`; the tuner's ``runtime_dropin_dir``.
        systemctl: argv prefix reaching this manager's systemctl.
        journalctl: argv prefix reaching its journalctl.
        host_pid: Host PID of the namespace's systemd (``None`` for the emulator).
    """

    def __init__(self, kind: str, unit_dir: Path, systemctl: list[str], journalctl: list[str],
                 host_pid: int | None = None, why_emulated: str | None = None,
                 runtime_dir: Path | None = None) -> None:
        self.kind = kind
        self.unit_dir = unit_dir
        self.runtime_dir = runtime_dir or unit_dir.parent / "run-units"
        self.systemctl = systemctl
        self.journalctl = journalctl
        self.host_pid = host_pid
        self.why_emulated = why_emulated
        self._units: list[str] = []
        self._reboot: Callable[[], None] | None = None

    @property
    def real(self) -> bool:
        """Whether this is real systemd."""
        return self.kind == "systemd"

    def require_real(self) -> None:
        """Skip the calling test, with the reason, unless this is real systemd."""
        if not self.real:
            pytest.skip(f"needs real systemd; using the emulator because: {self.why_emulated}")

    def systemctl_run(self, *args: str, check: bool = True, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run systemctl in the sandbox; raise ``AssertionError`` with its output on failure."""
        proc = subprocess.run([*self.systemctl, *args], capture_output=True, text=True, timeout=timeout_s)
        if check and proc.returncode != 0:
            raise AssertionError(f"systemctl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def add_unit(self, name: str, text: str) -> Path:
        """Write a unit file into :attr:`unit_dir` and ``daemon-reload``; returns its path."""
        path = self.unit_dir / name
        path.write_text(text, encoding="utf-8")
        self._units.append(name)
        self.systemctl_run("daemon-reload")
        return path

    def unit(self, name: str) -> SystemdUnit:
        """A :class:`~tuner.launch.unit.SystemdUnit` wired to this sandbox."""
        return SystemdUnit(name, systemctl=self.systemctl, journalctl=self.journalctl, dropin_dir=self.unit_dir,
                           runtime_dropin_dir=self.runtime_dir)

    def enable(self, name: str) -> None:
        """Make the sandbox's boot target want unit ``name`` (it comes up at :meth:`reboot`)."""
        wants = self.unit_dir / f"{TARGET}.d"
        wants.mkdir(exist_ok=True)
        (wants / f"50-{name}.conf").write_text(f"[Unit]\nWants={name}\n", encoding="utf-8")
        self.systemctl_run("daemon-reload")

    def reboot(self) -> None:
        """Reboot real systemd: SIGKILL it (a power cut), empty :attr:`runtime_dir` as a boot
        empties ``/run``, boot again on the same :attr:`unit_dir`. :attr:`systemctl`,
        :attr:`journalctl` and :attr:`host_pid` then reach the new instance (argv prefixes taken
        before are stale). Skips the test for the emulator.

        Raises:
            AssertionError: The new boot did not reach ``running``.
        """
        self.require_real()
        assert self._reboot is not None, "this sandbox cannot reboot"
        self._reboot()

    def stop_units(self) -> None:
        """Stop every unit added through :meth:`add_unit` (errors ignored)."""
        for name in reversed(self._units):
            with contextlib.suppress(Exception):
                self.systemctl_run("stop", name, check=False, timeout_s=60)


class SandboxBusy(Exception):
    """Another process held :data:`LOCK_PATH` for the whole wait; the message names it."""


def lock_holder(fd: int) -> str:
    """Who holds the sandbox lock, from what the holder wrote into it: ``PID n (command line)``."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        info = {}
    pid = info.get("owner_pid")
    if not pid:
        return "a process that wrote no owner (an older test run)"
    cmdline = info.get("owner_cmdline") or ""
    with contextlib.suppress(psutil.Error):
        cmdline = " ".join(psutil.Process(pid).cmdline()) or cmdline
    return f"PID {pid} ({cmdline[:200]})"


def _acquire_lock(wait_s: float, progress: Callable[[str], None]) -> int:
    """Take :data:`LOCK_PATH`, waiting up to ``wait_s`` and reporting every :data:`_PROGRESS_EVERY_S`.

    Raises:
        SandboxBusy: Still held after ``wait_s`` (the message names the holder).
    """
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o666)
    began = time.monotonic()
    reported = began
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            waited = time.monotonic() - began
            if waited > wait_s:
                holder = lock_holder(fd)
                os.close(fd)
                raise SandboxBusy(f"the systemd sandbox lock {LOCK_PATH} is held by {holder} after waiting "
                                  f"{waited:.0f} s; wait for that test run (or set TUNER_SANDBOX_WAIT_S)") from None
            if time.monotonic() - reported >= _PROGRESS_EVERY_S:
                reported = time.monotonic()
                progress(f"waiting {waited:.0f} s for the systemd sandbox lock, held by {lock_holder(fd)}")
            time.sleep(0.5)
    _write_lock_info(fd, {})
    return fd


def _write_lock_info(fd: int, extra: dict[str, object]) -> None:
    info = {"owner_pid": os.getpid(), "owner_cmdline": " ".join(sys.argv), **extra}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)


def _end_stale_sandbox(fd: int) -> None:
    """End a sandbox whose test run died without tearing down (we hold the lock now)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        info = {}
    pid = info.get("host_pid")
    if pid:
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - info.get("create_time", 0)) < 1 and str(SYSTEMD) in " ".join(proc.cmdline()):
                log.warning("ending a stale systemd sandbox (host PID %d)", pid)
                os.kill(pid, signal.SIGKILL)
                proc.wait(10)
        except (psutil.Error, ProcessLookupError):
            pass
    _clean_cgroups()


def _clean_cgroups() -> None:
    """Remove the empty ``init.scope`` / ``system.slice`` folders systemd leaves (§1, teardown)."""
    root = Path("/sys/fs/cgroup")
    if not root.is_dir():
        return
    for top in [root, *[p for p in root.iterdir() if p.is_dir()]]:
        for name in ("init.scope", "system.slice"):
            d = top / name
            if not d.is_dir():
                continue
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                d.rmdir()


def _why_not_real() -> str | None:
    if os.geteuid() != 0:
        return "not root (booting systemd in a PID namespace needs CAP_SYS_ADMIN)"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed"
    if not SYSTEMD.exists():
        return f"{SYSTEMD} does not exist"
    missing = [u for u in _JOURNALD_UNITS if not (Path("/lib/systemd/system") / u).exists()]
    if missing:
        return f"journald units missing from /lib/systemd/system: {', '.join(missing)}"
    return None


def _write_base_units(unit_dir: Path) -> None:
    for target in ("sysinit.target", "basic.target", "shutdown.target"):
        (unit_dir / target).write_text("[Unit]\nDefaultDependencies=no\n", encoding="utf-8")
    for name in _JOURNALD_UNITS:
        shutil.copy(Path("/lib/systemd/system") / name, unit_dir / name)
    (unit_dir / TARGET).write_text(
        "[Unit]\nDescription=sglang-tuner test sandbox\nDefaultDependencies=no\n"
        f"Wants={' '.join(_JOURNALD_UNITS)}\n",
        encoding="utf-8",
    )


def _systemd_child(unshare_pid: int, timeout_s: float) -> psutil.Process | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            for child in psutil.Process(unshare_pid).children():
                if str(SYSTEMD) in " ".join(child.cmdline()):
                    return child
        except psutil.Error:
            return None
        time.sleep(0.05)
    return None


def _boot_real(workdir: Path, fd: int) -> tuple[SystemdSandbox | None, str, subprocess.Popen[bytes] | None]:
    unit_dir = workdir / "units"
    runtime_dir = workdir / "run-units"
    if not unit_dir.is_dir():
        unit_dir.mkdir(parents=True, exist_ok=True)
        _write_base_units(unit_dir)
    runtime_dir.mkdir(parents=True, exist_ok=True)
    console = open(workdir / "systemd-console.log", "ab")  # noqa: SIM115
    cmd = ["unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc", "--mount", "--uts", "--ipc",
           "--", "env", f"SYSTEMD_UNIT_PATH={unit_dir}:{runtime_dir}", str(SYSTEMD), "--system", f"--unit={TARGET}",
           "--log-target=console"]
    unshare = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT,
                               start_new_session=True)
    console.close()
    child = _systemd_child(unshare.pid, 10.0)
    if child is None:
        unshare.kill()
        unshare.wait(10)
        tail = (workdir / "systemd-console.log").read_text(errors="replace")[-300:]
        return None, f"unshare did not start systemd (exit {unshare.poll()}): {tail.strip()}", None
    _write_lock_info(fd, {"host_pid": child.pid, "create_time": child.create_time()})
    prefix = ["nsenter", "-t", str(child.pid), "-m", "-p"]
    box = SystemdSandbox("systemd", unit_dir, [*prefix, "systemctl"], [*prefix, "journalctl"], host_pid=child.pid,
                         runtime_dir=runtime_dir)
    deadline = time.monotonic() + _BOOT_TIMEOUT_S
    state = ""
    while time.monotonic() < deadline:
        proc = box.systemctl_run("is-system-running", check=False, timeout_s=10)
        state = proc.stdout.strip()
        journald = box.systemctl_run("is-active", "systemd-journald.service", check=False, timeout_s=10).stdout.strip()
        if state in ("running", "degraded") and journald == "active":
            return box, "", unshare
        time.sleep(0.1)
    _kill_real(child.pid, unshare)
    return None, f"systemd did not reach 'running' in {_BOOT_TIMEOUT_S:.0f} s (state {state!r})", None


def _kill_real(host_pid: int, unshare: subprocess.Popen[bytes] | None) -> None:
    """End the namespace: SIGKILL its systemd (unshare ignores SIGTERM), then clean cgroups."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(host_pid, signal.SIGKILL)
    if unshare is not None:
        try:
            unshare.wait(15)
        except subprocess.TimeoutExpired:
            unshare.kill()
            unshare.wait(5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and psutil.pid_exists(host_pid):
        time.sleep(0.05)
    _clean_cgroups()


def _emulator(workdir: Path, why: str) -> SystemdSandbox:
    root = workdir / "emu" / "root" / "r"  # at least three levels deep (§2)
    unit_dir = root / "etc" / "systemd" / "system"
    unit_dir.mkdir(parents=True, exist_ok=True)
    (root / "run" / "systemd" / "system").mkdir(parents=True, exist_ok=True)
    (root / "run" / "systemd").mkdir(parents=True, exist_ok=True)
    bindir = Path(sys.executable).parent
    systemctl3, journalctl3 = bindir / "systemctl3", bindir / "journalctl3"
    if not systemctl3.exists():
        pytest.skip(f"no service manager for tests: real systemd unusable ({why}) and {systemctl3} missing "
                    "(pip install docker-systemctl-replacement)")
    systemctl = [str(systemctl3), f"--root={root}", "-c", f"_notify_socket_folder={root}/run/systemd",
                 "-c", "MinimumYield=0.1"]
    return SystemdSandbox("emulator", unit_dir, systemctl, [str(journalctl3), f"--root={root}"], why_emulated=why,
                          runtime_dir=root / "run" / "systemd" / "system")


@contextlib.contextmanager
def boot_sandbox(workdir: Path, *, force_emulator: str | None = None,
                 progress: Callable[[str], None] | None = None) -> Iterator[SystemdSandbox]:
    """Boot a sandbox under ``workdir``, yield it, tear it down.

    Args:
        workdir: An empty folder for unit files and the console log.
        force_emulator: Use the emulator and give this as the reason (tests of the fallback).
        progress: Receives a line while the lock is held by another process (default: stderr).

    Yields:
        The sandbox. The cross-process lock is held until the block ends (not for a forced emulator,
        whose state lives under ``workdir``).

    Raises:
        SandboxBusy: Another test run held the lock for ``$TUNER_SANDBOX_WAIT_S`` (default 240 s).
    """
    if force_emulator:  # the emulator keeps its state under workdir: no machine-wide lock needed
        warnings.warn(f"systemd sandbox: real systemd unavailable ({force_emulator}); using "
                      "docker-systemctl-replacement", stacklevel=3)
        box = _emulator(workdir, force_emulator)
        try:
            yield box
        finally:
            box.stop_units()
        return
    wait_s = float(os.environ.get("TUNER_SANDBOX_WAIT_S", _LOCK_WAIT_S))
    fd = _acquire_lock(wait_s, progress or (lambda line: print(line, file=sys.__stderr__, flush=True)))
    box: SystemdSandbox | None = None
    unshare = None
    try:
        _end_stale_sandbox(fd)
        why = _why_not_real()
        if why is None:
            box, why, unshare = _boot_real(workdir, fd)
        if box is not None:
            real = box

            def reboot() -> None:
                nonlocal unshare
                assert real.host_pid is not None
                _kill_real(real.host_pid, unshare)
                shutil.rmtree(real.runtime_dir, ignore_errors=True)  # /run is a tmpfs: gone at boot
                again, why_not, unshare = _boot_real(workdir, fd)
                assert again is not None, f"the sandbox did not boot again: {why_not}"
                real.systemctl, real.journalctl, real.host_pid = again.systemctl, again.journalctl, again.host_pid

            box._reboot = reboot
        if box is None:
            warnings.warn(f"systemd sandbox: real systemd unavailable ({why}); using docker-systemctl-replacement",
                          stacklevel=2)
            box = _emulator(workdir, why)
        yield box
    finally:
        if box is not None:
            if box.real and box.host_pid:
                _kill_real(box.host_pid, unshare)
            else:
                box.stop_units()
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
