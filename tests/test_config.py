"""The tuning config: valid files load; every bad file is one line naming the key and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tuner.config import load_config
from tuner.errors import ConfigError
from tuner.study.storage import study_artifacts_dir, study_storage_url
from tuner.units import parse_duration_s

ROOT = Path(__file__).resolve().parents[1]

GOOD = """
[study]
name = "t"

[service]
launcher = "process"
command = "python -m tuner.sim --model-path llama-3.1-8b --mem-fraction-static 0.8"
url = "http://127.0.0.1:30999"

[workload]
kind = "random"
input_len = 1000
output_len = 24

[slo]
ttft_ms = { p99 = 2000 }
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_good_config_and_defaults(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, GOOD))
    assert cfg.service.command[:3] == ["python", "-m", "tuner.sim"]
    assert study_storage_url(cfg) == "sqlite:///studies/t.db"
    assert str(study_artifacts_dir(cfg)) == "studies/t/artifacts"
    assert cfg.workload.input_len == 1000
    assert cfg.slo.ttft_ms == {"p99": 2000.0}
    assert cfg.objective.policy == "throughput_within_capacity"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[study\nname='x'", "not valid TOML"),
        (GOOD + "\n[budget]\nmesure_s = 3\n", "unknown key budget.mesure_s"),
        (GOOD.replace("[workload]", "[space]\nmem_fraction_static = [0.9, 1.2]\n\n[workload]"),
         "space.mem_fraction_static"),
        (GOOD.replace('launcher = "process"', 'launcher = "systemd"'), "unit"),
        (GOOD.replace("input_len = 1000", "input_len = -5"), "workload.input_len"),
        (GOOD + "\n[budget]\ntotal = \"forever\"\n", "budget.total"),
        (GOOD.replace("[study]\nname = \"t\"", "[study]\nname = \"a b\""), "study.name"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/tuner.toml")


@pytest.mark.parametrize(("text", "seconds"), [("4h", 14400), ("90m", 5400), ("1h30m", 5400), ("3m", 180), ("45s", 45), (120, 120)])
def test_budget_durations(text: str | int, seconds: float) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "4x", "h", "0m", "1h-3m", "3", "120"])
def test_bad_budget(text: str) -> None:
    with pytest.raises(ConfigError, match="--budget"):
        parse_duration_s(text)


def test_cli_bad_config_exits_1_with_one_line_and_touches_nothing(tmp_path: Path) -> None:
    bad = _write(tmp_path, GOOD + "\n[storage]\nurl = \"sqlite:///db.db\"\nbogus = 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "tuner.cli", "run", "--config", str(bad), "--budget", "3m"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "storage.bogus" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]


def test_cli_missing_unit_is_one_line_and_touches_nothing(tmp_path: Path) -> None:
    text = GOOD.replace('launcher = "process"', 'launcher = "systemd"\nunit = "no-such-unit-for-tuner.service"\n'
                        f'state_dir = "{tmp_path / "state"}"')
    config = _write(tmp_path, text)
    proc = subprocess.run(
        [sys.executable, "-m", "tuner.cli", "run", "--config", str(config), "--trials", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "studies").exists()


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.study.name and cfg.service.url.startswith("http://127.0.0.1:")
