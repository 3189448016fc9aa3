"""The exit codes the manual documents per outcome (docs/reviewing-and-applying.md, "Exit codes"), one real command each: 0 done,
1 one error line (bad input, a refused check), 2 a usage error, 130 an interrupted command."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.support.cli import TUNER, one_error_line, run_tuner, signal_when
from tests.support.configs import config_copy
from tests.support.study_factory import make_study, ok_trial

ROOT = Path(__file__).resolve().parents[2]


def test_the_manual_documents_each_code() -> None:
    text = (ROOT / "docs" / "reviewing-and-applying.md").read_text(encoding="utf-8")
    section = text[text.index("## Exit codes"):]
    section = section[:section.index("\n## ", 1)]
    for code in ("**0**", "**1**", "**2**", "**130**"):
        assert code in section, code


def test_done_is_0_bad_input_is_1_usage_is_2(tmp_path: Path) -> None:
    url = make_study(tmp_path / "s.db", "s", [ok_trial(0.8, 64, 10, 100.0, kind="baseline")])
    done = run_tuner("trials", "--storage", url, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert run_tuner(cwd=tmp_path).returncode == 0  # `tuner` alone: its help
    config = config_copy("demo-sim.toml", tmp_path, replace={"stress_s = 6": "stress_s = -6"})
    one_error_line(run_tuner("run", "--config", str(config), "--budget", "2m", cwd=tmp_path), "budget.stress_s")
    one_error_line(run_tuner("load", "--url", "http://127.0.0.1:99999", "--concurrency", "4", "--duration", "5", cwd=tmp_path), "port")
    one_error_line(run_tuner("trials", "--storage", f"sqlite:///{tmp_path / 'none.db'}", cwd=tmp_path), "does not exist")
    for args in (("trials", "--bogus"), ("show", "abc", "--storage", url), ("nosuch",)):
        usage = run_tuner(*args, cwd=tmp_path)
        assert usage.returncode == 2 and usage.stderr.count("\n") == 1 and "--help`" in usage.stderr, usage.stderr


def test_an_interrupted_command_is_130(tmp_path: Path) -> None:
    """``tuner load`` against a server that accepts and never answers, interrupted by SIGINT."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        proc = subprocess.Popen([TUNER, "load", "--url", f"http://127.0.0.1:{port}", "--concurrency", "2", "--duration", "60"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        silent.settimeout(120)

        def connected() -> socket.socket:  # the command is past its imports and waiting on the server
            conn, _ = silent.accept()
            time.sleep(0.5)
            return conn

        conn, err = signal_when(proc, connected, signal.SIGINT, timeout_s=60)
        conn.close()
    assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err[-2000:])


def test_ctrl_c_at_any_moment_of_the_start_is_one_line_never_a_traceback(tmp_path: Path) -> None:
    """A new user's sweep: Ctrl-C in the first seconds (while the commands were imported) was a
    ``KeyboardInterrupt`` traceback; later it was the one line. SIGINT at spread moments of a
    ``--dry-run`` start, each: exit 130 with one line, or the dry run's own end."""
    import signal
    import subprocess
    import time

    from tests.support.cli import TUNER
    from tests.support.configs import config_copy

    config = config_copy("demo-sim.toml", tmp_path)
    interrupted = 0
    for delay in (0.05, 0.15, 0.3, 0.5, 0.8, 1.2):
        proc = subprocess.Popen([TUNER, "run", "--config", str(config), "--dry-run"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert "Traceback" not in err, (delay, err[-2000:])
        if proc.returncode == 130:
            interrupted += 1
            assert len(err.strip().splitlines()) <= 1, (delay, err)  # "interrupted", or nothing at all
        else:
            assert proc.returncode == 0, (delay, proc.returncode, err[-1000:])
    assert interrupted, "no SIGINT landed before the dry run ended"
