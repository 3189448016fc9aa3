"""``tuner upgrade-check``'s flag report (issue 27): SGLang's bundled flag tables of 0.5.5.post3 and
0.5.23, and a study stored in a real SQLite file by the product's loop on the simulator's offline
server; the CLI runs as the installed script."""

from __future__ import annotations

from pathlib import Path

from tests.support.cli import one_error_line, run_tuner
from tests.support.offline_server import OfflineExecutor
from tests.support.scenarios import scenarios, with_seed
from tuner.sglang.flags import FlagTable
from tuner.study.loop import run_study
from tuner.upgrade import flag_changes

OLD, NEW = FlagTable.for_version("0.5.5"), FlagTable.for_version("0.5.23")


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
    one_error_line(run_tuner("upgrade-check", "--storage", url, "--study", cfg.study.name), "exactly one of --python")
    one_error_line(run_tuner("upgrade-check", "--storage", url, "--study", cfg.study.name, "--python",
                             str(tmp_path / "no-python")), "no-python")
