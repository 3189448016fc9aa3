"""Benchmark: the simulator's clock against real, published SGLang measurements (issue 37).

Every point of ``tests/benchmarks/fidelity/points-*.json`` (source, launch flags, client
definition and figures, as the source ran it) is replayed through the offline evaluation
(:func:`tuner.sim.evaluate.evaluate`, the path the study's search benchmarks use); the error per
metric (output throughput, mean / median / p99 TTFT, mean / median TPOT) is printed per point and
summarised (median and worst |error|, signed median) for the training set (the points the cost
factors were fitted on), the validation set (the same deployment family, never fitted) and the
other validation points (other models, GPUs and SGLang versions), as ``fidelity/sets.json`` names
them. A real figure that holds an artifact is excluded in its point, with the reason. The test
asserts issue 37's targets on the validation set; the other points' error is printed and stated in
``docs/simulator-fidelity.md``, not asserted.

One point is also replayed over HTTP: the simulator served as a real process (real time) and loaded
by ``tuner load`` (closed loop, the same lengths and concurrency, fewer requests to keep it short;
the offline evaluation of that same reduced workload is the reference).

Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_fidelity.py --run-benchmarks -s`` (about a
minute of CPU for the offline part, plus ~40 s of real time for the HTTP one).
``.venv/bin/python -m tests.benchmarks.bench_fidelity --record`` rewrites ``fidelity/stored.json``,
the figures the fast regression alarm (``tests/sim/test_fidelity_alarm.py``) holds the cost model to:
run it after a deliberate change of the cost model, and say why in the commit.
``--gains`` prints the fp8-KV and DP-attention throughput gains on the fidelity deployment.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.fidelity import (
    STORED,
    TARGETS,
    Point,
    errors,
    load_points,
    replay,
    split,
    summarise,
    workload,
)
from tuner.sim.evaluate import evaluate

HTTP_POINT = "imax-h200-dsr1-fp8-tp8-1k1k-c8"
HTTP_REQUESTS = 24
"""The HTTP replay: the point and its request count (3 rounds of its 8 in flight, ~45 s real time;
the first round holds the fresh server's cold first batch, so with 2 rounds the median TTFT would
fall between a cold and a warm request)."""


def run_all() -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Replay every point; returns ``(sim figures by id, signed errors by id)``."""
    sims: dict[str, dict[str, float]] = {}
    errs: dict[str, dict[str, float]] = {}
    for p in load_points():
        sims[p.id] = replay(p)
        errs[p.id] = errors(p, sims[p.id])
    return sims, errs


def report(errs: dict[str, dict[str, float]]) -> dict[str, dict[str, dict[str, float]]]:
    """Print the per-point and summary tables; return the summary per set."""
    points = load_points()
    sets = split(points)
    excluded = {p.id: p.excluded for p in points}
    out = {}
    for name, members in sets.items():
        print(f"\n{name} ({len(members)} points): error = simulated / real - 1")
        for p in members:
            cells = " ".join(f"{m}={v:+.1%}" for m, v in errs[p.id].items())
            skip = f"  [excluded: {', '.join(excluded[p.id])}]" if excluded[p.id] else ""
            print(f"  {p.id}: {cells}{skip}")
        summary = summarise([errs[p.id] for p in members])
        out[name] = summary
        print(f"  {'metric':<18} {'n':>3} {'median|e|':>10} {'worst':>8} {'signed median':>14}")
        for m, s in summary.items():
            print(f"  {m:<18} {int(s['n']):>3} {s['median_abs']:>10.1%} {s['worst']:>+8.1%} {s['median_signed']:>+14.1%}")
    return out


