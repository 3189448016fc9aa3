"""``tuner upgrade-check``'s flag report (issue 27): SGLang's bundled flag tables of 0.5.5.post3 and
0.5.23, and a study stored in a real SQLite file by the product's loop on the simulator's offline
server; the CLI runs as the installed script."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from tests.support.cli import one_error_line, run_tuner
from tests.support.configs import config_copy, service_url
from tests.support.offline_server import OfflineExecutor
from tests.support.scenarios import scenarios, with_seed
from tests.support.sim import is_healthy
from tuner.config import load_config
from tuner.sglang.flags import FlagTable
from tuner.study.loop import run_study
from tuner.study.storage import study_storage_url
from tuner.upgrade import flag_changes

OLD, NEW = FlagTable.for_version("0.5.5"), FlagTable.for_version("0.5.23")



@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Studies' artifacts (``studies/<study>/artifacts``) land in the test's folder."""
    monkeypatch.chdir(tmp_path)

def test_renamed_removed_and_changed_defaults_are_named() -> None:
    argv = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--tp", "8", "--cuda-graph-max-bs", "256",
            "--hybrid-kvcache-ratio", "0.5", "--sim-gpu", "L4-24GB"]
    changes = {c.field: c for c in flag_changes(argv, OLD, NEW)}
    assert changes["cuda_graph_max_bs"].change == "renamed"
    assert changes["cuda_graph_max_bs"].new == "--cuda-graph-max-bs-decode"  # §3.2; 0.5.23 finds it ambiguous
    assert changes["hybrid_kvcache_ratio"].change == "removed"
    assert changes["hicache_mem_layout"].change == "default"
    assert "tp_size" not in changes and "model_path" not in changes  # --tp is still a unique prefix
    assert all(c.field != "sim_gpu" for c in changes.values())  # not SGLang's flag
    assert flag_changes(argv, OLD, OLD) == []


def test_upgrade_check_reports_on_the_best_config_and_changes_nothing(tmp_path: Path) -> None:
    cfg = with_seed(scenarios()["8B on H100, 8k contexts, p99 ITL 240 ms"]["config"], 0)
    url = f"sqlite:///{tmp_path}/s.db"
    run_study(cfg, OfflineExecutor(cfg, world_seed=0), max_trials=3, storage_url=url)
    before = (tmp_path / "s.db").read_bytes()
    proc = run_tuner("upgrade-check", "--storage", url, "--study", cfg.study.name, "--version", "0.5.23")
    assert proc.returncode == 0, proc.stderr
    assert "SGLang 0.5.5 → 0.5.23" in proc.stdout and "hicache_mem_layout: default" in proc.stdout
    assert "fingerprint (" in proc.stdout and "bytes/token" in proc.stdout
    assert (tmp_path / "s.db").read_bytes() == before  # nothing persisted
    assert "no bundled flag table" not in proc.stdout
    # a release with no bundled table: read from the nearest one, and said so (the sweep of issue 28
    # saw "SGLang 0.5.5 → 9.9.9" with 0.5.23's flags and no word of it)
    newer = run_tuner("upgrade-check", "--storage", url, "--study", cfg.study.name, "--version", "0.5.99")
    assert newer.returncode == 0, newer.stderr
    assert "SGLang 0.5.99 has no bundled flag table: its flags are those of 0.5.23" in newer.stdout, newer.stdout
    # a series no bundled table covers is refused (the sweep of stop 37: 9.9 reported default changes)
    one_error_line(run_tuner("upgrade-check", "--storage", url, "--study", cfg.study.name, "--version", "9.9.9"),
                   "outside the bundled flag tables' series")
    one_error_line(run_tuner("upgrade-check", "--storage", url, "--study", cfg.study.name), "exactly one of --python")
    one_error_line(run_tuner("upgrade-check", "--storage", url, "--study", cfg.study.name, "--python",
                             str(tmp_path / "no-python")), "no-python")


def _stored_twin(tmp_path: Path) -> tuple[Path, Path]:
    """The reference twin's config (process launcher, simulator 0.5.5, a free port) and its study,
    stored by the product's loop on the offline simulator."""
    path = config_copy("reference-sim.toml", tmp_path, storage=True)
    cfg = load_config(path)
    run_study(cfg, OfflineExecutor(cfg, world_seed=0), max_trials=4, storage_url=study_storage_url(cfg))
    return path, tmp_path / "studies" / f"{cfg.study.name}.db"


def test_boot_starts_the_best_flags_on_the_new_version_once_and_restores(tmp_path: Path) -> None:
    path, db = _stored_twin(tmp_path)
    before = db.read_bytes()
    proc = run_tuner("upgrade-check", "--config", str(path), "--version", "0.5.23", "--boot", "--json", timeout_s=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    boot = report["boot"]
    assert "--sim-version" in boot["argv"] and boot["argv"][boot["argv"].index("--sim-version") + 1] == "0.5.23"
    # 0.5.16 moved the draft's KV into the cell (§1.5): less pool and draft share for the same flags
    assert boot["token_capacity"] < boot["before"]["token_capacity"]
    assert boot["draft_gib"] is not None and boot["draft_gib"] < boot["before"]["draft_gib"]
    assert boot["free_gib_after_graphs"] is not None
    assert not is_healthy(service_url(path), 1.0)  # restored: the process launcher's original ran nothing
    assert db.read_bytes() == before  # nothing persisted


def test_a_refused_boot_starts_nothing(tmp_path: Path) -> None:
    path, db = _stored_twin(tmp_path)
    before = db.read_bytes()
    now = datetime.datetime.now()
    closed = f"{(now + datetime.timedelta(hours=2)):%H:%M}-{(now + datetime.timedelta(hours=3)):%H:%M}"
    one_error_line(run_tuner("upgrade-check", "--config", str(path), "--version", "0.5.23", "--boot", "--window", closed),
                   "outside the window", "nothing was started")
    one_error_line(run_tuner("upgrade-check", "--config", str(path), "--version", "0.5.23", "--window", closed),
                   "only apply with --boot")
    assert not is_healthy(service_url(path), 1.0)
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())  # no lock, no state file
    assert db.read_bytes() == before
