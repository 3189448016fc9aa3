"""The baseline: the service's own flags, measured once per environment, and the space it fixes.

A study's first trial runs the unit as it is. What SGLang resolved for it (the fraction it chose,
its pool, its memory model) sets the search space: the ranges the ``[space]`` table leaves out, the
capacity ceiling, and whether the hierarchical cache enters it (the workload's prefix reuse). A
baseline that could not start for a reason other than memory means the command or the environment
is broken, and every other trial would fail the same way: the run stops.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.config import TunerConfig
from tuner.errors import StudyError
from tuner.load.workloads import build_workload, estimate_reuse
from tuner.records import TrialRecord
from tuner.sglang.failures import STARTUP_MEMORY_FAILURES
from tuner.sglang.flags import FlagTable, parse_argv
from tuner.sglang.hicache import HostMemory
from tuner.study.budget import reachable_slots
from tuner.study.hostcheck import ranks_of
from tuner.study.hosts import own, same_environment
from tuner.study.launch import needs_reference, record_numerics
from tuner.study.lever_space import LeverChoice, attentions_of_log, derive_levers, study_model
from tuner.study.optuna_io import (
    ENVIRONMENT_ATTR,
    HOST_ATTR,
    KIND_ATTR,
    REPEAT_ATTR,
    SPACE_ATTR,
    record_of,
    set_baseline_params,
)
from tuner.study.record import launch_stopped
from tuner.study.space import HiCacheChoice, Space, decide_hicache, resolve_space
from tuner.study.storage import show_command

__all__ = ["could_not_start", "check_started", "latest_baseline", "claim_baseline", "fix_space", "queue_reference",
           "reference_plan", "space_notes", "stored_space", "has_space", "resolve_study_space", "study_hicache",
           "study_levers"]

WAIT_POLL_S = 1.0
"""Seconds between looks at the study while another host measures the baseline."""
BASELINE_VISIBLE_S = 30.0
"""How long a host waits for a baseline whose space is stored to show among the finished trials
(counted from when no host was seen measuring it)."""

_log = logging.getLogger(__name__)


def could_not_start(record: TrialRecord) -> bool:
    """Whether a trial failed to start for a reason other than memory.

    A startup memory failure (§4.3) is what the search explores; any other failure before the
    server sized its KV pool (argparse, a missing model, a port in use, a hang) means the command
    or the environment is broken, and every other trial would fail the same way.
    """
    return (
        record.outcome == "failed"
        and record.token_capacity is None
        and record.failure_class not in STARTUP_MEMORY_FAILURES
    )


def check_started(record: TrialRecord, number: int, config: TunerConfig, url: str) -> None:
    """Stop the run when the baseline (trial ``number`` of the study stored at ``url``, its stored
    ``record``) :func:`could_not_start`.

    Raises:
        StudyError: Quoting the server's reason and the ``tuner show`` command that has its log.
    """
    if could_not_start(record):
        raise launch_stopped(f"the baseline (trial {number}, the service's own flags) could not start "
                             f"({record.failure_class.value if record.failure_class else 'failed'})", record,
                             fix="environment", show=show_command(config, url, number))


def latest_baseline(done: Sequence[tuple[int, TrialRecord]]) -> tuple[int, TrialRecord] | None:
    """The newest baseline of ``done`` that started (one that could not start is measured again:
    the command was fixed)."""
    return next(((n, r) for n, r in reversed(done) if r.kind == "baseline" and not could_not_start(r)), None)


def reference_plan(finished: Sequence[tuple[int, TrialRecord]], *, gate_on: bool
                   ) -> tuple[str, list[tuple[int, dict[str, Any]]]] | None:
    """What turning the quality gate on needs in a study that ran without it: one launch of the
    baseline's flags (it records the reference answers, :func:`tuner.load.quality.gate`), then
    each feasible trial whose numerics change was never probed (one per distinct numerics, in
    trial order), which is then probed; so ``tuner apply``'s hint ("enable the gate and run
    again") leads to a probed result.

    Args:
        finished: The study's finished trials.
        gate_on: ``[quality] enabled``.

    Returns:
        ``(the one line the run and its dry run print, (trial, params) to launch again in order)``, or ``None``
        when the gate is off or the study holds a reference (or a try to record one).
    """
    found = latest_baseline(finished)
    if not gate_on or found is None or not needs_reference(finished):
        return None
    queue: dict[str, tuple[int, dict[str, Any]]] = {"": (found[0], dict(found[1].params))}
    for number, record in finished:
        if record.feasible and record.quality.changes and record.quality.status == "unprobed":
            queue.setdefault(repr(sorted(record_numerics(record).items())), (number, dict(record.params)))
    probed = [str(n) for n, _ in list(queue.values())[1:]]
    line = (f"quality gate: this study holds no reference answers (the gate was off): the baseline's flags (trial "
            f"{found[0]}) run first to record them"
            + (f", then trial {', '.join(probed)}'s config{'s' if len(probed) > 1 else ''} to probe "
               f"{'their' if len(probed) > 1 else 'its'} numerics" if probed else ""))
    return line, list(queue.values())


def queue_reference(study: optuna.Study, finished: Sequence[tuple[int, TrialRecord]], *, gate_on: bool,
                    note: Callable[[int | None, str], None]) -> None:
    """Enqueue :func:`reference_plan`'s launches, once (a trial already waiting with the same
    params is not queued again), each a deliberate re-measurement of its trial
    (:data:`~tuner.study.optuna_io.REPEAT_ATTR`: the screens and the claim let it through, it is
    measured through to its quality phase, and its figures join the trial's), and tell ``note``
    the plan's line (``(None, line)``)."""
    plan = reference_plan(finished, gate_on=gate_on)
    if plan is None:
        return
    stored = study.user_attrs.get(SPACE_ATTR)
    space = Space.model_validate(stored) if stored else None
    waiting = [t.params for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))]
    for number, params in plan[1]:
        params = space.snap(params) if space is not None else params  # every searched knob, the sampler draws none
        if params not in waiting:
            study.enqueue_trial(params, user_attrs={KIND_ATTR: "enqueued", REPEAT_ATTR: number})
    note(None, plan[0])


