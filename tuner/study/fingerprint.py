"""The deployment's memory fingerprint: the typed memory facts of every start, keyed by what sets them.

Every start of SGLang reports the deployment's memory decomposition (``shared/sglang-reference.md``
§1.2, §1.6, §4.2, §8): the free memory at the baseline ``B``, the weights ``W``, the KV bytes per
token, the CUDA-graph memory at a captured batch size, the draft model's share (speculative
decoding) and the hierarchical cache's host pools. Capacity repeats within about ±0.05 % across
launches of one deployment (sgl-project/sglang#38272), so these figures are a fingerprint of the
deployment, not an estimate: what sets them is the GPU (model, memory, count), the driver, the
SGLang version, the model (its identity and quantization), the parallel layout and the structural
flags (``kv_cache_dtype``, DP attention, decode context parallel, speculative decoding, ...).

A :class:`Fingerprint` is that key (:class:`DeploymentKey`) and the facts of every launched trial
of one study (:class:`StartFacts`), derived from the trials' records
(:class:`tuner.records.MemoryFacts`) and stored as the study user attribute
:data:`FINGERPRINT_ATTR` (Optuna's own storage: a SQLite file or a PostgreSQL database), so every
study in a storage can read every other's (:func:`read_fingerprints`). :func:`compare` says whether
two keys describe the same deployment, the same one on another SGLang version or driver
(:data:`MATCH_VERSION`: only the facts the version does not set still hold), or another one (never
used, and why).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import optuna
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tuner.config import TunerConfig
from tuner.errors import FlagError, StudyError
from tuner.knobs import LEVERS
from tuner.records import TrialRecord, now_iso
from tuner.sglang.flags import FlagTable, parse_argv
from tuner.sglang.memory import KVCapacityModel

__all__ = [
    "FINGERPRINT_ATTR",
    "SCHEMA",
    "STRUCTURAL_FLAGS",
    "LAYOUT_FLAGS",
    "MATCH_SAME",
    "MATCH_VERSION",
    "MATCH_NONE",
    "MatchLevel",
    "DeploymentKey",
    "StartFacts",
    "Fingerprint",
    "Match",
    "StoredFingerprint",
    "deployment_key",
    "workload_key",
    "start_facts",
    "fingerprint_of",
    "save_fingerprint",
    "parse_fingerprint",
    "read_fingerprints",
    "compare",
]

FINGERPRINT_ATTR = "tuner.fingerprint"
"""Study user attribute holding ``Fingerprint.model_dump(mode="json")``."""
SCHEMA = 1
"""The stored fingerprint's schema; another schema is foreign (read as one line, never used)."""

LAYOUT_FLAGS = ("tp_size", "pp_size", "ep_size", "nnodes", *(flag for lever in LEVERS for flag in lever.layout))
"""SGLang's parallel layout flags: how the model and its KV cache are split over the GPUs (§1.3,
§1.5b: ``attn_tp = tp / dp`` divides the KV heads), the structural levers' own included
(:attr:`tuner.knobs.Lever.layout`: ``dcp_size``, ``dp_size``, ``enable_dp_attention``)."""
STRUCTURAL_FLAGS = (
    "quantization", "kv_cache_dtype", "speculative_algorithm", "speculative_draft_model_path",
    "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens", "page_size",
    "context_length", "attention_backend", "disable_cuda_graph", "enable_mixed_chunk", "dtype",
)
"""Flags of the service's command that set its memory decomposition (§1.3 the KV cell's dtype,
§1.5 speculative decoding's draft, §1.6 the req_to_token width, §2.1 the graphs); the study's
searched knobs are not part of the key (each start's facts carry them)."""

MatchLevel = Literal["same", "version", "none"]
MATCH_SAME: MatchLevel = "same"
MATCH_VERSION: MatchLevel = "version"
MATCH_NONE: MatchLevel = "none"


