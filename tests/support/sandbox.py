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

Any number of sandboxes run at once (in this and other test runs): each one's PID 1 moves itself
into a cgroup folder of its own (``tuner-sandbox-<pid>-<n>`` in the ``name=systemd`` and unified
hierarchies) before it becomes systemd, which then takes that folder as its root; its ``/run``
(journald's socket and journal) is a tmpfs of its own mount namespace. Each live sandbox has a
record in :data:`REGISTRY`; a sandbox left by a killed test run (its owner gone) is ended by the
next boot, by its recorded host PID checked by creation time and command line.

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
import itertools
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

__all__ = ["REGISTRY", "SystemdSandbox", "boot_sandbox"]

log = logging.getLogger(__name__)

REGISTRY = Path("/tmp/tuner-systemd-sandboxes")
"""One record per live sandbox (its owner, its systemd's host PID, its cgroup folder), so the next
boot ends the sandboxes of test runs that were killed."""
SYSTEMD = Path("/lib/systemd/systemd")
TARGET = "tuner-sandbox.target"
_JOURNALD_UNITS = ("systemd-journald.service", "systemd-journald.socket", "systemd-journald-dev-log.socket")
_BOOTS = itertools.count(1)
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


def _cgroup_roots() -> list[Path]:
    """The cgroup hierarchies systemd places its units in: every ``cgroup2`` mount (the unified
    one of a hybrid host, or the only one) and the v1 ``name=systemd`` one, from ``/proc/self/mounts``."""
    roots = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        if fields[2] == "cgroup2" or (fields[2] == "cgroup" and "name=systemd" in fields[3].split(",")):
            roots.append(Path(fields[1]))
    return roots


def _remove_cgroup(name: str) -> None:
    """Remove the sandbox's cgroup folder ``name`` (and what its systemd made below it) in every
    hierarchy; folders still holding a process stay."""
    for root in _cgroup_roots():
        top = root / name
        if not top.is_dir():
            continue
        for sub in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def _same_process(pid: int | None, create_time: float | None) -> psutil.Process | None:
    """The live process ``pid`` if it is the one created at ``create_time`` (not a reused PID)."""
    if not pid:
        return None
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        if create_time is None or abs(proc.create_time() - create_time) < 1:
            return proc
    return None


def _end_stale_sandboxes() -> None:
    """End the sandboxes of test runs that died without tearing down: the systemd (by its host PID,
    checked by creation time and command line) of each record in :data:`REGISTRY` whose owner
    process is gone, then its cgroup folders and its record."""
    if not REGISTRY.is_dir():
        return
    for record in REGISTRY.glob("*.json"):
        try:
            info = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if _same_process(info.get("owner_pid"), info.get("owner_create_time")) is not None:
            continue  # a live test run's sandbox
        host = _same_process(info.get("host_pid"), info.get("host_create_time"))
        if host is not None and str(SYSTEMD) in " ".join(host.cmdline()):
            log.warning("ending a stale systemd sandbox (host PID %d)", host.pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(host.pid, signal.SIGKILL)
            with contextlib.suppress(psutil.Error):
                host.wait(10)
        _remove_cgroup(str(info.get("cgroup", record.stem)))
        record.unlink(missing_ok=True)


def _register(name: str, host: psutil.Process) -> Path:
    """Record sandbox ``name`` in :data:`REGISTRY` (its owner and its systemd's host PID)."""
    REGISTRY.mkdir(parents=True, exist_ok=True)
    me = psutil.Process()
    record = REGISTRY / f"{name}.json"
    record.write_text(json.dumps({"cgroup": name, "owner_pid": me.pid, "owner_create_time": me.create_time(),
                                  "owner_cmdline": " ".join(sys.argv), "host_pid": host.pid,
                                  "host_create_time": host.create_time()}))
    return record


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


def _boot_real(workdir: Path, name: str) -> tuple[SystemdSandbox | None, str, subprocess.Popen[bytes] | None]:
    unit_dir = workdir / "units"
    runtime_dir = workdir / "run-units"
    if not unit_dir.is_dir():
        unit_dir.mkdir(parents=True, exist_ok=True)
        _write_base_units(unit_dir)
    runtime_dir.mkdir(parents=True, exist_ok=True)
    roots = _cgroup_roots()
    try:
        for root in roots:
            (root / name).mkdir(exist_ok=True)
    except OSError as err:
        return None, f"cannot make the sandbox's cgroup folder: {err}", None
    # The namespace's PID 1 moves itself into the sandbox's own cgroup folder before it becomes
    # systemd, which then takes that folder as its root: sandboxes never share a cgroup.
    move = "".join(f'echo $$ > "{root / name}/cgroup.procs" && ' for root in roots)
    console = open(workdir / "systemd-console.log", "ab")  # noqa: SIM115
    cmd = ["unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc", "--mount", "--uts", "--ipc",
           "--", "sh", "-c", f'{move}exec env SYSTEMD_UNIT_PATH="$0" "$1" --system --unit="$2" --log-target=console',
           f"{unit_dir}:{runtime_dir}", str(SYSTEMD), TARGET]
    unshare = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT,
                               start_new_session=True)
    console.close()
    child = _systemd_child(unshare.pid, 10.0)
    if child is None:
        unshare.kill()
        unshare.wait(10)
        _remove_cgroup(name)
        tail = (workdir / "systemd-console.log").read_text(errors="replace")[-300:]
        return None, f"unshare did not start systemd (exit {unshare.poll()}): {tail.strip()}", None
    _register(name, child)
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
    _kill_real(child.pid, unshare, name)
    return None, f"systemd did not reach 'running' in {_BOOT_TIMEOUT_S:.0f} s (state {state!r})", None


def _kill_real(host_pid: int, unshare: subprocess.Popen[bytes] | None, name: str) -> None:
    """End the namespace: SIGKILL its systemd (unshare ignores SIGTERM), then remove its cgroup
    folders and its record."""
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
    _remove_cgroup(name)
    (REGISTRY / f"{name}.json").unlink(missing_ok=True)


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
def boot_sandbox(workdir: Path, *, force_emulator: str | None = None) -> Iterator[SystemdSandbox]:
    """Boot a sandbox under ``workdir``, yield it, tear it down.

    Args:
        workdir: An empty folder for unit files and the console log.
        force_emulator: Use the emulator and give this as the reason (tests of the fallback).

    Yields:
        The sandbox: real systemd in its own namespaces and cgroup folder (any number may run at
        once, in this and other test runs), or the emulator with the reason it is used.
    """
    if force_emulator:  # the emulator keeps its state under workdir
        warnings.warn(f"systemd sandbox: real systemd unavailable ({force_emulator}); using "
                      "docker-systemctl-replacement", stacklevel=3)
        box = _emulator(workdir, force_emulator)
        try:
            yield box
        finally:
            box.stop_units()
        return
    name = f"tuner-sandbox-{os.getpid()}-{next(_BOOTS)}"
    box: SystemdSandbox | None = None
    unshare = None
    try:
        _end_stale_sandboxes()
        why = _why_not_real()
        if why is None:
            box, why, unshare = _boot_real(workdir, name)
        if box is not None:
            real = box

            def reboot() -> None:
                nonlocal unshare
                assert real.host_pid is not None
                _kill_real(real.host_pid, unshare, name)
                shutil.rmtree(real.runtime_dir, ignore_errors=True)  # /run is a tmpfs: gone at boot
                again, why_not, unshare = _boot_real(workdir, name)
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
                _kill_real(box.host_pid, unshare, name)
            else:
                box.stop_units()
