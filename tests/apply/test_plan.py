"""`plan_apply` / `plan_undo` on their own: what a plan says, and what it refuses, before anything changes.

Real parts: SQLite studies written as ``tuner run`` writes them, the apply log in the same
database, and unit files read through docker-systemctl-replacement (the sandbox's emulator: a plan
only reads the unit, so no systemd needs to run and no server starts).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.sandbox import SystemdSandbox, boot_sandbox
from tests.support.study_factory import failed_trial, make_study, ok_trial, skipped_trial
from tuner.apply import PERSISTENT_DROPIN, ApplyLog, ApplyRecord, Check, plan_apply, plan_undo
from tuner.config import TunerConfig, parse_config
from tuner.errors import ApplyError
from tuner.launch.unit import format_exec_command
from tuner.results import StoredStudy, StudyLocation, open_study

SIM = [sys.executable, "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB",
       "--mem-fraction-static", "0.80", "--port", "39999", "--enable-metrics"]
UNIT = "sim-plan.service"
TRIALS = [
    ok_trial(0.80, 64, 10, 1000.0, kind="baseline"),
    ok_trial(0.88, 128, 14, 1200.0, token_capacity=123_456, chunked_prefill_size=4096),
    failed_trial(0.97, "cuda_graph_oom", "Capture cuda graph failed"),
    skipped_trial(0.98, 2),
]


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdSandbox]:
    """docker-systemctl-replacement holding the simulator's unit file (never started)."""
    with pytest.warns(UserWarning, match="a plan reads unit files only"):
        with boot_sandbox(tmp_path_factory.mktemp("emu"), force_emulator="a plan reads unit files only") as sandbox:
            sandbox.add_unit(UNIT, f"[Service]\nExecStart={format_exec_command(SIM)}\n")
            yield sandbox


def _config(service: dict[str, Any]) -> TunerConfig:
    return parse_config({
        "study": {"name": "plan"},
        "service": {"sglang_version": "0.5.5", **service},
        "workload": {"kind": "random", "input_len": 128, "output_len": 8},
        "slo": {"ttft_ms": {"p99": 5000}},
    })


def _systemd(box: SystemdSandbox) -> dict[str, Any]:
    return {"launcher": "systemd", "unit": UNIT, "url": "http://127.0.0.1:39999", "systemctl": box.systemctl,
            "journalctl": box.journalctl, "dropin_dir": str(box.unit_dir),
            "runtime_dropin_dir": str(box.runtime_dir)}


def _study(tmp_path: Path, target: dict[str, Any] | None = None) -> tuple[StoredStudy, str]:
    url = make_study(tmp_path / "plan.db", "plan", TRIALS, info={"target": target} if target else None)
    return open_study(StudyLocation(storage_url=url, study_name="plan")), url


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_process_plan_replaces_the_tuned_flags_and_keeps_the_operators(tmp_path: Path) -> None:
    config = _config({"launcher": "process", "command": SIM, "url": "http://127.0.0.1:39999"})
    stored, url = _study(tmp_path)
    before = _tree(tmp_path)
    plan = plan_apply(stored, stored.trial(1), config, state_dir=tmp_path / "state")
    assert plan.action == "apply" and plan.launcher == "process" and plan.trial == 1
    assert plan.previous_argv == SIM
    new = plan.new_argv
    assert new[new.index("--mem-fraction-static") + 1] == "0.88"
    assert new[new.index("--max-running-requests") + 1] == "128"
    assert new[new.index("--chunked-prefill-size") + 1] == "4096"
    assert "--enable-metrics" in new and new[new.index("--port") + 1] == "39999"  # the operator's flags stay
    assert plan.expected_token_capacity == 123_456
    assert plan.expected_flags == {"mem_fraction_static": 0.88, "max_running_requests": 128,
                                   "chunked_prefill_size": 4096}
    assert plan.settings["state_dir"] == str(tmp_path / "state")
    assert "+ --mem-fraction-static 0.88" in plan.command_diff()
    assert "- --mem-fraction-static 0.80" in plan.command_diff()
    assert _tree(tmp_path) == before  # a plan changes nothing


def test_a_plan_for_the_baseline_pins_none_of_the_defaults_it_resolved(tmp_path: Path) -> None:
    """Operator review 2, R9: with the baseline as best, ``apply best --dry-run`` added the flags
    the baseline's command leaves unset at the values SGLang resolved for them (its defaults),
    right after "flags changed: none"."""
    config = _config({"launcher": "process", "command": SIM, "url": "http://127.0.0.1:39999"})
    stored, url = _study(tmp_path)
    plan = plan_apply(stored, stored.trial(0), config, state_dir=tmp_path / "state")
    assert plan.new_argv == SIM, plan.command_diff()
    tuned = plan_apply(stored, stored.trial(1), config, state_dir=tmp_path / "state").new_argv
    assert tuned[tuned.index("--max-running-requests") + 1] == "128"  # a value other than the default is set