def http_replay(point: Point, tmp_path: Path, n: int = HTTP_REQUESTS) -> tuple[dict, dict[str, float]]:
    """Serve the simulator for ``point`` in real time, load it with ``tuner load`` (closed loop,
    ``n`` requests), and return ``(tuner load's summary, the offline evaluation of the same n)``."""
    from tests.support.cli import TUNER
    from tests.support.fidelity import METRICS
    from tests.support.sim import start_healthy

    w = dict(point.workload, num_requests=n)
    sim = start_healthy(point.argv, tmp_path)
    try:
        out = tmp_path / "load.json"
        cmd = [TUNER, "load", "--url", sim.url, "--workload", "random",
               "--input-len", str(w["input_len"]), "--output-len", str(w["output_len"]),
               "--range-ratio", str(w["range_ratio"]), "--num-requests", str(n),
               "--concurrency", str(w["concurrency"]), "--vocab-size", "120000", "--json", str(out)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
        http = json.loads(out.read_text())["summary"]
    finally:
        sim.stop()
    res = evaluate(point.argv, workload(w, text=False), concurrency=w["concurrency"])  # tuner load sends ids
    offline = {m: float(getattr(res, a)) for m, a in METRICS.items() if getattr(res, a) is not None}
    return http, offline


@pytest.fixture(scope="module")
def figures() -> tuple[dict, dict]:
    return run_all()


def _check_targets(errs: dict, metrics: list[str]) -> None:
    summary = report(errs)["validation"]
    for metric in metrics:
        limit = TARGETS[metric]
        assert metric in summary, f"no validation point compares {metric}"
        s = summary[metric]
        assert s["median_abs"] <= limit, f"{metric}: median |error| {s['median_abs']:.1%} > {limit:.0%}"
        # no systematic sign: the signed median is well inside the spread
        assert abs(s["median_signed"]) <= limit, f"{metric}: systematic error {s['median_signed']:+.1%}"


def test_validation_errors_meet_issue_37_targets(figures):
    _check_targets(figures[1], ["output_throughput", "median_tpot_ms", "median_ttft_ms"])


def test_validation_p99_ttft_meets_its_target(figures):
    _check_targets(figures[1], ["p99_ttft_ms"])


def test_stored_figures_are_current(figures):
    sims, _ = figures
    stored = json.loads(STORED.read_text())["points"]
    for pid, sim in sims.items():
        for m, v in sim.items():
            assert v == pytest.approx(stored[pid][m], rel=0.01), (
                f"{pid} {m}: {v} vs stored {stored[pid][m]}: re-record with --record if the change is deliberate")


def test_http_replay_matches_offline(tmp_path):
    point = next(p for p in load_points() if p.id == HTTP_POINT)
    start = time.monotonic()
    http, offline = http_replay(point, tmp_path)
    names = {"output_throughput": "output_throughput", "median_ttft_ms": "median_ttft_ms",
             "median_tpot_ms": "median_tpot_ms", "mean_tpot_ms": "mean_tpot_ms"}
    print(f"\nHTTP replay of {point.id} ({HTTP_REQUESTS} requests, {time.monotonic() - start:.0f} s):")
    for m, key in names.items():
        got = http.get(key)
        print(f"  {m}: tuner load {got}  offline {offline.get(m):.2f}  real (full run) {point.real[m]}")
        assert got is not None, f"tuner load reported no {key}: {sorted(http)}"
        assert got == pytest.approx(offline[m], rel=0.15), f"{m}: HTTP {got} vs offline {offline[m]}"


def record() -> None:
    """Write every point's simulated figures and errors to ``stored.json``."""
    sims, errs = run_all()
    summary = report(errs)
    STORED.write_text(json.dumps({
        "_about": "The simulator's figures for every fidelity point at the last calibration "
                  "(python -m tests.benchmarks.bench_fidelity --record). tests/sim/test_fidelity_alarm.py "
                  "fails when the cost model drifts from them.",
        "points": {pid: {m: round(v, 4) for m, v in sim.items()} for pid, sim in sims.items()},
        "errors": {pid: {m: round(v, 4) for m, v in e.items()} for pid, e in errs.items()},
        "summary": {name: {m: {k: round(v, 4) for k, v in s.items()} for m, s in ms.items()}
                    for name, ms in summary.items()},
    }, indent=1) + "\n")
    print(f"\nwrote {STORED}")


GAIN_WORKLOADS = {"1k/1k, 64 in flight": (1024, 1024, 64), "8k/1k, 32 in flight": (8192, 1024, 32),
                  "1k/1k, 256 in flight": (1024, 1024, 256)}
GAIN_VARIANTS = {"fp8 KV": ["--kv-cache-dtype", "fp8_e4m3"], "DP attention 8": ["--enable-dp-attention", "--dp-size", "8"]}


def lever_gains() -> dict[str, dict[str, float]]:
    """Output throughput of the fidelity deployment (the points' flags, 4 x concurrency requests)
    and of its fp8-KV and DP-attention variants: the MLA gains issue 37 put at risk."""
    point = load_points()[0]
    out: dict[str, dict[str, float]] = {}
    for name, (n_in, n_out, conc) in GAIN_WORKLOADS.items():
        w = {"input_len": n_in, "output_len": n_out, "range_ratio": 0.8, "num_requests": 4 * conc, "concurrency": conc}
        row = {}
        for variant, extra in {"base": [], **GAIN_VARIANTS}.items():
            row[variant] = evaluate(point.argv + extra, workload(w), concurrency=conc).output_throughput
        out[name] = row
        print(name, "  ".join(f"{v}: {t:,.0f} tok/s ({t / row['base'] - 1:+.1%})" for v, t in row.items()))
    return out


if __name__ == "__main__":
    if "--record" in sys.argv:
        record()
    elif "--gains" in sys.argv:
        lever_gains()
    else:
        report(run_all()[1])
