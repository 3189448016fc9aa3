"""``tuner explain --trial N`` (issue 28, review N6): a stored trial's server log explained within
what its study measured: no "raise mem_fraction_static" advice beyond the activation peak the
stress load measured, every fraction beyond it marked as failing under load. The study is the
product's own run on the simulator's offline server, with its artifacts in a real SQLite study."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TUNER = str(Path(sys.executable).with_name("tuner"))


def _tuner(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TUNER, *args], capture_output=True, text=True, timeout=120, check=False, cwd=cwd,
                          env={"PATH": "/usr/bin:/bin", "COLUMNS": "160", "NO_COLOR": "1"})


@pytest.fixture(scope="module")
def reference_study(reference_offline_study) -> tuple[Path, str, int, float]:
    study = reference_offline_study
    peak = max(r.memory.peak_activation_gib or 0 for _, r in study.history)
    # the launched trial at the highest fraction: the study measured where its headroom ends
    highest, _ = max(((n, r) for n, r in study.history if r.outcome == "ok"),
                     key=lambda item: item[1].params["mem_fraction_static"])
    return study.folder, study.url, highest, peak


def test_the_highest_fractions_log_alone_advises_a_higher_fraction(reference_study) -> None:
    tmp, url, best, _ = reference_study
    shown = json.loads(_tuner("show", str(best), "--storage", url, "--json", cwd=tmp).stdout)
    log = shown["artifact_paths"]["server_log"]
    alone = json.loads(_tuner("explain", "--log", log, "--json", cwd=tmp).stdout)
    levers = alone["levers"] + [t["lever"] for t in alone["traps"] if t["lever"]]
    assert any(lv["knob"] == "mem_fraction_static" and lv["direction"] == "raise" for lv in levers), levers


def test_explain_of_a_stored_trial_keeps_within_the_studys_measured_boundaries(reference_study) -> None:
    tmp, url, best, peak = reference_study
    proc = _tuner("explain", "--trial", str(best), "--storage", url, "--json", cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    bounded = json.loads(proc.stdout)
    levers = bounded["levers"] + [t["lever"] for t in bounded["traps"] if t["lever"]]
    assert not any(lv["knob"] == "mem_fraction_static" and lv["direction"] == "raise" for lv in levers), levers
    current = float(bounded["settings"]["mem_fraction_static"]["value"])
    for row in bounded["predictions"]:
        if row["free_after_graphs_gib"] is not None and row["free_after_graphs_gib"] < peak:
            assert not row["starts"] and row["note"].startswith("fails under load"), row
    assert any(r["mem_fraction_static"] > current and not r["starts"] for r in bounded["predictions"])
    assert any(f.startswith("bounded by study reference-sim") for f in bounded["findings"])
    idle = [t for t in bounded["traps"] if t["id"] == "idle_reserve"]
    assert all(t["lever"] is None and t["severity"] == "info" for t in idle)
    text = _tuner("explain", "--trial", str(best), "--storage", url, cwd=tmp).stdout
    assert "raise mem_fraction_static" not in text


def test_trial_with_another_input_or_without_a_log_is_one_line(reference_study) -> None:
    tmp, url, best, _ = reference_study
    both = _tuner("explain", "--trial", str(best), "--storage", url, "--log", "x.log", cwd=tmp)
    assert both.returncode == 1 and "both name what to explain" in both.stderr and "Traceback" not in both.stderr
    study_alone = _tuner("explain", "--log", "x.log", "--storage", url, cwd=tmp)
    assert study_alone.returncode == 1 and "--trial" in study_alone.stderr
    missing = _tuner("explain", "--trial", "999", "--storage", url, cwd=tmp)
    assert missing.returncode == 1 and "no trial 999" in missing.stderr