class DeploymentKey(BaseModel):
    """What determines a deployment's memory facts.

    Attributes:
        gpu_name: The GPU model (NVML's name, or the simulator's ``--sim-gpu``).
        gpu_total_mib: Its memory (MiB, the smallest device), when known.
        gpu_count: GPUs the service uses (``tp × pp``, or NVML's count).
        driver_version: The NVIDIA driver (``simulated`` for the simulator).
        sglang_version: The SGLang version.
        model: The model (``[model] name`` or ``--model-path``).
        model_config_sha256: SHA-256 of its ``config.json`` when readable (the identity beyond a name).
        layout: The parallel layout flags the command sets (:data:`LAYOUT_FLAGS`).
        structural: The structural flags it sets (:data:`STRUCTURAL_FLAGS`; quantization among them).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu_name: str | None = None
    gpu_total_mib: float | None = None
    gpu_count: int | None = None
    driver_version: str | None = None
    sglang_version: str | None = None
    model: str | None = None
    model_config_sha256: str | None = None
    layout: dict[str, Any] = Field(default_factory=dict)
    structural: dict[str, Any] = Field(default_factory=dict)

    def describe(self) -> str:
        """One line: GPU, driver, version, model and the flags that are set."""
        flags = " ".join(f"{k}={v}" for k, v in sorted({**self.layout, **self.structural}.items()))
        gpu = f"{self.gpu_count or 1}x {self.gpu_name or '?'}"
        return f"{gpu}, driver {self.driver_version or '?'}, SGLang {self.sglang_version or '?'}, {self.model or '?'}" + (
            f", {flags}" if flags else "")


class StartFacts(BaseModel):
    """The memory facts of one launched trial (GiB = 2^30 bytes, as SGLang's log prints them, §0).

    Attributes:
        trial: The trial number.
        kind: The record's kind (``baseline``, ``predicted``, ``sampled``, ``enqueued``).
        params: Its searched knobs by SGLang field name.
        outcome: ``ok`` or ``failed``.
        failure_class: The failure's class, if it failed.
        slots: ``max_running_requests`` the server ran with (SGLang's effective value when logged).
        token_capacity: ``max_total_num_tokens`` (tokens).
        context_len: SGLang's ``context_len`` (tokens).
        page_size: SGLang's page size (tokens).
        capacity_model: The memory model calibrated on this start
            (:class:`tuner.sglang.memory.KVCapacityModel`: ``B``, ``S``, ``W``, bytes per token,
            graphs at the largest captured batch, the rest of the reserve).
        graph_bs: The captured decode batch sizes, when the log listed them.
        free_gib_after_graphs: Free GPU memory after graphs (the runtime headroom, GiB).
        draft_gib: The draft model's share (weights, KV, graphs of its own lines, GiB), with
            speculative decoding.
        host_pool_gb_per_rank: The hierarchical cache's host pool per rank (decimal GB).
        peak_activation_gib: The activation peak measured under load (GiB; workload-dependent).
        predicted_free_gib: What the planner predicted for the free memory after graphs (GiB).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    trial: int
    kind: str
    params: dict[str, Any] = Field(default_factory=dict)
    outcome: Literal["ok", "failed"]
    failure_class: str | None = None
    slots: int | None = None
    token_capacity: int | None = None
    context_len: int | None = None
    page_size: int = 1
    capacity_model: KVCapacityModel | None = None
    graph_bs: list[int] | None = None
    free_gib_after_graphs: float | None = None
    draft_gib: float | None = None
    host_pool_gb_per_rank: float | None = None
    peak_activation_gib: float | None = None
    predicted_free_gib: float | None = None

    @property
    def over_prediction_gib(self) -> float | None:
        """Predicted minus measured free memory after graphs (GiB; > 0: the model over-predicted)."""
        if self.predicted_free_gib is None or self.free_gib_after_graphs is None:
            return None
        return self.predicted_free_gib - self.free_gib_after_graphs


class Fingerprint(BaseModel):
    """One study's fingerprint: the deployment's key and the facts of every launch.

    Attributes:
        schema_version: :data:`SCHEMA`.
        study: The study it was taken from.
        key: The deployment (:class:`DeploymentKey`).
        workload: :func:`workload_key` of the study's workload, SLO and objective (measured values
            transfer between studies only where it is equal).
        context_tokens: The context length of the study's context capacity (tokens).
        starts: The launched trials' facts, oldest first.
        updated_at: When it was last written (ISO 8601, UTC).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    schema_version: int = Field(default=SCHEMA, alias="schema")
    study: str
    key: DeploymentKey
    workload: str | None = None
    context_tokens: int | None = None
    starts: list[StartFacts] = Field(default_factory=list)
    updated_at: str | None = None

    def stored(self) -> dict[str, Any]:
        """The JSON stored as :data:`FINGERPRINT_ATTR`."""
        return self.model_dump(mode="json", by_alias=True)

    @property
    def calibrated(self) -> list[StartFacts]:
        """The starts that calibrated a memory model."""
        return [s for s in self.starts if s.capacity_model is not None and s.context_len]

    def over_predictions_gib(self) -> list[float]:
        """Every check of the planner's memory model on this deployment: predicted − measured free
        memory after graphs (GiB), one per launch that had a prediction."""
        return [o for s in self.starts if (o := s.over_prediction_gib) is not None]

    def figures(self) -> dict[str, Any]:
        """The deployment's figures for a reader: ``baseline_gib`` (``B``), ``weight_gib``,
        ``cell_bytes`` (KV bytes per token per GPU), ``graph_gib_per_bs`` (``{bs: GiB}`` as
        observed), ``draft_gib``, ``host_pool_gb_per_rank``, ``launches``, ``failed``,
        ``model_error_gib`` (the largest over-prediction of free memory, GiB), ``tokens_per_hundredth``."""
        models = [s.capacity_model for s in self.calibrated if s.capacity_model is not None]
        graphs = {str(m.observed_graph_max_bs): round(m.observed_graph_gib, 3) for m in models
                  if m.observed_graph_gib is not None and m.observed_graph_max_bs}
        drafts = [s.draft_gib for s in self.starts if s.draft_gib is not None]
        pools = [s.host_pool_gb_per_rank for s in self.starts if s.host_pool_gb_per_rank is not None]
        over = self.over_predictions_gib()
        first = models[0] if models else None
        return {
            "baseline_gib": round(min(m.baseline_gib for m in models), 3) if models else None,
            "weight_gib": first.weight_gib if first else None,
            "cell_bytes": first.cell_bytes if first else None,
            "tokens_per_hundredth": round(first.tokens_per_hundredth()) if first else None,
            "graph_gib_per_bs": dict(sorted(graphs.items(), key=lambda kv: int(kv[0]))),
            "draft_gib": round(max(drafts), 3) if drafts else None,
            "host_pool_gb_per_rank": round(max(pools), 2) if pools else None,
            "launches": len(self.starts),
            "failed": sum(1 for s in self.starts if s.outcome == "failed"),
            "model_error_gib": round(max(over), 3) if over else None,
        }


class Match(BaseModel):
    """How a stored fingerprint's deployment relates to this one (:func:`compare`).

    Attributes:
        level: :data:`MATCH_SAME` (every fact holds), :data:`MATCH_VERSION` (same GPU, model,
            layout and flags on another SGLang version or driver: the facts those set do not hold)
            or :data:`MATCH_NONE` (never used).
        reason: One line: what differs (empty for :data:`MATCH_SAME`).
    """

    model_config = ConfigDict(frozen=True)

    level: MatchLevel
    reason: str = ""


class StoredFingerprint(BaseModel):
    """A fingerprint as read from a storage: the study's name and the fingerprint, or why it
    cannot be used (``error``: a corrupt or foreign attribute, in one line)."""

    model_config = ConfigDict(frozen=True)

    study: str
    fingerprint: Fingerprint | None = None
    error: str | None = None


def _config_sha(config: TunerConfig, model_path: Any) -> str | None:
    """SHA-256 of the model's ``config.json`` (``[model] config_json``, else ``--model-path``'s), or
    ``None`` when neither is a readable file."""
    candidates = [config.model.config_json] if config.model.config_json else []
    if isinstance(model_path, str) and model_path:
        candidates.append(str(Path(model_path) / "config.json"))
    for path in candidates:
        try:
            return hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            continue
    return None


def _table(version: Any) -> FlagTable:
    """The bundled flag table nearest ``version`` (the newest when it is unknown): the layout and
    structural flags are spelled alike in every bundled version."""
    try:
        return FlagTable.for_version(str(version)) if version else FlagTable.for_version(FlagTable.bundled_versions()[-1])
    except FlagError:
        return FlagTable.for_version(FlagTable.bundled_versions()[-1])


def deployment_key(environment: Mapping[str, Any], argv: Sequence[str], config: TunerConfig,
                   searched: Iterable[str] = ()) -> DeploymentKey:
    """The deployment key of a study's service.

    Args:
        environment: The run's environment (:func:`tuner.entrypoints.resolve_environment`:
            ``sglang_version``, ``gpu_name``, ``gpu_count``, ``gpu_total_mib``, ``driver_version``,
            ``model``).
        argv: The service's command line (its flags by SGLang's spelling for that version).
        config: The config (``[model] config_json``).
        searched: Knobs the study searches (left out of the key: each start carries them).
    """
    flags = parse_argv(list(argv), _table(environment.get("sglang_version")))
    skip = set(searched)
    layout = {k: flags[k] for k in LAYOUT_FLAGS if k in flags and k not in skip}
    structural = {k: flags[k] for k in STRUCTURAL_FLAGS if k in flags and k not in skip}
    total = environment.get("gpu_total_mib")
    return DeploymentKey(
        gpu_name=environment.get("gpu_name"), gpu_total_mib=float(total) if total else None,
        gpu_count=int(environment["gpu_count"]) if environment.get("gpu_count") else None,
        driver_version=environment.get("driver_version"), sglang_version=environment.get("sglang_version"),
        model=environment.get("model"), model_config_sha256=_config_sha(config, flags.get("model_path")),
        layout=layout, structural=structural,
    )


def workload_key(config: TunerConfig, context_tokens: int) -> str:
    """A digest of what a trial's measured values depend on beside the deployment: ``[workload]``,
    ``[slo]``, ``[objective]``, the load phases of ``[budget]`` and the context length. Two studies
    with equal keys measure a config alike (values, SLO verdicts, the activation peak)."""
    data = {
        "workload": config.workload.model_dump(mode="json"),
        "slo": config.slo.model_dump(mode="json"),
        "objective": config.objective.model_dump(mode="json"),
        "budget": config.budget.model_dump(mode="json", exclude={"total", "trials", "restore_reserve_s"}),
        "context_tokens": context_tokens,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _draft_gib(record: TrialRecord) -> float | None:
    """The draft model's own memory on the primary rank (weights + KV + graphs of its lines, §4.1)."""
    ranks = record.memory.ranks
    if not ranks:
        return None
    rank = ranks.get("TP0") or next(iter(ranks.values()))
    draft = rank.get("draft") if isinstance(rank, dict) else None
    if not isinstance(draft, dict):
        return None
    parts = [draft.get("weight_gib"), draft.get("kv_size_gib"), draft.get("k_size_gib"), draft.get("v_size_gib"),
             draft.get("graph_gib")]
    values = [float(p) for p in parts if isinstance(p, (int, float))]
    return round(sum(values), 3) if values else None


