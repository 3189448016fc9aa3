"""`tuner trials / show / best / report / apply --dry-run` on a study written by a real `tuner run`.

One short `tuner run` of ``configs/demo-sim.toml`` (the simulator under the process launcher, on a
free port, storage and artifacts in a temp dir, shortened load phases, two trials) per module;
the readers are then checked against what Optuna itself stored.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import optuna
import pytest

from tests.report.cli_runner import run_tuner

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    work = tmp_path_factory.mktemp("realrun")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    text = (REPO / "configs" / "demo-sim.toml").read_text(encoding="utf-8")
    text = text.replace("30000", str(port))
    text = re.sub(r"(?m)^measure_s = .*$", "measure_s = 4", text)
    text = re.sub(r"(?m)^stress_s = .*$", "stress_s = 2", text)
    text += f'\n[storage]\nurl = "sqlite:///{work / "demo.db"}"\nartifacts_dir = "{work / "artifacts"}"\n'
    config = work / "demo.toml"
    config.write_text(text, encoding="utf-8")
    proc = run_tuner("run", "--config", str(config), "--budget", "3m", "--trials", "2", cwd=work, timeout_s=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (work / "run.out").write_text(proc.stdout, encoding="utf-8")
    return config, f"sqlite:///{work / 'demo.db'}"


def test_trials_json_matches_what_optuna_stored(real_run: tuple[Path, str], tuner_cli) -> None:
    config, storage = real_run
    proc = tuner_cli("trials", "--config", str(config), "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    study = optuna.load_study(study_name="demo-sim", storage=storage)
    trials = study.get_trials(deepcopy=False)
    assert [r["number"] for r in rows] == [t.number for t in trials] and len(rows) == 2
    assert rows[0]["kind"] == "baseline"
    for row, trial in zip(rows, trials):
        assert row["state"] == trial.state.name
        if trial.values is not None:
            assert row["values"] == list(trial.values)
            assert row["context_capacity"] == trial.values[0]
            feasible = all(v <= 0 for v in trial.constraints.values())
            assert row["feasible"] is feasible
        assert row["params"]["mem_fraction_static"] is not None
    feasible_rows = json.loads(tuner_cli("trials", "--config", str(config), "--json", "--feasible").stdout)
    assert [r["number"] for r in feasible_rows] == [r["number"] for r in rows if r["feasible"]]


def test_show_json_and_text(real_run: tuple[Path, str], tuner_cli) -> None:
    config, _ = real_run
    proc = tuner_cli("show", "0", "--config", str(config), "--json")
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert "tuner.sim" in shown["record"]["argv"] and shown["record"]["token_capacity"] > 0
    assert any(p["name"] == "measure" for p in shown["record"]["phases"])
    assert shown["artifact_paths"] and all(Path(p).is_file() for p in shown["artifact_paths"].values())
    proc = tuner_cli("show", "0", "--config", str(config))
    assert proc.returncode == 0, proc.stderr
    for text in ("Memory per GPU (waterfall)", "load phases", "measure", "log excerpt", "artifacts"):
        assert text in proc.stdout, text


def test_best_report_and_apply_dry_run(real_run: tuple[Path, str], tmp_path: Path, tuner_cli) -> None:
    config, storage = real_run
    rows = json.loads(tuner_cli("trials", "--config", str(config), "--json").stdout)
    proc = tuner_cli("best", "--config", str(config), "--json")
    if not any(r["feasible"] for r in rows):
        assert proc.returncode == 1 and "no feasible trial" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    best = json.loads(proc.stdout)
    assert best["trial"]["feasible"] and best["baseline"]["number"] == 0
    assert {t["number"] for t in best["front"]} <= {r["number"] for r in rows if r["feasible"]}
    assert best["trial"]["number"] in {t["number"] for t in best["front"]}
    assert best["deltas"]["context_capacity"]["best"] == best["trial"]["context_capacity"]
    out = tmp_path / "report.html"
    assert tuner_cli("report", "--config", str(config), "-o", str(out)).returncode == 0
    assert 'id="pareto-front"' in out.read_text(encoding="utf-8")
    proc = tuner_cli("apply", "best", "--config", str(config), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "process launcher" in proc.stdout and "tuner.sim" in proc.stdout


def test_run_summary_says_what_best_says(real_run: tuple[Path, str], tuner_cli) -> None:
    """The run's closing "why:" line and `tuner best` come from one computation on one pool."""
    config, _ = real_run
    out = (config.parent / "run.out").read_text(encoding="utf-8")
    assert not out.startswith("\n"), out[:200]
    proc = tuner_cli("best", "--config", str(config), "--json")
    if proc.returncode != 0:
        assert "no feasible trial yet" in out and "no feasible trial" in proc.stderr
        return
    best = json.loads(proc.stdout)
    why = [line for line in out.splitlines() if line.startswith("why: ")]
    assert why == [f"why: {best['reason']}"], (why, best["reason"])
    assert f"best (trial {best['trial']['number']})" in out


def test_run_errors_are_one_line_without_a_blank_line(tmp_path: Path) -> None:
    proc = run_tuner("run", "--config", str(REPO / "configs" / "demo-sim.toml"), "--budget", "5s",
                     "--storage", f"sqlite:///{tmp_path / 'none.db'}", cwd=tmp_path, timeout_s=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == "", repr(proc.stdout)
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: --budget 5s is shorter than one trial"), proc.stderr
