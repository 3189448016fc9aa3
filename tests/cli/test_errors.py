"""The CLI's error boundary: every user error is one line on stderr and a non-zero exit."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import one_error_line, run_tuner
from tests.support.configs import config_copy


def tuner(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed script with a bare environment (no venv on PATH, 120 columns)."""
    kept = {k: os.environ[k] for k in ("TMPDIR", "SGLANG_TUNER_STATE_DIR", "SGLANG_TUNER_LOCK_DIR") if k in os.environ}  # hygiene
    return run_tuner(*args, env={"COLUMNS": "120", "PATH": "/usr/bin:/bin", **kept})


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("load", "--bogus"), "No such option: --bogus — see `tuner load --help`"),
        (("show", "-1"), "No such option: -1"),
        (("nosuch",), "No such command 'nosuch'"),
        (("run", "--budget"), "requires an argument"),
    ],
)
def test_usage_errors_are_one_line_exit_2(args: tuple[str, ...], needle: str) -> None:
    one_error_line(tuner(*args), needle, code=2)


def test_tuner_error_keeps_square_brackets(tmp_path: Path) -> None:
    """A TunerError naming a TOML section keeps its brackets (rich would eat ``[budget]`` as markup)."""
    config = config_copy("demo-sim.toml", tmp_path)
    proc = tuner("run", "--config", str(config))
    line = one_error_line(proc, "no budget")
    assert "nor [budget] total/trials is set" in line, line


def test_config_error_names_the_dotted_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[service]\nlauncher = 'process'\nbogus_key = 1\n")
    proc = tuner("run", "--config", str(bad), "--budget", "1m", "--dry-run")
    one_error_line(proc, "unknown key service.bogus_key")


def test_no_arguments_prints_help_and_help_keeps_brackets() -> None:
    proc = tuner()
    assert proc.returncode == 0 and "Usage: tuner" in proc.stdout and "apply" in proc.stdout
    proc = tuner("trials", "--help")
    assert proc.returncode == 0 and "[study]" in proc.stdout, proc.stdout


def test_a_port_out_of_range_is_one_line_in_load_and_in_run(tmp_path: Path) -> None:
    """A URL's port above 65535 was a 50-60-line ``ValueError: Port out of range`` traceback in
    ``tuner load`` and in the run's port check (operator review N2)."""
    one_error_line(tuner("load", "--url", "http://127.0.0.1:99999", "--concurrency", "4", "--duration", "5"),
                   "port", "99999")
    config = config_copy("demo-sim.toml", tmp_path)
    text = config.read_text()
    port = text.split("http://127.0.0.1:", 1)[1].split('"', 1)[0].split("/", 1)[0]
    config.write_text(text.replace(f"127.0.0.1:{port}", "127.0.0.1:99999").replace(f'"{port}"', '"99999"'))
    one_error_line(tuner("run", "--config", str(config), "--budget", "2m"), "service.url", "99999")
    assert not (tmp_path / "studies").exists() or not any((tmp_path / "studies").iterdir())


def test_explain_names_a_port_out_of_range() -> None:
    """``explain --url`` with a port above 65535 said "cannot reach ... InvalidURL" (review N16)."""
    one_error_line(tuner("explain", "--url", "http://127.0.0.1:99999"), "bad port", "65535")


def test_restore_refuses_a_state_folder_that_does_not_exist(tmp_path: Path) -> None:
    """A mistyped ``--state-dir`` said "nothing to restore ...; stopped" with exit 0, hiding the real
    state file (review N13)."""
    config = config_copy("demo-sim.toml", tmp_path)
    one_error_line(tuner("restore", "--config", str(config), "--state-dir", str(tmp_path / "nope")), "--state-dir", "does not exist")
    (tmp_path / "file").write_text("")
    one_error_line(tuner("restore", "--config", str(config), "--state-dir", str(tmp_path / "file")), "--state-dir", "not a folder")
    # under a virtual file system (no blocks at all) no folder can be made, and the disk is not full:
    # the review sweep of issue 28 saw "the disk holding the state folder /proc is full (0 KiB free)"
    line = one_error_line(tuner("restore", "--config", str(config), "--state-dir", "/proc/nope"), "--state-dir")
    assert "full" not in line and "cannot be written (/proc is not a writable folder)" in line


