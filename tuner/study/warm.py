"""Warm start: a new study on a deployment another study has fingerprinted begins calibrated.

After the baseline of a new study (its own first start, which also checks the fingerprint), the
study looks for the fingerprints of the other studies in its storage
(:func:`tuner.study.fingerprint.read_fingerprints`; with the default one-file-per-study SQLite
storage, the other ``studies/*.db`` files too) and takes the best match
(:func:`tuner.study.fingerprint.compare`):

- **The same deployment** (GPU, driver, SGLang version, model, layout, structural flags): the
  baseline's own memory facts are checked against the fingerprint's (free memory at the baseline
  ``B``, weights, bytes per KV token: within 1 %, the run-to-run spread being about ±0.05 %,
  sgl-project/sglang#38272). When they hold, the earlier study's checks of the memory model
  (predicted − measured free memory after graphs, one per launch) become this study's: its margin
  above the activation need is the verified one from the first proposal on, so the planner's first
  proposal after the baseline is the predicted frontier, not a step that checks the model
  (:func:`tuner.study.calibration.margin_for`). Where the workload, SLO and objective are equal
  too (:func:`tuner.study.fingerprint.workload_key`), the earlier study's best config is enqueued
  as the first proposal (Optuna's ``enqueue_trial``; measured here, never copied as a result), and
  its measured trials are added to the sampler's in-memory study as prior knowledge (Optuna's
  ``add_trials``, :meth:`tuner.study.decide.sampler.ProposalMirror.add_prior`).
- **The same GPU, model, layout and flags on another SGLang version or driver**: the study checks
  each earlier figure against its own baseline (``B``, weights, bytes per KV token, the graphs at
  the same captured batch, the draft's share) and says which hold and which moved. Only when every
  one holds (the graphs compared) are the memory model's references and checks transferred; a
  moved figure means the version changed the decomposition, and nothing of the model is. Measured
  values never transfer across versions.
- **Anything else** (another GPU, another model, another layout or flags): never used; the study
  says why. A corrupt or foreign fingerprint is one line, and is never used either.

What was reused is stored as the study user attribute :data:`WARM_ATTR` (:class:`WarmStart`),
shown as a progress line and by ``tuner fingerprints``; a resumed run re-applies it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tuner.config import TunerConfig
from tuner.errors import StudyError
from tuner.records import TrialRecord
from tuner.study.best import best_by
from tuner.study.calibration import ModelSettings, Point
from tuner.study.fingerprint import (
    MATCH_NONE,
    MATCH_SAME,
    MATCH_VERSION,
    DeploymentKey,
    Fingerprint,
    Match,
    MatchLevel,
    StartFacts,
    StoredFingerprint,
    compare,
    read_fingerprints,
    start_facts,
)
from tuner.study.optuna_io import KIND_ATTR, PREDICTION_ATTR, record_of, records
from tuner.study.space import Space
from tuner.study.storage import STUDIES_DIR, default_storage_url, display_url, read_storage

__all__ = ["WARM_ATTR", "HOLD_TOLERANCE", "WarmStart", "Prior", "warm_start", "candidate_urls", "figures_hold", "is_fresh"]

WARM_ATTR = "tuner.warm_start"
"""Study user attribute holding ``WarmStart.model_dump(mode="json")``."""
HOLD_TOLERANCE = 0.01
"""Relative difference within which a fingerprint's figure still holds against this study's
baseline (capacity repeats within about ±0.05 % across launches, sgl-project/sglang#38272; the
log prints GiB to two decimals)."""

_log = logging.getLogger(__name__)


class WarmStart(BaseModel):
    """What a study reused from another study's fingerprint, and what it did not use and why.

    Attributes:
        source: The study whose fingerprint was used (``None``: none).
        source_storage: Its storage (password hidden).
        level: ``same`` (the same deployment), ``version`` (another SGLang version or driver) or
            ``None``.
        reason: One line: why this fingerprint (or why none).
        reused: What was reused, one line each.
        moved: The earlier figures that do not hold on this study's baseline, one line each.
        not_used: Other fingerprints that were not used, and why, one line each.
        checks_gib: The earlier checks of the memory model (predicted − measured free memory after
            graphs, GiB) this study's margin starts from.
        enqueued: The earlier study's best config enqueued as the first proposal, or ``None``.
        enqueued_from_trial: Its trial number in the earlier study.
        sampler_trials: Earlier measured trials added to the sampler as prior knowledge.
        references: The earlier starts whose memory models serve as this study's reference points
            (their pool, graphs and reserve at their knobs; :attr:`ModelSettings.prior_points`).
    """

    model_config = ConfigDict(extra="forbid")

    source: str | None = None
    source_storage: str | None = None
    level: MatchLevel | None = None
    reason: str = ""
    reused: list[str] = Field(default_factory=list)
    moved: list[str] = Field(default_factory=list)
    not_used: list[str] = Field(default_factory=list)
    checks_gib: list[float] = Field(default_factory=list)
    enqueued: dict[str, Any] | None = None
    enqueued_from_trial: int | None = None
    sampler_trials: int = 0
    references: list[StartFacts] = Field(default_factory=list)

    def line(self) -> str:
        """One progress line: what was reused, or why nothing was."""
        if self.source is None:
            why = f": {'; '.join(self.not_used)}" if self.not_used else ""
            return f"warm start: none ({self.reason}{why})"
        what = "; ".join(self.reused) or "nothing"
        text = f"warm start from study {self.source} ({self.reason}): reused {what}"
        if self.moved:
            text += "; moved: " + "; ".join(self.moved)
        return text


@dataclass(frozen=True)
class Prior:
    """A run's warm start: the stored :class:`WarmStart` and the sampler's prior trials.

    Attributes:
        warm: What was reused.
        trials: The earlier study's measured trials for the sampler (this study's distributions).
    """

    warm: WarmStart
    trials: tuple[FrozenTrial, ...] = ()

    def settings(self, settings: ModelSettings, space: Space) -> ModelSettings:
        """``settings`` with the earlier checks of the memory model (:attr:`WarmStart.checks_gib`)
        and its starts as reference points (:attr:`WarmStart.references`, on ``space``'s grid)."""
        points = tuple(
            Point(number=-1 - s.trial, params=space.snap(dict(s.params)), slots=int(s.slots or s.params.get(
                "max_running_requests") or space.max_running_requests[1]), model=s.capacity_model,
                  context_len=s.context_len, page_size=s.page_size, peak_gib=None, feasible=False, capacity=0)
            for s in self.warm.references if s.capacity_model is not None and s.context_len and s.params)
        if not self.warm.checks_gib and not points:
            return settings
        return dataclasses.replace(settings, prior_checks_gib=tuple(self.warm.checks_gib), prior_points=points)


def candidate_urls(url: str, study_name: str) -> list[str]:
    """The storages a study looks in for fingerprints: its own, and with the default
    one-file-per-study SQLite storage (``studies/<study>.db``) every other ``studies/*.db``."""
    urls = [url]
    if url == default_storage_url(study_name) and STUDIES_DIR.is_dir():
        urls += [u for path in sorted(STUDIES_DIR.glob("*.db")) if (u := f"sqlite:///{path}") != url]
    return urls


def _read_all(urls: Sequence[str], study_name: str) -> list[tuple[str, StoredFingerprint]]:
    found: list[tuple[str, StoredFingerprint]] = []
    for url in urls:
        try:
            storage = read_storage(url)
            found += [(url, item) for item in read_fingerprints(storage, exclude=study_name)]
        except StudyError as err:
            _log.info("fingerprints of %s not read: %s", display_url(url), err.message)
    return found


def _ratio_line(name: str, old: float | None, new: float | None, unit: str, fmt: str = "{:.2f}") -> tuple[bool, str] | None:
    if old is None or new is None:
        return None
    holds = abs(old - new) <= HOLD_TOLERANCE * max(abs(old), abs(new), 1e-9)
    text = f"{name} {fmt.format(new)} {unit}" if holds else f"{name} {fmt.format(old)} → {fmt.format(new)} {unit}"
    return holds, text


def figures_hold(fingerprint: Fingerprint, baseline: TrialRecord) -> tuple[list[str], list[str]]:
    """Which of ``fingerprint``'s figures hold on this study's ``baseline`` start, and which moved:
    free memory at the baseline ``B``, weights, bytes per KV token (within :data:`HOLD_TOLERANCE`),
    the CUDA-graph memory at the same largest captured batch, the draft's share.

    Returns:
        ``(held, moved)``: one line per figure (``B 21.68 GiB``; ``weights 14.96 → 15.02 GiB``).
    """
    held: list[str] = []
    moved: list[str] = []
    model = baseline.memory.capacity_model
    starts = fingerprint.calibrated
    if model is None or not starts:
        return held, ["this baseline reported no memory model to check the fingerprint against"]
    old = starts[0].capacity_model
    assert old is not None
    rows = [
        _ratio_line("B", old.baseline_gib, model.baseline_gib, "GiB"),
        _ratio_line("weights", old.weight_gib, model.weight_gib, "GiB"),
        _ratio_line("KV cell", float(old.cell_bytes), float(model.cell_bytes), "bytes/token", "{:.0f}"),
    ]
    graphs = [s.capacity_model for s in starts if s.capacity_model is not None
              and s.capacity_model.observed_graph_max_bs == model.observed_graph_max_bs]
    if graphs and model.observed_graph_max_bs:
        rows.append(_ratio_line(f"graphs at bs {model.observed_graph_max_bs}", graphs[0].observed_graph_gib,
                                model.observed_graph_gib, "GiB"))
    drafts = [s.draft_gib for s in fingerprint.starts if s.draft_gib is not None]
    facts = start_facts(0, baseline)
    if drafts and facts is not None:
        rows.append(_ratio_line("draft share", drafts[0], facts.draft_gib, "GiB"))
    for row in rows:
        if row is not None:
            (held if row[0] else moved).append(row[1])
    return held, moved


def _rank(item: tuple[str, StoredFingerprint, Match], workload: str | None) -> tuple[int, int, int]:
    _url, stored, match = item
    fp = stored.fingerprint
    assert fp is not None
    return (0 if match.level == MATCH_SAME else 1, 0 if fp.workload == workload else 1, -len(fp.starts))


def _sampler_trials(source: optuna.Study, space: Space) -> tuple[FrozenTrial, ...]:
    """The earlier study's launched trials as this study's sampler sees trials: its values and
    constraints, the params this space searches (a trial with a param outside it is left out)."""
    distributions = space.distributions()
    out = []
    for trial in source.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        record = record_of(trial)
        if record is None or record.outcome not in ("ok", "failed") or trial.values is None:
            continue
        params = {k: v for k, v in trial.params.items() if k in distributions}
        if not params or not all(space.contains(k, v) for k, v in params.items()):
            continue
        out.append(optuna.trial.create_trial(
            state=TrialState.COMPLETE, values=trial.values, params=params,
            distributions={k: distributions[k] for k in params}, constraints=trial.constraints))
    return tuple(out)


def _best_of(source: optuna.Study, config: TunerConfig) -> tuple[int, TrialRecord] | None:
    objective = config.objective
    choice = best_by([(t.number, r) for t, r in records(source)], objective)
    return (choice.number, choice.record) if choice is not None else None


def _enqueue_best(study: optuna.Study, best: tuple[int, TrialRecord], source: str, space: Space) -> dict[str, Any]:
    """Enqueue the earlier best config as this study's first proposal, with the earlier
    measurement as its prediction (a check of the fingerprint when it is measured here)."""
    number, record = best
    params = space.snap(dict(record.params))
    prediction = {"token_capacity": record.token_capacity, "context_capacity": record.context_capacity,
                  "free_gib_after_graphs": record.free_gib_after_graphs,
                  "why": f"the best config of study {source} (trial {number}) on the same deployment and workload"}
    study.enqueue_trial(params, user_attrs={KIND_ATTR: "predicted",
                                            PREDICTION_ATTR: {k: v for k, v in prediction.items() if v is not None}})
    return params


def _stored(study: optuna.Study) -> WarmStart | None:
    raw = study.user_attrs.get(WARM_ATTR)
    if raw is None:
        return None
    try:
        return WarmStart.model_validate(raw)
    except ValidationError:
        return WarmStart(reason="the stored warm start is unreadable: nothing reused")


def _resumed(warm: WarmStart, url: str, study_name: str, space: Space) -> Prior:
    """A resumed run's prior: the stored warm start, and its sampler trials read again (left out,
    with a log line, when the earlier study cannot be read any more)."""
    trials: tuple[FrozenTrial, ...] = ()
    if warm.source is not None and warm.sampler_trials and warm.source_storage is not None:
        try:
            for candidate in candidate_urls(url, study_name):
                if display_url(candidate) == warm.source_storage:
                    trials = _sampler_trials(optuna.load_study(study_name=warm.source, storage=read_storage(candidate)),
                                             space)
                    break
        except (StudyError, KeyError) as err:
            _log.info("warm start: the sampler's prior trials of %s not read: %s", warm.source, err)
    return Prior(warm=warm, trials=trials)


def warm_start(study: optuna.Study, url: str, key: DeploymentKey, *, workload: str, baseline: TrialRecord | None,
               config: TunerConfig, space: Space, fresh: bool) -> Prior:
    """The warm start of ``study`` (stored as :data:`WARM_ATTR` the first time; see the module).

    Args:
        study: The study, its baseline measured.
        url: Its storage URL.
        key: This deployment (:func:`tuner.study.fingerprint.deployment_key`).
        workload: This study's :func:`tuner.study.fingerprint.workload_key`.
        baseline: This study's baseline record (checks the fingerprint), or ``None``.
        config: The config (``[objective]``: the earlier best by the same policy).
        space: This study's space (the enqueued config and the sampler's trials on its grid).
        fresh: Whether the study has no launched trial but its baseline (else nothing is looked
            up: the study has facts of its own).

    Returns:
        The prior (:class:`Prior`).
    """
    stored = _stored(study)
    if stored is not None:
        return _resumed(stored, url, config.study.name, space)
    if not fresh:
        return Prior(warm=WarmStart(reason="the study has launched trials of its own"))
    found = _read_all(candidate_urls(url, config.study.name), config.study.name)
    not_used = [stored_fp.error for _u, stored_fp in found if stored_fp.error]
    usable: list[tuple[str, StoredFingerprint, Match]] = []
    for u, stored_fp in found:
        if stored_fp.fingerprint is None:
            continue
        match = compare(stored_fp.fingerprint.key, key)
        if match.level == MATCH_NONE:
            not_used.append(f"study {stored_fp.study}: {match.reason}")
        else:
            usable.append((u, stored_fp, match))
    try:
        warm = _choose(study, usable, not_used, workload=workload, baseline=baseline, config=config, space=space)
    except (StudyError, KeyError) as err:  # the earlier study went away between the two reads
        warm = Prior(warm=WarmStart(reason=f"the matching study could not be read: {err}", not_used=not_used))
    study.set_user_attr(WARM_ATTR, warm.warm.model_dump(mode="json"))
    return warm


def _choose(study: optuna.Study, usable: list[tuple[str, StoredFingerprint, Match]], not_used: list[str], *,
            workload: str, baseline: TrialRecord | None, config: TunerConfig, space: Space) -> Prior:
    for u, stored_fp, match in sorted(usable, key=lambda item: _rank(item, workload)):
        fp = stored_fp.fingerprint
        assert fp is not None
        if baseline is None:
            not_used.append(f"study {fp.study}: this study's baseline did not start, so the fingerprint is unchecked")
            continue
        held, moved = figures_hold(fp, baseline)
        if match.level == MATCH_SAME and moved:
            not_used.append(f"study {fp.study}: same deployment key but its figures do not hold on this baseline "
                            f"({'; '.join(moved)})")
            continue
        common = WarmStart(source=fp.study, source_storage=display_url(u), level=match.level,
                           not_used=not_used, moved=moved, reason=match.reason or "the same deployment")
        if match.level == MATCH_VERSION:
            graphs = any(line.startswith("graphs at bs") for line in held)
            if moved or not graphs:  # the version moved a figure, or the graphs could not be compared
                return Prior(warm=common.model_copy(update={"reused": [
                    f"nothing of the memory model; still holds: {', '.join(held)}" if held
                    else "nothing (each figure moved with the version)"]}))
            # every figure holds on this baseline (B, weights, KV cell, graphs, draft): the memory
            # model's references and checks do too; measured values do not (another version)
            checks = [round(c, 4) for c in fp.over_predictions_gib()]
            return Prior(warm=common.model_copy(update={
                "reused": [f"{', '.join(held)} (every figure holds on this baseline)",
                           f"{len(fp.calibrated)} calibrated starts as reference points of the memory model",
                           *([f"the memory model's measured error ({len(checks)} checks)"] if checks else []),
                           "no measured values (another version)"],
                "checks_gib": checks, "references": fp.calibrated}))
        checks = [round(c, 4) for c in fp.over_predictions_gib()]
        reused = [f"{', '.join(held)} (checked on this baseline)"]
        if checks:
            reused.append(f"the memory model's measured error ({len(checks)} checks, at most {max(checks):.2f} GiB)")
        enqueued = trial_no = None
        trials: tuple[FrozenTrial, ...] = ()
        if fp.workload == workload:
            source = optuna.load_study(study_name=fp.study, storage=read_storage(u))
            best = _best_of(source, config)
            if best is not None:
                enqueued, trial_no = _enqueue_best(study, best, fp.study, space), best[0]
                reused.append(f"its best config (trial {trial_no}) as the first proposal")
            trials = _sampler_trials(source, space)
            if trials:
                reused.append(f"{len(trials)} measured trials as the sampler's prior")
        else:
            reused.append("no measured values (another workload, SLO or objective)")
        references = fp.calibrated
        if references:
            reused.insert(1, f"{len(references)} calibrated starts as reference points of the memory model "
                             "(graph memory per batch size, the reserve at their knobs)")
        warm = common.model_copy(update={"reused": reused, "checks_gib": checks, "enqueued": enqueued,
                                         "enqueued_from_trial": trial_no, "sampler_trials": len(trials),
                                         "references": references})
        return Prior(warm=warm, trials=trials)
    reason = "no other study in this storage has a fingerprint" if not not_used else "no fingerprint matches"
    return Prior(warm=WarmStart(reason=reason, not_used=not_used))


def is_fresh(finished: Sequence[tuple[int, TrialRecord]]) -> bool:
    """Whether a study's only launched trials are baselines (a new study, its baseline measured)."""
    return all(r.kind == "baseline" for _, r in finished if r.outcome in ("ok", "failed"))
