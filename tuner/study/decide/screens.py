"""Screens: a config the study need not restart the service for, and why.

Each screen is one rule with one method, ``why_not(params, view) -> Skip | None``; the study asks
them in order before a launch (:class:`tuner.study.decide.Decider`) and tells a skipped config
PRUNED with the reason and the proving trial:

- :class:`MeasuredAlready` — the same config (on the space's grid) was launched.
- :class:`MustFail` — a memory failure proves it fails (monotone in ``mem_fraction_static`` and the
  reserve knobs, :func:`tuner.sglang.memory.must_fail`).
- :class:`Predicted` — the calibrated models predict it cannot win: below the best capacity's band,
  more request slots than can change its result, too little headroom for the measured activation
  peak; and one proof, the SLO's monotone rule (sampled configs only; the reasons say "predicted").
- :class:`QualityFailed` — a trial with the same numerics failed the quality gate (the answers
  depend on the numerics only, :mod:`tuner.sglang.numerics`).
- :class:`HostMemory` — its hierarchical-cache pools do not fit this host.
- :class:`RunningElsewhere` — another host runs the same config now (the sampler's draws).
- :class:`Unavailable` — a structural lever this SGLang version does not have (its flag table), or
  a ``--dcp-size`` or DP-attention ``--dp-size`` that does not divide ``--tp-size`` (each lever's
  rule, :meth:`tuner.knobs.Lever.unavailable`; never launched, the skip names the fact).
- :class:`WontStart` — the ladder's arithmetic says the config's structural rung does not start
  (issue 23: DP attention's replicated weights above the fraction's budget; the skip names the GiB).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tuner.knobs
from tuner.sglang.failures import FailureClass
from tuner.sglang.flags import flag_int
from tuner.sglang.hicache import HostMemory as HostReading
from tuner.sglang.memory import must_fail
from tuner.study.calibration import Calibration, deployment_capacity
from tuner.study.decide import Skip
from tuner.study.decide.rungs import RungPrices, same_rung
from tuner.study.hostcheck import host_skip_reason, ranks_of
from tuner.study.launch import launch_numerics, record_numerics
from tuner.study.optuna_io import HOST_ATTR
from tuner.study.slo_bound import family_of
from tuner.study.space import config_key
from tuner.study.view import StudyView

__all__ = ["MeasuredAlready", "MustFail", "QualityFailed", "Predicted", "HostMemory", "RunningElsewhere", "Unavailable",
           "WontStart"]

class Unavailable:
    """A structural lever the deployment cannot take (:meth:`tuner.knobs.Lever.unavailable`, each
    lever's rule: the SGLang version has no such flag or value in the bundled flag tables,
    :func:`tuner.sglang.levers.flag_available`; a ``--dcp-size`` or a DP-attention ``--dp-size``
    that does not divide ``--tp-size``). The proof is the study's baseline
    (:attr:`tuner.study.view.StudyView.baseline`): its version and command are the fact."""

    def __init__(self, version: str, argv: Sequence[str]) -> None:
        self._version = version
        self._tp = flag_int(argv, "--tp-size", "--tp", "--tensor-parallel-size") or 1

    def why_not(self, params: Mapping[str, Any], view: StudyView) -> Skip | None:
        for lever in tuner.knobs.LEVERS:
            value = params.get(lever.knob.name)
            if value is None or value == lever.neutral:
                continue
            why = lever.unavailable(value, version=self._version, tp=self._tp)
            if why is not None:
                return Skip(f"unavailable: {why}", view.baseline)
        return None


class WontStart:
    """A config whose structural rung (fp8 KV, DCP, DP attention over the baseline's) the ladder
    says does not start: its static memory (the baseline's, plus DP attention's replicated
    attention and embedding weights, :func:`tuner.sglang.levers.dp_attention_extra_weight_gib`)
    leaves no KV pool at ``mem_fraction_static × B``, SGLang's ``Not enough memory`` (§4.3;
    :func:`tuner.sglang.ladder.evaluate`, equal to the simulator's startup path,
    ``tests/sglang/test_ladder_sim.py``). The proof is the baseline's start (the calibrated memory
    model); never launched. The ladder's free memory after graphs is not used here: a rung's own
    CUDA graphs (DP attention's per-rank batches) are not known from the baseline's start, so a
    short reserve is left to the rung's boot probe and the memory screens calibrated on it.

    Args:
        prices: The rung pricer of this run.
    """

    def __init__(self, prices: RungPrices) -> None:
        self.prices = prices

    def why_not(self, params: Mapping[str, Any], view: StudyView) -> Skip | None:
        priced = self.prices.price(params, view)
        if priced is None or priced[1].tokens_per_rank is None or priced[1].tokens_per_rank > 0:
            return None
        number, rung = priced
        return Skip(f"predicted not to start (the ladder's arithmetic on trial {number}'s start): {rung.why}", number)


class MeasuredAlready:
    """The same config was launched (compared on the space's grid: the baseline's resolved knobs,
    and floats, land on the same point).

    Args:
        reprobe: The quality gate is on: a launch that changed numerics without a quality probe
            (the gate was off then) does not count as measured, so it is launched and probed again.
    """

    def __init__(self, *, reprobe: bool = False) -> None:
        self.reprobe = reprobe

    def why_not(self, params: Mapping[str, Any], view: StudyView) -> Skip | None:
        number = view.measured.get(config_key(view.space.snap(dict(params))))
        if number is None:
            return None
        if self.reprobe:
            quality = next((r.quality for n, r in view.finished if n == number), None)
            if quality is not None and quality.changes and quality.status == "unprobed":
                return None
        return Skip(f"the same config was measured by trial {number}", number)


class MustFail:
    """An earlier failure proves the config fails: a failure at a fraction, with every other
    memory knob equal or smaller, fails at every larger fraction (§1.6, §8)."""

    def why_not(self, params: Mapping[str, Any], view: StudyView) -> Skip | None:
        failures = [(n, r, r.failure_class) for n, r in view.finished
                    if r.outcome == "failed" and r.failure_class is not None]
        if not failures:
            return None
        proved, index = must_fail(dict(params), [(dict(r.params), _monotone_class(c)) for _, r, c in failures])
        if not proved or index is None:
            return None
        number, record, failure_class = failures[index]
        return Skip(
            f"must fail: trial {number} failed with {failure_class.value} at "
            f"mem_fraction_static={record.params.get('mem_fraction_static')} with other memory "
            "knobs equal or smaller, and failures are monotone in these knobs",
            number,
        )


class QualityFailed:
    """A trial with the same numerics failed the quality gate: its answers would be the same. The
    config's numerics are those of its launch (:func:`tuner.study.launch.launch_numerics`: the
    switches rendered as the trial renders them, over the baseline's numerics), the key its record
    would store; a stored record's is rebuilt from its launch (:func:`tuner.study.launch.record_numerics`).

    Also: the gate could not record the baseline's reference answers and says why (the server
    returns no logprobs, the task probe carries no signal: the baseline's ``reason``), and no
    launch recorded one since: a config that changes numerics could only be ``unprobed``, never
    feasible nor appliable, so it is not launched (the skip names the reason and its fix)."""

    def why_not(self, params: Mapping[str, Any], view: StudyView) -> Skip | None:
        failed = [(n, r) for n, r in view.finished if r.quality.status == "failed"]
        baseline = next(((n, r) for n, r in view.finished if r.kind == "baseline"), None)
        if baseline is None:
            return None
        base = record_numerics(baseline[1])
        numerics = launch_numerics(params, base)
        refused = baseline[1].quality.reason
        if (refused and baseline[1].quality.status == "same" and numerics != base
                and not any(r.quality.status == "reference" for _, r in view.finished)):
            return Skip(f"changes numerics ({', '.join(f'{k}={v}' for k, v in numerics.items()) or 'defaults'}) and the "
                        f"quality gate has no reference to compare it with: {refused}", baseline[0])
        for number, record in failed:
            if record_numerics(record) == numerics:
                return Skip(f"fails the quality gate: trial {number} with the same numerics "
                            f"({', '.join(f'{k}={v}' for k, v in numerics.items())}) failed it: {record.quality.reason}",
                            number)
        return None


def _monotone_class(failure_class: FailureClass) -> FailureClass:
    """A runtime OOM under the stress load bounds the reserve exactly like a CUDA-graph OOM.

    Both say the ``(1 − mfs) × B`` reserve was too small for what runs out of it (§1.6, §8): a
    larger fraction, or larger reserve knobs (``max_running_requests``, ``chunked_prefill_size``,
    ``cuda_graph_max_bs``), leaves less headroom for a stress load that is at least as heavy
    (capacity, and with it the stress concurrency, only grows with the fraction).
    """
    return FailureClass.CUDA_GRAPH_OOM if failure_class is FailureClass.RUNTIME_OOM else failure_class


class Predicted:
    """A sampled config the calibrated models say is not worth a restart.

    Predictions (not proofs, and the reasons say "predicted"): its context capacity is below the
    best feasible trial's capacity band (:func:`tuner.study.best.band_floor`: it cannot win on the
    policy); it has more request slots than can change its result
    (:meth:`~tuner.study.calibration.Calibration.slots_cap`); its headroom after graphs is below the
    measured activation peak scaled to its prefill chunk, times the safety factor, plus the margin
    (:meth:`~tuner.study.calibration.Calibration.need_gib`), or below what a runtime OOM under the
    stress load already showed too small, scaled by the ratio of prefill chunks (activations grow
    with the chunk, §1.6). One proof (the SLO's monotone rule, :mod:`tuner.study.slo_bound`): it
    runs at least as many requests at once as a window of the same other knobs that broke the SLO,
    with no better CUDA-graph coverage of those batches (the rule does not hold across a captured
    size, :meth:`~tuner.study.calibration.Calibration.slo_proof`).

    The capacity band is the view's (:attr:`tuner.study.view.StudyView.band_floor`, the study's
    ``[objective]``).

    A config whose structural rung (fp8 KV, DCP, DP attention) no started trial ran is not
    predicted (another rung's KV cell and weights would mispredict it): its first launch is the
    rung's boot probe, which calibrates the model for it (issue 23).
    """

    def why_not(self, params: Mapping[str, Any], view: StudyView) -> Skip | None:
        cal = view.calibration
        if not cal.model_points:
            return None
        snapped = view.space.snap(params)
        if not any(same_rung(p.params, snapped) for p in cal.model_points):
            return None  # a structural rung's first launch is its boot probe: no other rung's cell predicts it
        family = family_of(snapped)
        mfs, mrr = snapped["mem_fraction_static"], snapped["max_running_requests"]
        ref = cal.reference(family, mrr)
        tokens, free = cal.predict(ref, mfs, mrr, family)
        capacity = deployment_capacity(family, mrr, tokens, view.settings.context_tokens) if tokens > 0 else 0
        floor = view.band_floor
        if floor and capacity < floor:
            return Skip(
                f"predicted context capacity {capacity} (model calibrated on trial {ref.number}) is below "
                f"{floor}, the capacity band of the best feasible trial, so it cannot win on the "
                "policy; not launched", ref.number)
        if tokens > 0 and mrr > cal.slots_cap(tokens):
            return Skip(
                f"max_running_requests={mrr} is more than the {cal.slots_cap(tokens)} requests this config can "
                f"change the result with (predicted pool {tokens} tokens, model calibrated on trial {ref.number}: "
                "its context capacity, or what the measured window can run at once by [budget] max_concurrency "
                "and the pool over the mean request length); predicted, not launched", ref.number)
        running = cal.running_requests(mrr, tokens) if tokens > 0 else mrr
        proof = cal.slo_proof(family, mrr, running, tokens=tokens if tokens > 0 else None)
        if proof is not None:
            number, broken = proof
            return Skip(
                f"must break the SLO: trial {number} broke it running {broken:g} requests at once "
                f"with the same other knobs and no fewer of those batches on CUDA graphs, and this config runs "
                f"{running} (closed-loop latency grows with the requests in flight at equal knobs and graph "
                "coverage); not launched", number)
        measured = [int(p.params["max_running_requests"]) for p in cal.points if family_of(p.params) == family]
        if measured and mrr > 2 * max(measured):
            return Skip(
                f"max_running_requests={mrr} is more than twice any measured config of these knobs "
                f"({max(measured)}); its CUDA graphs and request table are not calibrated; not launched", ref.number)
        return _headroom(cal, family, free, ref.number, view)


def _headroom(cal: Calibration, family: tuple[tuple[str, Any], ...], free: float, ref_number: int,
              view: StudyView) -> Skip | None:
    """The predicted headroom against the measured peaks, the survivors and the runtime OOMs."""
    prefill = cal.effective_prefill(dict(family).get("chunked_prefill_size", 1))

    def scale(params: Mapping[str, Any]) -> float:
        return prefill / cal.effective_prefill(params.get("chunked_prefill_size", 1))

    peaks = [(p.peak_gib * scale(p.params), p.number) for p in cal.points if p.peak_gib]
    if peaks:
        need = cal.need_gib(family)
        if free < need:
            peak, number = max(peaks)
            return Skip(
                f"predicted {free:.2f} GiB free after graphs (model calibrated on trial {ref_number}), below the "
                f"{need:.2f} GiB the stress load needs: trial {number}'s measured activation peak scaled to this "
                f"prefill chunk ({peak:.2f} GiB; activations scale with it) × {view.settings.peak_safety:g} + the "
                f"{cal.margin_gib:.2f} GiB the model's checked predictions leave as margin; predicted, not launched",
                number)
    survivors = [(p.model.observed_free_after_graphs_gib * scale(p.params), p.number)
                 for p in cal.points if p.model.observed_free_after_graphs_gib is not None]
    if survivors and not any(p.peak_gib for p in cal.points):
        least, number = min(survivors)
        if free < least:
            return Skip(
                f"predicted {free:.2f} GiB free after graphs, less than any config has survived the stress "
                f"load with ({least:.2f} GiB, trial {number}, scaled to this prefill chunk); the planner "
                "explores that frontier; not launched", number)
    for number, record in view.finished:
        if record.failure_class is FailureClass.RUNTIME_OOM and record.free_gib_after_graphs is not None:
            bound = record.free_gib_after_graphs * scale(record.params)
            if free <= bound:
                return Skip(
                    f"predicted {free:.2f} GiB free after graphs, below the {bound:.2f} GiB that trial {number}'s "
                    "runtime OOM under load implies for this prefill chunk (activations scale with it); "
                    "not launched", number)
    return None


class HostMemory:
    """The config's hierarchical-cache pools do not fit this host: per rank × ranks against
    ``MemAvailable`` and the unit's ``MemoryMax``, with the margin and the arithmetic
    (:func:`tuner.study.hostcheck.host_skip_reason`, ``shared/sglang-reference.md`` §7). The host
    is read at every check (before each launch).

    Args:
        read_host: Reads this host's memory (``None``: not known, no check).
        version: The SGLang version (the ratio's default, 0.5.23's auto-sizing).
        argv: The service's command line (its ranks, ``--page-size``).
    """

    def __init__(self, read_host: Callable[[], HostReading | None], version: str, argv: Sequence[str]) -> None:
        self.read_host = read_host
        self.version = version
        self.argv = list(argv)

    def why_not(self, params: Mapping[str, Any], view: StudyView) -> Skip | None:
        if not params.get("enable_hierarchical_cache"):
            return None
        page = params.get("page_size") or flag_int(self.argv, "--page-size") or 1
        found = host_skip_reason(params, view.finished, self.read_host(), version=self.version,
                                 ranks=ranks_of(self.argv), page_size=int(page))
        return Skip(*found) if found is not None else None


class RunningElsewhere:
    """Another host runs the same config now (a claimed RUNNING trial; the claim lock settles two
    hosts that drew it at once, :func:`tuner.study.hosts.claimed_reason`)."""

    def why_not(self, params: Mapping[str, Any], view: StudyView) -> Skip | None:
        wanted = config_key(view.space.snap(dict(params)))
        for trial in view.running:
            if trial.params and trial.user_attrs.get(HOST_ATTR) and config_key(view.space.snap(trial.params)) == wanted:
                return Skip(f"the same config is running on host {trial.user_attrs.get(HOST_ATTR)} "
                            f"(trial {trial.number})", trial.number)
        return None