def test_hints_name_what_the_user_can_do(tmp_path: Path) -> None:
    """A missing trace named a ``--trace`` flag ``run`` does not have (review N17); a missing MySQL
    driver named a module, not the package that installs it (N18)."""
    config = tmp_path / "trace.toml"
    config.write_text('[study]\nname = "t"\n[service]\nlauncher = "process"\ncommand = ["python3", "-m", "tuner.sim", '
                      '"--model-path", "llama-3.1-8b", "--port", "30999"]\nurl = "http://127.0.0.1:30999"\n[workload]\nkind = "trace"\n'
                      'path = "/nonexistent/trace.jsonl"\n')
    one_error_line(tuner("run", "--config", str(config), "--budget", "2m", "--dry-run"), "[workload] path")
    one_error_line(tuner("trials", "--storage", "mysql://127.0.0.1:30998/x"), "pip install mysqlclient")


def test_the_dry_run_plans_against_the_run_s_storage_and_makes_the_run_s_checks(tmp_path: Path) -> None:
    """``run --dry-run`` said nothing of a command whose executable does not exist (exit 0; the real
    run then failed at launch after creating its study: review N11), and planned against the
    config's storage whatever ``--storage`` said (issue 29)."""
    config = config_copy("demo-sim.toml", tmp_path)
    other = f"sqlite:///{tmp_path / 'other.db'}"
    dry = tuner("run", "--config", str(config), "--dry-run", "--storage", other)
    assert dry.returncode == 0, dry.stderr
    assert other in dry.stdout and "every check a run makes" in dry.stdout
    text = config.read_text()
    broken = tmp_path / "missing-binary.toml"
    broken.write_text(text.replace('"{python}"', '"/nonexistent/bin/python3"', 1))
    assert broken.read_text() != text
    proc = tuner("run", "--config", str(broken), "--dry-run")
    assert "first candidate: the baseline" in proc.stdout  # the plan, then the check that fails
    one_error_line(proc, "server command not found", "/nonexistent/bin/python3")
    assert not (tmp_path / "studies").exists() or not any((tmp_path / "studies").iterdir())


@pytest.mark.slow
def test_apply_checks_write_and_state_dir_before_anything_with_dry_run_too(tmp_path: Path) -> None:
    """``apply --dry-run --write <folder>`` and ``--state-dir /proc/nope`` were accepted, and without
    ``--dry-run`` the path was checked only after the plan was printed (review N14, #176-178)."""
    store = ("--storage", f"sqlite:///{tmp_path}/none.db")
    for write, problem in ((tmp_path, "is a folder"), (tmp_path / "nodir" / "cmd.sh", "folder that does not exist")):
        for dry in (("--dry-run",), ()):
            one_error_line(tuner("apply", "best", *dry, "--write", str(write), *store), "--write", problem)
    (tmp_path / "file").write_text("")
    one_error_line(tuner("apply", "best", "--dry-run", "--state-dir", str(tmp_path / "file" / "state"), *store),
                   "--state-dir", "cannot be written")
    one_error_line(tuner("apply", "best", "--dry-run", "--state-dir", str(tmp_path / "file"), *store), "not a folder")
    # root passes the permission check on /proc, where no file can be created (the sweep of issue 28)
    for args in (("apply", "best", "--dry-run", "--write", "/proc/tuner-cmd.sh", *store),
                 ("report", "-o", "/proc/tuner-report.html", *store)):
        one_error_line(tuner(*args), "/proc", "virtual file system")