def start_facts(number: int, record: TrialRecord) -> StartFacts | None:
    """The facts of one trial's start, or ``None`` for a trial that was not launched (skipped,
    not started for the budget)."""
    if record.outcome not in ("ok", "failed"):
        return None
    memory = record.memory
    scheduler = memory.scheduler or {}
    slots = scheduler.get("max_running_requests") or record.params.get("max_running_requests")
    graph_bs = (record.resolved.get("cuda_graph_bs") or {}).get("value")
    return StartFacts(
        trial=number, kind=record.kind, params=dict(record.params), outcome=record.outcome,
        failure_class=record.failure_class.value if record.failure_class else None,
        slots=int(slots) if slots else None, token_capacity=record.token_capacity,
        context_len=memory.context_len, page_size=memory.page_size, capacity_model=memory.capacity_model,
        graph_bs=[int(b) for b in graph_bs] if isinstance(graph_bs, list) else None,
        free_gib_after_graphs=record.free_gib_after_graphs, draft_gib=_draft_gib(record),
        host_pool_gb_per_rank=record.cache.host_pool_gb_per_rank, peak_activation_gib=memory.peak_activation_gib,
        predicted_free_gib=record.prediction.free_gib_after_graphs,
    )


def fingerprint_of(study: str, key: DeploymentKey, finished: Sequence[tuple[int, TrialRecord]], *,
                   workload: str | None, context_tokens: int | None) -> Fingerprint:
    """The fingerprint of a study's finished trials (``(number, record)``, oldest first)."""
    starts = [facts for number, record in finished if (facts := start_facts(number, record)) is not None]
    return Fingerprint(study=study, key=key, workload=workload, context_tokens=context_tokens, starts=starts,
                       updated_at=now_iso())