@pytest.mark.parametrize(("number", "why"), [(2, "not feasible (cuda_graph_oom)"), (3, "not feasible (skipped: mem_fraction_static 0.98")])
def test_plan_refuses_a_trial_that_is_not_feasible(tmp_path: Path, number: int, why: str) -> None:
    config = _config({"launcher": "process", "command": SIM, "url": "http://127.0.0.1:39999"})
    stored, url = _study(tmp_path)
    with pytest.raises(ApplyError, match=re.escape(why)) as err:
        plan_apply(stored, stored.trial(number), config, state_dir=tmp_path / "state")
    assert f"trial {number}" in str(err.value) and "\n" not in str(err.value)


def test_systemd_plan_writes_a_dropin_with_the_new_exec_start(box: SystemdSandbox, tmp_path: Path) -> None:
    stored, url = _study(tmp_path, target={"launcher": "systemd", "unit": UNIT})
    before = _tree(box.unit_dir)
    plan = plan_apply(stored, stored.trial(1), _config(_systemd(box)), state_dir=tmp_path / "state")
    assert plan.launcher == "systemd" and plan.target == UNIT and plan.previous_argv == SIM
    assert plan.dropin_path == str(box.unit_dir / f"{UNIT}.d" / PERSISTENT_DROPIN)
    assert plan.previous_dropin is None and plan.new_dropin is not None
    assert "ExecStart=\n" in plan.new_dropin  # clears the unit's own ExecStart first
    assert f"ExecStart={format_exec_command(plan.new_argv)}" in plan.new_dropin
    assert "study plan, trial 1" in plan.new_dropin and "tuner apply --undo" in plan.new_dropin
    text = plan.render(timeout_s=60)
    assert f"would create {plan.dropin_path}" in text and "token capacity 123456" in text
    assert _tree(box.unit_dir) == before


def test_plan_refuses_a_config_for_another_unit_than_the_study_tuned(box: SystemdSandbox, tmp_path: Path) -> None:
    stored, url = _study(tmp_path, target={"launcher": "systemd", "unit": "other.service"})
    with pytest.raises(ApplyError, match=f"tuned unit other.service, but the config's service is {UNIT}"):
        plan_apply(stored, stored.trial(1), _config(_systemd(box)), state_dir=tmp_path / "state")


def _record(log: ApplyLog, *, trial: int, previous: str | None, new: str | None, capacity: int | None = None,
            previous_command: list[str] | None = None) -> ApplyRecord:
    checks = [Check(name="token_capacity", ok=True, detail="ok", expected=capacity, observed=capacity)] if capacity else []
    return log.add(ApplyRecord(at="2026-01-01T00:00:00+00:00", action="apply", study="plan", trial=trial,
                               target=UNIT, outcome="verified", previous_command=previous_command or SIM,
                               new_command=["/new", str(trial)], previous_dropin=previous, new_dropin=new,
                               checks=checks))


def test_undo_plan_returns_to_the_state_before_the_last_verified_apply(box: SystemdSandbox, tmp_path: Path) -> None:
    stored, url = _study(tmp_path, target={"launcher": "systemd", "unit": UNIT})
    config = _config(_systemd(box))
    log = ApplyLog(url)
    folder = box.unit_dir / f"{UNIT}.d"
    try:
        with pytest.raises(ApplyError, match=f"no verified apply on {UNIT} to undo"):
            plan_undo(stored, config, log, state_dir=tmp_path / "state")
        first = _record(log, trial=1, previous=None, new="[Service]\n# first\n", capacity=111_000)
        second = _record(log, trial=4, previous=first.new_dropin, new="[Service]\n# second\n",
                         previous_command=["/new", "1"])
        folder.mkdir(exist_ok=True)
        (folder / PERSISTENT_DROPIN).write_text("[Service]\n# edited by hand\n")
        with pytest.raises(ApplyError, match=f"changed since apply #{second.id}"):
            plan_undo(stored, config, log, state_dir=tmp_path / "state")
        (folder / PERSISTENT_DROPIN).write_text(second.new_dropin or "")
        before = _tree(box.unit_dir)
        plan = plan_undo(stored, config, log, state_dir=tmp_path / "state")
        assert plan.action == "undo" and plan.undoes == second.id
        assert plan.previous_dropin == second.new_dropin and plan.new_dropin == first.new_dropin
        assert plan.new_argv == ["/new", "1"]
        assert plan.trial == 1 and plan.expected_token_capacity == 111_000  # what the state below measured
        assert _tree(box.unit_dir) == before
    finally:
        log.close()
        (folder / PERSISTENT_DROPIN).unlink(missing_ok=True)


def test_undo_plan_needs_the_systemd_launcher(tmp_path: Path) -> None:
    stored, url = _study(tmp_path)
    log = ApplyLog(url)
    try:
        with pytest.raises(ApplyError, match="needs the systemd launcher"):
            plan_undo(stored, _config({"launcher": "process", "command": SIM, "url": "http://127.0.0.1:39999"}),
                      log, state_dir=tmp_path / "state")
    finally:
        log.close()
