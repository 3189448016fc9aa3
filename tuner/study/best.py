"""The one "best" rule: which feasible trial a study recommends under its ``[objective]`` policy.

The run's closing summary, ``tuner best``, the HTML report and ``tuner apply best`` all call
:func:`choose_best` (the readers through :meth:`tuner.results.StoredStudy` views), so they agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from optuna.trial import FrozenTrial
from pydantic import BaseModel, ConfigDict, ValidationError

from tuner.config import ObjectiveSection
from tuner.errors import ConfigError, StudyError
from tuner.records import CapacityBasis, StudyInfo, TrialRecord

__all__ = [
    "BestChoice",
    "choose_best",
    "edge_noise",
    "best_by",
    "capacity_basis",
    "capacity_label",
    "LATENCY_TIE",
    "measured_noise",
    "MetricDelta",
    "stored_policy",
    "override_policy",
    "MRR_CUT_RATIO",
    "max_running_requests_cut",
    "admission_limit",
    "admission_line",
    "binding_phase",
    "band_floor",
    "probe_floor",
]


class BestChoice(BaseModel):
    """The trial chosen as best and why.

    Attributes:
        number: The Optuna trial number.
        record: Its record.
        reason: One sentence on why it won under the policy.
        tied: Other trials statistically tied with it on throughput (within :attr:`noise`);
            capacity decided among them.
        noise: The relative throughput margin treated as a tie.
        noise_measured: Whether :attr:`noise` was measured from re-measured configs
            (:func:`measured_noise`) rather than ``[objective] throughput_noise``.
        basis: Which context capacity the choice ranked by (:func:`capacity_basis`).
        concurrency: The concurrent sessions the deployment needs (``[objective] concurrency``):
            capacities above it counted as it, or ``None``.
    """

    model_config = ConfigDict(frozen=True)

    number: int
    record: TrialRecord
    reason: str
    tied: list[int] = []
    noise: float | None = None
    noise_measured: bool = False
    basis: CapacityBasis = "oom_safe"
    concurrency: int | None = None


LATENCY_TIE = 0.05
"""Relative p99 latency margin within which throughput-tied trials count as equally fast to
answer (a p99 over a few dozen requests moves by several percent between windows)."""


def capacity_basis(capacity: str, records: Sequence[TrialRecord]) -> CapacityBasis:
    """The context capacity a choice ranks by: ``slo_safe`` or ``oom_safe`` as ``[objective]
    capacity`` names it; ``auto`` is ``slo_safe`` when the trials were judged against an SLO (a
    record's :attr:`tuner.records.SloCapacity.limits`), else ``oom_safe``."""
    if capacity in ("slo_safe", "oom_safe"):
        return capacity  # type: ignore[return-value]
    return "slo_safe" if any(r.slo_capacity.limits for r in records) else "oom_safe"


def capacity_label(basis: CapacityBasis) -> str:
    """``SLO-safe context capacity`` or ``OOM-safe context capacity``: what a figure is."""
    return "SLO-safe context capacity" if basis == "slo_safe" else "OOM-safe context capacity"


def _latency(record: TrialRecord) -> float | None:
    """The measured window's p99 latency as the choice compares it: against the SLO where one was
    set (the ``slo`` constraint is the worst ``p99 / limit − 1``), else the p99 TTFT (ms)."""
    if record.slo_capacity.limits and record.constraints.get("slo") is not None:
        return 1.0 + float(record.constraints["slo"])
    return record.p99_ttft_ms


def _p99_text(record: TrialRecord) -> str:
    """``p99 TTFT 1,460 ms, ITL 390 ms over 27 requests`` (the measured window's)."""
    measure = next((p for p in record.phases if p.name == "measure"), None)
    count = f" over {measure.completed} requests" if measure is not None else ""
    parts = [f"{name} {value:,.0f} ms" for name, value in (("p99 TTFT", record.p99_ttft_ms), ("ITL", record.p99_itl_ms))
             if value is not None]
    return (", ".join(parts) or "no p99") + count


def _tie_break(ties: list[tuple[int, TrialRecord]], cap: Any) -> tuple[tuple[int, TrialRecord], str | None]:
    """Among throughput ties: the lowest p99 latency (within :data:`LATENCY_TIE` counted equal),
    then the higher context capacity, then fewer request slots (effective
    ``max_running_requests``), then higher throughput, then the earlier trial; with the sentence
    saying what decided when it was not capacity or throughput alone."""
    tput = lambda r: r.output_throughput_tok_s or 0.0  # noqa: E731
    latencies = [lat for _, r in ties if (lat := _latency(r)) is not None]
    fastest = min(latencies) if latencies else None
    quick = [p for p in ties if fastest is None or ((lat := _latency(p[1])) is not None
                                                    and lat <= fastest * (1 + LATENCY_TIE) + 1e-12)] or ties
    top = max(cap(r) or 0 for _, r in quick)
    widest = [p for p in quick if (cap(p[1]) or 0) == top]
    slots = lambda r: _max_running_requests(r) or 1 << 30  # noqa: E731
    chosen = min(widest, key=lambda p: (slots(p[1]), -tput(p[1]), p[0]))
    notes = []
    slower = [p for p in ties if p not in quick]
    if slower:
        others = "; ".join(f"trial {n}: {_p99_text(r)}" for n, r in sorted(slower)[:3])
        notes.append(f"lower p99 latency ({_p99_text(chosen[1])}) than the tied {others}")
    more_slots = [p for p in widest if p is not chosen and slots(p[1]) > slots(chosen[1])]
    if more_slots:
        notes.append(f"fewer request slots ({_max_running_requests(chosen[1])}) than tied trial(s) "
                     f"{', '.join(str(n) for n, _ in sorted(more_slots))}")
    return chosen, ("; ".join(notes) or None)


def _load_note(chosen: tuple[int, TrialRecord], others: list[tuple[int, TrialRecord]]) -> str | None:
    """Says plainly when throughputs compared were measured at different loads (the measured
    window's closed-loop streams), or ``None`` when every one ran at the same."""
    streams = {n: r.measured_load.streams for n, r in [chosen, *others] if r.measured_load.streams is not None}
    if len(set(streams.values())) <= 1:
        return None
    listed = ", ".join(f"trial {n}: {s:g}" for n, s in sorted(streams.items())[:4])
    return f"their throughputs were measured at different loads (streams {listed}), not at equal load"


def choose_best(
    finished: Sequence[tuple[FrozenTrial, TrialRecord]] | Sequence[tuple[int, TrialRecord]],
    *,
    policy: str = "throughput_within_capacity",
    capacity_tolerance: float = 0.05,
    throughput_noise: float = 0.03,
    capacity: str = "auto",
    concurrency: int | None = None,
) -> BestChoice | None:
    """Pick "best" among feasible, fully measured trials by the configured policy.

    Context capacity is the one ``capacity`` names (:func:`capacity_basis`: by default the
    SLO-safe one where an SLO was set, :meth:`tuner.records.TrialRecord.capacity`).

    ``throughput_within_capacity`` keeps the trials whose context capacity is within
    ``capacity_tolerance`` of the best (the band); among them, every trial whose output throughput
    is within ``throughput_noise`` of the band's highest counts as tied (a short measured window
    cannot tell such throughputs apart), and the tie goes to the higher context capacity, then the
    higher throughput, then the earlier trial. A config measured more than once competes with its
    mean throughput, and once any config was, the tie margin is the spread measured on them
    (:func:`measured_noise`) where it exceeds ``throughput_noise`` (the configured margin is the
    precision asked for; the measurement widens it when the box is noisier); the choice names the
    tied trials.

    Args:
        finished: ``(trial or number, record)`` pairs; only feasible ``ok`` records compete.
        policy: ``throughput_within_capacity`` (see above), ``max_capacity`` (highest capacity;
            throughput breaks ties) or ``max_throughput``.
        capacity_tolerance: Relative capacity band of ``throughput_within_capacity`` (0.05 = 5 %).
        throughput_noise: Relative throughput margin of ``throughput_within_capacity`` treated as
            a tie (0.03 = 3 %), or the measured spread when larger.
        capacity: ``[objective] capacity``: ``auto``, ``slo_safe`` or ``oom_safe``.
        concurrency: The concurrent sessions the deployment needs (``[objective] concurrency``):
            a capacity above it counts as it, so capacity the traffic cannot use does not outrank
            throughput (the reason says so when it decided); ``None``: no cap.

    Returns:
        The choice, or ``None`` when no trial is feasible.
    """
    measured = []
    for item, record in finished:
        number = item if isinstance(item, int) else item.number
        if record.feasible and record.outcome == "ok" and record.context_capacity is not None:
            measured.append((number, record))
    if not measured:
        return None
    pool = _by_config(measured)
    basis = capacity_basis(capacity, [r for _, r in measured])
    cap = lambda r: _needed(r.capacity(basis), concurrency)  # noqa: E731
    label = capacity_label(basis)
    unit = "sessions" if basis == "slo_safe" else "requests"
    noise_measured = measured_noise(measured)
    if noise_measured is not None:  # the measured spread, never tighter than the configured margin
        throughput_noise = max(throughput_noise, noise_measured)
    top_capacity = max(cap(r) or 0 for _, r in pool)
    tput = lambda r: r.output_throughput_tok_s or 0.0  # noqa: E731
    ties: list[tuple[int, TrialRecord]] = []
    if policy == "max_throughput":
        number, record = max(pool, key=lambda p: (tput(p[1]), cap(p[1]) or 0, -p[0]))
        reason = f"highest output throughput ({tput(record):.1f} tok/s) among feasible trials"
    elif policy == "max_capacity":
        number, record = max(pool, key=lambda p: (cap(p[1]) or 0, tput(p[1]), -p[0]))
        reason = f"highest {label} ({cap(record)} {unit}) among feasible trials"
    else:
        floor = math.ceil(top_capacity * (1.0 - capacity_tolerance) - 1e-9)
        band = [p for p in pool if (cap(p[1]) or 0) >= floor]
        fastest_number, fastest = max(band, key=lambda p: (tput(p[1]), cap(p[1]) or 0, -p[0]))
        ties = [p for p in band if tput(p[1]) >= tput(fastest) * (1.0 - throughput_noise) - 1e-9]
        (number, record), decided = _tie_break(ties, cap)
        among = (
            f"among the {len(band)} feasible trial(s) within {capacity_tolerance:.0%} of the best "
            f"{label} ({top_capacity} {unit})"
        )
        if number == fastest_number:
            reason = f"highest output throughput ({tput(record):.1f} tok/s) {among}"
            if len(ties) > 1 and decided is None:
                reason += (
                    f"; {len(ties) - 1} other(s) within the {throughput_noise:.0%} throughput noise "
                    f"margin have no higher {label}"
                )
        elif decided is None:
            reason = (
                f"highest {label} ({cap(record)} {unit}) of the {len(ties)} "
                f"trial(s) whose output throughput is within the {throughput_noise:.0%} noise margin "
                f"of the highest ({tput(fastest):.1f} tok/s, trial {fastest_number}; this one "
                f"{tput(record):.1f} tok/s), {among}"
            )
        else:
            reason = (
                f"output throughput within the {throughput_noise:.0%} noise margin of the highest "
                f"({tput(fastest):.1f} tok/s, trial {fastest_number}; this one {tput(record):.1f} tok/s) "
                f"{among}"
            )
        if decided is not None:
            reason += f"; {decided}"
        note = _load_note((number, record), [p for p in ties if p[0] != number])
        if note is not None:
            reason += f"; {note}"
    tied: list[int] = []
    if policy == "throughput_within_capacity":
        tied = sorted(n for n, _ in ties if n != number)
        if tied and noise_measured is not None:
            reason += (f"; statistically tied with trial(s) {', '.join(map(str, tied))} (throughputs within "
                       f"±{throughput_noise:.1%}, the spread measured on re-measured configs)")
    if record.windows > 1:
        reason += f"; its throughput is the mean of {record.windows} measured windows"
    reason += _capacity_notes(pool, number, record, basis, None if policy == "max_throughput" else concurrency)
    return BestChoice(number=number, record=record, reason=reason, tied=tied, noise=throughput_noise,
                      noise_measured=noise_measured is not None, basis=basis, concurrency=concurrency)


def _capacity_notes(pool: Sequence[tuple[int, TrialRecord]], number: int, record: TrialRecord,
                    basis: CapacityBasis, concurrency: int | None) -> str:
    """What the capacity rules decided, for the reason (``""`` when nothing): capacities above the
    sessions the deployment needs counted as those, and memory capacity that holds no more
    sessions within the SLO (:func:`_unused_memory`)."""
    text = ""
    capped = sorted(n for n, r in pool if concurrency is not None and (r.capacity(basis) or 0) > concurrency)
    if capped:
        text += (f"; capacities above the {concurrency} concurrent sessions the deployment needs "
                 f"([objective] concurrency) count as {concurrency} (trial(s) {', '.join(map(str, capped[:6]))}): "
                 "capacity the traffic cannot use does not outrank throughput")
    unused = _unused_memory(pool, number, record, basis) if basis == "slo_safe" else None
    return text + (f"; {unused}" if unused is not None else "")


def _needed(capacity: int | None, concurrency: int | None) -> int | None:
    """``capacity`` counted up to ``concurrency`` (the sessions the deployment needs), as ranked."""
    if capacity is None or concurrency is None:
        return capacity
    return min(capacity, concurrency)


def _unused_memory(pool: Sequence[tuple[int, TrialRecord]], number: int, record: TrialRecord,
                   basis: CapacityBasis) -> str | None:
    """Where another trial admits more longest contexts (OOM-safe) than the chosen one but holds
    the SLO at no more sessions (a steady window of it broke the SLO; a count capped by ``[budget]
    max_concurrency`` proves nothing): ``"trial 4 admits 48 longest contexts (vs 8) but holds the
    SLO at 8 sessions: bound by decode step time (...)"``; ``None`` otherwise."""
    wider = [(n, r) for n, r in pool if n != number and (r.context_capacity or 0) > (record.context_capacity or 0)
             and r.slo_capacity.measure == "steady" and r.slo_capacity.broken_at is not None
             and (r.capacity(basis) or 0) <= (record.capacity(basis) or 0)]
    if not wider:
        return None
    n, r = max(wider, key=lambda p: (p[1].context_capacity or 0, -p[0]))
    phase = binding_phase(r)
    return (f"trial {n} admits {r.context_capacity} longest contexts (vs {record.context_capacity}) but holds the "
            f"SLO at {r.capacity(basis)} sessions" + (f": bound by {phase}" if phase else ""))


def best_by(
    finished: Sequence[tuple[FrozenTrial, TrialRecord]] | Sequence[tuple[int, TrialRecord]],
    objective: ObjectiveSection,
) -> BestChoice | None:
    """:func:`choose_best` by the config's ``[objective]`` (policy, capacity tolerance, throughput
    noise, capacity basis): the one call every decision and reader of a running study makes."""
    return choose_best(finished, policy=objective.policy, capacity_tolerance=objective.capacity_tolerance,
                       throughput_noise=objective.throughput_noise, capacity=objective.capacity,
                       concurrency=objective.concurrency)


def _config_key(record: TrialRecord, number: int) -> tuple[Any, ...]:
    """The config a trial measured (its params); a trial without params is its own."""
    key = tuple(sorted((k, v) for k, v in record.params.items() if v is not None))
    return key if key else ("trial", number)


def _by_config(measured: Sequence[tuple[int, TrialRecord]]) -> list[tuple[int, TrialRecord]]:
    """One entry per config: its first trial, with the mean throughput of every window that
    measured it (:attr:`tuner.records.TrialRecord.windows` counts them)."""
    groups: dict[tuple[Any, ...], list[tuple[int, TrialRecord]]] = {}
    for number, record in measured:
        groups.setdefault(_config_key(record, number), []).append((number, record))
    out = []
    for items in groups.values():
        number, record = items[0]
        if len(items) > 1:
            mean = sum(r.output_throughput_tok_s or 0.0 for _, r in items) / len(items)
            record = record.model_copy(update={"output_throughput_tok_s": mean, "windows": len(items)})
        out.append((number, record))
    return out


def band_floor(finished: Sequence[tuple[int, TrialRecord]], objective: ObjectiveSection) -> int:
    """The least context capacity that can still win on the policy: the best feasible capacity's
    band (``[objective] capacity_tolerance``) for ``throughput_within_capacity`` and
    ``max_capacity``; 0 for ``max_throughput`` (any capacity may win there) or with nothing
    feasible yet."""
    best = choose_best(finished, policy="max_capacity", capacity=objective.capacity, concurrency=objective.concurrency)
    if best is None or objective.policy == "max_throughput":
        return 0
    top = _needed(best.record.capacity(best.basis), objective.concurrency) or 0
    return math.ceil(top * (1.0 - objective.capacity_tolerance) - 1e-9)


def probe_floor(finished: Sequence[tuple[int, TrialRecord]], probe_only_below: float, capacity: str = "auto") -> int:
    """Capacity-first fidelity: a trial whose boot probe shows a context capacity below this skips
    its full load (``[budget] probe_only_below`` of the best feasible capacity on the objective's
    basis, ``capacity``: an OOM-safe capacity below the best SLO-safe one cannot win; 0 = always
    load)."""
    best = choose_best(finished, policy="max_capacity", capacity=capacity)
    if best is None or probe_only_below <= 0:
        return 0
    return int(probe_only_below * (best.record.capacity(best.basis) or 0))


def measured_noise(measured: Sequence[tuple[int, TrialRecord]]) -> float | None:
    """The run-to-run throughput spread of this study: over every config measured more than once,
    the largest ``(max − min) / mean`` of its windows' output throughputs; ``None`` when no config
    was measured twice.

    Args:
        measured: ``(number, record)`` of feasible, measured trials.
    """
    groups: dict[tuple[Any, ...], list[float]] = {}
    for number, record in measured:
        if record.output_throughput_tok_s:
            groups.setdefault(_config_key(record, number), []).append(record.output_throughput_tok_s)
    spreads = [(max(v) - min(v)) / (sum(v) / len(v)) for v in groups.values() if len(v) > 1]
    return max(spreads) if spreads else None


def stored_policy(info: StudyInfo | None) -> ObjectiveSection:
    """The study's "best" policy: its stored ``[objective]`` (:attr:`StudyInfo.policy`), or the
    config's defaults when the study stored none.

    Raises:
        StudyError: The stored policy is not a valid ``[objective]`` section.
    """
    raw = dict(info.policy) if info is not None else {}
    known = {k: v for k, v in raw.items() if k in ObjectiveSection.model_fields}
    try:
        return ObjectiveSection.model_validate(known)
    except ValidationError as err:
        first = err.errors()[0]
        raise StudyError(
            f"the study's stored objective section is invalid: {'.'.join(map(str, first['loc']))}: "
            f"{first['msg']}",
            hint="pass --policy and --tolerance to choose explicitly",
        ) from err


class MetricDelta(BaseModel):
    """One metric of the chosen trial against the baseline.

    Attributes:
        baseline: The baseline's value (``None`` when unknown).
        best: The chosen trial's value.
        delta: ``best - baseline`` in the metric's unit.
        ratio: ``best / baseline`` (``None`` when the baseline is 0 or unknown).
    """

    model_config = ConfigDict(frozen=True)

    baseline: float | None
    best: float | None
    delta: float | None
    ratio: float | None


def override_policy(
    info: StudyInfo | None, policy: str | None = None, tolerance: float | None = None
) -> ObjectiveSection:
    """The study's stored policy (``info``) with ``--policy``/``--tolerance`` applied.

    Raises:
        ConfigError: An unknown policy name, a tolerance outside [0, 1), or a tolerance with a
            policy other than ``throughput_within_capacity`` (it would be ignored).
    """
    base = stored_policy(info)
    update: dict[str, Any] = {"policy": policy or base.policy}
    if tolerance is not None and update["policy"] != "throughput_within_capacity":
        raise ConfigError(
            f"--tolerance {tolerance!r} applies only to policy throughput_within_capacity, "
            f"not {update['policy']}",
            hint="drop --tolerance, or pass --policy throughput_within_capacity",
        )
    update["capacity_tolerance"] = base.capacity_tolerance if tolerance is None else tolerance
    try:
        return ObjectiveSection.model_validate({**base.model_dump(), **update})
    except ValidationError as err:
        first = err.errors()[0]
        flag = "--policy" if first["loc"][0] == "policy" else "--tolerance"
        raise ConfigError(
            f"{flag} {update[str(first['loc'][0])]!r} is invalid: {first['msg']}",
            hint="use --policy throughput_within_capacity|max_capacity|max_throughput and "
            "--tolerance between 0 and 1",
        ) from err


MRR_CUT_RATIO = 0.5
"""A chosen ``max_running_requests`` at or below this share of the baseline's effective value is
called out by :func:`max_running_requests_cut`."""


def _max_running_requests(record: TrialRecord) -> int | None:
    """The effective ``max_running_requests`` SGLang resolved for a trial (§2.3), else the asked
    value, else ``None``."""
    resolved = record.resolved.get("max_running_requests")
    value = resolved.get("value") if isinstance(resolved, dict) else None
    if value is None:
        value = record.params.get("max_running_requests")
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


def max_running_requests_cut(record: TrialRecord | None, baseline: TrialRecord | None, *,
                             applied: bool = True) -> str | None:
    """One line when ``record`` caps ``max_running_requests`` well below the baseline's effective value.

    A lower cap means at most that many requests of any length run at once (the rest queue), a
    limit the context-capacity figure alone does not show. The cap is the one ``tuner apply``
    carries: the :func:`admission_limit` where there is one (``applied``), else the trial's own.

    Args:
        record: The chosen trial's record (``None``: no line).
        baseline: The baseline trial's record, or ``None``.
        applied: Whether the apply carries the admission limit (``False``: ``--keep-admission``).

    Returns:
        ``"max_running_requests 2048 → 22: at most 22 requests of any length run at once"`` when
        the chosen value is at most :data:`MRR_CUT_RATIO` of the baseline's, else ``None``.
    """
    if baseline is None or record is None:
        return None
    old = _max_running_requests(baseline)
    new = (admission_limit(record) if applied else None) or _max_running_requests(record)
    if old is None or new is None or new > old * MRR_CUT_RATIO:
        return None
    return f"max_running_requests {old} → {new}: at most {new} requests of any length run at once"


def _admits(record: TrialRecord) -> int | None:
    """Longest contexts a config admits at once: the smaller of its OOM-safe context capacity and
    its effective ``max_running_requests`` (§2.3); ``None`` when unknown."""
    if record.context_capacity is None:
        return None
    mrr = _max_running_requests(record)
    return min(record.context_capacity, mrr) if mrr is not None else record.context_capacity


def admission_limit(record: TrialRecord | None) -> int | None:
    """The admission limit an applied config carries so that it holds the SLO it was measured to
    hold: the steady SLO-safe sessions ``M`` (:attr:`tuner.records.SloCapacity.contexts`, sessions
    of :mod:`tuner.load.steady`) where the config admits more longest contexts than ``M``.

    Set as SGLang's ``--max-running-requests M`` (§2.3: the scheduler runs at most ``M`` requests
    at once; the others wait in its queue): the ``M`` running keep the latency the steady window
    measured at ``M`` sessions. ``None`` where no limit is needed or none can be said: no SLO, a
    figure capped by ``[budget] max_concurrency`` (``≥ M``), the SLO held at every count the
    memory admits, no count measured to hold it (0: :meth:`tuner.records.SloCapacity.none_held` says why), or a burst-based figure
    of a study stored before steady windows (never advised on).
    """
    if record is None or not record.slo_capacity.limits:
        return None
    slo, admits = record.slo_capacity, _admits(record)
    held = slo.contexts
    if admits is None or held is None or slo.measure != "steady" or slo.at_least or held <= 0 or held >= admits:
        return None
    return held


def admission_line(record: TrialRecord | None, *, applied: bool = True) -> str | None:
    """One line saying what a config admits against what holds the SLO, and the admission limit
    ``tuner apply`` carries where they differ (:func:`admission_limit`): ``"admits 8 longest
    contexts at once, holds the SLO up to 6 sessions (bound by ...); applying
    --max-running-requests 6 (requests beyond 6 wait in SGLang's queue: their TTFT grows with the
    wait, the 6 running keep the SLO; --keep-admission keeps the trial's own)"``.

    What it admits is the smaller of the OOM-safe context capacity and the effective
    ``max_running_requests`` (§2.3); what holds the SLO is the steady SLO-safe capacity
    (:attr:`tuner.records.SloCapacity.contexts`, sessions of :mod:`tuner.load.steady`). A burst-based
    figure of a study stored before steady windows is named as such, never advised on.

    Args:
        record: The trial's record (``None``: no line).
        applied: Whether the apply carries the limit (``tuner apply`` without ``--keep-admission``,
            and every reader, which says what ``tuner apply`` will do); ``False``: the trial's own
            admission is kept and the line says which value to set instead.

    Returns:
        The line, or ``None`` without an SLO-safe figure.
    """
    if record is None or not record.slo_capacity.limits:
        return None
    slo, admits, held = record.slo_capacity, _admits(record), record.slo_capacity.contexts
    if admits is None or held is None:
        return None
    text = f"admits {admits} longest contexts at once"
    if slo.measure == "burst":
        return f"{text}; {held} met the SLO in a burst of longest prompts (stored before steady windows: rerun for sessions)"
    if slo.at_least or held >= admits:
        return f"{text}, holds the SLO at {'≥ ' if slo.at_least else ''}{held} sessions: no admission limit needed"
    if held == 0:
        return f"{text}; {slo.none_held()}"
    phase, noise = binding_phase(record), edge_noise(record)
    queue = (f"requests beyond {held} wait in SGLang's queue: their TTFT grows with the wait, the {held} running "
             "keep the SLO")
    head = (f"{text}, holds the SLO up to {held} sessions" + (f" (bound by {phase})" if phase else "")
            + (f"; {noise}" if noise else ""))
    if applied:
        return f"{head}; applying --max-running-requests {held} ({queue}; --keep-admission keeps the trial's own)"
    return (f"{head}; keeping the trial's own admission (--keep-admission): set --max-running-requests {held} "
            f"to hold the SLO ({queue})")


def edge_noise(record: TrialRecord) -> str | None:
    """Whether the SLO's edge lies within the steady windows' sampling noise: the smallest count
    that broke the binding limit (the one it overshot most) broke it by no more than its window's
    95 % interval (the p99's lower bound is within the limit), and the count that held it held it
    by no more than its own (the p99's upper bound is unknown or past the limit). Then a
    re-measurement at the held count can break the SLO: on the reference twin the 10 s windows held
    5 sessions (p99 ITL 3,360 ms, bounded above by nothing) and broke 6 (5,032 ms, 95 % from 3,363
    ms), and two 60 s windows at 5 read 5,036 ms (broken) and 3,583 ms (held).

    Returns:
        ``"the edge is within the windows' noise (6 sessions broke p99 ITL at 5,032 ms, 95 % from
        3,363 ms; 5 held it at 3,360 ms, 95 % up to ∞): 5 may break it when re-measured; longer
        windows ([budget] stress_s) narrow it"``, or ``None`` where a window decided it (or none
        broke it, or the figure is not a steady one).
    """
    slo = record.slo_capacity
    held = next((s for s in slo.steps if s.met and s.contexts == slo.contexts), None)
    broken = next((s for s in slo.steps if not s.met and s.contexts == slo.broken_at), None)
    if slo.measure != "steady" or held is None or broken is None:
        return None
    over = {k: v for k, v in broken.violations.items() if v is not None and v > 0 and k in _INTERVALS}
    if not over:
        return None
    key = max(over, key=lambda k: over[k])
    limit, (name, point, low, high) = slo.limits.get(key), _INTERVALS[key]
    b_point, b_low = getattr(broken, point), getattr(broken, low)
    h_point, h_high = getattr(held, point), getattr(held, high)
    if (limit is None or b_point is None or h_point is None or b_low is None or b_low > limit
            or (h_high is not None and h_high <= limit)):
        return None
    return (f"the edge is within the windows' noise ({broken.contexts} sessions broke {name} at {b_point:,.0f} ms, "
            f"95 % from {b_low:,.0f} ms; {held.contexts} held it at {h_point:,.0f} ms, 95 % up to "
            f"{'∞' if h_high is None else f'{h_high:,.0f} ms'}): {held.contexts} may break it when re-measured; "
            "longer windows ([budget] stress_s) narrow it")


_INTERVALS = {"p99_ttft_ms": ("p99 TTFT", "p99_ttft_ms", "p99_ttft_low_ms", "p99_ttft_high_ms"),
              "p99_itl_ms": ("p99 ITL", "p99_itl_ms", "p99_itl_low_ms", "p99_itl_high_ms")}
"""The limits whose steady-window p99 carries a 95 % interval (:class:`tuner.records.SloStep`):
key → (name, p99 field, lower bound field, upper bound field)."""


def binding_phase(record: TrialRecord) -> str | None:
    """What bounds a trial's SLO-safe sessions below what its memory admits, in a few words with
    the evidence: ``"prefill queueing (p99 TTFT 47,600 ms > 30,000 ms at 8 sessions: new prompts
    wait behind the others' prefills)"``, ``"decode step time (p99 ITL 4,970 ms > 4,000 ms at 8
    sessions: ...)"``, or ``"a graph-size edge (...)"`` when the breaking count exceeds the largest
    captured CUDA-graph batch (``cuda_graph_max_bs``, §2.1: decode past it runs without graphs).

    The phase is read from the smallest steady window that broke the SLO
    (:attr:`tuner.records.SloCapacity.broken_at`): the limit it overshot most, TTFT (prefill
    queueing) or ITL/TPOT (decode step time). ``None`` when no window broke it (the memory binds).
    """
    slo = record.slo_capacity
    broken = next((s for s in slo.steps if not s.met and s.contexts == slo.broken_at), None)
    if slo.measure != "steady" or broken is None:
        return None
    graphs = (record.resolved.get("cuda_graph_max_bs") or {}).get("value") if isinstance(
        record.resolved.get("cuda_graph_max_bs"), dict) else None
    if isinstance(graphs, (int, float)) and 0 < graphs < broken.contexts:
        return (f"a graph-size edge ({broken.contexts} sessions exceed cuda_graph_max_bs {int(graphs)}: "
                "their decode steps run without CUDA graphs)")
    over = {k: v for k, v in broken.violations.items() if v is not None and v > 0}
    if not over:
        return None
    worst = max(over, key=lambda k: over[k])
    measured = {"p99_ttft_ms": ("p99 TTFT", broken.p99_ttft_ms), "p99_itl_ms": ("p99 ITL", broken.p99_itl_ms),
                "p99_tpot_ms": ("p99 TPOT", broken.p99_tpot_ms)}
    name, value = measured.get(worst, (worst, None))
    limit = slo.limits.get(worst)
    evidence = (f"{name} {value:,.0f} ms > {limit:,.0f} ms at {broken.contexts} sessions"
                if value is not None and limit else f"{name} over its limit at {broken.contexts} sessions")
    if "ttft" in worst:
        return f"prefill queueing ({evidence}: new prompts wait behind the others' prefills)"
    return f"decode step time ({evidence}: every step carries the sessions' tokens and the prefill chunks joining it)"
