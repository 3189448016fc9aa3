"""The systemd fault suites' unit under test: the simulator as a real unit of the sandbox's systemd
(:class:`Served`), its config, ``tuner run`` in the background (:func:`running`), and the tuner's
``systemctl`` calls, logged (:class:`Calls`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests
from optuna.trial import TrialState

from tests.support.configs import load_study, study_created
from tests.support.net import free_port
from tests.support.sandbox import SystemdSandbox
from tests.support.sim import is_healthy
from tuner.launch.unit import format_exec_command


class Served:
    """The unit under test: the simulator on a free port, started before the module's cases."""

    def __init__(self, box: SystemdSandbox) -> None:
        self.box = box
        self.unit = f"sglang-faults-{free_port()}.service"
        self.dropin_folder = box.unit_dir / f"{self.unit}.d"
        self.trial_folder = box.runtime_dir / f"{self.unit}.d"  # systemd's runtime folder: a trial's drop-in
        self._service = ""
        self._listen_on(free_port())

    def _listen_on(self, port: int) -> None:
        """Serve on ``port``; the served model name is the unit's own, so a reply proves who answers."""
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.argv = [sys.executable, "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB",
                     "--mem-fraction-static", "0.80", "--sim-time-scale", "0.01", "--host", "127.0.0.1",
                     "--port", str(port), "--served-model-name", self.unit.removesuffix(".service")]

    def add_to(self, box: SystemdSandbox, service: str = "") -> None:
        """Write the unit file for the current port; ``service`` = more ``[Service]`` lines (kept
        when :meth:`ensure_serving` moves the unit to another port)."""
        self._service = service
        box.add_unit(self.unit, "[Unit]\nDescription=simulated SGLang (fault suite)\n[Service]\n"
                                f"Environment=PYTHONUNBUFFERED=1\n{service}ExecStart={format_exec_command(self.argv)}\n")

    def answers(self) -> bool:
        """Whether the server on :attr:`url` is this unit's (not another test's simulator that took
        the port while the unit was down, e.g. across a sandbox reboot)."""
        if not is_healthy(self.url, 0.5):
            return False
        with contextlib.suppress(requests.RequestException, ValueError):
            info = requests.get(f"{self.url}/get_server_info", timeout=5).json()
            return bool(info.get("served_model_name") == self.unit.removesuffix(".service"))
        return False

    def pid_state(self) -> tuple[int, str]:
        """``(MainPID, ActiveState)`` as systemd reports them now."""
        out = self.box.systemctl_run("show", "-p", "MainPID", "-p", "ActiveState", self.unit).stdout
        props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        return int(props["MainPID"]), props["ActiveState"]

    def ensure_serving(self) -> tuple[int, str]:
        """Start the unit on its own command if it is not serving; return ``pid_state()``.

        While the unit was down (a reboot of the sandbox), a simulator of another test worker can
        have taken its port: a health check would then pass on that server while the unit's own
        process fails to bind and the unit turns ``failed`` moments later. So the unit must answer
        under its own name; if the port is someone else's, the unit moves to a free one.
        """
        if self.pid_state()[1] != "active":
            if is_healthy(self.url, 0.5) and not self.answers():
                self._listen_on(free_port())
                self.add_to(self.box, self._service)
            self.box.systemctl_run("start", self.unit)
        deadline = time.monotonic() + 90
        while not self.answers():
            assert time.monotonic() < deadline, f"the unit did not come up: {self.pid_state()}"
            time.sleep(0.2)
        before = self.pid_state()
        assert before[0] > 0 and before[1] == "active", before
        return before

    def journal_tail(self, lines: int = 15) -> str:
        """The unit's last journal lines (why it is in the state it is), for assertion messages."""
        proc = subprocess.run([*self.box.journalctl, "-u", self.unit, "-n", str(lines), "--no-pager"],
                              capture_output=True, text=True, timeout=30)
        return proc.stdout[-3000:] or proc.stderr[-1000:]

    def tuner_dropins(self) -> list[str]:
        """The unit's drop-in names in the persistent and the runtime folder."""
        return sorted({p.name for d in (self.dropin_folder, self.trial_folder) for p in d.glob("*.conf")})

    def config(self, tmp: Path, *, name: str = "sd", state: str = "state", url: str | None = None,
               journalctl: list[str] | None = None, measure_s: int = 4, storage: str = "",
               systemctl: list[str] | None = None, service: str = "", budget: str = "",
               storage_lines: str = "") -> Path:
        """A systemd config for this unit; storage defaults to ``studies/<name>.db`` under ``tmp``.
        ``systemctl``: the command (default the sandbox's); ``service``/``budget``/``storage_lines``:
        more lines for ``[service]``/``[budget]``/``[storage]`` (the last with ``storage`` only)."""
        text = (
            f'[study]\nname = "{name}"\n\n'
            + (f'[storage]\nurl = "{storage}"\n{storage_lines}\n' if storage else "")
            + f'[service]\nlauncher = "systemd"\nunit = "{self.unit}"\nurl = "{url or self.url}"\n'
            f"systemctl = {json.dumps(systemctl or self.box.systemctl)}\njournalctl = {json.dumps(journalctl or self.box.journalctl)}\n"
            f'dropin_dir = "{self.box.unit_dir}"\nruntime_dropin_dir = "{self.box.runtime_dir}"\n'
            f'state_dir = "{tmp / state}"\nstart_timeout_s = 90\n'
            f'gpu_monitor = "sim"\n{service}\n[space]\nmem_fraction_step = 0.01\n\n'
            '[workload]\nkind = "random"\ninput_len = 1000\noutput_len = 16\n\n'
            '[slo]\nitl_ms = { p99 = 5000 }\n\n[objective]\ncontext_tokens = 2048\n\n'
            f"[budget]\nwarmup_s = 1\nmeasure_s = {measure_s}\nstress_s = 2\nmax_concurrency = 16\n{budget}"
        )
        path = tmp / f"{name}.toml"
        path.write_text(text)
        return path


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            out = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"the tuner exited ({proc.returncode}) before {what}: {out[-2000:]}")
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def background_run(config: Path, cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tuner.cli", "run", "--config", str(config), *args], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@contextlib.contextmanager
def running(config: Path, cwd: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``tuner run`` in the background for the block; killed at the block's end if it still runs."""
    run = background_run(config, cwd, *args)
    try:
        yield run
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(30)


CHANGING = {"start", "stop", "restart", "try-restart", "reload", "daemon-reload", "reset-failed", "kill",
            "enable", "disable", "mask", "unmask", "isolate"}
"""``systemctl`` verbs that change a unit (``show``, ``cat``, ``is-active`` only read)."""


class Calls:
    """Every ``systemctl`` call of the tuner, through a wrapper script that logs it and runs it, and
    the hooks' calls in the same log (so their order is visible)."""

    def __init__(self, tmp: Path, served: Served) -> None:
        self.wrapper = tmp / "systemctl-logged"
        self.wrapper.write_text('#!/bin/sh\necho "systemctl $*" >> "$0.log"\nexec "$@"\n')
        self.wrapper.chmod(0o755)
        self.log = Path(f"{self.wrapper}.log")
        self.systemctl = [str(self.wrapper), *served.box.systemctl]

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def changing(self, after: int = 0) -> list[str]:
        """The calls (from line ``after`` on) whose verb changes the unit."""
        return [line for line in self.lines()[after:] if line.startswith("systemctl ") and CHANGING & set(line.split())]

    def hook(self, tmp: Path, body: str, name: str = "hook") -> str:
        """A hook script that logs ``HOOK <name> <reason>`` into the call log, then runs ``body``."""
        script = tmp / f"{name}.sh"
        script.write_text(f'#!/bin/sh\necho "HOOK $SGLANG_TUNER_HOOK $SGLANG_TUNER_REASON" >> {self.log}\n{body}\n')
        script.chmod(0o755)
        return str(script)


TRIAL_DROPIN = "90-tuner-trial.conf"
"""The drop-in a trial writes beside the unit (``tuner.launch.unit``)."""


def in_trial(served: Served) -> bool:
    """Whether the unit runs a trial's flags and serves."""
    return TRIAL_DROPIN in served.tuner_dropins() and is_healthy(served.url, 0.5)


def completed_trials(storage: str, study: str = "sd") -> int:
    """How many trials of ``study`` are complete in the SQLite ``storage`` (0 before the run made it)."""
    if not study_created(Path(storage.removeprefix("sqlite:///"))):
        return 0  # read only once the run made it (a second schema creation can collide with the run's)
    try:
        return sum(1 for t in load_study(storage, study).trials if t.state == TrialState.COMPLETE)
    except Exception:  # noqa: BLE001 - not created yet
        return 0


def left_over(tmp: Path, served: Served) -> list[str]:
    """What a run that changed nothing must not leave: a state file, a lock file, a tuner drop-in."""
    files = [p.name for d in (tmp / "state", tmp / "locks") if d.exists() for p in d.glob("*")
             if p.suffix in (".json", ".lock")]
    return files + served.tuner_dropins()


def logged_run(config: Path, cwd: Path, *args: str) -> tuple[subprocess.Popen[str], Path]:
    """``tuner run`` in the background, its stdout and stderr in ``cwd/run.out`` (returned beside it)."""
    out = cwd / "run.out"
    proc = subprocess.Popen([sys.executable, "-m", "tuner.cli", "run", "--config", str(config), *args], cwd=cwd,
                            stdout=out.open("w"), stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, COLUMNS="200", NO_COLOR="1"))
    return proc, out