def claim_baseline(
    study: optuna.Study, environment: Mapping[str, Any], host: str, *,
    claim: Callable[[], AbstractContextManager[object]], can_continue: Callable[[], bool],
    own_environment: Callable[[], bool], on_wait: Callable[[str], None],
) -> tuple[optuna.Trial | None, tuple[int, TrialRecord] | None]:
    """The study's baseline of ``environment``, or the trial this host measures it in.

    Once per study and environment: under the claim lock, a finished baseline (any host's) is
    taken; else, while another host measures it (or its stored space has not shown up among the
    finished trials yet, at most :data:`BASELINE_VISIBLE_S`), this host waits, polling every
    :data:`WAIT_POLL_S`; else it asks a trial for it and claims it (:func:`tuner.study.hosts.own`).
    Each look is one read of the trials (a baseline finishing meanwhile is seen running or
    finished); a claim whose lock the database dropped inside the hold (:attr:`Section.lost`, as
    :func:`tuner.study.hosts.claim_trial` checks) is checked again and yields (told FAIL, no
    record) to another host's baseline claimed in that gap.

    Args:
        study: The study.
        environment: This run's environment.
        host: This host's name.
        claim: The claim lock's context (:meth:`tuner.study.loop.StudyRun.claim`).
        can_continue: Whether the budget and the trial cap leave room for one more trial (asked
            outside the claim lock: it may wait for the maintenance window).
        own_environment: Whether this run's environment is the study's own.
        on_wait: Told once, with one line, when this host starts waiting for another's.

    Returns:
        ``(trial to measure it in, None)``, or ``(None, (number, record))`` of the finished
        baseline, or ``(None, None)`` when no trial fits the budget or the cap.
    """
    waited_s = 0.0  # since no host measures it (the stored space's trial may not be visible yet)
    while True:
        go_on = can_continue()  # never inside the claim lock: it may wait for [service] window to open
        with claim() as section:
            found, measuring, done_elsewhere = _baseline_state(study, environment, own_environment)
            if found is not None or not go_on:
                return None, found
            trial = None
            if not measuring and not (done_elsewhere and waited_s < BASELINE_VISIBLE_S):
                trial = study.ask()
                trial.set_user_attr(KIND_ATTR, "baseline")
                own(study, trial, host, environment)
        if trial is not None and not getattr(section, "lost", False):
            return trial, None
        if trial is not None:
            # The database dropped the claim lock inside the hold (as tuner.study.hosts.claim_trial
            # checks): another host may have claimed a baseline in that gap. Hold it again and look.
            _log.warning("trial %d: the database dropped the claim lock during the baseline's claim; checking "
                         "the claim again", trial.number)
            with claim():
                found, measuring, _ = _baseline_state(study, environment, own_environment, besides=trial.number)
                if found is None and not measuring:
                    return trial, None
                study.tell(trial, state=TrialState.FAIL)  # no record: the other host's baseline is the study's
            continue
        if not waited_s and measuring:  # another host measures this environment's baseline now
            on_wait(f"waiting for the baseline (trial {measuring[0].number}) on host "
                    f"{measuring[0].user_attrs.get(HOST_ATTR, '?')}")
        waited_s = 0.0 if measuring else waited_s + WAIT_POLL_S
        time.sleep(WAIT_POLL_S)


