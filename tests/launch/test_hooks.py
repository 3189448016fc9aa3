"""``[service]`` hooks as real processes: a non-zero exit, a death by a signal and a hang are each one
:class:`~tuner.errors.HookError` naming what happened; a hang's whole process group is killed (no
child of the hook is left running, re-parented to PID 1)."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from tuner.errors import HookError
from tuner.launch.hooks import run_hook

CONTEXT = {"SGLANG_TUNER_URL": "http://127.0.0.1:1", "SGLANG_TUNER_REASON": "trial"}


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "hook.sh"
    path.write_text(f"#!/bin/sh\n{body}\n", encoding="utf-8")
    path.chmod(0o755)
    return [str(path)]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_hook_that_exits_non_zero_is_named_with_its_output(tmp_path: Path) -> None:
    with pytest.raises(HookError) as err:
        run_hook("pre_restart", _script(tmp_path, 'echo "$SGLANG_TUNER_HOOK: balancer refused" >&2\nexit 3'),
                 timeout_s=30, context=CONTEXT)
    assert err.value.hook == "pre_restart"
    assert "exited 3: pre_restart: balancer refused" in err.value.message


@pytest.mark.parametrize(("signal_name", "line"), [("KILL", "killed by SIGKILL"), ("TERM", "killed by SIGTERM")])
def test_a_hook_killed_by_a_signal_is_named_by_the_signal(tmp_path: Path, signal_name: str, line: str) -> None:
    with pytest.raises(HookError) as err:
        run_hook("post_ready", _script(tmp_path, f"kill -{signal_name} $$"), timeout_s=30, context=CONTEXT)
    assert line in err.value.message and "exited -" not in err.value.message, err.value.message


def test_a_hanging_hook_is_killed_with_its_children(tmp_path: Path) -> None:
    children = tmp_path / "children"
    # a child in the background, one that ignores SIGTERM, and the hook itself waiting on both
    hook = _script(tmp_path, f"sleep 60 &\necho $! >> {children}\n"
                             f"sh -c 'trap \"\" TERM; sleep 60' &\necho $! >> {children}\nsleep 60")
    begun = time.monotonic()
    with pytest.raises(HookError) as err:
        run_hook("pre_restart", hook, timeout_s=1.0, context=CONTEXT)
    took = time.monotonic() - begun
    assert "did not finish in 1 s (its process group was killed)" in err.value.message
    assert took < 10, took
    pids = [int(p) for p in children.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]


def test_a_hook_that_cannot_run_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(HookError) as err:
        run_hook("pre_restart", [str(tmp_path / "missing")], timeout_s=5, context=CONTEXT)
    assert "cannot be run" in err.value.message
