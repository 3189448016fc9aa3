"""``tuner run --prometheus-textfile``: a running study scraped as node_exporter's textfile
collector would (the file parsed by ``prometheus_client``'s own parser while the run works and
after it), and the Grafana dashboard in ``configs/`` asking only for series the file has."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.configs import config_copy

ROOT = Path(__file__).resolve().parents[2]
TUNER = str(Path(sys.executable).with_name("tuner"))


def _scrape(path: Path) -> dict[str, float]:
    """``{"name{label=value,...}": value}`` of every sample in the file."""
    samples = {}
    for family in text_string_to_metric_families(path.read_text(encoding="utf-8")):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_running_study_is_scraped_and_the_dashboard_asks_for_what_is_there(tmp_path: Path) -> None:
    config = config_copy("demo-sim.toml", tmp_path, phases={"warmup_s": 1, "measure_s": 3, "stress_s": 1})
    prom, events = tmp_path / "tuner.prom", tmp_path / "progress.jsonl"
    proc = subprocess.Popen([TUNER, "run", "--config", str(config), "--trials", "2", "--prometheus-textfile",
                             str(prom), "--json-progress", str(events)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    during: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if prom.exists():
                seen = _scrape(prom)
                if seen.get("sglang_tuner_trial_in_flight", -1) >= 0 and any(
                        k.startswith("sglang_tuner_phase{") and v == 1 for k, v in seen.items()):
                    during = seen
            time.sleep(0.2)
        assert proc.wait(timeout=300) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert during, "never scraped a trial in flight"
    assert during["sglang_tuner_running"] == 1 and during["sglang_tuner_restarts_total"] >= 1, during
    after = _scrape(prom)
    summary = json.loads(events.read_text(encoding="utf-8").splitlines()[-1])
    assert after["sglang_tuner_running"] == 0 and after["sglang_tuner_trial_in_flight"] == -1, after
    assert after["sglang_tuner_restarts_total"] == summary["trials_run"], (after, summary)
    ended = sum(v for k, v in after.items() if k.startswith("sglang_tuner_trials_total{"))
    assert ended == summary["trials_run"] + summary["trials_skipped"], (after, summary)
    assert after["sglang_tuner_best_context_capacity"] >= summary["baseline"]["context_capacity"] > 0, after
    # the best's SLO-safe capacity (the demo sets an SLO): measured, never above its OOM-safe one
    assert 0 <= after["sglang_tuner_best_slo_context_capacity"] <= after["sglang_tuner_best_context_capacity"], after
    assert after["sglang_tuner_last_restart_timestamp_seconds"] > time.time() - 600
    info = [k for k in after if k.startswith("sglang_tuner_info{")]
    assert info and "study=demo-sim" in info[0], info

    dashboard = json.loads((ROOT / "configs" / "grafana-sglang-tuner.json").read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    names = {base for k in after for base in (k.split("{")[0],)}
    asked = {m for e in exprs for m in re.findall(r"sglang_tuner_[a-z_]+", e)}
    assert asked and asked <= names, asked - names


def test_an_unwritable_textfile_is_refused_before_the_run(tmp_path: Path) -> None:
    config = config_copy("demo-sim.toml", tmp_path)
    done = subprocess.run([TUNER, "run", "--config", str(config), "--trials", "1", "--prometheus-textfile",
                           str(tmp_path / "no-such-folder" / "t.prom")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "--prometheus-textfile" in done.stderr and "folder that does not exist" in done.stderr
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


def _dashboard_metrics() -> set[str]:
    """Every ``sglang_tuner_*`` series a panel, an annotation or a template variable of the Grafana
    dashboard in ``configs/`` asks for."""
    dashboard = json.loads((ROOT / "configs" / "grafana-sglang-tuner.json").read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    exprs += [json.dumps(v.get("query", "")) for v in dashboard.get("templating", {}).get("list", [])]
    return {m for e in exprs for m in re.findall(r"sglang_tuner_[a-z_]+", e)}


def test_every_metric_the_dashboard_names_is_exported(tmp_path: Path) -> None:
    """The exporter's own exposition (a fresh run's file, before any trial), parsed by
    ``prometheus_client``'s parser: every series the dashboard names is in it, the SLO-safe
    capacity included; and a name the exporter does not write would fail the check."""
    from tuner.report.prometheus import PrometheusTextfile

    prom = tmp_path / "t.prom"
    PrometheusTextfile(prom, study="s", host="h", storage="sqlite:///x.db")
    exported = {k.split("{")[0] for k in _scrape(prom)}
    asked = _dashboard_metrics()
    assert {"sglang_tuner_best_slo_context_capacity", "sglang_tuner_restarts_total",
            "sglang_tuner_last_restart_timestamp_seconds", "sglang_tuner_trials_total"} <= asked, asked
    assert asked <= exported, asked - exported
    assert "sglang_tuner_best_slo_capacity" not in exported  # a misspelt name would be caught


@pytest.mark.parametrize(("basis", "best"), [("slo_safe", 0), ("oom_safe", 1)])
def test_the_best_so_far_ranks_by_the_capacity_the_study_ranks_by(tmp_path: Path, basis: str, best: int) -> None:
    """A real run of the reference twin: every trial SLO-safe at 3, the baseline (OOM-safe 4) the
    fastest; ``tuner best`` (SLO-safe basis) chose the baseline while the exporter's "best so far"
    ranked by the OOM-safe capacity named trial 1 (8): a Grafana panel contradicting the study."""
    from tuner.report.prometheus import PrometheusTextfile
    from tuner.study.progress import Progress

    prom = tmp_path / "t.prom"
    sink = PrometheusTextfile(prom, study="s", host="h", storage="sqlite:///x.db", basis=basis)
    for number, (oom, slo, tput) in enumerate(((4, 3, 129.0), (8, 3, 118.0))):
        sink(Progress(event="trial_end", number=number, result={
            "outcome": "ok", "feasible": True, "context_capacity": oom, "slo_context_capacity": slo,
            "output_throughput_tok_s": tput}))
    seen = _scrape(prom)
    assert seen["sglang_tuner_best_trial"] == best, seen
    assert seen["sglang_tuner_best_context_capacity"] == (4, 8)[best]
    assert seen["sglang_tuner_best_slo_context_capacity"] == 3
