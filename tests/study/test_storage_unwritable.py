"""A study file that stops taking writes mid-run on a disk that is not full: named as what it is.

SQLite reports a write to a file made immutable under an open connection (``chattr +i``) as
"disk I/O error", a phrase it also uses for a full disk; a new user's sweep saw the run say "the
disk ... is full" and point at ``df -h`` when the disk had room. A real SQLite study, a real
immutable flag (skipped where ``chattr`` is refused: no CAP_LINUX_IMMUTABLE, or a file system
without the flag).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from tuner.errors import StudyError
from tuner.study.storage import open_storage, storage_errors


@pytest.fixture
def immutable(tmp_path: Path) -> Iterator[Path]:
    """A study file, and the flag set on it by the test (always cleared at the end)."""
    db = tmp_path / "s.db"
    db.touch()
    if subprocess.run(["chattr", "+i", str(db)], capture_output=True, check=False).returncode != 0:
        pytest.skip("chattr +i is refused here (no CAP_LINUX_IMMUTABLE or no such flag on this file system)")
    subprocess.run(["chattr", "-i", str(db)], check=True)
    db.unlink()
    yield db
    subprocess.run(["chattr", "-i", str(db)], capture_output=True, check=False)


def test_a_write_refused_on_a_disk_with_room_is_not_called_a_full_disk(immutable: Path) -> None:
    url = f"sqlite:///{immutable}"
    study = optuna.create_study(study_name="s", storage=open_storage(url))
    study.tell(study.ask(), 1.0)
    trial = study.ask()
    subprocess.run(["chattr", "+i", str(immutable)], check=True)
    with pytest.raises(StudyError) as raised, storage_errors(url):
        study.tell(trial, 2.0)
    text = f"{raised.value.message} — {raised.value.hint}"
    assert "could not be written (disk I/O error)" in text and str(immutable) in text, text
    assert "is full" not in text and "df -h" not in text and "\n" not in text, text
    subprocess.run(["chattr", "-i", str(immutable)], check=True)
    assert [t.state.name for t in optuna.load_study(study_name="s", storage=url).trials] == ["COMPLETE", "RUNNING"]
