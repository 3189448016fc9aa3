"""A study file that stops taking writes mid-run on a disk that is not full: named as what it is.

SQLite reports a write to a file made immutable under an open connection (``chattr +i``) as
"disk I/O error", a phrase it also uses for a full disk; a new user's sweep saw the run say "the
disk ... is full" and point at ``df -h`` when the disk had room. A real SQLite study, a real
immutable flag (:mod:`tests.support.immutable`).
"""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from tests.support.immutable import immutable
from tuner.errors import StudyError
from tuner.study.storage import open_storage, storage_errors


def test_a_write_refused_on_a_disk_with_room_is_not_called_a_full_disk(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    url = f"sqlite:///{db}"
    study = optuna.create_study(study_name="s", storage=open_storage(url))
    study.tell(study.ask(), 1.0)
    trial = study.ask()
    with immutable(db), pytest.raises(StudyError) as raised, storage_errors(url):
        study.tell(trial, 2.0)
    text = f"{raised.value.message} — {raised.value.hint}"
    assert "could not be written (disk I/O error)" in text and str(db) in text, text
    assert "is full" not in text and "df -h" not in text and "\n" not in text, text
    assert [t.state.name for t in optuna.load_study(study_name="s", storage=url).trials] == ["COMPLETE", "RUNNING"]
