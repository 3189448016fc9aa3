"""The bundled configs (``configs/*.toml``) copied for a test: a free port, a private state dir,
optionally shortened load phases; and the studies they store."""

from __future__ import annotations

import contextlib
import re
import sqlite3
import subprocess
from dataclasses import dataclass
from pathlib import Path

import optuna

from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""


def config_copy(name: str, tmp_path: Path, *, extra_service: str = "", replace: dict[str, str] | None = None,
                phases: dict[str, float] | None = None, storage: bool = False, port: int | None = None,
                slo: bool = True) -> Path:
    """``configs/<name>`` written to ``tmp_path/<name>``, ready for one test.

    Args:
        name: File name under ``configs/``.
        tmp_path: The test's folder (state dir ``tmp_path/state``; ``studies/`` lands in the cwd).
        extra_service: TOML lines added to ``[service]``.
        replace: Exact text replacements (each must occur).
        phases: ``[budget]`` values to set, e.g. ``{"measure_s": 4, "stress_s": 2}`` (s).
        port: The port to serve on (default: a free one).
        slo: ``False`` drops the config's ``[slo]`` table: a test of storage or service control
            then spares each trial the SLO bracket's steady windows (about a minute a trial).
        storage: Also pin ``[storage]`` to ``tmp_path/studies/<study>.db`` and
            ``tmp_path/studies/<study>/artifacts`` (the default paths, made absolute, so readers
            find the study from any working directory).

    Returns:
        The copy's path. Port 30000/30001 becomes ``port``.
    """
    text = (ROOT / "configs" / name).read_text(encoding="utf-8")
    port = free_port() if port is None else port
    for old in ("30000", "30001"):
        text = text.replace(old, str(port))
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    if not slo:
        text, n = re.subn(r"(?ms)^\[slo\]\n.*?(?=^\[)", "", text)
        assert n == 1, "no [slo] table to drop"
    for key, value in (phases or {}).items():
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value:g}", text)
        assert n == 1, key
    text = text.replace("[service]\n", f'[service]\nstate_dir = "{tmp_path / "state"}"\n{extra_service}', 1)
    if storage:
        study = re.search(r'(?m)^name = "([^"]+)"', text)
        assert study is not None
        studies = tmp_path / "studies"
        (studies / study.group(1)).mkdir(parents=True, exist_ok=True)  # [storage] folders must exist
        text += (f'\n[storage]\nurl = "sqlite:///{studies / (study.group(1) + ".db")}"\n'
                 f'artifacts_dir = "{studies / study.group(1) / "artifacts"}"\n')
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def service_url(config: Path) -> str:
    """The ``url = "..."`` of a config's ``[service]``."""
    line = next(x for x in config.read_text().splitlines() if x.startswith("url = "))
    return line.split('"')[1]


def study_created(db: Path) -> bool:
    """Whether a run has created its study in the SQLite file ``db``, read without writing:
    Optuna's storage would create its schema in a file the run is still setting up, and the two
    creations can collide (``table ... already exists``)."""
    if not db.exists():
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)) as conn:
            return conn.execute("SELECT count(*) FROM studies").fetchone()[0] > 0
    except sqlite3.Error:
        return False


def load_study(storage: str, name: str) -> optuna.Study:
    """The stored study (Optuna's public ``load_study``)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=storage)


@dataclass(frozen=True)
class DemoRun:
    """One finished ``tuner run --config <demo-sim copy> --budget 3m --trials 3``.

    Attributes:
        config: The config copy (free port, private state dir, absolute ``[storage]``).
        work: Its folder (the run's cwd; ``studies/demo-sim.db`` and its artifacts are there).
        storage: The study's Optuna storage URL.
        proc: The finished process (stdout, stderr, returncode).
    """

    config: Path
    work: Path
    storage: str
    proc: subprocess.CompletedProcess[str]

    @property
    def stdout(self) -> str:
        return self.proc.stdout