def test_init_output_folder_and_an_empty_copy_name_are_refused(tmp_path: Path) -> None:
    """``init -o <folder>`` suggested --force, which then failed with "Is a directory" (N19);
    ``copy-study --to-study ''`` copied under the source's name silently (#139)."""
    for force in ((), ("--force",)):
        one_error_line(tuner("init", "--sim", "-o", str(tmp_path), *force), "is a folder")
    one_error_line(tuner("copy-study", "--from", f"sqlite:///{tmp_path}/a.db", "--to", f"sqlite:///{tmp_path}/b.db",
                         "--study", "s", "--to-study", ""), "'--to-study': is empty", code=2)  # every option's rule
    assert not (tmp_path / "b.db").exists()


def test_a_gpu_monitor_the_config_names_must_open_in_the_dry_run(tmp_path: Path) -> None:
    """``gpu_monitor = "nvml"`` on a host without NVML only warned, and ran without a monitor;
    its ``--dry-run`` said nothing (review N22)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        pytest.skip("NVML opens on this host: nothing to refuse")
    except Exception:  # noqa: BLE001 - any NVML failure is what the test needs
        pass
    config = config_copy("demo-sim.toml", tmp_path, replace={'gpu_monitor = "sim"': 'gpu_monitor = "nvml"'})
    line = one_error_line(tuner("run", "--config", str(config), "--dry-run", "--trials", "1"), "gpu_monitor")
    assert '"none"' in line, line


def test_a_mistyped_command_placeholder_is_a_config_error(tmp_path: Path) -> None:
    """``"{pyton}"`` in ``[service] command`` passed the config check; the run failed 33 s later at
    launch as "server command not found: '{pyton}'" after storing a failed baseline (review N11, #252)."""
    config = config_copy("demo-sim.toml", tmp_path, replace={'"{python}"': '"{pyton}"'})
    for args in (("--dry-run", "--trials", "1"), ("--budget", "2m")):
        line = one_error_line(tuner("run", "--config", str(config), *args), "service.command", "{pyton}")
        assert "unknown placeholder" in line and "{python}" in line, line
    assert not (tmp_path / "studies").exists()
    # a JSON argument in braces is not a placeholder
    from tuner.config import ServiceSection

    kept = ServiceSection(launcher="process", command=["sglang", "--json-model-override-args", '{"a": 1}'])
    assert kept.command[-1] == '{"a": 1}'


def test_restore_refuses_a_unit_that_is_not_the_configs(tmp_path: Path) -> None:
    """``restore --config C --unit other.service`` silently restored ``other.service`` instead of the
    config's service ("nothing to restore", exit 0; review #189); the config's own name is accepted."""
    config = config_copy("demo-sim.toml", tmp_path)
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    port = config.read_text().split("http://127.0.0.1:", 1)[1].split('"', 1)[0]
    line = one_error_line(tuner("restore", "--config", str(config), "--state-dir", str(state), "--unit", "other.service"),
                          "--unit other.service", f"process-{port}")
    assert "--config alone" in line, line
    same = tuner("restore", "--config", str(config), "--state-dir", str(state), "--unit", f"process-{port}")
    assert same.returncode == 0 and f"process-{port}: nothing to restore" in same.stdout, same.stderr


def test_load_window_and_timeout_errors_name_the_option() -> None:
    """``load --duration -5`` said "warmup_s=0.0, duration_s=-5.0, cooldown_s=0.0 are invalid" and
    ``--request-timeout -1`` "request_timeout_s=-1.0 / timeout_s=None are invalid" (the sweep of
    issue 28): the line names the option the user gave and its value."""
    base = ("load", "--url", "http://127.0.0.1:1", "--concurrency", "2")
    for args, needle in ((("--duration", "-5"), "--duration -5 s is out of range"),
                         (("--duration", "5", "--warmup", "-1"), "--warmup -1 s is out of range"),
                         (("--duration", "5", "--cooldown", "-2"), "--cooldown -2 s is out of range"),
                         (("--duration", "5", "--request-timeout", "-1"), "--request-timeout -1 s"),
                         (("--duration", "5", "--timeout", "0"), "--timeout 0 s")):
        line = one_error_line(tuner(*base, *args), needle)
        assert "None" not in line and "=0.0" not in line, line
