"""Replaying real, published SGLang measurements through the simulator, and the error per metric.

The points live in ``tests/benchmarks/fidelity/points-*.json`` (each with its source, launch flags,
client definition and measured figures, as the source ran it); ``sets.json`` there names the
training and validation points and the real figures excluded as artifacts. Used by
``tests/benchmarks/bench_fidelity.py`` (all points, the summary, ``--record``) and by the fast
regression alarm ``tests/sim/test_fidelity_alarm.py`` (a few points against the stored figures).

Error of a metric = simulated / real − 1 (signed: + means the simulator says slower for a latency,
faster for a throughput).
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.sim.engine import SimRequest
from tuner.sim.evaluate import EvalResult, evaluate

DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "fidelity"
"""Folder of the points, the sets and the stored figures."""
STORED = DATA / "stored.json"
"""The simulator's figures for every point when the cost model was last calibrated."""

METRICS: dict[str, str] = {
    "output_throughput": "output_throughput",
    "mean_ttft_ms": "mean_ttft_ms",
    "median_ttft_ms": "p50_ttft_ms",
    "p99_ttft_ms": "p99_ttft_ms",
    "mean_tpot_ms": "mean_tpot_ms",
    "median_tpot_ms": "p50_tpot_ms",
}
"""Real metric name (bench_serving's, in the points) → :class:`EvalResult` attribute."""

TARGETS: dict[str, float] = {
    "output_throughput": 0.10,
    "median_tpot_ms": 0.10,
    "median_ttft_ms": 0.20,
    "p99_ttft_ms": 0.30,
}
"""Issue 37's validation targets: the largest median |error| allowed per metric."""


@dataclass(frozen=True)
class Point:
    """One real measurement.

    Attributes:
        id: The point's id.
        argv: The simulator's command line: the source's server flags, the model preset and the GPU.
        workload: The client definition (``input_len``, ``output_len``, ``range_ratio``,
            ``num_requests``, ``concurrency``).
        real: The measured figures (bench_serving names: ms, tokens/s).
        excluded: Real metrics not compared on this point (artifacts), with the reason.
        raw: The whole record as stored.
    """

    id: str
    argv: list[str]
    workload: dict[str, Any]
    real: dict[str, float]
    excluded: dict[str, str]
    raw: dict[str, Any]


def _sets() -> dict[str, Any]:
    return json.loads((DATA / "sets.json").read_text())


def _cold_start(workload: dict[str, Any], server_args: list[str]) -> bool:
    """Whether the first burst fits one prefill batch (see ``sets.json`` ``cold_start_tail``)."""
    budget = 16384  # SGLang's --max-prefill-tokens default (§2.4)
    if "--max-prefill-tokens" in server_args:
        budget = int(server_args[server_args.index("--max-prefill-tokens") + 1])
    return int(workload["concurrency"]) * int(workload["input_len"]) <= budget


def load_points() -> list[Point]:
    """Every point of every ``points-*.json``, in file order.

    Raises:
        KeyError: A point lacks ``sim_model``, ``gpu``, ``server_args``, ``workload`` or ``real``.
    """
    sets = _sets()
    cold = sets["cold_start_tail"]
    points = []
    for path in sorted(DATA.glob("points-*.json")):
        for raw in json.loads(path.read_text())["points"]:
            args = [a for a in raw["server_args"] if a != "--trust-remote-code"]
            excluded = {}
            if _cold_start(raw["workload"], args):
                excluded = {m: "first-batch cold start (sets.json cold_start_tail)" for m in cold["metrics"]}
            points.append(Point(raw["id"], ["--model-path", raw["sim_model"], "--sim-gpu", raw["gpu"], *args],
                                raw["workload"], raw["real"], excluded, raw))
    return points


def split(points: Iterable[Point]) -> dict[str, list[Point]]:
    """``{"train": [...], "validation": [...]}`` as ``sets.json`` names them (a point in neither
    is left out)."""
    sets = _sets()
    by_id = {p.id: p for p in points}
    return {name: [by_id[i] for i in sets[name] if i in by_id] for name in ("train", "validation")}


def workload(w: dict[str, Any], seed: int = 0, *, text: bool = True) -> list[SimRequest]:
    """The client's requests: vLLM's ``benchmark_serving.py`` random dataset with ``--ignore-eos``:
    input and output lengths uniform in ``[range_ratio × L, L]``, random token ids (no shared
    prefixes), ``num_requests`` of them, sent as text (the server tokenizes them) unless ``text``
    is False."""
    rng = random.Random(seed)
    ratio = float(w.get("range_ratio", 1.0))
    reqs = []
    for i in range(int(w["num_requests"])):
        n_in = rng.randint(int(w["input_len"] * ratio), int(w["input_len"]))
        n_out = rng.randint(int(w["output_len"] * ratio), int(w["output_len"]))
        reqs.append(SimRequest(f"f{i}", [rng.randrange(100, 120_000) for _ in range(n_in)], n_out, ignore_eos=True,
                               text=text))
    return reqs


def replay(point: Point) -> dict[str, float]:
    """The simulator's figures for ``point`` (offline evaluation, virtual clock), bench_serving names.

    Raises:
        RuntimeError: The simulated server did not start or failed under the load.
    """
    w = point.workload
    result: EvalResult = evaluate(point.argv, workload(w), concurrency=w.get("concurrency"))
    if not result.started or result.error or result.runtime_oom:
        raise RuntimeError(f"{point.id}: the simulator failed ({result.startup_failure or result.error or 'runtime OOM'})")
    out = {}
    for real_name, attr in METRICS.items():
        value = getattr(result, attr)
        if value is not None:
            out[real_name] = float(value)
    return out


def errors(point: Point, sim: dict[str, float]) -> dict[str, float]:
    """Signed relative error per compared metric (excluded ones left out)."""
    return {m: sim[m] / point.real[m] - 1.0 for m in METRICS
            if m in sim and m in point.real and m not in point.excluded and point.real[m]}


def summarise(per_point: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per metric over the points: ``n``, ``median_abs``, ``worst`` (signed, largest |error|),
    ``median_signed``."""
    out: dict[str, dict[str, float]] = {}
    for m in METRICS:
        vals = [e[m] for e in per_point if m in e]
        if not vals:
            continue
        out[m] = {"n": len(vals), "median_abs": statistics.median(abs(v) for v in vals),
                  "worst": max(vals, key=abs), "median_signed": statistics.median(vals)}
    return out