def save_fingerprint(study: optuna.Study, fingerprint: Fingerprint) -> None:
    """Store ``fingerprint`` as the study's :data:`FINGERPRINT_ATTR` (rewritten whole: each write
    is derived from every trial the writer read, so a host's write never loses another's start
    for long)."""
    study.set_user_attr(FINGERPRINT_ATTR, fingerprint.stored())


def parse_fingerprint(study: str, raw: Any) -> StoredFingerprint:
    """A stored attribute as a fingerprint, or one line saying why it is not one (corrupt JSON
    shape, another schema, another study's name)."""
    if not isinstance(raw, dict):
        return StoredFingerprint(study=study, error=f"study {study!r}: fingerprint is not a JSON object: not used")
    schema = raw.get("schema")
    if schema != SCHEMA:
        return StoredFingerprint(study=study, error=f"study {study!r}: fingerprint of schema {schema!r} "
                                 f"(this tuner reads schema {SCHEMA}): foreign, not used")
    try:
        fingerprint = Fingerprint.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return StoredFingerprint(study=study, error=f"study {study!r}: fingerprint unreadable "
                                 f"({err.error_count()} errors, first at {where or 'top'}: {first.get('msg')}): not used")
    if fingerprint.study != study:
        return StoredFingerprint(study=study, error=f"study {study!r}: fingerprint says it is study "
                                 f"{fingerprint.study!r} (copied from elsewhere?): not used")
    return StoredFingerprint(study=study, fingerprint=fingerprint)