def _baseline_state(study: optuna.Study, environment: Mapping[str, Any], own_environment: Callable[[], bool], *,
                    besides: int | None = None) -> tuple[tuple[int, TrialRecord] | None, list[FrozenTrial], bool]:
    """``(finished baseline, baselines being measured, stored space of it)`` of ``environment`` from
    one read of the study's trials, so a baseline that finishes meanwhile is seen either running or
    finished, never neither (two reads, finished then running, let a host measure it twice).
    ``besides``: a trial number left out (this host's own claim)."""
    done_elsewhere = SPACE_ATTR in study.user_attrs and own_environment()
    trials = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                                  TrialState.RUNNING))
              if t.number != besides and same_environment(t.user_attrs.get(ENVIRONMENT_ATTR), environment)]
    done = [(t.number, r) for t in trials if t.state is not TrialState.RUNNING and (r := record_of(t)) is not None]
    found = latest_baseline(done)
    measuring = [t for t in trials if t.state is TrialState.RUNNING and t.user_attrs.get(KIND_ATTR) == "baseline"]
    return found, measuring, done_elsewhere


def fix_space(study: optuna.Study, trial: optuna.Trial, record: TrialRecord, config: TunerConfig,
              environment: Mapping[str, Any], context_tokens: int, *, host: HostMemory | None,
              own_environment: bool, argv: Sequence[str] = ()) -> Space:
    """Resolve the study's space from the baseline's ``record``, store it (study attribute
    :data:`~tuner.study.optuna_io.SPACE_ATTR`) and record the baseline's knobs as its running
    ``trial``'s Optuna params.

    A host of another environment mixed into the study (``own_environment`` false) keeps the
    study's stored space. ``argv`` is the service's command (its ranks on the host, its levers).

    Returns:
        The study's space.
    """
    space = resolve_study_space(config, record, environment, context_tokens, host=host, ranks=ranks_of(argv), argv=argv)
    stored = study.user_attrs.get(SPACE_ATTR)
    if stored is None or own_environment:
        study.set_user_attr(SPACE_ATTR, space.model_dump(mode="json"))
    else:
        space = Space.model_validate(stored)
    set_baseline_params(trial, space, record.params)
    return space


def has_space(study: optuna.Study) -> bool:
    """Whether the study's space is fixed (its baseline was measured)."""
    return SPACE_ATTR in study.user_attrs


def stored_space(study: optuna.Study, name: str) -> Space:
    """The resolved space study ``name`` stored when its baseline was measured (:func:`fix_space`).

    Raises:
        StudyError: The study has no baseline to derive it from.
    """
    data = study.user_attrs.get(SPACE_ATTR)
    if data is None:
        raise StudyError(f"study {name!r} has no baseline trial to derive its search space from",
                         hint="run again with a budget long enough for one trial")
    return Space.model_validate(data)


