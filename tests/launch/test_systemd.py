"""The systemd launcher against real systemd 252 booted in a private PID namespace (tests/sandbox.py).

The simulator runs as the unit's service; the tuner drives it through ``nsenter ... systemctl`` and
``journalctl`` exactly as in production. When the sandbox cannot boot real systemd it falls back to
the emulator and says why; tests needing real systemd semantics are then skipped with the reason.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import one_error_line, run_tuner
from tests.support.conformance import START_TIMEOUT_S, Harness, LauncherConformance
from tests.support.net import free_port
from tests.support.sandbox import SystemdSandbox
from tests.support.sim import set_flag, sim_command, wait_healthy
from tuner.launch.base import LaunchPhase
from tuner.launch.factory import build_launcher
from tuner.launch.unit import format_exec_command
from tuner.sglang.client import SGLangClient
from tuner.sglang.failures import FailureClass


def _unit_text(argv: list[str], extra: str = "") -> str:
    return ("[Unit]\nDescription=simulated SGLang server (test)\n[Service]\nEnvironment=PYTHONUNBUFFERED=1\n"
            f"{extra}ExecStart={format_exec_command(argv)}\n")


def _folder_snapshot(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.glob("*"))} if folder.is_dir() else {}


@contextlib.contextmanager
def _service(box: SystemdSandbox, tmp_path: Path, unit_extra: str = "") -> Iterator[tuple[str, dict, list[str]]]:
    """A running, healthy simulator unit with one operator drop-in: (unit, settings, argv); stopped after."""
    port = free_port()
    argv = sim_command(port)
    unit = f"sim-{port}.service"
    box.add_unit(unit, _unit_text(argv, unit_extra))
    folder = box.unit_dir / f"{unit}.d"
    folder.mkdir()
    (folder / "10-operator.conf").write_text("[Service]\nEnvironment=OPERATOR_SETTING=1\n")
    box.systemctl_run("daemon-reload")
    box.systemctl_run("start", unit)
    (tmp_path / "state").mkdir(exist_ok=True)  # the folder a run keeps its state file in
    settings = {"launcher": "systemd", "unit": unit, "url": f"http://127.0.0.1:{port}",
                "systemctl": box.systemctl, "journalctl": box.journalctl, "dropin_dir": str(box.unit_dir),
                "runtime_dropin_dir": str(box.runtime_dir),
                "state_dir": str(tmp_path / "state"), "stop_timeout_s": 30}
    try:
        wait_healthy(settings["url"], START_TIMEOUT_S)
        yield unit, settings, argv
    finally:
        box.systemctl_run("stop", unit, check=False)


@pytest.fixture
def harness(systemd_sandbox: SystemdSandbox, tmp_path: Path) -> Iterator[Harness]:
    box = systemd_sandbox
    with _service(box, tmp_path) as (unit, settings, argv):
        folder = box.unit_dir / f"{unit}.d"
        unit_file = box.unit_dir / unit

        def snapshot() -> tuple[dict[str, str], dict[str, str], str, str]:
            show = box.systemctl_run("show", "-p", "DropInPaths", unit).stdout.strip()
            return _folder_snapshot(folder), _folder_snapshot(box.runtime_dir / f"{unit}.d"), unit_file.read_text(), show

        yield Harness(settings=settings, base_argv=argv, url=settings["url"], snapshot=snapshot)


class TestSystemdLauncher(LauncherConformance):
    """The launcher contract, systemd launcher (trial drop-in, daemon-reload, journal)."""


def test_trial_dropin_is_quoted_and_listed(systemd_sandbox: SystemdSandbox, tmp_path: Path) -> None:
    box = systemd_sandbox
    with _service(box, tmp_path) as (unit, settings, argv):
        launcher = build_launcher(settings)
        with launcher.session():
            text = launcher.dry_run([*argv, "--served-model-name", "x $HOME 100% y"]).splitlines()
            dropin = box.runtime_dir / f"{unit}.d" / "90-tuner-trial.conf"
            assert text[0] == f"Would write {dropin} (a runtime drop-in: systemd forgets it at boot):"
            assert (f"Then would run systemctl daemon-reload, stop {unit}, wait until its GPU memory is "
                    f"released, and start {unit}.") in text
            assert text[-1] == "As a shell line: " + shlex.join([*argv, "--served-model-name", "x $HOME 100% y"])
            launcher.start([*argv, "--served-model-name", "x $HOME 100% y"])
            assert launcher.wait(START_TIMEOUT_S).phase is LaunchPhase.READY
            text = dropin.read_text()
            assert not (box.unit_dir / f"{unit}.d" / "90-tuner-trial.conf").exists()
            assert "ExecStart=\nExecStart=" in text and '"x $$HOME 100%% y"' in text
            assert str(dropin) in box.systemctl_run("show", "-p", "DropInPaths", unit).stdout
            assert launcher.unit.exec_command().argv[-1] == "x $HOME 100% y"
            with SGLangClient(settings["url"]) as client:
                assert client.server_info().raw["served_model_name"] == "x $HOME 100% y"
        assert not dropin.exists()


def test_crash_loop_under_restart_always_is_detected_and_stopped(
    systemd_sandbox: SystemdSandbox, tmp_path: Path
) -> None:
    box = systemd_sandbox
    box.require_real()
    with _service(box, tmp_path, unit_extra="Restart=always\nRestartSec=300ms\n") as (unit, settings, argv):
        launcher = build_launcher(settings)
        crashing = [sys.executable, "-c", "import time; print('booting', flush=True); time.sleep(0.5); raise SystemExit(3)"]
        with launcher.session():
            launcher.start(crashing)
            st = launcher.wait(START_TIMEOUT_S)
            assert st.phase is LaunchPhase.FAILED, st
            assert st.failure is not None and st.failure.failure_class is FailureClass.CRASH
            assert "crash loop" in st.failure.evidence and st.failure.exit_status == 3
            assert st.elapsed_s < START_TIMEOUT_S / 4
            props = launcher.unit.properties()
            assert props.active_state in ("inactive", "failed"), props
            time.sleep(1.0)
            assert launcher.unit.properties().n_restarts == props.n_restarts, "still restarting"
        wait_healthy(settings["url"], START_TIMEOUT_S)


def _cli_target(box: SystemdSandbox, settings: dict) -> list[str]:
    """``tuner restore`` options reaching the sandbox (``--systemctl`` first)."""
    return ["--systemctl", " ".join(box.systemctl), "--journalctl", " ".join(box.journalctl),
            "--dropin-dir", str(box.unit_dir), "--runtime-dropin-dir", str(box.runtime_dir), "--state-dir", settings["state_dir"], "--url", settings["url"]]


def test_bad_input_is_one_line_and_changes_nothing(systemd_sandbox: SystemdSandbox, tmp_path: Path) -> None:
    box = systemd_sandbox
    with _service(box, tmp_path) as (unit, settings, argv):
        base = _cli_target(box, settings)
        before = _folder_snapshot(box.unit_dir / f"{unit}.d"), box.systemctl_run("show", "-p", "MainPID", unit).stdout
        one_error_line(run_tuner("restore", "--unit", "no-such-unit", *base), "no-such-unit.service", "unknown")
        assert not [p.name for p in Path(settings["state_dir"]).glob("*no-such-unit*")], "restore left a file"
        one_error_line(run_tuner("restore", "--unit", unit, *base[2:], "--systemctl", "/nonexistent/systemctl"),
                               "/nonexistent/systemctl", "not found")
        env_unit = f"env-{unit}"
        box.add_unit(env_unit, _unit_text(argv).replace("--port", "--port-from-env $PORT --port"))
        one_error_line(run_tuner("restore", "--unit", env_unit, *base), "ExecStart", "environment variable")
        ro = ("unshare", "--mount", "--", "sh", "-c",
              'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(box.unit_dir))
        # nothing to put back: a read-only drop-in folder does not matter, nothing is touched
        # (with a state file to put back it is one line and the unit left serving: tests/study/test_service_faults.py)
        done = run_tuner("restore", "--unit", unit, *base, prefix=ro)
        assert done.returncode == 0 and "nothing to restore" in done.stdout, (done.stdout, done.stderr)
        after = _folder_snapshot(box.unit_dir / f"{unit}.d"), box.systemctl_run("show", "-p", "MainPID", unit).stdout
        assert after == before
        assert not (box.unit_dir / f"{env_unit}.d").exists()


@pytest.mark.parametrize("folder", ["runtime", "persistent (an older version's)"])
def test_restore_without_state_removes_a_stray_trial_dropin_else_touches_nothing(
    systemd_sandbox: SystemdSandbox, tmp_path: Path, folder: str
) -> None:
    box = systemd_sandbox
    with _service(box, tmp_path) as (unit, settings, argv):
        stray = box.unit(unit)
        stray.write_dropin("90-tuner-trial.conf", stray.exec_start_dropin(set_flag(argv, "--mem-fraction-static", "0.7")),
                           runtime=folder == "runtime")
        box.systemctl_run("daemon-reload")
        box.systemctl_run("restart", unit)
        base = ["--unit", unit, *_cli_target(box, settings)]
        done = run_tuner("restore", *base)
        assert done.returncode == 0 and "from the leftover trial change" in done.stdout, (done.stdout, done.stderr)
        with SGLangClient(settings["url"]) as client:
            assert client.server_info().mem_fraction_static == 0.85
        assert sorted(p.name for p in (box.unit_dir / f"{unit}.d").iterdir()) == ["10-operator.conf"]
        assert not (box.runtime_dir / f"{unit}.d" / "90-tuner-trial.conf").exists()
        pid = stray.properties().main_pid
        done = run_tuner("restore", *base)
        assert done.returncode == 0 and "nothing to restore" in done.stdout, (done.stdout, done.stderr)
        assert stray.properties().main_pid == pid
        # a mistyped --state-dir with nothing to undo is refused, not reported as nothing to restore (review N13)
        one_error_line(run_tuner("restore", *base[:-4], "--state-dir", settings["state_dir"] + "-typo", *base[-2:]),
                       "--state-dir", "does not exist")


def test_example_units_are_readable_and_the_sim_unit_serves(systemd_sandbox: SystemdSandbox, tmp_path: Path) -> None:
    box = systemd_sandbox
    examples = Path(__file__).parents[2] / "systemd"
    for name in ("sglang.service", "sglang-sim.service"):
        box.add_unit(f"example-{name}", (examples / name).read_text())
        argv = box.unit(f"example-{name}").exec_command().argv
        assert "--mem-fraction-static" in argv and argv[0].startswith("/opt/")
    port = free_port()
    text = (examples / "sglang-sim.service").read_text().replace("/opt/sglang-tuner/.venv/bin/python", sys.executable)
    box.add_unit("example-sim-live.service", text.replace("--port 30000", f"--port {port}"))
    box.systemctl_run("start", "example-sim-live.service")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", START_TIMEOUT_S)
    finally:
        box.systemctl_run("stop", "example-sim-live.service", check=False)
    box.add_unit("example-tuner-run.service", (examples / "tuner-run.service").read_text())
    shown = box.systemctl_run("show", "-p", "KillMode,TimeoutStopUSec,ExecStopPost", "example-tuner-run.service").stdout
    assert "KillMode=mixed" in shown and "tuner restore" in shown
    shown = box.systemctl_run("show", "-p", "ExecStart,LogsDirectory", "example-tuner-run.service").stdout
    assert "--json-progress /var/log/sglang-tuner/progress.jsonl" in shown and "LogsDirectory=sglang-tuner" in shown
    assert "LogRateLimitIntervalUSec=0" in box.systemctl_run("show", "-p", "LogRateLimitIntervalUSec", "example-sglang.service").stdout
