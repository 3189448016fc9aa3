"""`tuner trials / show / best / studies` through the CLI entry point: output and bad input."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
from pathlib import Path


def _one_error_line(proc, *needles: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_trials_json_and_csv(demo_study: str, tuner_cli) -> None:
    proc = tuner_cli("trials", "--storage", demo_study, "--json", "--sort", "capacity", "--feasible")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["number"] for r in rows] == [2, 1, 0]
    assert rows[1]["params"]["mem_fraction_static"] == 0.88
    assert rows[1]["context_capacity"] == 14 and rows[1]["output_throughput_tok_s"] == 1200.0
    assert all(r["feasible"] and r["failure_class"] is None for r in rows)
    proc = tuner_cli("trials", "--storage", demo_study, "--csv", "--failed")
    table = list(csv.DictReader(io.StringIO(proc.stdout)))
    assert [(r["number"], r["failure_class"]) for r in table] == [("3", "cuda_graph_oom"), ("4", "")]
    assert table[0]["param.mem_fraction_static"] == "0.97"
    proc = tuner_cli("trials", "--storage", demo_study)
    assert proc.returncode == 0 and "cuda_graph_oom" in proc.stdout and "baseline" in proc.stdout
    _one_error_line(tuner_cli("trials", "--storage", demo_study, "--json", "--csv"), "--json and --csv exclude")


def test_show_and_best(demo_study: str, tuner_cli) -> None:
    proc = tuner_cli("show", "3", "--storage", demo_study, "--json")
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["record"]["failure_evidence"].startswith("Capture cuda graph failed")
    proc = tuner_cli("show", "1", "--storage", demo_study)
    assert proc.returncode == 0, proc.stderr
    for text in ("load phases", "measure", "mem_fraction_static", "log excerpt", "artifacts", "abc123"):
        assert text in proc.stdout, text
    proc = tuner_cli("best", "--storage", demo_study, "--json")
    assert proc.returncode == 0, proc.stderr
    best = json.loads(proc.stdout)
    assert best["trial"]["number"] == 1 and best["baseline"]["number"] == 0
    assert [t["number"] for t in best["front"]] == [2, 1]
    assert best["deltas"]["context_capacity"] == {"baseline": 10.0, "best": 14.0, "delta": 4.0, "ratio": 1.4}
    proc = tuner_cli("best", "--storage", demo_study, "--policy", "max_capacity")
    assert proc.returncode == 0 and "trial 2" in proc.stdout


def test_studies_lists_each_study(demo_study: str, tuner_cli) -> None:
    proc = tuner_cli("studies", "--storage", demo_study, "--json")
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert row["study"] == "demo" and row["n_trials"] == 6 and row["model"] == "llama-3.1-8b"


def test_bad_input_one_line_nonzero_nothing_changed(demo_study: str, infeasible_study: str, tmp_path: Path, tuner_cli, monkeypatch) -> None:
    db = Path(demo_study.removeprefix("sqlite:///"))
    before = db.read_bytes()
    _one_error_line(tuner_cli("show", "42", "--storage", demo_study), "no trial 42", "tuner trials")
    _one_error_line(tuner_cli("best", "--storage", infeasible_study), "no feasible trial")
    missing = tmp_path / "missing.db"
    _one_error_line(tuner_cli("trials", "--storage", f"sqlite:///{missing}"), "does not exist")
    assert not missing.exists()
    _one_error_line(tuner_cli("trials", "--storage", demo_study, "--sort", "speed"), "--sort 'speed'")
    monkeypatch.chdir(tmp_path)
    _one_error_line(tuner_cli("trials"), "no study given")
    assert db.read_bytes() == before


def test_unusable_storage_url_is_one_line_for_every_reader(tuner_cli) -> None:
    """A missing DBAPI driver or an unknown dialect names the URL and the fix, never a traceback."""
    readers = [["trials"], ["show", "0"], ["best"], ["studies"], ["report"], ["dashboard", "--port", "1"],
               ["apply", "best", "--dry-run"], ["applies"]]
    postgres = "postgresql+psycopg://u:p@127.0.0.1:1/db"  # port 1: nothing listens (connection refused)
    if importlib.util.find_spec("psycopg") is None:
        refused = ("'psycopg'", "not installed", "pip install 'sglang-tuner[postgres]'")
    else:  # the password is never printed
        refused = ("postgresql+psycopg://u:***@127.0.0.1:1/db", "is unreachable", "check the host and port")
    for url, needles in ((postgres, refused), ("bogus://x", ("bogus://x", "unknown database kind", "check the URL"))):
        for args in readers:
            _one_error_line(tuner_cli(*args, "--storage", url), *needles)


def test_piped_tables_fit_their_content_and_empty_applies_is_one_line(demo_study: str, tuner_cli, monkeypatch) -> None:
    """Without a terminal and without COLUMNS, tables are not cut or wrapped at 80 columns."""
    monkeypatch.delenv("COLUMNS")
    proc = tuner_cli("trials", "--storage", demo_study)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()}
    assert rows["3"][-1] == "cuda_graph_oom" and "skipped:" in rows["4"], proc.stdout
    # the reason a config was skipped is in the table and in --json, where a skip violates nothing (review N8)
    skip = json.loads(tuner_cli("trials", "--storage", demo_study, "--json").stdout)[4]
    assert skip["skipped_reason"] and " ".join(rows["4"]).endswith(" ".join(skip["skipped_reason"].split()[-2:]))
    assert skip["constraints"] is None and skip["proved_by_trial"] is not None, skip
    assert "…" not in proc.stdout and "max_run" in proc.stdout
    proc = tuner_cli("applies", "--storage", demo_study)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines() == [
        f"no apply recorded in {demo_study} yet (`tuner apply best` makes one)"], proc.stdout
    proc = tuner_cli("applies", "--storage", demo_study, "--study", "demo")
    assert proc.stdout.startswith("no apply recorded in demo yet"), proc.stdout
