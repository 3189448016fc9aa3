"""systemd command-line quoting and unit-file reading (pure functions), and the state file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.errors import LaunchError
from tuner.launch.session import SessionState, StateStore, UnitLock
from tuner.launch.unit import (
    _exec_start_values,
    format_exec_command,
    split_exec_command,
)

TRICKY = ["a b", 'q"uote', "it's", "semi;colon", ";", "", "100%", "$HOME", "${X}", "back\\slash", "tab\tnew\nline",
          "\x01ctl", "ünï", "--flag=v a"]


@pytest.mark.parametrize("word", TRICKY)
def test_quoting_round_trips_every_value(word: str) -> None:
    argv = ["/usr/bin/python3", "-m", "sglang.launch_server", "--served-model-name", word]
    line = format_exec_command(argv)
    assert split_exec_command(line).argv == argv
    assert "$" not in line.replace("$$", "") and "%" not in line.replace("%%", "")


@pytest.mark.parametrize(
    ("value", "why"),
    [("/bin/x --name %i", "specifiers"), ("/bin/x --port $PORT", "environment variable"),
     ("/bin/x a ; /bin/y", "several commands"), ("@/bin/x y", "'@' prefix"), ('/bin/x "open', "quote")],
)
def test_unreadable_exec_start_is_refused(value: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        split_exec_command(value)


def test_prefix_kept_and_relative_executable_refused() -> None:
    assert split_exec_command("-/usr/bin/x a").prefix == "-"
    assert format_exec_command(["/usr/bin/x", "a"], "-") == "-/usr/bin/x a"
    with pytest.raises(LaunchError, match="absolute"):
        format_exec_command(["python", "-m", "sglang.launch_server"])


def test_dropins_reset_exec_start_in_order() -> None:
    unit = "[Unit]\nDescription=x\n[Service]\nExecStart=/bin/a \\\n  --long 1\n"
    reset = "[Service]\nExecStart=\nExecStart=/bin/b 2\n"
    other = "[Service]\nEnvironment=ExecStart=/bin/c\n# ExecStart=/bin/d\n"
    assert _exec_start_values([unit]) == ["/bin/a  --long 1"]
    assert _exec_start_values([unit, reset, other]) == ["/bin/b 2"]


def test_state_file_round_trip_and_malformed(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state", "sglang.service")
    assert store.load() is None
    state = SessionState(launcher="systemd", key="sglang.service", original_argv=["/bin/a", "b c"],
                         original_dropins={"10-x.conf": "[Service]\n"})
    store.save(state)
    assert store.load() == state and oct(store.path.stat().st_mode & 0o777) == "0o600"
    store.path.write_text("{not json")
    with pytest.raises(LaunchError, match="malformed") as err:
        store.load()
    assert "\n" not in str(err.value)


def test_lock_names_the_holder(tmp_path: Path) -> None:
    with UnitLock("sglang.service", lock_dir=tmp_path):
        with pytest.raises(LaunchError, match="PID") as err:
            UnitLock("sglang.service", lock_dir=tmp_path).acquire()
        assert "\n" not in str(err.value)
    with UnitLock("sglang.service", lock_dir=tmp_path) as again:  # released on exit
        assert again.held


_HOLD = (
    "import sys, time\n"
    "from tuner.launch.session import UnitLock\n"
    "lock = UnitLock('sglang.service', lock_dir=sys.argv[1]); lock.acquire()\n"
    "print('held', flush=True); time.sleep(120)\n"
)


def test_lock_is_per_unit_per_host_and_stale_after_kill_9(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    import signal
    import subprocess
    import sys

    from tuner.launch.process import ProcessLauncher

    monkeypatch.setenv("SGLANG_TUNER_LOCK_DIR", str(tmp_path / "locks"))
    # two launchers with different state folders (and so different studies) share one lock
    one = ProcessLauncher(["/bin/true"], url="http://127.0.0.1:1", state_dir=tmp_path / "a")
    two = ProcessLauncher(["/bin/true"], url="http://127.0.0.1:1", state_dir=tmp_path / "b")
    assert one.lock.path == two.lock.path == tmp_path / "locks" / "process-1.lock"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path / "locks")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LaunchError, match=f"PID {holder.pid} ") as err:
            UnitLock("sglang.service", lock_dir=tmp_path / "locks").acquire()
        assert "python" in str(err.value) and "\n" not in str(err.value)
        recorded = UnitLock("sglang.service", lock_dir=tmp_path / "locks").holder()
        assert recorded["pid"] == holder.pid and recorded["start_time"] > 0
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    # kill -9 never released it: the content names a dead PID; the kernel dropped the flock
    lock = UnitLock("sglang.service", lock_dir=tmp_path / "locks")
    assert lock.holder()["pid"] == holder.pid
    with caplog.at_level("INFO"), lock:
        assert lock.holder()["pid"] != holder.pid
    assert f"tuner PID {holder.pid}" in caplog.text and "ended without releasing" in caplog.text
    assert lock.holder() == {}  # released: cleared


def test_a_killed_holders_state_file_must_be_restored_first(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    left = tmp_path / "a" / "sglang.service.state.json"
    left.parent.mkdir()
    left.write_text("{}")
    hold = _HOLD.replace("lock_dir=sys.argv[1])", f"lock_dir=sys.argv[1], state_file=__import__('pathlib').Path({str(left)!r}))")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "locks")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    other = UnitLock("sglang.service", lock_dir=tmp_path / "locks", state_file=tmp_path / "b" / "sglang.service.state.json")
    with pytest.raises(LaunchError, match="left its state in") as err:
        other.acquire()
    assert f"--state-dir {left.parent}" in str(err.value) and not other.held
    with UnitLock("sglang.service", lock_dir=tmp_path / "locks", state_file=left):  # its own restore may
        pass


def test_the_shipped_configs_and_unit_name_the_folders_the_launcher_writes() -> None:
    """Operator review 2, D5: ``configs/reference.toml`` and ``systemd/sglang.service`` put the trial
    drop-in under /etc/systemd/system, where an operator auditing the box would not find it."""
    import re

    from tuner.launch.systemd import TRIAL_DROPIN
    from tuner.launch.unit import DEFAULT_DROPIN_DIR, DEFAULT_RUNTIME_DROPIN_DIR

    root = Path(__file__).resolve().parents[2]
    named = 0
    for path in [*sorted((root / "configs").glob("*.toml")), *sorted((root / "systemd").iterdir())]:
        text = path.read_text()
        for folder in re.findall(rf"(/[\w/]+)/[\w.@-]+\.d/{re.escape(TRIAL_DROPIN)}", text):
            assert folder == str(DEFAULT_RUNTIME_DROPIN_DIR), (path.name, folder)
            named += 1
        for folder in re.findall(r"(/[\w/]+)/[\w.@-]+\.d/80-tuner\.conf", text):
            assert folder == str(DEFAULT_DROPIN_DIR), (path.name, folder)
    assert named >= 2


_HOLD_AS = ("import sys,time;from tuner.launch.session import UnitLock as U;"
            "U('sglang.service',lock_dir=sys.argv[-1]).acquire();print('held',flush=True);time.sleep(99)")
"""Holds the lock; the lock folder last, after a ``--storage`` URL (the command line is kept to 300 characters)."""


def test_the_lock_file_is_the_owners_alone_and_masks_the_storage_password(tmp_path: Path) -> None:
    """The holder's command line goes into the lock file and the "being tuned by another tuner"
    refusal; a `--storage postgresql+psycopg://user:PW@...` in it is masked there, and the file is
    0600 (it was world-readable, and kept after a kill -9)."""
    import signal
    import subprocess
    import sys

    secret = "s3cret-PW"
    locks = tmp_path / "locks"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_AS, "--storage",
                               f"postgresql+psycopg://tuner:{secret}@db:5432/tuner?password={secret}", str(locks)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        path = locks / "sglang.service.lock"
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        text = path.read_text()
        assert secret not in text and "postgresql+psycopg://tuner:***@db:5432/tuner?password=***" in text, text
        with pytest.raises(LaunchError, match="being tuned by another tuner") as err:
            UnitLock("sglang.service", lock_dir=locks).acquire()
        assert secret not in str(err.value) and "tuner:***@db" in str(err.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)


def test_a_released_lock_file_is_removed_but_never_another_holders(tmp_path: Path) -> None:
    lock = UnitLock("sglang.service", lock_dir=tmp_path)
    with lock:
        assert lock.path.exists()
    assert not lock.path.exists()  # released by its owner: removed
    # a lock whose file was replaced meanwhile (another tuner's, at the same path) leaves that one
    lock.acquire()
    lock.path.unlink()
    with UnitLock("sglang.service", lock_dir=tmp_path) as other:
        lock.release()
        assert other.path.exists() and other.holder()["pid"]
    assert not lock.path.exists()
