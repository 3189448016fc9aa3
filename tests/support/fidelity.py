"""Replaying real, published SGLang measurements through the simulator, and the error per metric.

The points live in ``tests/benchmarks/fidelity/points-*.json`` (each with its source, launch flags,
client definition and measured figures, as the source ran it, and any real figure excluded as an
artifact with its reason); ``sets.json`` there names the training and validation points. Used by
``tests/benchmarks/bench_fidelity.py`` (all points, the summary, ``--record``) and by the fast
regression alarm ``tests/sim/test_fidelity_alarm.py`` (a few points against the stored figures).

Error of a metric = simulated / real − 1 (signed: + means the simulator says slower for a latency,
faster for a throughput).
"""

from __future__ import annotations

import json
import math
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
        argv: The simulator's command line: the source's server flags (``sim_args`` where the
            point renames them for the simulator's SGLang version), the model preset and the GPU.
        workload: The client definition (``input_len``, ``output_len``, ``range_ratio``,
            ``num_requests``, ``concurrency``).
        real: The measured figures (bench_serving names: ms, tokens/s).
        excluded: Real metrics not compared on this point (artifacts), with the reason (the
            point's ``excluded`` in its file).
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


def load_points() -> list[Point]:
    """Every point of every ``points-*.json``, in file order.

    Raises:
        KeyError: A point lacks ``sim_model``, ``gpu``, ``server_args``, ``workload`` or ``real``.
    """
    points = []
    for path in sorted(DATA.glob("points-*.json")):
        for raw in json.loads(path.read_text())["points"]:
            args = [a for a in raw.get("sim_args", raw["server_args"]) if a != "--trust-remote-code"]
            excluded = dict(raw.get("excluded", {}))
            points.append(Point(raw["id"], ["--model-path", raw["sim_model"], "--sim-gpu", raw["gpu"], *args],
                                raw["workload"], raw["real"], excluded, raw))
    return points


def split(points: Iterable[Point]) -> dict[str, list[Point]]:
    """``{"train": [...], "validation": [...], "validation_other": [...]}`` as ``sets.json`` names
    them (a point in none is left out)."""
    sets = _sets()
    by_id = {p.id: p for p in points}
    return {name: [by_id[i] for i in ids if i in by_id] for name, ids in sets.items() if isinstance(ids, list)}


def _sharegpt_lengths(rng: random.Random, rec: dict[str, Any]) -> tuple[int, int]:
    """One (input, output) length pair of a reconstructed ShareGPT workload: lognormal lengths with
    the stated means and ``sigma`` (``rec``), kept only where bench_serving's ShareGPT sampler keeps
    a conversation (prompt 4-1,024 tokens, output at least 4, prompt + output at most 2,048)."""
    sigma = 1.0
    mu_in = math.log(rec["mean_input"]) - sigma * sigma / 2
    mu_out = math.log(rec["mean_output"]) - sigma * sigma / 2
    while True:
        n_in = int(rng.lognormvariate(mu_in, sigma))
        n_out = int(rng.lognormvariate(mu_out, sigma))
        if 4 <= n_in <= 1024 and n_out >= 4 and n_in + n_out <= 2048:
            return n_in, n_out


def workload(w: dict[str, Any], seed: int = 0, *, text: bool = True) -> list[SimRequest]:
    """The client's requests, sent as text (the server tokenizes them) unless ``text`` is False.

    ``kind`` ``random``: bench_serving's random dataset with ``--ignore-eos`` (vLLM's and SGLang's):
    input and output lengths uniform in ``[range_ratio × L, L]`` (at least 1 token), random token
    ids (no shared prefixes). ``kind`` ``sharegpt``: lengths drawn by :func:`_sharegpt_lengths` from
    ``w["reconstructed"]`` (the source does not give them per request). ``num_requests`` of them; a
    ``rate`` gives Poisson arrivals at that many requests/s (bench_serving's
    ``np.random.exponential(1 / rate)`` gaps), else all arrive at once (or the closed loop sends them).
    """
    rng = random.Random(seed)
    ratio = float(w.get("range_ratio", 1.0))
    rate = w.get("rate")
    reqs = []
    t = 0.0
    for i in range(int(w["num_requests"])):
        if w.get("kind") == "sharegpt":
            n_in, n_out = _sharegpt_lengths(rng, w["reconstructed"])
        else:
            n_in = max(1, rng.randint(int(w["input_len"] * ratio), int(w["input_len"])))
            n_out = max(1, rng.randint(int(w["output_len"] * ratio), int(w["output_len"])))
        if rate:
            t += rng.expovariate(float(rate))
        reqs.append(SimRequest(f"f{i}", [rng.randrange(100, 120_000) for _ in range(n_in)], n_out, ignore_eos=True,
                               arrival_s=t if rate else 0.0, text=text))
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