def read_fingerprints(storage: optuna.storages.BaseStorage, *, exclude: str | None = None) -> list[StoredFingerprint]:
    """Every study's fingerprint in ``storage`` (studies without one are left out), oldest
    study first; ``exclude`` names a study to leave out (the one being run).

    Raises:
        StudyError: The storage cannot be read.
    """
    try:
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    except Exception as err:  # noqa: BLE001 - any storage error is one line for the reader
        raise StudyError(f"the storage's studies cannot be read: {str(err).splitlines()[0] if str(err) else type(err).__name__}",
                         hint="check --storage") from err
    return [parse_fingerprint(s.study_name, s.user_attrs[FINGERPRINT_ATTR]) for s in summaries
            if FINGERPRINT_ATTR in s.user_attrs and s.study_name != exclude]


def _differs(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    names = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if not names:
        return None
    return ", ".join(f"{k} {a.get(k, 'unset')} vs {b.get(k, 'unset')}" for k in names)


def compare(stored: DeploymentKey, current: DeploymentKey) -> Match:
    """Whether ``stored``'s facts describe the ``current`` deployment.

    Another GPU (model, memory or count; a fact one side does not know is not compared), another model (name or ``config.json``), another parallel
    layout or other structural flags: :data:`MATCH_NONE`, with the first difference named. Then
    another SGLang version or driver: :data:`MATCH_VERSION` (the free memory at the baseline, the
    graphs, the draft's budget and the model's error move with them). Else :data:`MATCH_SAME`.
    """
    counts = stored.gpu_count and current.gpu_count and stored.gpu_count != current.gpu_count
    if stored.gpu_name != current.gpu_name or counts or (
            stored.gpu_total_mib and current.gpu_total_mib and abs(stored.gpu_total_mib - current.gpu_total_mib) > 1):
        return Match(level=MATCH_NONE, reason=f"other GPU ({stored.gpu_count or 1}x {stored.gpu_name} vs "
                                              f"{current.gpu_count or 1}x {current.gpu_name})")
    if stored.model != current.model or (
            stored.model_config_sha256 and current.model_config_sha256
            and stored.model_config_sha256 != current.model_config_sha256):
        same_name = stored.model == current.model
        return Match(level=MATCH_NONE, reason=f"other model ({stored.model} vs {current.model}"
                                              f"{': its config.json differs' if same_name else ''})")
    if (diff := _differs(stored.layout, current.layout)) is not None:
        return Match(level=MATCH_NONE, reason=f"other parallel layout ({diff})")
    if (diff := _differs(stored.structural, current.structural)) is not None:
        return Match(level=MATCH_NONE, reason=f"other structural flags ({diff})")
    moved = [f"SGLang {stored.sglang_version} vs {current.sglang_version}"
             if stored.sglang_version != current.sglang_version else "",
             f"driver {stored.driver_version} vs {current.driver_version}"
             if stored.driver_version != current.driver_version else ""]
    moved = [m for m in moved if m]
    if moved:
        return Match(level=MATCH_VERSION, reason="same GPU, model, layout and flags on " + " and ".join(moved))
    return Match(level=MATCH_SAME)