def space_notes(space: Space) -> list[str]:
    """The progress lines of a space the baseline fixed: the hierarchical cache's place, each
    structural lever derived, and one short line naming those not derived (``tuner run
    --dry-run`` prints each reason with its source)."""
    notes = [f"hierarchical cache {space.hicache_reason}"]
    notes += [f"structural lever {reason}" for reason in space.lever_reasons if ": not derived:" not in reason]
    left_out = [reason.split(":", 1)[0] for reason in space.lever_reasons if ": not derived:" in reason]
    if left_out:
        notes.append(f"structural levers not derived: {', '.join(left_out)} (`tuner run --dry-run` says why)")
    return notes


def study_hicache(config: TunerConfig, *, device_tokens: int | None, version: str | None,
                  host: HostMemory | None = None, ranks: int = 1) -> HiCacheChoice:
    """The hierarchical cache's place in this study's space (:func:`tuner.study.space.decide_hicache`),
    from the workload's prefix reuse (:func:`tuner.load.workloads.estimate_reuse`, nothing sent)."""
    reuse = None
    if config.space.hierarchical_cache is None:
        reuse = estimate_reuse(build_workload(config.workload, seed=config.study.seed))
    table = FlagTable.for_version(version) if version else None
    return decide_hicache(config.space, reuse=reuse, device_tokens=device_tokens, version=version, table=table,
                          host=host, ranks=ranks)


def study_levers(config: TunerConfig, argv: Sequence[str], version: str | None, gpu: str | None,
                 ranks: Mapping[str, Mapping[str, Any]] | None = None) -> LeverChoice:
    """The structural levers' place in this study's space (:func:`tuner.study.lever_space.derive_levers`)
    from the service's command, its SGLang version and GPU, the model's ``config.json`` and (once
    measured) the baseline's startup lines ``ranks``."""
    version = version or FlagTable.bundled_versions()[0]
    flags = parse_argv(list(argv), FlagTable.for_version(version))
    return derive_levers(config.space, flags, version=version, gpu=gpu, model=study_model(config, flags),
                         log_attentions=attentions_of_log(ranks or {}))


def resolve_study_space(config: TunerConfig, record: TrialRecord, environment: Mapping[str, Any],
                        context_tokens: int, *, host: HostMemory | None = None, ranks: int = 1,
                        argv: Sequence[str] = ()) -> Space:
    """The study's space from the baseline's resolved knobs, the predicted capacity ceiling and the
    workload's prefix reuse (whether the hierarchical cache's knobs enter it, :func:`study_hicache`).

    Args:
        config: The config (its ``[space]``, ``[workload]``).
        record: The baseline's record (its params, ``token_capacity`` and ``memory.capacity_model``).
        environment: The run's environment (``gpu_total_mib``, ``sglang_version`` when known).
        context_tokens: The context length of context capacity (tokens).
        host: The host's memory reading (the ``hicache_size`` range), if known.
        ranks: Ranks on the host (``tp × pp``).
        argv: The service's command (the structural levers, :func:`study_levers`); empty: only
            the levers ``[space]`` lists.
    """
    hint = slots = None
    model = record.memory.capacity_model
    if model is not None:
        top = model.tokens(0.97)
        hint = max(1, top // max(1, context_tokens))
        workload = build_workload(config.workload, seed=config.study.seed)
        slots = reachable_slots(config.budget, max_total_num_tokens=top, context_tokens=context_tokens,
                                mean_request_tokens=workload.mean_request_tokens)
    hicache = study_hicache(config, device_tokens=record.token_capacity, version=environment.get("sglang_version"),
                            host=host, ranks=ranks)
    levers = study_levers(config, argv, environment.get("sglang_version"), environment.get("gpu_name"),
                          record.memory.ranks) if argv else None
    version = environment.get("sglang_version")
    draft_kv_dtype = bool(version) and FlagTable.for_version(str(version)).has("speculative_draft_kv_cache_dtype")
    return resolve_space(config.space, record.params, gpu_total_mib=environment.get("gpu_total_mib"),
                         capacity_hint=hint, slots_hint=slots, hicache=hicache, levers=levers,
                         draft_kv_dtype=draft_kv_dtype)
