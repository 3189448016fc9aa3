"""``tuner copy-study`` into an SQLite file checks the target as ``tuner run`` checks its storage
(review N4): a file that holds someone else's tables is refused with one line naming ``--to``, and
left as it was; a copy prints no log line of Optuna's own."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

from tests.support.cli import one_error_line, run_tuner
from tests.support.study_factory import make_study, ok_trial


def test_copy_study_refuses_a_foreign_sqlite_file_and_changes_nothing(tmp_path: Path) -> None:
    source = make_study(tmp_path / "src.db", "s", [ok_trial(0.8, 64, 10, 100.0, kind="baseline")])
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO customers (name) VALUES ('ada')")
    before = hashlib.sha256(foreign.read_bytes()).hexdigest()
    line = one_error_line(run_tuner("copy-study", "--from", source, "--to", f"sqlite:///{foreign}", "--study", "s",
                                    cwd=tmp_path), "not an Optuna study storage", "--to")
    assert "--storage" not in line
    assert hashlib.sha256(foreign.read_bytes()).hexdigest() == before
    copied = run_tuner("copy-study", "--from", source, "--to", f"sqlite:///{tmp_path / 'copy.db'}", "--study", "s",
                       cwd=tmp_path)
    assert copied.returncode == 0 and "copied study s (1 trials)" in copied.stdout, copied.stderr
    assert "[I " not in copied.stderr + copied.stdout  # Optuna's own "A new study created" log line


def test_copy_study_hints_name_the_option_that_holds_the_bad_file(tmp_path: Path) -> None:
    """A corrupt ``--to`` file said "check [storage] url" (review #136) and a bad ``--from`` said
    "point --storage at ..." (the sweep of issue 28): each hint names the option the user passed."""
    source = make_study(tmp_path / "src.db", "s", [ok_trial(0.8, 64, 10, 100.0, kind="baseline")])
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 8)
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(bytes(range(256)) * 8)
    for bad in (corrupt, garbage):
        line = one_error_line(run_tuner("copy-study", "--from", source, "--to", f"sqlite:///{bad}", "--study", "s",
                                        cwd=tmp_path), "--to")
        assert "[storage]" not in line and "--storage" not in line, line
        line = one_error_line(run_tuner("copy-study", "--from", f"sqlite:///{bad}", "--to",
                                        f"sqlite:///{tmp_path / 'new.db'}", "--study", "s", cwd=tmp_path), "--from")
        assert "--storage" not in line, line
    for missing in (f"sqlite:///{tmp_path / 'nothere.db'}", "bogus:/x"):
        line = one_error_line(run_tuner("copy-study", "--from", missing, "--to", f"sqlite:///{tmp_path / 'new.db'}",
                                        "--study", "s", cwd=tmp_path), "--from")
        assert "--storage" not in line, line
    assert not (tmp_path / "new.db").exists()
