"""``tuner explain``: where a server's GPU memory went, what limits capacity, what would change it.

One concept: an :class:`Explanation` built from what SGLang itself reported (a log, a unit's
journal, a running server's ``/get_server_info``) and, optionally, the model's ``config.json``.
It holds the memory waterfall (``shared/sglang-reference.md`` §1.2, §1.6, §4.2), the capacity
limit (§2.3, §8), predictions at other fractions (§1.8, :mod:`tuner.sglang.memory`) and the known
traps with their evidence. ``--json`` prints :meth:`Explanation.model_dump`; the schema is in
``docs/explain-schema.md``. The rich text view is :mod:`tuner.report.explain` (print and rich
belong to the CLI and report layers).
"""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from tuner.errors import ConfigError, LogError, ServerError
from tuner.sglang.activation import FALLBACK_GIB, prefill_peak_gib
from tuner.sglang.client import ServerInfo
from tuner.sglang.failures import LEVERS, Failure, FailureClass, Lever
from tuner.sglang.ladder import LadderBase, PricedLever, Rung, ladder
from tuner.sglang.levers import attention_type, dcp_per_rank_cell_bytes, draft_budget, dsa_kv_settings
from tuner.sglang.logs import KVShortfall, LoggedLine, LogReport, OOMDetail, non_memory_fatal, parse_log_bytes
from tuner.sglang.memory import (
    GIB,
    KVCapacityModel,
    cell_size_bytes,
    context_len_from_max_req_input_len,
    effective_max_running_requests,
    max_req_input_len,
    req_to_token_gib,
)
from tuner.sglang.modelconfig import ModelArch
from tuner.sglang.phases import STARTUP, UNKNOWN, settling_line
from tuner.sglang.speculative import speculative_max_running_requests
from tuner.sglang.structural import structural_lever
from tuner.sglang.wrapped import CAPTURE_FAILED, capture_cause

__all__ = [
    "SCHEMA_VERSION",
    "Setting",
    "WaterfallStep",
    "RequestFit",
    "Capacity",
    "Prediction",
    "Trap",
    "Explanation",
    "explain",
    "read_journal",
    "explain_from",
    "waterfall_steps",
    "RetractionSummary",
    "rank_levers",
]

SCHEMA_VERSION = 1
_FROZEN = ConfigDict(frozen=True, extra="forbid")
_SHORT_REQUEST_TOKENS = 4096
"""A short chat request (prompt + output), for "can the batch outgrow the captured graphs" (case-21)."""
IDLE_RESERVE_GIB = 2.0
"""Free memory after graphs above which the reserve is called idle (activations of one chunk of
a few thousand tokens take well under this on the GPUs of §2.1; the tuner measures the peak)."""


class Setting(BaseModel):
    """One server setting with where its value came from."""

    model_config = _FROZEN

    value: Any
    source: str
    """``log:scheduler``, ``log:server_args``, ``server_info``, ``model_config``, ``derived``, ``cli``."""


class WaterfallStep(BaseModel):
    """One line of the memory waterfall (per GPU, GiB = 2^30 bytes)."""

    model_config = _FROZEN

    item: str
    """``baseline_free``, ``weights``, ``kv_pool``, ``other_static``, ``reserve``,
    ``req_to_token``, ``cuda_graphs``, ``draft_model``, ``other_reserve``, ``free_after_graphs``."""
    label: str
    gib: float | None
    tokens: int | None = None
    source: str
    note: str | None = None


class RequestFit(BaseModel):
    """How many requests of one length are resident at once (design: context capacity)."""

    model_config = _FROZEN

    request_tokens: int
    resident_requests: int
    limited_by: Literal["kv_pool", "max_running_requests"]


class Capacity(BaseModel):
    """What limits concurrent context capacity."""

    model_config = _FROZEN

    max_total_num_tokens: int | None
    effective_max_running_requests: int | None
    context_len: int | None
    max_req_input_len: int | None
    kv_bound_above_tokens: float | None
    """Requests longer than ``max_total_num_tokens / max_running_requests`` are limited by the KV
    pool, shorter ones by max_running_requests."""
    limit: Literal["kv_pool", "max_running_requests", "unknown"]
    statement: str
    fits: list[RequestFit] = Field(default_factory=list)


class Prediction(BaseModel):
    """Predicted pool and headroom at one ``mem_fraction_static``."""

    model_config = _FROZEN

    mem_fraction_static: float
    max_total_num_tokens: int
    delta_tokens: int | None
    kv_pool_gib: float
    free_after_graphs_gib: float | None
    starts: bool
    note: str | None = None


class Trap(BaseModel):
    """A known trap that applies, with its evidence."""

    model_config = _FROZEN

    id: str
    """``fraction_misread``, ``idle_reserve``, ``cuda_graph_bs_below_max_running_requests``,
    ``hicache_per_rank``, ``speculative_max_running_requests_48``, ``draft_kv_under_budget``, ``max_total_tokens_cap``,
    ``context_exceeds_pool``, ``retractions``, ``max_running_requests_reduced``, ``failure``."""
    severity: Literal["info", "warning", "error"]
    title: str
    detail: str
    evidence: list[str] = Field(default_factory=list)
    fix: str | None = None
    lever: Lever | None = None
    """The knob this trap says to move, which way and why (``None``: informational)."""
    also: list[Lever] = Field(default_factory=list)
    """Other knobs that address the same trap, best first (``tuner explain`` lists them after the lever)."""


class RetractionSummary(BaseModel):
    """The retraction lines of a log (§4.4) and the decode line before the first one (§4.5)."""

    model_config = _FROZEN

    lines: int
    """How many retraction lines the log holds (every rank's)."""
    retracted_reqs: int
    """``#retracted_reqs`` summed over those lines."""
    ranks: int
    running_req_before: int | None = None
    """``#running-req`` of the decode line before the first retraction, on its rank."""
    num_token_before: int | None = None
    """``#token`` of that line: KV tokens the running requests held."""
    token_usage_before: float | None = None


class Explanation(BaseModel):
    """Everything ``tuner explain`` says; ``--json`` prints this (``docs/explain-schema.md``)."""

    model_config = _FROZEN

    schema_version: int = SCHEMA_VERSION
    sources: list[str]
    sglang_version: str | None
    log_format: str | None
    state: Literal["ready", "failed", "starting", "unknown"]
    """``ready``: a ready line, batch lines, or a live server; ``failed``: a classified failure;
    ``starting``: startup lines without a ready line (or a partial log); ``unknown``: neither."""
    failure: Failure | None
    diagnosis: Failure | None = None
    """The failure, else the soft diagnosis of a server that kept running (``retraction_storm``);
    ``failure_class``, ``phase`` and the quoted ``evidence`` line."""
    lever: Lever | None = None
    """The one knob to move first, which way and why: the diagnosis's, else the first trap's."""
    levers: list[Lever] = Field(default_factory=list)
    """Every lever that applies, ranked: ``lever`` first, then the diagnosis's other knobs, then the
    other traps' levers in trap order (one entry per knob and direction)."""
    settings: dict[str, Setting]
    waterfall: list[WaterfallStep]
    capacity: Capacity
    model: dict[str, Any] | None
    predictions: list[Prediction]
    traps: list[Trap]
    findings: list[str]
    warnings: list[str]
    logged: dict[str, list[LoggedLine]] = Field(default_factory=dict)
    """Every number of every recognised line per rank prefix (``""``: no prefix), as printed
    (value and unit), plus each rank's last prefill and decode batch line."""
    oom: OOMDetail | None = None
    """The numbers of a CUDA/HIP OOM message (MiB / GiB converted; ``logged`` has them as printed)."""
    kv_shortfall: KVShortfall | None = None
    """The KV allocator's page shortfall (tokens asked, available, evictable), if logged."""
    retractions: RetractionSummary | None = None
    """The log's retractions, if any."""
    ladder: list[Rung] = Field(default_factory=list)
    """The structural levers priced on this start (:mod:`tuner.sglang.ladder`): fp8 KV, DP
    attention, DCP, speculative decoding off, the fraction's ceiling; empty without a calibrated model."""


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def read_journal(unit: str, *, journalctl: str = "journalctl", timeout_s: float = 60.0) -> LogReport:
    """Read a systemd unit's journal and parse it (the last start in it is reported).

    Args:
        unit: The unit name (``sglang`` or ``sglang.service``).
        journalctl: The journalctl command prefix, e.g. ``"nsenter -t PID -m -p journalctl"``;
            ``-u UNIT -o short-iso --no-pager`` is appended.
        timeout_s: Limit for the command.

    Returns:
        The parsed report.

    Raises:
        LogError: The command is missing, failed, timed out, or printed no SGLang line.
    """
    cmd = [*shlex.split(journalctl), "-u", unit, "-o", "short-iso", "--no-pager"]
    source = f"`{' '.join(cmd)}`"
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
    except FileNotFoundError as err:
        raise LogError(f"cannot run {cmd[0]}: not found", hint="install systemd's journalctl or pass --journalctl COMMAND / --log FILE") from err
    except subprocess.TimeoutExpired as err:
        raise LogError(f"{source} took longer than {timeout_s:.0f} s", hint="pass --log FILE with an exported journal") from err
    if proc.returncode != 0:
        last = (proc.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise LogError(f"{source} failed: {last}", hint="check the unit name and your permission to read its journal")
    if not [line for line in proc.stdout.splitlines() if line.strip() and not line.startswith(b"-- ")]:
        # journalctl -u prints "-- No entries --" and exits 0 for a unit systemd does not know.
        if _unit_load_state(unit, journalctl, timeout_s) == "not-found":
            raise LogError(f"no such unit {unit}: systemd does not know it",
                           hint="check the name with `systemctl list-units --all 'sglang*'`, or pass --log FILE")
        raise LogError(f"the journal holds no entry for unit {unit}: no such unit, or it never logged",
                       hint="check the name with `systemctl status UNIT`, your permission to read the journal, or pass --log FILE")
    return parse_log_bytes(proc.stdout, source=f"journal of unit {unit}")


def _unit_load_state(unit: str, journalctl: str, timeout_s: float) -> str | None:
    """systemd's ``LoadState`` of ``unit`` (``loaded``, ``not-found``...) through the systemctl next
    to the ``journalctl`` command (same prefix, e.g. ``nsenter ... systemctl``), or None when it
    cannot be asked."""
    words = shlex.split(journalctl)
    if not words or Path(words[-1]).name != "journalctl":
        return None
    cmd = [*words[:-1], str(Path(words[-1]).with_name("systemctl")), "show", "-p", "LoadState", "--value", unit]
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = proc.stdout.decode(errors="replace").strip()
    return state if proc.returncode == 0 and state else None


# ---------------------------------------------------------------------------------------------
# Assembly
# ---------------------------------------------------------------------------------------------


def _to_num(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    t = text.strip().strip("'\"")
    if t in ("None", "null", ""):
        return None
    if t in ("True", "False"):
        return t == "True"
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


_ARG_ALIASES = {"tensor_parallel_size": "tp_size", "tp": "tp_size", "cuda_graph_max_bs_decode": "cuda_graph_max_bs", "model": "model_path"}
_SETTING_KEYS = (
    "mem_fraction_static", "max_running_requests", "chunked_prefill_size", "max_prefill_tokens", "context_length",
    "cuda_graph_max_bs", "page_size", "tp_size", "dp_size", "kv_cache_dtype", "speculative_algorithm",
    "speculative_num_draft_tokens", "max_total_tokens", "enable_hierarchical_cache", "hicache_size", "hicache_ratio",
    "disable_radix_cache", "model_path",
)


def _settings(report: LogReport | None, info: ServerInfo | None, fill_ins: dict[str, Any], warnings: list[str]) -> dict[str, Setting]:
    """Settings the input states (a live server's answer over the log's), then ``fill_ins`` (CLI
    values, source ``cli``) for keys the input does not state; a CLI value that differs from a
    stated one is not used, and ``warnings`` says so."""
    out: dict[str, Setting] = {}
    if report is not None:
        for key, raw in report.server_args.items():
            name = _ARG_ALIASES.get(key, key)
            if name in _SETTING_KEYS and _to_num(raw) is not None:
                out[name] = Setting(value=_to_num(raw), source="log:server_args")
    if info is not None:
        for name in _SETTING_KEYS:
            value = getattr(info, name, None)
            if value is not None:
                out[name] = Setting(value=value, source="server_info")
    for key, value in fill_ins.items():
        stated = out.get(key)
        if value is None:
            continue
        if stated is None:
            out[key] = Setting(value=value, source="cli")
        elif stated.value != value:
            flag = "--" + key.replace("_", "-")
            warnings.append(f"{flag} {value:g} is not used: the input states {key}={stated.value} ({stated.source}), "
                            "which is what the server ran with")
    return out


def _check_fraction(mem_fraction_static: float | None) -> None:
    """Reject a ``--mem-fraction-static`` outside SGLang's (0, 1) (§1.2: a share of the baseline).

    Raises:
        ConfigError: The value is ≤ 0, ≥ 1 or not a number.
    """
    if mem_fraction_static is not None and not 0.0 < mem_fraction_static < 1.0:
        raise ConfigError(f"--mem-fraction-static {mem_fraction_static:g} is outside (0, 1)",
                          hint="pass the server's fraction, e.g. --mem-fraction-static 0.88 (a share of the free GPU memory, §1.2)")


def _val(settings: dict[str, Setting], key: str) -> Any:
    s = settings.get(key)
    return s.value if s is not None else None


def explain(
    report: LogReport | None = None,
    *,
    info: ServerInfo | None = None,
    model: ModelArch | None = None,
    sources: Sequence[str] = (),
    mem_fraction_static: float | None = None,
    fractions: Sequence[float] | None = None,
    metrics: Mapping[str, float] | None = None,
    gpu: str | None = None,
    structural: Sequence[PricedLever] = (),
) -> Explanation:
    """Explain one server start.

    Args:
        report: A parsed log (file, journal), if any.
        info: ``/get_server_info`` of the running server, if any.
        model: The model's architecture, for the KV cell size (otherwise derived from the logged
            KV size / token count).
        sources: Descriptions of the inputs, for the output.
        mem_fraction_static: The fraction, used only when neither the log nor the server states it
            (a stated value wins; a different one given here is reported in ``warnings``); in (0, 1).
        fractions: Fractions to predict (default: around the current one).
        metrics: A ``/metrics`` scrape of the running server (:meth:`SGLangClient.metrics`), if any.
        gpu: The GPU's name or architecture (``RTX PRO 6000``, ``sm120``), for the ladder's
            feasibility cells (unknown without it).
        structural: The structural levers' declarations for the ladder (:data:`tuner.knobs.LEVERS`,
            handed in by ``tuner explain``'s command; empty: no lever's cell or rule is asked).

    Returns:
        The :class:`Explanation`.

    Raises:
        LogError: Neither a log nor server info was given.
        ConfigError: ``mem_fraction_static`` is outside (0, 1).
    """
    if report is None and info is None:
        raise LogError("nothing to explain", hint="pass --log FILE, --unit NAME or --url URL")
    _check_fraction(mem_fraction_static)
    findings: list[str] = []
    warnings = list(report.warnings) if report else []
    settings = _settings(report, info, {"mem_fraction_static": mem_fraction_static}, warnings)
    prim = report.primary() if report else None
    tokens = (report.max_total_num_tokens if report else None) or (info.max_total_num_tokens if info else None)
    _scheduler_settings(settings, report, info, model)
    ctx, ctx_bound = _context(settings, info, tokens)
    _derived_max_running_requests(settings, report, info, tokens, ctx_bound)
    mrr = _val(settings, "effective_max_running_requests")
    tp = _val(settings, "tp_size") or (len(report.ranks) if report and len(report.ranks) > 1 else None)
    page = _val(settings, "page_size") or 1
    mfs = _fraction(settings, report, prim, findings, warnings)
    cell, cell_source = _cell(settings, report, info, model, prim, tokens, tp, page, warnings, gpu)
    kv_model = _capacity_model(settings, report, info, prim, mfs, cell, tokens, findings, warnings)

    waterfall = _waterfall(report, info, kv_model, tokens, mrr, ctx, mfs)
    capacity = _capacity(tokens, mrr, ctx)
    predictions = _predictions(kv_model, mfs, mrr, ctx, page, _val(settings, "cuda_graph_max_bs"), fractions,
                               failed=report.failure if report else None)
    traps = _traps(_TrapInput(report=report, info=info, m=kv_model, settings=settings, tokens=tokens, mrr=mrr, ctx=ctx, mfs=mfs, tp=tp, prim=prim))
    traps += _metric_traps(metrics or {})
    traps.sort(key=lambda t: _TRAP_ORDER.get(t.id, 50))
    findings += _findings(kv_model, capacity, mfs, traps)
    findings += _live_findings(metrics or {})
    if report is not None and report.weights_committed_after_capture and prim is not None and prim.weight_gib is None:
        warnings.append("weights were loaded in 0.5.23's overlap mode ('Load weight end. Committed real weights ...'): the log "
                        "prints no weight memory, so W and the baseline split are unknown")
    failure = report.failure if report else None
    diagnosis = report.diagnosis if report else None
    levers = rank_levers(diagnosis, traps)
    return Explanation(
        sources=list(sources), sglang_version=info.version if info else None, log_format=report.version_format if report else None,
        state=_state(report, info), failure=failure, diagnosis=diagnosis, lever=levers[0] if levers else None, levers=levers, settings=settings,
        waterfall=waterfall, capacity=capacity, model=_model_out(kv_model, cell, cell_source, page), predictions=predictions, traps=traps,
        findings=findings, warnings=warnings, logged=dict(report.logged) if report else {}, oom=report.oom if report else None,
        kv_shortfall=report.kv_shortfall if report else None, retractions=_retraction_summary(report),
        ladder=_ladder(report, info, model, kv_model, settings, mfs, gpu, structural),
    )


def _arg(report: LogReport | None, info: ServerInfo | None, *names: str) -> Any:
    """A launch argument as the server's info or the logged ``server_args`` state it."""
    for name in names:
        if info is not None and info.raw.get(name) is not None:
            return info.raw[name]
        if report is not None and name in report.server_args:
            value = _to_num(report.server_args[name])
            return None if value in ("None", "none") else value
    return None


def _ladder(report: LogReport | None, info: ServerInfo | None, model: ModelArch | None, kv_model: KVCapacityModel | None,
            settings: dict[str, Setting], mfs: Any, gpu: str | None, levers: Sequence[PricedLever] = ()) -> list[Rung]:
    """The ladder from the calibrated model and the launch arguments (empty when uncalibrated)."""
    if kv_model is None or mfs is None or (report is not None and report.failure is not None):
        return []
    version = (info.version if info and info.version else None) or (report.version_format if report and report.version_format else "0.5.5")
    tp = int(_val(settings, "tp_size") or 1)
    dp_on = _arg(report, info, "enable_dp_attention") in (True, "True", "true")
    draft = _draft_of(report, report.primary()) if report is not None else None
    backend = _arg(report, info, "attention_backend", "decode_attention_backend")
    flags = {k: _arg(report, info, k) for k in ("kv_cache_dtype", "attention_backend", "speculative_algorithm", "enable_dp_attention", "dcp_size",
                                                "dsa_prefill_backend", "dsa_decode_backend")}
    spec = _val(settings, "speculative_algorithm") or None
    headroom = 0
    if spec and draft_budget(str(version)).headroom and str(spec).upper() != "NGRAM":
        pool = _arg(report, info, "max_running_requests")
        logged = report.scheduler.max_running_requests if report is not None and report.scheduler is not None else None
        if pool is None and logged:  # the scheduler line: max_running_requests // dp per DP rank (tp_worker.py)
            pool = logged * (int(_val(settings, "dp_size") or 1) if dp_on else 1)
        if pool is None:  # SGLang's own default under speculative decoding (48), never the non-speculative estimate
            pool = speculative_max_running_requests(str(spec))
        steps, topk = _arg(report, info, "speculative_num_steps"), _arg(report, info, "speculative_eagle_topk")
        draft_tokens = _arg(report, info, "speculative_num_draft_tokens")
        if None not in (pool, steps, topk, draft_tokens):
            headroom = int(pool) * int(steps) * int(topk) + int(pool) * int(draft_tokens) + 100
    if headroom:  # the logged count holds 0.5.5's headroom rows; the profiled budget does not (§1.5)
        kv_model = kv_model.model_copy(update={"static_gib": kv_model.static_gib + headroom * kv_model.cell_bytes / GIB})
    base = LadderBase(
        memory=kv_model, model=model, version=str(version), tp=tp, dp=int(_val(settings, "dp_size") or 1) if dp_on else 1,
        mem_fraction_static=float(mfs), kv_cache_dtype=str(_val(settings, "kv_cache_dtype") or "auto"),
        speculative_algorithm=_val(settings, "speculative_algorithm") or None, attention_backend=str(backend) if backend else None,
        context_len=_val(settings, "context_len"), page_size=int(_val(settings, "page_size") or 1), gpu=gpu,
        draft_weight_gib=draft.weight_gib if draft else None, draft_kv_gib=draft.kv_pool_gib if draft else None,
        draft_graph_gib=draft.graph_gib if draft else None, spec_headroom_tokens=headroom,
        graphs_captured=_graphs_captured(report),
        flags={k: v for k, v in flags.items() if v is not None}, levers=tuple(levers),
    )
    return ladder(base)


def _graphs_captured(report: LogReport | None) -> bool | None:
    """Whether the logged start captured CUDA graphs (a ``Capture cuda graph end`` line, §4.2 item
    7); ``None`` without a log."""
    prim = report.primary() if report is not None else None
    return None if prim is None else prim.graph_gib is not None


def _scheduler_settings(settings: dict[str, Setting], report: LogReport | None, info: ServerInfo | None, model: ModelArch | None) -> None:
    """What the scheduler line states wins (§4.2 item 8: the effective values), then the server's
    info, the launch flags, the model config; the captured decode sizes from the capture lines."""
    sched = report.scheduler if report else None
    if sched and sched.max_running_requests is not None:
        settings["effective_max_running_requests"] = Setting(value=sched.max_running_requests, source="log:scheduler")
    elif info and info.effective_max_running_requests is not None:
        settings["effective_max_running_requests"] = Setting(value=info.effective_max_running_requests, source="server_info")
    if sched and sched.context_len is not None:
        settings["context_len"] = Setting(value=sched.context_len, source="log:scheduler")
    elif _val(settings, "context_length") is not None:
        settings["context_len"] = Setting(value=_val(settings, "context_length"), source=settings["context_length"].source)
    elif model and model.max_position_embeddings:
        settings["context_len"] = Setting(value=model.max_position_embeddings, source="model_config")
    for key in ("chunked_prefill_size", "max_prefill_tokens"):
        if sched and getattr(sched, key) is not None:
            settings[key] = Setting(value=getattr(sched, key), source="log:scheduler")
    if report is not None and report.cuda_graph_max_bs is not None:
        settings["cuda_graph_max_bs"] = Setting(value=report.cuda_graph_max_bs, source="log:capture bs list")


def _context(settings: dict[str, Setting], info: ServerInfo | None, tokens: int | None) -> tuple[int | None, int | None]:
    """``(context_len, the context that bounds the §2.3 estimate)``. Without a stated context, a
    server's ``max_req_input_len = min(context_len − 1, tokens − 1) − 5`` (§1.4) gives either the
    context itself or context ≥ the pool, and any such context gives the same default
    max_running_requests (the §2.3 estimate is clamped to 2048)."""
    ctx = _val(settings, "context_len")
    if ctx is not None or not (tokens and tokens > 0 and info and info.max_req_input_len):
        return ctx, ctx
    implied = context_len_from_max_req_input_len(int(tokens), info.max_req_input_len)
    if implied is None:
        return None, int(tokens)
    settings["context_len"] = Setting(value=implied, source="derived from server_info max_req_input_len (§1.4)")
    return implied, implied


def _derived_max_running_requests(settings: dict[str, Setting], report: LogReport | None, info: ServerInfo | None,
                                  tokens: int | None, ctx_bound: int | None) -> None:
    """The effective max_running_requests by SGLang's default rule (§2.3) when no input states it."""
    if "effective_max_running_requests" in settings or not (tokens and tokens > 0 and ctx_bound):
        return
    version = (info.version if info and info.version else None) or (report.version_format if report else None) or "0.5.5"
    settings["effective_max_running_requests"] = Setting(
        value=effective_max_running_requests(int(tokens), int(ctx_bound), requested=_val(settings, "max_running_requests"), version=version,
                                             speculative_algorithm=_val(settings, "speculative_algorithm")),
        source="derived (§2.3)",
    )


def _fraction(settings: dict[str, Setting], report: LogReport | None, prim: Any, findings: list[str], warnings: list[str]) -> Any:
    """The fraction: stated, else derived as (W + KV) / B (§1.8 step 2 reversed); a CLI value that
    differs from the log's arithmetic by more than 0.02 is kept and warned about."""
    mfs = _val(settings, "mem_fraction_static")
    baseline = min((r.load_begin_avail_gib for r in report.ranks.values() if r.load_begin_avail_gib is not None), default=None) if report else None
    if not ((mfs is None or settings["mem_fraction_static"].source == "cli") and prim and baseline
            and prim.weight_gib is not None and prim.kv_pool_gib is not None):
        return mfs
    derived = round((prim.weight_gib + prim.kv_pool_gib) / baseline, 3)
    why = (f"(weights {prim.weight_gib:.2f} + KV {prim.kv_pool_gib:.2f}) / baseline {baseline:.2f} GiB gives ≈{derived:.3f} "
           "(assumes nothing else was allocated before profiling)")
    if mfs is None:
        settings["mem_fraction_static"] = Setting(value=derived, source="derived")
        findings.append(f"mem_fraction_static is not in the input; {why}.")
        return derived
    if abs(float(mfs) - derived) > 0.02:
        warnings.append(f"--mem-fraction-static {float(mfs):g} is used, but the log's {why}; the predictions assume the value you gave")
    return mfs


def _cell(settings: dict[str, Setting], report: LogReport | None, info: ServerInfo | None, model: ModelArch | None, prim: Any,
          tokens: int | None, tp: int | None, page: int, warnings: list[str], gpu: str | None = None) -> tuple[int | None, str | None]:
    """``(KV bytes per token per GPU, source)``: the model config's (§1.3; a DSA model's row per its
    backend and GPU, its indexer × dcp: :func:`~tuner.sglang.levers.dsa_kv_settings`), else the logged
    KV size over ``#tokens + page_size`` (§4.2 item 5), else the server info's; a model config that
    disagrees with the log by more than 2 % is warned about."""
    cell: int | None = None
    cell_source = None
    if model is not None:
        version = info.version if info and info.version else (report.version_format if report and report.version_format else "0.5.5")
        dtype, raw, dcp = str(_val(settings, "kv_cache_dtype") or "auto"), False, int(_arg(report, info, "dcp_size") or 1)
        if attention_type(model) == "dsa":
            dtype, raw = dsa_kv_settings(version=version, gpu=gpu, kv_cache_dtype=dtype, dcp=dcp,
                                         prefill_backend=_arg(report, info, "dsa_prefill_backend"),
                                         decode_backend=_arg(report, info, "dsa_decode_backend"))
        cell = cell_size_bytes(model, tp=int(tp or 1), kv_cache_dtype=dtype, version=version,
                               speculative_algorithm=_val(settings, "speculative_algorithm"), dsa_raw=raw)
        cell = dcp_per_rank_cell_bytes(cell, model, dcp)
        cell_source = "model_config"
    if prim and tokens and prim.kv_pool_gib is not None:
        logged_cell = prim.kv_pool_gib * GIB / (tokens + page)
        if cell is None:
            return int(round(logged_cell)), "log:KV size / #tokens"
        if abs(logged_cell - cell) / cell > 0.02:
            warnings.append(f"the KV cell from the model config ({cell} B/token) differs from the logged one ({logged_cell:.0f} B/token); check --model-config and --tp")
    elif info and tokens and info.kvcache_gib and cell is None:
        return int(round(info.kvcache_gib * GIB / (tokens + page))), "server_info:kvcache / token_capacity"
    return cell, cell_source


def _capacity_model(settings: dict[str, Setting], report: LogReport | None, info: ServerInfo | None, prim: Any, mfs: Any, cell: int | None,
                    tokens: int | None, findings: list[str], warnings: list[str]) -> KVCapacityModel | None:
    """The memory model calibrated on the log (:meth:`KVCapacityModel.from_report`), else on the
    server info (baseline = (weight + kvcache) / mem_fraction_static)."""
    cap = _val(settings, "max_total_tokens")
    if mfs is not None and cell and report is not None and prim is not None:
        try:
            return KVCapacityModel.from_report(report, cell, float(mfs), max_total_tokens=cap)
        except LogError as err:
            warnings.append(f"memory model not calibrated: {err.message}")
    if info is None or not (mfs and cell and info.weight_gib is not None and info.kvcache_gib is not None and tokens):
        return None
    base = (info.weight_gib + info.kvcache_gib) / float(mfs)
    findings.append(f"baseline {base:.2f} GiB derived from server info as (weight + kvcache) / mem_fraction_static (no log given).")
    return KVCapacityModel(baseline_gib=base, static_gib=float(mfs) * base - tokens * cell / GIB, weight_gib=info.weight_gib,
                           cell_bytes=cell, source="server_info", observed_mem_fraction_static=float(mfs), observed_tokens=tokens,
                           observed_free_after_graphs_gib=info.startup_available_gib, observed_graph_gib=info.graph_gib, max_total_tokens=cap)


def _live_findings(metrics: Mapping[str, float]) -> list[str]:
    """The running server's batch as ``/metrics`` states it (§5.5)."""
    live = {k: metrics[k] for k in ("sglang:num_running_reqs", "sglang:token_usage", "sglang:num_queue_reqs") if k in metrics}
    return ["live: " + ", ".join(f"{k.split(':', 1)[1]}={v:g}" for k, v in live.items()) + " (from /metrics)."] if live else []


def _state(report: LogReport | None, info: ServerInfo | None) -> Literal["ready", "failed", "starting", "unknown"]:
    """``failed`` with a failure; ``ready`` with a ready line, batch or retraction lines, or a live
    server; ``starting`` with startup lines only; else ``unknown``."""
    if report is not None and report.failure is not None:
        return "failed"
    if info is not None or (report and (report.ready or report.batch_summary.prefill_lines or report.batch_summary.decode_lines or report.retractions)):
        return "ready"
    return "starting" if report and report.ranks else "unknown"


def _model_out(kv_model: KVCapacityModel | None, cell: int | None, cell_source: str | None, page: int) -> dict[str, Any] | None:
    """The ``model`` block of the explanation: the calibrated model's numbers, else the cell alone."""
    if kv_model is not None:
        return {
            "source": kv_model.source, "baseline_gib": round(kv_model.baseline_gib, 3), "static_gib": round(kv_model.static_gib, 3),
            "weight_gib": kv_model.weight_gib, "cell_bytes": kv_model.cell_bytes, "cell_source": cell_source,
            "tokens_per_hundredth": round(kv_model.tokens_per_hundredth()), "gib_per_hundredth": round(kv_model.baseline_gib / 100, 3),
            "min_fraction": round(kv_model.min_fraction(page_size=page), 4),
        }
    return {"source": None, "cell_bytes": cell, "cell_source": cell_source} if cell else None


_TRAP_ORDER = {"transformers_fallback": -1, "failure": 0, "allocator_retry": 1, "tight_headroom": 4, "retractions": 1, "kv_pool_nearly_full": 2, "context_exceeds_pool": 3, "after_pool_allocation": 4,
               "cuda_graph_bs_below_max_running_requests": 5, "idle_reserve": 6}
"""Which trap's lever comes first when there is no failure (most binding first); unlisted traps after."""


_OUTRANKS_DIAGNOSIS = frozenset({"transformers_fallback"})
"""Traps whose lever comes before the diagnosis's: a model run through the Transformers fallback
has memory and kernels that are not SGLang's, so no memory knob read from SGLang's rules is sure."""


def _pick_lever(diagnosis: Failure | None, traps: Sequence[Trap]) -> Lever | None:
    """The diagnosis's lever, unless it names no knob (a crash) and a trap does; else the first
    trap (in :data:`_TRAP_ORDER`) with a lever of severity warning or error."""
    if diagnosis is not None and diagnosis.failure_class is FailureClass.CRASH and non_memory_fatal(diagnosis.evidence):
        return next((t.lever for t in traps if t.id == "failure"), LEVERS[FailureClass.CRASH])  # no memory knob helps
    first = None
    outranking = next((t.lever for t in traps if t.id in _OUTRANKS_DIAGNOSIS and t.lever is not None), None)
    if outranking is not None:
        return outranking
    for t in traps:
        if t.lever is None:
            continue
        if t.id in ("failure", "retractions") and diagnosis is not None:
            if t.lever.knob is not None:
                return t.lever
            first = first or t.lever
            continue
        if t.severity != "info":
            return t.lever
    if first is not None:
        return first
    return LEVERS[diagnosis.failure_class] if diagnosis is not None else None


def _retraction_summary(report: LogReport | None) -> RetractionSummary | None:
    if report is None or not report.retractions:
        return None
    first = report.retractions[0]
    return RetractionSummary(lines=len(report.retractions), retracted_reqs=sum(r.retracted_reqs for r in report.retractions),
                             ranks=len({r.rank or "" for r in report.retractions}), running_req_before=first.running_req_before,
                             num_token_before=first.num_token_before, token_usage_before=first.token_usage_before)


def rank_levers(diagnosis: Failure | None, traps: Sequence[Trap]) -> list[Lever]:
    """Every lever of ``traps``, ranked: :func:`_pick_lever`'s first (what the diagnosis asks), then
    that trap's other knobs, then every other trap's lever and its other knobs in trap order; one
    entry per (knob, direction).

    Args:
        diagnosis: The failure or soft diagnosis, if any.
        traps: The traps, already in :data:`_TRAP_ORDER`.

    Returns:
        The levers, best first (empty when nothing applies).
    """
    first = _pick_lever(diagnosis, traps)
    ordered: list[Lever] = [first] if first is not None else []
    owner = next((t for t in traps if t.lever is first), None)
    if owner is not None:
        ordered += owner.also
    for t in traps:
        if t is not owner and t.lever is not None and t.severity != "info":
            ordered += [t.lever, *t.also]
    seen: set[tuple[str | None, str]] = set()
    out = []
    for lever in ordered:
        key = (lever.knob, lever.direction)
        if key not in seen:
            seen.add(key)
            out.append(lever)
    return out


RESIDUE_ROUNDING_GIB = 0.02
"""A derived residue (``other_static``, ``other_reserve``) within this of zero is the rounding of
the two-decimal GiB figures it is computed from (§4.2), not memory: it gets no waterfall row."""


class _WaterfallInput(NamedTuple):
    report: LogReport | None
    info: ServerInfo | None
    m: KVCapacityModel | None
    tokens: int | None
    mrr: int | None
    ctx: int | None
    mfs: float | None
    prim: Any
    draft: Any


def _waterfall(report: LogReport | None, info: ServerInfo | None, m: KVCapacityModel | None, tokens: int | None,
               mrr: int | None, ctx: int | None, mfs: float | None) -> list[WaterfallStep]:
    """Where one GPU's memory went, in startup order (§1.2, §1.6, §4.2): the static budget
    (weights, KV pool, state pools), the ``(1 − mfs)`` reserve and what came out of it, and the
    runtime headroom. GiB = 2^30 bytes; a row the inputs do not give is left out, never 0."""
    prim = report.primary() if report else None
    w = _WaterfallInput(report, info, m, tokens, mrr, ctx, mfs, prim, _draft_of(report, prim))
    return [*_loaded_steps(w), *_budget_steps(w), *_reserve_steps(w), *_draft_steps(w)[0], *_after_reserve_steps(w), *_headroom_steps(w)]


def _weight_gib(w: _WaterfallInput) -> float | None:
    return w.prim.weight_gib if w.prim and w.prim.weight_gib is not None else (w.info.weight_gib if w.info else None)


def _kv_gib(w: _WaterfallInput) -> float | None:
    return w.prim.kv_pool_gib if w.prim and w.prim.kv_pool_gib is not None else (w.info.kvcache_gib if w.info else None)


def _loaded_steps(w: _WaterfallInput) -> list[WaterfallStep]:
    """Baseline, distributed init, weights, KV pool (or the pool's drop of free memory), state pool."""
    steps, prim, m = [], w.prim, w.m
    if m is not None:
        steps.append(WaterfallStep(item="baseline_free", label="free GPU memory at the baseline (B, min over ranks)", gib=round(m.baseline_gib, 2),
                                   source="log:Load weight begin" if m.source == "log" else m.source))
    if prim and prim.baseline_gib is not None:
        steps.append(WaterfallStep(item="distributed_init", label="taken by distributed init (already outside B)", gib=prim.baseline_gib,
                                   source="log:Init torch distributed / Memory baseline"))
    weight, kv = _weight_gib(w), _kv_gib(w)
    if weight is not None:
        steps.append(WaterfallStep(item="weights", label="weights (W)", gib=weight,
                                   source="log:Load weight end" if prim and prim.weight_gib is not None else "server_info"))
    if kv is not None or w.tokens is not None:
        steps.append(WaterfallStep(item="kv_pool", label="KV pool", gib=kv, tokens=w.tokens, note=_kv_note(prim),
                                   source="log:KV Cache is allocated" if prim and prim.kv_pool_gib is not None else "server_info"))
    if prim is not None and prim.kv_pool_gib is None and prim.kv_pool_consumed_gib is not None:
        steps.append(WaterfallStep(item="pool_drop", label="free memory taken by init_memory_pool (KV pool + req_to_token)", gib=prim.kv_pool_consumed_gib,
                                   source="derived: Load weight end − Memory pool end avail mem", note="the log prints no KV size line"))
    if prim is not None and prim.mamba_cache_gib is not None:
        steps.append(WaterfallStep(item="state_pool", label="hybrid state pool (Mamba/GDN conv + ssm state)", gib=prim.mamba_cache_gib,
                                   source="log:Mamba Cache is allocated", note="carved out of the static budget before the KV pool (§1.2)"))
    return steps


def _budget_steps(w: _WaterfallInput) -> list[WaterfallStep]:
    """The draft's KV inside the budget (0.5.16+), the static residue, and the reserve."""
    steps, draft, m, mfs = [], w.draft, w.m, w.mfs
    if draft is not None and draft.kv_pool_gib is not None and w.report is not None and _draft_in_budget(w.report):
        steps.append(WaterfallStep(item="draft_kv_pool", label="draft model's KV pool (inside the profiled budget, 0.5.16+)", gib=round(draft.kv_pool_gib, 2),
                                   tokens=draft.kv_tokens, source="log:KV Cache is allocated (second line)",
                                   note=f"K {draft.k_size_gib} + V {draft.v_size_gib} GiB" if draft.k_size_gib is not None else None))
    if m is None or mfs is None:
        return steps
    weight, kv = _weight_gib(w), _kv_gib(w)
    if weight is not None and kv is not None:
        other = mfs * m.baseline_gib - weight - kv - ((w.prim.mamba_cache_gib if w.prim else None) or 0.0)
        if abs(other) > RESIDUE_ROUNDING_GIB:
            steps.append(WaterfallStep(item="other_static", label="other static (mfs × B − W − KV)", gib=round(other, 2) + 0.0, source="derived",
                                       note="≈0 when nothing else was allocated between baseline and profiling (§8)"))
    steps.append(WaterfallStep(item="reserve", label=f"reserve (1 − {mfs:g}) × B", gib=round(m.reserve_gib(float(mfs)), 2), source="derived",
                               note="everything below comes out of this"))
    return steps


def _reserve_steps(w: _WaterfallInput) -> list[WaterfallStep]:
    """The req_to_token table (§1.6) and the target's CUDA graphs."""
    steps = []
    if w.mrr and w.ctx:
        steps.append(WaterfallStep(item="req_to_token", label=f"req_to_token table ({w.mrr} × ({w.ctx} + 4) × 4 B)",
                                   gib=round(req_to_token_gib(w.mrr, w.ctx), 2), source="derived"))
    if w.prim and w.prim.graph_gib is not None:
        steps.append(WaterfallStep(item="cuda_graphs", label="CUDA graphs (target)", gib=w.prim.graph_gib, source="log:Capture ... end"))
    elif w.info and w.info.graph_gib is not None:
        steps.append(WaterfallStep(item="cuda_graphs", label="CUDA graphs", gib=w.info.graph_gib, source="server_info"))
    return steps


def _draft_steps(w: _WaterfallInput) -> tuple[list[WaterfallStep], float]:
    """``(rows, GiB of the draft in the reserve)``: 0.5.16+ loads the draft before profiling (its
    weights are static, its KV in the target's cell), so only its graphs come out of the reserve;
    earlier its weights, KV and graphs all do (§1.5)."""
    d = w.draft
    if d is None:
        return [], 0.0
    if w.report is not None and _draft_in_budget(w.report):
        if d.graph_gib is None:
            return [], 0.0
        return [WaterfallStep(item="draft_model", label="draft model graphs (its weights are static, its KV is in the pool)",
                              gib=d.graph_gib, source="log:Capture draft ... end",
                              note=f"draft weights {d.weight_gib} GiB counted before profiling" if d.weight_gib is not None else None)], 0.0
    in_reserve = sum(x for x in (d.weight_gib, d.kv_pool_gib) if x is not None)
    parts = [f"{name} {v:.2f} GiB" for name, v in (("weights", d.weight_gib), ("KV", d.kv_pool_gib), ("graphs", d.graph_gib)) if v is not None]
    return [WaterfallStep(item="draft_model", label="draft model (weights + KV + graphs)", gib=round(in_reserve + (d.graph_gib or 0.0), 2),
                          tokens=d.kv_tokens, source="log:draft Load weight/KV/Capture", note=", ".join(parts) + " (the parts the log prints)")], in_reserve


def _after_reserve_steps(w: _WaterfallInput) -> list[WaterfallStep]:
    """The rest of the reserve's use (derived) and what was allocated between the pool and capture."""
    steps = []
    in_reserve = _draft_steps(w)[1]
    m = w.m
    if m is not None and m.other_reserve_gib is not None and abs(m.other_reserve_gib - in_reserve) > RESIDUE_ROUNDING_GIB:
        steps.append(WaterfallStep(item="other_reserve", label="other reserve use (workspace, allocator)",
                                   gib=round(m.other_reserve_gib - in_reserve, 2) + 0.0, source="derived"))
    after_pool = _after_pool_drop(w.report, w.prim)
    if after_pool is not None:
        gib, src, note = after_pool
        steps.append(WaterfallStep(item="after_pool_allocation", label="taken after the KV pool, before graph capture (attention workspace, buffers)",
                                   gib=gib, source=src, note=note))
    return steps


def _headroom_steps(w: _WaterfallInput) -> list[WaterfallStep]:
    """The runtime headroom: ``free_after_graphs`` (graphs captured) or ``free_at_start`` (none in the
    log), from the scheduler line, the last capture end line or the server info; while capture is
    still pending at the log's end, ``free_so_far`` instead (not the runtime headroom)."""
    report, prim, info = w.report, w.prim, w.info
    free = report.scheduler.available_gpu_mem_gib if report and report.scheduler else None
    free_src = "log:scheduler available_gpu_mem"
    pending = report is not None and report.scheduler is None and not report.ready and report.last_phase == "capture"
    if free is None and prim is not None and not pending:
        draft_end = w.draft.graph_end_avail_gib if w.draft else None
        free = draft_end if draft_end is not None else prim.graph_end_avail_gib  # the last capture of the start
        free_src = "log:Capture ... end avail mem"
    if free is None and info and info.startup_available_gib is not None:
        free, free_src = info.startup_available_gib, "server_info:startup_available"
    if free is not None:
        if _captured_graphs(report, info):
            return [WaterfallStep(item="free_after_graphs", label="free after graphs (runtime headroom)", gib=free, source=free_src)]
        return [WaterfallStep(item="free_at_start", label="free when the scheduler started (runtime headroom; the log shows no CUDA-graph capture)",
                              gib=free, source=free_src)]
    if not pending or report is None:
        return []
    last, src = report.capture_progress_avail_gib, "log:Capturing batches avail_mem"
    if last is None and prim is not None:
        last = prim.graph_end_avail_gib if prim.graph_end_avail_gib is not None else prim.graph_begin_avail_gib
        src = "log:Capture ... avail mem"
    if last is None:
        return []
    return [WaterfallStep(item="free_so_far", label="free at the last capture line (capture still pending: not the runtime headroom)",
                          gib=last, source=src, note="the log ends before the scheduler line; later graphs and buffers come out of this")]


def _captured_graphs(report: LogReport | None, info: ServerInfo | None) -> bool:
    """The server captured CUDA graphs: some capture line in the log (§4.2 item 7), or a live
    server's graph memory above 0. A server run with ``--disable-cuda-graph`` (or a log cut before
    capture) has none, so its headroom is not "after graphs"."""
    if report is not None:
        for r in report.ranks.values():
            for d in (r, r.draft):
                if d is not None and (d.graph_gib is not None or d.graph_begin_avail_gib is not None or d.graph_bs):
                    return True
        if report.capture_progress_avail_gib is not None:
            return True
    return bool(info is not None and info.graph_gib)


HEADROOM_ITEMS = ("free_after_graphs", "free_at_start")
"""The waterfall rows that are the runtime headroom (with and without CUDA graphs)."""


def _kv_note(prim: Any) -> str | None:
    """How the KV pool row is made up: K + V, or a hybrid SWA pool's total (§4.2 item 5)."""
    if prim is None:
        return None
    if prim.swa_pool_gib is not None:
        return (f"SWAKVPool total of the sliding-window part ({prim.swa_tokens:,} tokens) and the full-attention part; "
                "its KV lines are the parts, not added again")
    return f"K {prim.k_size_gib} + V {prim.v_size_gib} GiB" if prim.k_size_gib is not None else None


def _draft_of(report: LogReport | None, prim: Any) -> Any:
    """The draft model's lines: the binding rank's, else any rank's (each rank prints its own)."""
    if prim is not None and prim.draft is not None:
        return prim.draft
    if report is None:
        return None
    return next((r.draft for r in report.ranks.values() if r.draft is not None), None)


def _draft_in_budget(report: LogReport) -> bool:
    """0.5.16+ sizes the draft's KV inside the profiled budget (the target's cell grows, §1.5); before,
    the draft's weights and KV come out of the reserve."""
    return report.version_format in ("0.5.16", "0.5.23")


AFTER_POOL_GIB = 2.0
"""A drop of free memory between ``Memory pool end`` and the first graph-capture line above which
something large was allocated outside the budget (attention workspace such as AITER's, §1.6)."""


def _after_pool_drop(report: LogReport | None, prim: Any) -> tuple[float, str, str] | None:
    """``(GiB, source, note)`` of what was allocated after the (last) KV pool and before graph
    capture: ``Memory pool end`` avail minus the first capture line's avail, when ≥ 1 GiB."""
    if report is None or prim is None:
        return None
    draft = prim.draft
    pool_end = draft.memory_pool_end_avail_gib if draft is not None and draft.memory_pool_end_avail_gib is not None else prim.memory_pool_end_avail_gib
    if pool_end is None:
        return None
    begin, src, note = prim.graph_begin_avail_gib, "log:Memory pool end − Capture ... begin avail mem", "nothing of graphs yet"
    if begin is None and report.capture_progress_avail_gib is not None:
        begin, src = report.capture_progress_avail_gib, "log:Memory pool end − Capturing batches avail_mem"
        note = "includes the graphs captured so far"
    if begin is None or pool_end - begin < 1.0:
        return None
    return round(pool_end - begin, 2), src, note


def _capacity(tokens: int | None, mrr: int | None, ctx: int | None) -> Capacity:
    if not tokens or tokens <= 0:
        return Capacity(max_total_num_tokens=tokens, effective_max_running_requests=mrr, context_len=ctx, max_req_input_len=None,
                        kv_bound_above_tokens=None, limit="unknown", statement="no KV pool size in the input")
    # A request longer than the context length is rejected, never resident (§1.4): no row for it.
    lengths = sorted({n for n in (1024, 4096, 8192, 32768, ctx) if n and (not ctx or n <= ctx)})
    fits = []
    for n in lengths:
        by_kv = tokens // n
        if mrr is not None and mrr < by_kv:
            fits.append(RequestFit(request_tokens=n, resident_requests=mrr, limited_by="max_running_requests"))
        else:
            fits.append(RequestFit(request_tokens=n, resident_requests=by_kv, limited_by="kv_pool"))
    bound = tokens / mrr if mrr else None
    if mrr and bound is not None:
        statement = (f"the KV pool ({tokens:,} tokens, set by mem_fraction_static) limits concurrency for requests longer than "
                     f"{bound:,.0f} tokens; max_running_requests={mrr} binds only for shorter ones")
        limit: Literal["kv_pool", "max_running_requests", "unknown"] = "kv_pool" if bound < 1024 else "max_running_requests"
        if limit == "max_running_requests":
            statement = (f"max_running_requests={mrr} limits concurrency for requests shorter than {bound:,.0f} tokens; "
                         f"longer ones are limited by the KV pool ({tokens:,} tokens)")
    else:
        statement = f"the KV pool holds {tokens:,} tokens (max_running_requests unknown)"
        limit = "kv_pool"
    return Capacity(max_total_num_tokens=tokens, effective_max_running_requests=mrr, context_len=ctx,
                    max_req_input_len=max_req_input_len(tokens, ctx) if ctx else None, kv_bound_above_tokens=bound,
                    limit=limit, statement=statement, fits=fits)


def _predictions(m: KVCapacityModel | None, mfs: float | None, mrr: int | None, ctx: int | None, page: int,
                 graph_bs: int | None, fractions: Sequence[float] | None, failed: Failure | None = None) -> list[Prediction]:
    """Pool and headroom at fractions around ``mfs``. A start that failed from the reserve at
    ``mfs`` (``cuda_graph_oom``, ``startup_oom``) fails at every higher fraction too (§1.6): those
    rows say ``starts: false`` whatever the headroom arithmetic says (it cannot see an allocation
    the log does not print, e.g. an attention workspace)."""
    if m is None or mfs is None:
        return []
    reserve_failed = failed is not None and failed.failure_class in (FailureClass.CUDA_GRAPH_OOM, FailureClass.STARTUP_OOM)
    mfs = float(mfs)
    if fractions is None:
        fractions = [mfs + d for d in (-0.04, -0.02, 0.0, 0.01, 0.02, 0.04, 0.05)]
    base_tokens = m.tokens(mfs, page_size=page)
    out = []
    for f in sorted({round(x, 3) for x in fractions if 0.0 < x < 1.0}):
        t = m.tokens(f, page_size=page)
        free = None
        if m.observed_free_after_graphs_gib is not None and m.observed_mem_fraction_static is not None:
            free = m.observed_free_after_graphs_gib - (f - m.observed_mem_fraction_static) * m.baseline_gib
        elif mrr and ctx:
            free = m.headroom_gib(f, max_running_requests=mrr, context_len=ctx, cuda_graph_max_bs=graph_bs)
        starts = t > 0 and (free is None or free > 0)
        note = None
        if reserve_failed and f >= float(mfs) - 1e-9:
            starts = False
            note = f"the log's start failed at {float(mfs):g} ({failed.failure_class.value}); a higher fraction leaves a smaller reserve"  # type: ignore[union-attr]
        elif t <= 0:
            note = "startup KV OOM: Not enough memory (§4.3)"
        elif free is not None and free <= 0:
            note = "no room for graphs/activations: CUDA-graph or runtime OOM"
        elif free is not None and free < 1.0:
            note = "under 1 GiB headroom: a long prefill is likely to OOM"
        out.append(Prediction(mem_fraction_static=f, max_total_num_tokens=t, delta_tokens=t - base_tokens if base_tokens > 0 else None,
                              kv_pool_gib=round(max(t, 0) * m.cell_bytes / GIB, 2), free_after_graphs_gib=round(free, 2) if free is not None else None,
                              starts=starts, note=note))
    return out


def _prefix_tier_words(report: LogReport, m: KVCapacityModel | None, device_tokens: int | None) -> str:
    """What the host pool adds, in words: a prefix tier of N tokens, not active capacity (§7)."""
    host_tokens = report.host_pool_tokens
    if host_tokens is None and m is not None and m.cell_bytes and report.host_pool_gb is not None:
        host_tokens = int(report.host_pool_gb * 1e9 // m.cell_bytes)
    size = f"of {host_tokens:,} tokens " if host_tokens else ""
    pool = f" of {device_tokens:,} tokens" if device_tokens else ""
    return (f" It adds a host prefix tier {size}(evicted prefixes load back instead of being prefilled again), "
            f"not active capacity: running requests must still fit the device pool{pool} (§7, sglang#11698).")


class _TrapInput(BaseModel):
    """What every trap rule reads: the parsed log, the live server's info, the memory model and the
    settings, with the facts :func:`explain` derived from them."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    report: LogReport | None
    info: ServerInfo | None
    m: KVCapacityModel | None
    settings: dict[str, Setting]
    tokens: int | None
    mrr: int | None
    ctx: int | None
    mfs: float | None
    tp: int | None
    prim: Any


def _failure_rule(c: _TrapInput) -> Trap | None:
    """The failure itself, with its class's lever (§4.3, §4.4)."""
    report, m, mfs = c.report, c.m, c.mfs
    if report is not None and report.failure is not None:
        return (_failure_trap(report.failure, m, report, mfs))
    return None


def _fraction_misread_rule(c: _TrapInput) -> Trap | None:
    """The fraction misread as a share of post-weight memory (§1.2, §1.8 step 4)."""
    m, tokens, mfs, prim = c.m, c.tokens, c.mfs, c.prim
    # The fraction misread as a share of post-weight memory (§1.2, §1.8 step 4).
    if m is not None and mfs is not None and prim is not None and prim.weight_gib is not None and prim.kv_pool_gib is not None:
        # What was left after the weights: the logged 'Load weight end' avail mem where printed, not B − W.
        after = prim.weight_end_avail_gib if prim.weight_end_avail_gib is not None else m.baseline_gib - prim.weight_gib
        wrong = float(mfs) * after
        return (Trap(
            id="fraction_misread", severity="info",
            title="mem_fraction_static covers weights plus KV of the whole baseline, not a share of what is left after the weights",
            detail=(f"{mfs:g} × baseline {m.baseline_gib:.2f} GiB = {float(mfs) * m.baseline_gib:.2f} GiB holds weights {prim.weight_gib:.2f} + "
                    f"KV {prim.kv_pool_gib:.2f} GiB. Read as a share of the {after:.2f} GiB left after weights, KV would be "
                    f"{wrong:.2f} GiB; the log shows {prim.kv_pool_gib:.2f}. Each +0.01 moves {m.baseline_gib / 100:.2f} GiB from "
                    f"the reserve into KV (≈{m.tokens_per_hundredth():,.0f} tokens)."),
            evidence=[f"Load weight begin. avail mem={m.baseline_gib:.2f} GB", f"Load weight end ... mem usage={prim.weight_gib:.2f} GB",
                      f"KV Cache is allocated. #tokens: {tokens}, KV size: {prim.kv_pool_gib:.2f} GB"],
        ))
    return None


def _idle_reserve_rule(c: _TrapInput) -> Trap | None:
    """Headroom after startup above :data:`IDLE_RESERVE_GIB`: KV the reserve could hold (§1.6, §8)."""
    report, info, m, tokens, mrr, ctx, mfs = c.report, c.info, c.m, c.tokens, c.mrr, c.ctx, c.mfs
    step = next((s for s in _waterfall(report, info, m, tokens, mrr, ctx, mfs) if s.item in HEADROOM_ITEMS), None)
    free = step.gib if step is not None else None
    if free is not None and free >= IDLE_RESERVE_GIB and m is not None:
        hundredths = int((free - 1.0) / (m.baseline_gib / 100))
        after = "after CUDA graphs" if step is not None and step.item == "free_after_graphs" else "once started (no CUDA graphs captured)"
        return (Trap(
            id="idle_reserve", severity="warning",
            title=f"about {free:.1f} GiB per GPU sits idle {after}",
            detail=(f"{free:.2f} GiB is free {after}; only activations use it. Keeping ~1 GiB, +{hundredths / 100:.2f} of fraction "
                    f"would add ≈{hundredths * m.tokens_per_hundredth():,.0f} tokens; the safe ceiling is the activation peak of the "
                    "largest prefill chunk, found under a stress load (tuner run)."),
            evidence=[f"available_gpu_mem={free:.2f} GB"], fix="raise --mem-fraction-static step by step under peak-prefill load (tuner run does this)",
            lever=Lever(knob="mem_fraction_static", direction="raise",
                        why=f"{free:.2f} GiB sits idle {after}; each +0.01 turns {m.baseline_gib / 100:.2f} GiB of it into "
                            f"≈{m.tokens_per_hundredth():,.0f} KV tokens (raise under peak-prefill load, keeping the activation peak)"),
        ))
    return None


def _graph_bs_rule(c: _TrapInput) -> Trap | None:
    """Decode graphs captured below max_running_requests (§2.1, case-21)."""
    report, settings, tokens, mrr = c.report, c.settings, c.tokens, c.mrr
    graph_bs = _val(settings, "cuda_graph_max_bs")
    if graph_bs and mrr and graph_bs < mrr:
        s = report.batch_summary if report else None
        ev = [f"captured decode batch sizes up to {graph_bs} ({settings['cuda_graph_max_bs'].source})", f"max_running_requests={mrr}"]
        reached = None
        if s and s.decode_lines_without_cuda_graph:
            ev.append(f"{s.decode_lines_without_cuda_graph} decode lines ran without CUDA graph (up to {s.max_running_req_without_cuda_graph} running)")
            reached = True
        elif s and s.decode_lines and s.max_running_req is not None:
            reached = s.max_running_req > graph_bs
            ev.append(f"the logged decode batches reached {s.max_running_req} running requests")
        note = " The logged batches stayed below it so far." if reached is False else ""
        if reached is None and tokens and tokens // _SHORT_REQUEST_TOKENS <= graph_bs:
            reached = False  # the pool cannot even hold more than graph_bs short requests
            note = f" The KV pool holds at most {tokens // _SHORT_REQUEST_TOKENS} requests of {_SHORT_REQUEST_TOKENS:,} tokens, so it binds first for such requests."
            ev.append(f"max_total_num_tokens={tokens}")
        return (Trap(
            id="cuda_graph_bs_below_max_running_requests", severity="info" if reached is False else "warning",
            title=f"CUDA graphs cover decode batches up to {graph_bs}, but up to {mrr} requests are admitted",
            detail="Decode batches above the largest captured size run eagerly and slower, so the batch grows and stays large (case-21)." + note,
            evidence=ev, fix="raise --cuda-graph-max-bs (0.5.23: --cuda-graph-max-bs-decode); graphs for 128 cost ~0.15 GB on a small model",
            lever=Lever(knob="cuda_graph_max_bs", direction="raise",
                        why=f"decode batches above {graph_bs} run without CUDA graphs while up to {mrr} requests are admitted (slow, and the batch stays large)"),
        ))
    return None


def _hicache_rule(c: _TrapInput) -> Trap | None:
    """The hierarchical cache's host pool is per rank (§7, case-16)."""
    report, m, tokens, tp = c.report, c.m, c.tokens, c.tp
    if report is not None and report.host_pool_gb is not None:
        ranks = report.host_pool_ranks
        idx = [int(r.split("TP")[-1]) for r in ranks if "TP" in r and r.split("TP")[-1].isdigit()]
        n = max(int(tp or 1), len(ranks), (max(idx) + 1) if idx else 1)
        return (Trap(
            id="hicache_per_rank", severity="warning" if n > 1 else "info",
            title=f"the hierarchical cache's host pool is per rank: {report.host_pool_gb:g} GB × {n} ranks = {report.host_pool_gb * n:g} GB of pinned host RAM",
            detail="--hicache-size (decimal GB) and --hicache-ratio size each TP rank's own host pool; it must fit psutil available − 10 GiB (§7, case-16)."
                   + _prefix_tier_words(report, m, tokens),
            evidence=[f"Allocating {report.host_pool_gb:.2f} GB host memory ({', '.join(r or 'no rank' for r in ranks)})"],
            fix="size --hicache-size as (host RAM budget) / tp",
            lever=Lever(knob="hicache_size", direction="lower",
                        why=f"each of the {n} ranks pins its own {report.host_pool_gb:g} GB host pool: size it as (host RAM budget) / {n}"),
        ))
    return None


def _speculative_rule(c: _TrapInput) -> Trap | None:
    """Speculative decoding resets max_running_requests to 48 (§1.5)."""
    report, settings, mrr = c.report, c.settings, c.mrr
    spec = _val(settings, "speculative_algorithm")
    if (report is not None and report.max_running_requests_reset_for_speculative) or (spec and mrr == 48 and _val(settings, "max_running_requests") in (None, 48)):
        return (Trap(
            id="speculative_max_running_requests_48", severity="warning",
            title="speculative decoding reset max_running_requests to 48",
            detail="With --speculative-algorithm and no --max-running-requests, SGLang admits at most 48 requests (§1.5), whatever the KV pool holds.",
            evidence=["Max running requests is reset to 48 for speculative decoding" if report and report.max_running_requests_reset_for_speculative else f"speculative_algorithm={spec}, max_running_requests=48"],
            fix="set --max-running-requests explicitly",
            lever=Lever(knob="max_running_requests", direction="set", why="speculative decoding without --max-running-requests admits at most 48 requests (§1.5)"),
        ))
    return None


DRAFT_UNDER_BUDGET_GIB = 0.05
"""A draft pool larger than its share of the profiled budget by more than this is reported (GiB)."""


def _draft_under_budget_rule(c: _TrapInput) -> Trap | None:
    """0.5.16+ budgets the draft's KV as the target's cell × (1 + draft_layers / target_layers)
    (``DefaultPoolConfigurator``, ``pool_configurator.py``: it "assumes the draft shares the target's
    per-layer KV size", §1.5). A draft whose own per-layer KV is larger (an MHA draft on an MLA
    target) allocates more than that share, and the excess comes out of the ``(1 − mfs)`` reserve.

    From the log alone: the draft's share is what the budget left after the target's weights, the
    draft's weights and the target's KV (``mfs × B − W − W_draft − KV``); the under-budget is the
    draft pool (its ``KV Cache is allocated`` line) minus that share.
    """
    report, m, mfs, prim = c.report, c.m, c.mfs, c.prim
    if report is None or m is None or mfs is None or prim is None or not _draft_in_budget(report):
        return None
    draft = _draft_of(report, prim)
    weight, kv = prim.weight_gib, prim.kv_pool_gib
    if draft is None or draft.kv_pool_gib is None or weight is None or kv is None:
        return None
    share = mfs * m.baseline_gib - weight - (draft.weight_gib or 0.0) - kv
    under = draft.kv_pool_gib - max(share, 0.0)
    if under <= DRAFT_UNDER_BUDGET_GIB:
        return None
    geometry = "an MHA draft (K/V halves)" if draft.k_size_gib is not None else "the draft"
    target = "an MLA target" if prim.k_size_gib is None else "the target"
    return Trap(
        id="draft_kv_under_budget", severity="warning",
        title=f"the draft's KV pool takes {under:.2f} GiB of runtime reserve that the fraction does not show",
        detail=(f"SGLang 0.5.16+ budgets the draft's KV as the target's cell × (1 + draft_layers / target_layers), assuming the "
                f"draft has the target's per-layer KV size (§1.5). Here {geometry} on {target} allocates {draft.kv_pool_gib:.2f} "
                f"GiB for {draft.kv_tokens or 0:,} tokens against a share of about {max(share, 0.0):.2f} GiB, so {under:.2f} GiB "
                f"more comes out of the (1 − {mfs:g}) × B reserve: the runtime headroom is that much smaller than the fraction "
                "suggests (0.5.5 / 0.5.10 take the whole draft pool from the reserve instead)."),
        evidence=[f"draft KV Cache is allocated: {draft.kv_pool_gib:.2f} GiB; mfs × B − W − W_draft − KV = {share:.2f} GiB"],
        fix="keep that much more reserve: a lower --mem-fraction-static, or a draft whose KV matches the target's per-layer size",
        lever=Lever(knob="mem_fraction_static", direction="lower",
                    why=f"the draft's KV pool takes {under:.2f} GiB of the reserve beyond its budgeted share (§1.5)"),
    )


def _mtt_profiled_rule(c: _TrapInput) -> Trap | None:
    """``--max-total-tokens`` above the profiled pool (§1.4)."""
    report = c.report
    if report is not None and report.max_total_tokens_requested is not None:
        prof = report.max_total_tokens_profiled
        return (Trap(
            id="max_total_tokens_cap", severity="error" if prof is not None and prof <= 0 else "info",
            title=f"--max-total-tokens {report.max_total_tokens_requested} is larger than the profiled pool ({prof})",
            detail="The cap only lowers the pool; the profiled value is used (§1.4)." + (" The profiled value is ≤ 0: startup KV OOM." if prof is not None and prof <= 0 else ""),
            evidence=[f"max_total_tokens={report.max_total_tokens_requested} is larger than the profiled value {prof}"],
        ))
    return None


def _mtt_cap_rule(c: _TrapInput) -> Trap | None:
    """``--max-total-tokens`` capping the pool below the fraction's (§1.4)."""
    m, settings, tokens, mfs = c.m, c.settings, c.tokens, c.mfs
    cap = _val(settings, "max_total_tokens")
    if cap and tokens and tokens >= int(cap) - 1 and m is not None and mfs is not None:
        uncapped = math.floor(m.kv_budget_gib(float(mfs)) * GIB / m.cell_bytes)
        if uncapped > tokens:
            return (Trap(
                id="max_total_tokens_cap", severity="warning",
                title=f"--max-total-tokens {cap} caps the pool below what the fraction gives (~{uncapped:,} tokens)",
                detail="Memory freed by a lower cap is not given to anything else; it stays idle (§1.4).",
                evidence=[f"max_total_tokens={cap} ({settings['max_total_tokens'].source})", f"#tokens: {tokens}"],
                fix="drop --max-total-tokens, or lower --mem-fraction-static to hand the memory to the reserve",
            ))
    return None


def _context_rule(c: _TrapInput) -> Trap | None:
    """The context length above the KV pool, or rejected inputs (§1.4, case-26)."""
    report, tokens, ctx = c.report, c.tokens, c.ctx
    rejections = report.input_rejections if report else []
    if (ctx and tokens and ctx > tokens) or rejections:
        ev = [f"context_len={ctx}, max_total_num_tokens={tokens}"] if ctx and tokens else []
        ev += [f"Input length ({r.input_tokens} tokens) exceeds the maximum allowed length ({r.max_allowed_tokens} tokens)" for r in rejections[:3]]
        return (Trap(
            id="context_exceeds_pool", severity="warning",
            title="the context length is larger than the KV pool" if ctx and tokens and ctx > tokens else "requests were rejected as longer than the pool allows",
            detail=("The longest accepted input is min(context_len − 1, max_total_num_tokens − 1) − 5"
                    + (f" = {max_req_input_len(tokens, ctx):,} tokens" if ctx and tokens else "") + ", so long requests are rejected although --context-length accepts them (§1.4, case-26)."),
            evidence=ev, fix="enlarge the KV pool (higher --mem-fraction-static, more GPUs, fp8 KV) or lower --context-length to what fits",
            also=[Lever(knob="tp_size", direction="raise", why="more GPUs give each rank a larger KV pool for the long requests"),
                  Lever(knob="mem_fraction_static", direction="raise", why="a higher fraction enlarges the KV pool, if the headroom after graphs allows")],
            lever=Lever(knob="context_length", direction="lower",
                        why=(f"the pool holds {tokens:,} tokens, so inputs over {max_req_input_len(tokens, ctx):,} are rejected although context_len is {ctx:,}; "
                             if ctx and tokens else "requests longer than the pool allows were rejected; ")
                            + "lower --context-length to what fits, or enlarge the pool (a higher fraction, fp8 KV, more GPUs)"),
        ))
    return None


def _kv_full_rule(c: _TrapInput) -> Trap | None:
    """Retractions, else a nearly full pool (§4.4, case-27, case-38, case-49)."""
    report, tokens = c.report, c.tokens
    if report is not None and report.retractions:
        return (_retraction_trap(report, tokens))
    elif report is not None and (report.batch_summary.max_token_usage or 0.0) >= 0.9:
        usage = report.batch_summary.max_token_usage or 0.0
        # Every figure from the one line that reached the peak usage (a stress prefill's usage with a
        # measure-phase decode line's tokens per request would describe no moment of the server);
        # a prefill line prints no #token: its usage × the pool is what the running requests held.
        line_usage = lambda b: b.token_usage if b.token_usage is not None else b.full_token_usage  # noqa: E731
        peak = next((b for b in report.batches if line_usage(b) is not None and abs(line_usage(b) - usage) < 1e-9), None)
        running = peak.running_req if peak else None
        in_use = (peak.num_token if peak.num_token is not None else (round(usage * tokens) if tokens else None)) if peak else None
        evidence = f"token usage {usage:.2f}"
        if peak is not None:
            evidence += (f", #running-req {running}, #token {in_use}" + ("" if peak.num_token is not None else " (usage × pool)")
                         + f" (one {peak.kind} line" + (f" at {peak.timestamp}" if peak.timestamp else "") + ")")
        return (Trap(
            id="kv_pool_nearly_full", severity="warning", title=f"the KV pool was nearly full: token usage reached {usage:.2f}",
            detail="Near a full pool the scheduler retracts requests and decode slows while they are re-run (§4.4, case-27).",
            evidence=[evidence],
            lever=(full := _kv_full_levers(running, in_use, usage))[0], also=full[1],
        ))
    return None


def _shortfall_rule(c: _TrapInput) -> Trap | None:
    """The KV allocator's page shortfall while the server kept running (§4.4)."""
    report, settings = c.report, c.settings
    if report is not None and report.kv_shortfall is not None and report.failure is None:
        return (_shortfall_trap(report, settings))
    return None


def _after_pool_rule(c: _TrapInput) -> Trap | None:
    """Memory taken after the KV pool and before capture (§1.6, case-30, case-31)."""
    report, prim = c.report, c.prim
    after_pool = _after_pool_drop(report, prim)
    if after_pool is not None and after_pool[0] >= AFTER_POOL_GIB:
        gib, _src, _note = after_pool
        rocm = report is not None and report.oom is not None and report.oom.vendor == "hip"
        return (Trap(
            id="after_pool_allocation", severity="warning",
            title=f"{gib:.2f} GiB was allocated after the KV pool and before graph capture",
            detail=("Something outside the profiled budget took it from the (1 − mem_fraction_static) reserve: usually an attention "
                    "backend's workspace (on ROCm the AITER backend sizes its buffers from max_total_num_tokens or the context "
                    "length, §1.6)" + (" — the OOM was a HIP OOM" if rocm else "") + ". Graphs, the req_to_token table and "
                    "activations must fit what is left; predictions at higher fractions cannot see this allocation."),
            evidence=[f"Memory pool end ... avail mem → first capture line: −{gib:.2f} GB"],
            lever=Lever(knob="mem_fraction_static", direction="lower",
                        why=f"{gib:.2f} GiB allocated after the pool comes out of the reserve; a lower fraction (or --max-total-tokens, "
                            "or a shorter --context-length for a workspace sized by it) leaves room for it"),
            also=[Lever(knob="max_total_tokens", direction="set", why=f"a pool capped by --max-total-tokens leaves its memory to the {gib:.2f} GiB allocated after it"),
                  Lever(knob="context_length", direction="lower", why="workspaces such as AITER's are sized from the context length (§1.6)")],
        ))
    return None


def _mrr_reduced_rule(c: _TrapInput) -> Trap | None:
    """0.5.16+'s max_running_requests cap (§2.3)."""
    report = c.report
    if report is not None and report.max_running_requests_reduced_to is not None:
        return (Trap(
            id="max_running_requests_reduced", severity="info",
            title=f"max_running_requests was reduced from {report.max_running_requests_requested} to {report.max_running_requests_reduced_to}",
            detail="From 0.5.16 SGLang caps it at max_total_num_tokens // 2 per DP worker (§2.3).",
            evidence=[f"max_running_requests was reduced from the requested {report.max_running_requests_requested} to {report.max_running_requests_reduced_to}"],
        ))
    return None


def _runtime_free(c: _TrapInput) -> tuple[float, str] | None:
    """What is free once the server started, and the line that says it: the scheduler line's
    ``available_gpu_mem`` (the waterfall's headroom step), else, on a log without it, the lowest
    ``avail mem`` of a ``Capture cuda graph end`` line (graphs are the last startup allocation, §4.2)."""
    report = c.report
    if report is None:
        return None
    if report.scheduler is not None and report.scheduler.available_gpu_mem_gib is not None:
        step = next((s for s in _waterfall(report, c.info, c.m, c.tokens, c.mrr, c.ctx, c.mfs) if s.item in HEADROOM_ITEMS), None)
        return (step.gib, f"available_gpu_mem={step.gib:.2f} GB") if step is not None and step.gib is not None else None
    ends = [d.graph_end_avail_gib for r in report.ranks.values() for d in (r, r.draft) if d is not None and d.graph_end_avail_gib is not None]
    return (min(ends), f"Capture cuda graph end ... avail mem={min(ends):.2f} GB") if ends else None


def _tight_headroom_rule(c: _TrapInput) -> Trap | None:
    """Headroom after startup below the activation peak of the deployment's prefill chunk
    (:func:`~tuner.sglang.activation.prefill_peak_gib`, SGLang's own reserve rule; 1 GiB where the
    chunk is not known) on a server that started: the next long prefill is likely a runtime OOM
    (§1.6, §4.4). Not raised once a failure explains the start."""
    report = c.report
    free = _runtime_free(c) if report is not None and report.failure is None else None
    if free is None:
        return None
    gib, line = free
    chunk = _val(c.settings, "chunked_prefill_size")
    peak = prefill_peak_gib(int(chunk) if chunk is not None else None)
    need = peak if peak is not None else FALLBACK_GIB
    if gib >= need:
        return None
    basis = (f"SGLang reserves {need:.2f} GiB for a {int(chunk):,}-token prefill chunk's activations (max(chunk, 2048) × 1.5 MB, "
             "server_args.py)" if peak is not None and chunk is not None else
             f"the chunk size is not in the log, so the threshold is {FALLBACK_GIB:g} GiB (a scheduler line or --chunked-prefill-size would set it)")
    per = f"; each −0.01 of fraction adds {c.m.baseline_gib / 100:.2f} GiB" if c.m is not None else ""
    return Trap(
        id="tight_headroom", severity="warning",
        title=f"only {gib:.2f} GiB is free for activations once started",
        detail=(f"{gib:.2f} GiB is left for the activations of a prefill chunk" + (f" of {int(chunk):,} tokens" if chunk else "")
                + f" and of the running batch; {basis}. A long prefill is likely to run out of CUDA memory while serving (§1.6, §4.4)."),
        evidence=[line],
        fix="lower --mem-fraction-static for more headroom, or a smaller --chunked-prefill-size",
        lever=Lever(knob="mem_fraction_static", direction="lower", why=f"{gib:.2f} GiB of headroom is under the {need:.2f} GiB a prefill chunk needs{per}"),
        also=[Lever(knob="chunked_prefill_size", direction="lower", why="a smaller prefill chunk needs fewer activations at once")],
    )


def _allocator_retry_rule(c: _TrapInput) -> Trap | None:
    """torch's caching allocator missed and retried (``memory allocation failed with OOM ... (free:
    F, total: T)``): CUDA memory, not the KV allocator, so more KV is the wrong way (§4.4)."""
    retry = c.report.allocator_retry if c.report is not None else None
    if retry is None:
        return None
    free = f", {retry.free_bytes / GIB:.2f} GiB free of {retry.total_bytes / GIB:.2f} GiB" if retry.free_bytes is not None and retry.total_bytes is not None else ""
    return Trap(
        id="allocator_retry", severity="warning",
        title=f"torch's CUDA allocator ran short {retry.count} time(s): {retry.tried_bytes / GIB:.2f} GiB asked{free}",
        detail=("PyTorch's caching allocator could not allocate and retried after freeing its cached blocks (a warning; a hard "
                "failure raises 'CUDA out of memory'). This is GPU headroom, not the KV pool: a higher fraction makes it worse."),
        evidence=[f"memory allocation failed with OOM on device {retry.device} while trying to allocate {retry.tried_bytes} bytes"],
        lever=Lever(knob="mem_fraction_static", direction="lower", why=f"an allocation of {retry.tried_bytes / GIB:.2f} GiB found too little "
                    "free GPU memory: a lower fraction leaves more headroom for activations"),
        also=[Lever(knob="chunked_prefill_size", direction="lower", why="a smaller prefill chunk asks for smaller activation buffers")],
    )


def _transformers_fallback_rule(c: _TrapInput) -> Trap | None:
    """``... falling back to Transformers implementation``: no native SGLang class for the model, so
    its kernels and memory are not SGLang's (the fraction and tp rules of §1 may not hold)."""
    line = c.report.transformers_fallback if c.report is not None else None
    if line is None:
        return None
    return Trap(
        id="transformers_fallback", severity="warning",
        title="the model runs through the Transformers fallback, not a native SGLang implementation",
        detail=("SGLang has no native class for this architecture and runs the Hugging Face implementation: its attention, KV "
                "layout and memory use differ from SGLang's own models, so fix this before tuning memory knobs (or adding GPUs)."),
        evidence=[line],
        lever=Lever(knob="model_impl", direction="set", why="the architecture is not native: use an SGLang release (or --model-impl) with a native "
                    "implementation of it before moving memory knobs; the fallback's memory differs"),
    )


_TRAP_RULES = (
    _tight_headroom_rule,
    _allocator_retry_rule,
    _transformers_fallback_rule,
    _failure_rule,
    _fraction_misread_rule,
    _idle_reserve_rule,
    _graph_bs_rule,
    _hicache_rule,
    _speculative_rule,
    _draft_under_budget_rule,
    _mtt_profiled_rule,
    _mtt_cap_rule,
    _context_rule,
    _kv_full_rule,
    _shortfall_rule,
    _after_pool_rule,
    _mrr_reduced_rule,
)
"""The trap rules; each reads :class:`_TrapInput` and returns its trap or ``None``. Their order is not
a priority: :data:`_TRAP_ORDER` ranks the traps afterwards."""


def _traps(c: _TrapInput) -> list[Trap]:
    """Every trap whose rule applies to ``c`` (see :data:`_TRAP_RULES`)."""
    return [t for t in (rule(c) for rule in _TRAP_RULES) if t is not None]


def _metric_traps(metrics: Mapping[str, float]) -> list[Trap]:
    """Retractions seen by a running server's ``/metrics`` (§5.5; the counter is 0.5.10+, the
    histogram ``sglang:num_retractions`` and the gauge ``num_retracted_reqs`` 0.5.5)."""
    for name in ("sglang:num_retracted_requests_total", "sglang:num_retractions_sum", "sglang:num_retracted_reqs"):
        value = metrics.get(name)
        if value:
            return [Trap(
                id="retractions", severity="warning", title=f"the running server has retracted requests ({name} = {value:g})",
                detail="Retraction is the soft signal that KV capacity binds (§4.4, §8); decode slows while requests are re-queued (case-27).",
                evidence=[f"{name} {value:g}"],
            )]
    return []


_FIXES = {
    FailureClass.STARTUP_KV_OOM: "raise --mem-fraction-static (weights did not leave a KV budget)",
    FailureClass.WEIGHT_LOAD_OOM: "the weights do not fit: more GPUs (tp), a quantized checkpoint, or free the GPUs first",
    FailureClass.CUDA_GRAPH_OOM: "lower --mem-fraction-static or --cuda-graph-max-bs (the reserve did not hold graphs/draft)",
    FailureClass.HOST_MEMORY: "lower --hicache-size / --hicache-ratio (per rank) to fit host RAM",
    FailureClass.UNBALANCED_MEMORY: "another process holds GPU memory; free it (wait for a stopped server to exit)",
    FailureClass.RUNTIME_OOM: "lower --chunked-prefill-size or --mem-fraction-static to leave activation headroom",
    FailureClass.STARTUP_OOM: "lower --mem-fraction-static to leave a larger reserve (the log does not show the phase)",
    FailureClass.KV_PAGE_SHORTFALL: "a smaller --page-size, fewer running requests, or more KV; not a lower fraction",
    FailureClass.RETRACTION_STORM: "more KV (a higher fraction, fp8 KV) when few long requests fill the pool, else admit fewer",
    FailureClass.REQUEST_SLOT_EXHAUSTION: "the req_to_token pool ran out of request slots; see the SGLang issue for your version",
    FailureClass.INVALID_ARGUMENTS: "fix the flag for this SGLang version (tuner knows each version's spellings)",
    FailureClass.STARTUP_TIMEOUT: "raise the start timeout, or look for a hang in the log",
    FailureClass.CRASH: "read the traceback above the evidence line",
}


_MEANING = {
    FailureClass.STARTUP_KV_OOM: "mem_fraction_static × baseline did not cover the weights, so the KV budget was ≤ 0 (§1.2, §4.3)",
    FailureClass.WEIGHT_LOAD_OOM: "the GPU ran out of memory while loading weights, before the KV pool is sized (mem_fraction_static plays no part yet)",
    FailureClass.CUDA_GRAPH_OOM: ("the GPU ran out of memory during startup after the KV pool was sized: what is allocated then (the req_to_token table "
                                  "and KV pool in init_memory_pool, CUDA graphs, a 0.5.5/0.5.10 draft model) did not fit the "
                                  "(1 − mem_fraction_static) reserve (§1.2, §1.6, §4.3)"),
    FailureClass.HOST_MEMORY: "the hierarchical cache's host pool (per rank) did not fit host RAM (§7)",
    FailureClass.UNBALANCED_MEMORY: "free memory differed between GPUs at startup (§1.1)",
    FailureClass.RUNTIME_OOM: "CUDA ran out of memory while serving: activations outgrew the headroom (§4.4)",
    FailureClass.STARTUP_OOM: ("the GPU ran out of memory before the server was ready, and the log shows no startup phase line or known frame; "
                               "nothing of serving either, so it is a startup OOM (§4.3)"),
    FailureClass.KV_PAGE_SHORTFALL: "the KV allocator had no free pages for the batch; this is KV-pool accounting, not CUDA memory (§4.4)",
    FailureClass.RETRACTION_STORM: "the KV pool was full and the scheduler retracted running requests (§4.4)",
    FailureClass.REQUEST_SLOT_EXHAUSTION: "the req_to_token pool had no request slot left (§4.4, case-29)",
    FailureClass.INVALID_ARGUMENTS: "the command line was rejected",
    FailureClass.STARTUP_TIMEOUT: "no ready line within the start timeout",
    FailureClass.CRASH: "a process exited or raised without a more specific cause in the log",
}


def _reserve_fix(report: LogReport | None, m: KVCapacityModel | None, mfs: float | None) -> str:
    """The fix of a startup OOM from the ``(1 − mfs) × B`` reserve (§1.2): how far to lower the
    fraction, from the failed allocation's shortfall when torch logged it (each −0.01 adds B/100)."""
    site = (report.failure_site if report else None) or ""
    others = ("--max-running-requests / --context-length (a smaller req_to_token table) or --cuda-graph-max-bs"
              if "graph" not in site and "capture" not in site else "--cuda-graph-max-bs (fewer graphs)")
    begins = [r.load_begin_avail_gib for r in report.ranks.values() if r.load_begin_avail_gib is not None] if report else []
    base = m.baseline_gib if m is not None else (min(begins) if begins else None)
    if mfs is None or base is None:
        return f"lower --mem-fraction-static to leave a larger reserve, or lower {others}"
    mfs = float(mfs)
    fix = "lower --mem-fraction-static"
    oom = report.oom if report else None
    if oom is not None and oom.tried_to_allocate_mib is not None and oom.free_mib is not None and oom.tried_to_allocate_mib > oom.free_mib:
        short_gib = (oom.tried_to_allocate_mib - oom.free_mib) / 1024
        fix += (f" below {mfs - short_gib / base:.3f} (the allocation lacked {short_gib:.2f} GiB; each −0.01 adds {base / 100:.2f} GiB "
                "to the reserve), and further for graphs and activations")
    return fix + f": {mfs:g} leaves only (1 − {mfs:g}) × {base:.2f} GiB = {(1 - mfs) * base:.2f} GiB; or lower {others}"


class _Refined(BaseModel):
    """What a class's rule makes of the log's numbers: the lever, the other knobs, and optionally a
    new fix or detail text (``None``: the class's default)."""

    model_config = ConfigDict(frozen=True)

    lever: Lever
    also: list[Lever] = Field(default_factory=list)
    fix: str | None = None
    detail: str | None = None


WORKSPACE_ALLOCATION_GIB = 1.0
"""One startup allocation at least this large outside graph capture, where the log places it on a
context-sized buffer (:data:`CONTEXT_SIZED_SITE`, or ROCm's AITER default, see
:func:`_context_sized`): the req_to_token table (max_running_requests × (context_len + 4) × 4 B,
§1.6) or an attention backend's workspace (AITER sizes it from the context length, case-32)."""

CONTEXT_SIZED_SITE = re.compile(r"ReqToTokenPool|req_to_token|AttnBackend|attn_backend|attention_backend|workspace", re.I)
"""Traceback frames of buffers sized from the context length: the req_to_token table
(``memory_pool.py`` ``ReqToTokenPool``) and attention backends' workspaces (``layers/attention/*``)."""


def _context_sized(report: LogReport | None) -> bool:
    """Whether the log places a failed startup allocation on a context-sized buffer: a traceback
    frame names one (:data:`CONTEXT_SIZED_SITE`), or, with no frame at all, the OOM is ROCm's (HIP),
    where SGLang's default attention backend is AITER (sglang#20392), whose workspace is sized from
    the model's context length at ``AiterAttnBackend.__init__`` (sglang#20890, case-32). Any other
    unplaced allocation (a round 4.00 GiB one, a draft pool's) is not read as context-sized."""
    if report is None:
        return False
    site = report.failure_site or ""
    if site:
        return bool(CONTEXT_SIZED_SITE.search(site))
    return report.oom is not None and report.oom.vendor == "hip"


def _reserve_levers(report: LogReport | None, m: KVCapacityModel | None, mfs: float | None) -> _Refined:
    """``cuda_graph_oom`` / ``startup_oom``: the ``(1 − mfs)`` reserve was too small (§1.6). One large
    allocation outside graph capture is a context-sized buffer (:data:`WORKSPACE_ALLOCATION_GIB`), so
    the context length comes first; one over half the GPU is the model itself (more GPUs)."""
    fix = _reserve_fix(report, m, mfs)
    lower = Lever(knob="mem_fraction_static", direction="lower", why=fix)
    cap = Lever(knob="max_total_tokens", direction="set", why="a smaller pool (--max-total-tokens) hands its memory to the reserve")
    shorter = Lever(knob="context_length", direction="lower",
                    why="buffers allocated after the pool (req_to_token table, attention workspaces) grow with the context length (§1.6)")
    oom = report.oom if report else None
    site = (report.failure_site if report else None) or ""
    tried_gib = oom.tried_to_allocate_mib / 1024 if oom is not None and oom.tried_to_allocate_mib is not None else None
    if tried_gib is not None and oom is not None and oom.total_capacity_gib is not None and tried_gib > 0.5 * oom.total_capacity_gib:
        return _Refined(lever=Lever(knob="tp_size", direction="raise", why=f"one allocation of {tried_gib:.2f} GiB is over half the GPU's "
                                    f"{oom.total_capacity_gib:.2f} GiB: more GPUs or a smaller model, not a fraction"), also=[lower], fix=fix)
    failed = report.failure if report else None
    in_capture = "graph" in site or "capture" in site or (failed is not None and (failed.phase == "capture" or "capture" in failed.evidence.lower()))
    if tried_gib is not None and tried_gib >= WORKSPACE_ALLOCATION_GIB and not in_capture and _context_sized(report):
        return _Refined(lever=Lever(knob="context_length", direction="lower",
                                    why=f"one allocation of {tried_gib:.2f} GiB at startup, outside graph capture, is a buffer sized from the "
                                        "context (an attention workspace or the req_to_token table, §1.6): a shorter --context-length "
                                        "shrinks it; or " + fix), also=[lower, cap], fix=fix)
    if tried_gib is not None and not site and failed is not None and failed.phase in (UNKNOWN, STARTUP):
        settle = settling_line() if failed.phase == UNKNOWN else settling_line("step")
        lower = lower.model_copy(update={"why": f"the log does not place this {tried_gib:.2f} GiB allocation ({settle}); whatever "
                                                "it was, it came from the reserve: " + fix})
    return _Refined(lever=lower, also=[cap, shorter], fix=fix)


def _kv_oom_levers(report: LogReport | None, m: KVCapacityModel | None, mfs: float | None) -> _Refined:
    """``startup_kv_oom``: the KV budget ≤ 0 (§1.2, §4.3); raise the fraction above what the weights
    take of the baseline, or more GPUs when they take ≥ 0.95 of it."""
    low = m.min_fraction() if m is not None else None
    if low is None and report is not None:
        begins = [r.load_begin_avail_gib for r in report.ranks.values() if r.load_begin_avail_gib is not None]
        ends = [r.weight_end_avail_gib for r in report.ranks.values() if r.weight_end_avail_gib is not None]
        if begins and ends:
            low = (min(begins) - min(ends)) / min(begins)
    more_gpus = Lever(knob="tp_size", direction="raise", why="more GPUs split the weights and leave each a KV budget")
    if low is None:
        return _Refined(lever=LEVERS[FailureClass.STARTUP_KV_OOM], also=[more_gpus])
    fix = (f"raise --mem-fraction-static above {low:.3f} (weights alone take that share of the baseline)"
           + (f", plus ≈0.01 per {m.tokens_per_hundredth():,.0f} tokens" if m else " plus the KV pool you want"))
    if low >= 0.95:
        return _Refined(lever=Lever(knob="tp_size", direction="raise", why=f"the weights alone take {low:.3f} of the free memory: no fraction "
                                    "leaves a KV pool; more GPUs or a smaller checkpoint"), fix=fix)
    return _Refined(lever=Lever(knob="mem_fraction_static", direction="raise", why=fix), also=[more_gpus], fix=fix)


def _runtime_oom_levers(report: LogReport | None, m: KVCapacityModel | None, mfs: float | None) -> _Refined:
    """``runtime_oom``: activations of the running batch outgrew the headroom after graphs (§4.4): a
    smaller prefill chunk, fewer running requests (case-11: a batch of thousands), more headroom."""
    detail = None
    phase = report.failure.phase if report is not None and report.failure is not None else None
    if phase == UNKNOWN:
        detail = ("CUDA ran out of memory running a batch (the traceback's forward frames): activations outgrew the headroom (§4.4); "
                  "whether it was the warm-up request or a served one, the log does not show.")
    elif report is not None and not report.ready and not report.batch_summary.prefill_lines:
        detail = "CUDA ran out of memory running a batch before the server was ready (the warm-up request): activations outgrew the headroom (§4.4)."
    peak = report.batch_summary.max_running_req if report is not None else None
    return _Refined(lever=LEVERS[FailureClass.RUNTIME_OOM], detail=detail, also=[
        Lever(knob="max_running_requests", direction="lower",
              why="a smaller running batch needs fewer activations" + (f" (up to {peak} ran)" if peak else "")),
        Lever(knob="mem_fraction_static", direction="lower", why="a lower fraction leaves more headroom after graphs for activations (§1.6)"),
    ])


def _shortfall_levers(report: LogReport | None, m: KVCapacityModel | None, mfs: float | None) -> _Refined:
    """``kv_page_shortfall``: the KV allocator's pages (§4.4), see :func:`_shortfall_trap`."""
    if report is None:
        return _Refined(lever=LEVERS[FailureClass.KV_PAGE_SHORTFALL])
    trap = _shortfall_trap(report, {})
    return _Refined(lever=trap.lever or LEVERS[FailureClass.KV_PAGE_SHORTFALL], fix=trap.fix, detail=trap.detail)


def _slot_levers(report: LogReport | None, m: KVCapacityModel | None, mfs: float | None) -> _Refined:
    """``request_slot_exhaustion``: the req_to_token pool's slots (§4.4, case-29)."""
    if report is None or report.req_slots_available is None:
        return _Refined(lever=LEVERS[FailureClass.REQUEST_SLOT_EXHAUSTION])
    return _Refined(lever=Lever(knob="max_running_requests", direction="set",
                                why=f"the req_to_token pool had {report.req_slots_available} slot(s) for {report.req_slots_requested} request(s): "
                                    "slots leak or are all held while the KV pool may have room; an explicit --max-running-requests sizes the pool "
                                    "(SGLang's hint to lower it helps only when the slots are really all in use)"))


_NOT_MEMORY = (
    ("no kernel image", "a kernel has no image for this GPU's architecture (raised at its first launch, often graph capture): install a "
                        "build of SGLang and its kernel libraries for this GPU; no memory knob changes it"),
    ("out of resource", "a Triton kernel asked for more shared memory than the hardware has: a kernel configuration (block sizes, "
                        "num_stages) or attention backend change, not GPU memory"),
    ("illegal memory access", "an illegal memory access is a kernel or driver fault, not a lack of memory: read the traceback, try "
                              "another attention backend or SGLang build"),
)
"""Why no memory knob helps, per non-memory fatal line (``tuner.sglang.logs.non_memory_fatal``)."""


def _crash_levers(report: LogReport | None, m: KVCapacityModel | None, mfs: float | None) -> _Refined:
    """``crash``: no knob, and when the evidence is a fatal line that is not memory, why not."""
    evidence = report.failure.evidence if report is not None and report.failure is not None else ""
    why = next((w for key, w in _NOT_MEMORY if key in evidence), None)
    if why is None and CAPTURE_FAILED.search(evidence):
        why = ("SGLang wraps every CUDA-graph capture exception in 'Capture cuda graph failed' with advice about memory; "
               + ("the cause is unknown: " + settling_line("cause") if capture_cause(evidence) == "unknown"
                  else "the wrapped error is not memory, so no memory knob helps: fix what it names"))
    return _Refined(lever=Lever(knob=None, direction="none", why=why) if why else LEVERS[FailureClass.CRASH], fix=why)


def _weight_oom_levers(report: LogReport | None, m: KVCapacityModel | None, mfs: float | None) -> _Refined:
    """``weight_load_oom``: the weights did not fit the free memory at load, before any fraction
    applies (§1.2): more GPUs split them, a quantized checkpoint shrinks them."""
    begins = [r.load_begin_avail_gib for r in report.ranks.values() if r.load_begin_avail_gib is not None] if report else []
    oom = report.oom if report else None
    nums = f" ({min(begins):.2f} GiB free at 'Load weight begin'" if begins else ""
    if oom is not None and oom.tried_to_allocate_mib is not None:
        nums += ("; " if nums else " (") + f"a {oom.tried_to_allocate_mib / 1024:.2f} GiB allocation failed"
    nums += ")" if nums else ""
    return _Refined(lever=Lever(knob="tp_size", direction="raise", why=f"the weights did not fit the GPU{nums}: more GPUs (tp) split them, "
                                "or a quantized checkpoint; mem_fraction_static plays no part yet"),
                    also=[Lever(knob="quantization", direction="set", why="a quantized checkpoint (fp8, int4) takes a fraction of the weight memory")])


_HOST_ASK = re.compile(r"Requesting (\d+(?:\.\d+)?) GB but only have (\d+(?:\.\d+)?) GB free")


def _host_levers(report: LogReport | None, m: KVCapacityModel | None, mfs: float | None) -> _Refined:
    """``host_memory``: the hierarchical cache's host pools (per rank, decimal GB) asked for more than
    ``psutil available − 10 GiB`` (§4.3, §7); the message's numbers give how far to lower."""
    evidence = report.failure.evidence if report is not None and report.failure is not None else ""
    ask = _HOST_ASK.search(evidence)
    if ask is None:
        return _Refined(lever=LEVERS[FailureClass.HOST_MEMORY])
    want, have = float(ask.group(1)), float(ask.group(2))
    ranks = max(len(report.host_pool_ranks) if report else 0, 1)
    return _Refined(lever=Lever(knob="hicache_size", direction="lower",
                                why=f"the host pools asked for {want:g} GB with only {have:g} GB free (psutil available − 10 GiB, §7): "
                                    f"size --hicache-size so that {ranks} rank(s) × size stays below {have:g} GB"),
                    also=[Lever(knob="hicache_ratio", direction="lower", why="a smaller host/device ratio shrinks each rank's host pool")])


_CLASS_RULES = {
    FailureClass.CRASH: _crash_levers,
    FailureClass.WEIGHT_LOAD_OOM: _weight_oom_levers,
    FailureClass.HOST_MEMORY: _host_levers,
    FailureClass.CUDA_GRAPH_OOM: _reserve_levers,
    FailureClass.STARTUP_OOM: _reserve_levers,
    FailureClass.STARTUP_KV_OOM: _kv_oom_levers,
    FailureClass.RUNTIME_OOM: _runtime_oom_levers,
    FailureClass.KV_PAGE_SHORTFALL: _shortfall_levers,
    FailureClass.REQUEST_SLOT_EXHAUSTION: _slot_levers,
}
"""The rule that makes a class's lever concrete from the log's numbers; a class not listed keeps
:data:`~tuner.sglang.failures.LEVERS`' default."""


def _oom_words(oom: OOMDetail | None) -> str:
    """`` The CUDA allocator tried to allocate X MiB with F MiB free of T GiB.`` (empty without numbers)."""
    if oom is None or oom.tried_to_allocate_mib is None:
        return ""
    what = f"tried to allocate {oom.tried_to_allocate_mib:,.2f} MiB"
    if oom.free_mib is not None:
        what += f" with {oom.free_mib:,.2f} MiB free"
    if oom.total_capacity_gib is not None:
        what += f" of {oom.total_capacity_gib:.2f} GiB"
    return f" The {'HIP' if oom.vendor == 'hip' else 'CUDA'} allocator {what}."


def _failure_trap(failure: Failure, m: KVCapacityModel | None, report: LogReport | None, mfs: float | None = None) -> Trap:
    """The ``failure`` trap: what the class means, the phase, the quoted evidence line, and the lever
    with the log's numbers (§4.3, §4.4), made by the class's rule in :data:`_CLASS_RULES`."""
    cls = failure.failure_class
    rule = _CLASS_RULES.get(cls)
    refined = rule(report, m, mfs) if rule else _Refined(lever=LEVERS[cls])
    if report is not None and (cause := structural_lever(cls, report.server_args)) is not None:
        refined = refined.model_copy(update={"lever": cause, "also": [refined.lever, *refined.also]})
    detail = (refined.detail or _MEANING.get(cls, cls.value) + ".") + _oom_words(report.oom if report else None)
    where = f"phase {failure.phase}" if failure.phase and failure.phase != UNKNOWN else None
    if failure.phase == UNKNOWN:
        where = "phase unknown: no startup or serving line in the log"
        detail += f" The phase is unknown: {settling_line()}."
    elif failure.phase == STARTUP and report is not None and report.failure_site:
        where = "during startup, per the traceback's frames"
    elif failure.phase == STARTUP:
        where = "during startup (the traceback's frames); the step is not in the log"
        detail += f" The traceback runs through the server's construction; {settling_line('step')}."
    site = report.failure_site if report else None
    title = f"the server failed: {cls.value}" + (f" (raised in {site})" if site else "") + (f" [{where}]" if where else "")
    return Trap(id="failure", severity="error", title=title, detail=detail, evidence=[failure.evidence],
                fix=refined.fix or _FIXES.get(cls), lever=refined.lever, also=refined.also)


FEW_REQUESTS_FILL = 8
"""When each running request holds at least 1/8 of the pool, so that a handful fill it, admitting
fewer cannot help and a few hundredths of fraction only postpone it: the request length binds."""


def _kv_full_levers(running: int | None, in_use: int | None, usage: float | None) -> tuple[Lever, list[Lever]]:
    """``(lever, others)`` of a full KV pool (§4.4, §8), from the decode line that saw it. A handful
    of requests each holding ≥ 1/:data:`FEW_REQUESTS_FILL` of the pool (case-38: 2 requests of
    ≈154K tokens): bound the request length (``max_new_tokens``, context length); few requests of
    moderate length (≤ 16, or ≥ 4,096 tokens each): more KV; many short ones (case-49: 66 of
    ≈1,320 tokens): admit fewer. 'Lower the offered concurrency' with 2 running requests is wrong."""
    per_req = in_use / running if running and in_use else None
    pool = in_use / usage if in_use and usage else None
    held = f"{running} request(s) of ≈{per_req:,.0f} tokens" if per_req else (f"{running} request(s)" if running is not None else "few requests")
    more_kv = Lever(knob="mem_fraction_static", direction="raise", why="more KV tokens (a higher fraction, fp8 KV, more GPUs) hold longer requests")
    fewer = Lever(knob="max_running_requests", direction="lower", why="admitting fewer requests leaves each room to grow without retraction")
    if per_req is not None and pool is not None and per_req * FEW_REQUESTS_FILL >= pool:
        return Lever(knob="max_new_tokens", direction="lower",
                     why=f"{held} filled the {pool:,.0f}-token pool: a handful of very long requests, so admitting fewer cannot help and "
                         "more KV only postpones it; cap the request's output (max_tokens) or the context length"), [
            Lever(knob="context_length", direction="lower", why="a shorter --context-length bounds how long one request may grow"), more_kv]
    if (running is not None and running <= 16) or (per_req is not None and per_req >= 4096):
        return Lever(knob="mem_fraction_static", direction="raise",
                     why=f"only {held} held the pool: fewer requests would not help; the pool needs more tokens (a higher fraction, fp8 KV, more GPUs)"), [fewer]
    return Lever(knob="max_running_requests", direction="lower",
                 why=f"{held if per_req else 'many requests'} filled the pool: admitting fewer avoids retraction; or enlarge the pool (a higher fraction)"), [more_kv]


def _retraction_trap(report: LogReport, tokens: int | None) -> Trap:
    """Retractions (§4.4; the 0.4.x wording ``Decode out of memory happened``): a full pool, not a CUDA
    OOM. The lever reads the rank's last decode line before the first retraction (what filled it)."""
    n = sum(r.retracted_reqs for r in report.retractions)
    first, last = report.retractions[0], report.retractions[-1]
    running, in_use, usage = first.running_req_before, first.num_token_before, first.token_usage_before
    if running is None:  # no decode line before it on that rank: the last one of the log
        decodes = [b for b in report.batches if b.kind == "decode"]
        before = decodes[-1] if decodes else None
        running, in_use = (before.running_req, before.num_token) if before else (None, None)
        usage = (before.token_usage or before.full_token_usage) if before else None
    ratio = (f" The new-token ratio jumped {last.new_token_ratio_before:g} → {last.new_token_ratio_after:g}, so admission turns conservative."
             if last.new_token_ratio_before is not None and last.new_token_ratio_after is not None else "")
    ranks = sorted({r.rank or "" for r in report.retractions})
    lever, also = _kv_full_levers(running, in_use, usage)
    return Trap(
        id="retractions", severity="warning",
        title=f"the KV pool filled up: {len(report.retractions)} retraction line(s) on {len(ranks)} rank(s), {n} request(s) retracted",
        detail=("Retraction is the soft signal that KV capacity binds (§4.4, §8), not a CUDA OOM: the scheduler evicts running "
                "requests and re-runs them later, and decode slows meanwhile (case-27)." + ratio
                + (f" Before it, {running} request(s) held {in_use:,} tokens" + (f" of {tokens:,}" if tokens else "") + "." if running is not None and in_use else "")),
        evidence=[report.soft_failure.evidence if report.soft_failure else f"#retracted_reqs: {last.retracted_reqs}"],
        lever=lever, also=also,
    )


def _shortfall_trap(report: LogReport, settings: Mapping[str, Setting]) -> Trap:
    """The KV allocator's page shortfall (``Decode out of memory. Try to lower your batch size.``, §4.4):
    free tokens that are not whole free pages for every request. A lower fraction makes it worse."""
    sf = report.kv_shortfall
    page = settings.get("page_size").value if settings.get("page_size") else None  # type: ignore[union-attr]
    nums = []
    if sf is not None:
        if sf.requested_tokens is not None:
            nums.append(f"asked for {sf.requested_tokens:,} tokens")
        if sf.available_tokens is not None or sf.available_size is not None:
            avail = sf.available_tokens if sf.available_tokens is not None else sf.available_size
            nums.append(f"{avail:,} available" + (f" ({sf.available_size:,} free + {sf.evictable_size:,} evictable)"
                                                   if sf.available_size is not None and sf.evictable_size is not None else ""))
    short_by_pages = (sf is not None and sf.requested_tokens is not None and sf.available_size is not None
                      and sf.available_size >= sf.requested_tokens)
    detail = ("The KV allocator had no free pages for the batch (" + ", ".join(nums) + "): " if nums else "The KV allocator had no free pages for the batch: ")
    if short_by_pages:
        detail += ("more tokens were free than asked for, so the free slots were not whole free pages: each request takes whole pages "
                   f"of page_size{f' {page}' if page else ''} tokens (decode over-estimates one new page per request).")
        assert sf is not None and sf.requested_tokens is not None and sf.available_size is not None
        if sf.kind == "decode":  # "Try to allocate len(seq_lens) × token_per_req": one token per running request
            need = f"{sf.requested_tokens:,} decode requests a new page each (up to {sf.requested_tokens:,} × page_size" + (
                f" = {sf.requested_tokens * int(page):,} tokens)" if page else " tokens)")
        else:
            need = f"{sf.requested_tokens:,} tokens in whole pages"
        lever = Lever(knob="page_size", direction="lower",
                      why=f"{sf.available_size:,} free tokens could not give {need}: a smaller page size wastes less per "
                          "request (or fewer running requests); a lower fraction makes it worse")
    else:
        detail += "the pool itself was exhausted (not CUDA memory)."
        lever = Lever(knob="mem_fraction_static", direction="raise",
                      why="the KV pool had fewer free tokens than the batch needs: more KV (a higher fraction) or fewer running requests; "
                          "a lower fraction makes it worse")
    return Trap(id="kv_page_shortfall", severity="error" if report.failure is not None else "warning",
                title="the KV allocator ran out of pages (not a CUDA OOM)", detail=detail,
                evidence=[report.failure.evidence if report.failure else "Decode out of memory. Try to lower your batch size."],
                fix=lever.why, lever=lever)


def _findings(m: KVCapacityModel | None, cap: Capacity, mfs: float | None, traps: list[Trap]) -> list[str]:
    out = []
    if m is not None and mfs is not None:
        out.append(f"mem_fraction_static={float(mfs):g} is a share of the {m.baseline_gib:.2f} GiB free at the baseline for weights plus the KV pool; "
                   f"the other {m.reserve_gib(float(mfs)):.2f} GiB is the reserve.")
        out.append(f"each +0.01 of mem_fraction_static adds ≈{m.tokens_per_hundredth():,.0f} tokens (+{m.baseline_gib / 100:.2f} GiB of KV) and takes as much from the headroom.")
    out.append(f"capacity: {cap.statement}.")
    for t in traps:
        if t.id == "idle_reserve":
            out.append(t.title + ".")
    return out


# ---------------------------------------------------------------------------------------------
# Stored trial reports
# ---------------------------------------------------------------------------------------------


def waterfall_steps(memory: Mapping[str, Any]) -> list[WaterfallStep]:
    """The waterfall of a stored trial memory report (``ranks``, ``scheduler``, ``capacity_model``,
    ``server_info`` as :mod:`tuner.trial` stores them).

    Raises:
        ValueError: The stored report does not validate (pydantic).
        KeyError, TypeError: It lacks the expected shape.
    """
    report = LogReport.model_validate({"ranks": memory.get("ranks") or {}, "scheduler": memory.get("scheduler")})
    model = KVCapacityModel.model_validate(memory["capacity_model"]) if memory.get("capacity_model") else None
    info = ServerInfo.model_validate({k: v for k, v in (memory.get("server_info") or {}).items() if v is not None}) if memory.get("server_info") else None
    sched = report.scheduler
    mfs = model.observed_mem_fraction_static if model else None
    return _waterfall(report, info, model, report.max_total_num_tokens or (model.observed_tokens if model else None),
                      sched.max_running_requests if sched else None, sched.context_len if sched else memory.get("context_len"), mfs)


def explain_from(
    *,
    log: str | None = None,
    unit: str | None = None,
    url: str | None = None,
    model_config: str | None = None,
    journalctl: str = "journalctl",
    mem_fraction_static: float | None = None,
    timeout_s: float = 10.0,
    gpu: str | None = None,
    device_free: Callable[[str], tuple[float, str] | None] | None = None,
    structural: Sequence[PricedLever] = (),
) -> Explanation:
    """Gather the inputs ``tuner explain`` names and explain them (the CLI's one entry point).

    Args:
        log: A log file path (``.gz`` too), or ``-`` for standard input.
        unit: A systemd unit whose journal to read.
        url: A running server's base URL.
        model_config: A Hugging Face ``config.json`` (or its directory).
        journalctl: The journalctl command prefix for ``unit``.
        mem_fraction_static: The fraction, used only if no input states it; in (0, 1).
        timeout_s: HTTP timeout for ``url``.
        gpu: The GPU's name or architecture, for the ladder's feasibility cells.
        structural: The structural levers' declarations for the ladder (:func:`explain`).
        device_free: For ``url`` without a log: reads the server's GPU memory free now (GiB, and
            where it was read: NVML, the simulator's ledger), the same figure as the log's
            ``available_gpu_mem`` after CUDA graphs (§4.2) when the server is idle; used when
            ``/get_server_info`` has no ``startup_available`` (before 0.5.23), so the URL and the
            log of one server predict the same headroom.

    Returns:
        The :class:`Explanation`.

    Raises:
        LogError: No input, or a log that is empty, binary or not SGLang's.
        ServerError: ``url`` unreachable or not SGLang.
        ModelConfigError: A bad ``config.json``.
        ConfigError: ``mem_fraction_static`` is outside (0, 1).
    """

    from tuner.sglang.client import SGLangClient
    from tuner.sglang.logs import read_log
    from tuner.sglang.modelconfig import load_model_config

    if not (log or unit or url):
        raise LogError("nothing to explain", hint="pass --log FILE, --unit NAME or --url URL")
    if log and unit:
        raise LogError(f"--log {log} and --unit {unit} both name a log to read",
                       hint="pass one of them (--url may go with either)")
    _check_fraction(mem_fraction_static)
    sources: list[str] = []
    report = None
    if log == "-":
        report = parse_log_bytes(sys.stdin.buffer.read(), source="standard input")
        sources.append("log on standard input")
    elif log:
        report = read_log(Path(log))
        sources.append(f"log {log}")
    elif unit:
        report = read_journal(unit, journalctl=journalctl)
        sources.append(f"journal of unit {unit}")
    info = None
    metrics = None
    if url:
        with SGLangClient(url, timeout_s=timeout_s) as client:
            info = client.server_info()
            try:
                metrics = client.metrics()
            except ServerError:
                metrics = None  # launched without --enable-metrics: the rest still explains
        sources.append(f"server {url}")
        if report is None and info.startup_available_gib is None and device_free is not None:
            read = device_free(url)
            if read is not None:
                info = info.model_copy(update={"startup_available_gib": read[0]})
                sources.append(f"GPU memory free now ({read[1]}: {read[0]:.2f} GiB; taken as available_gpu_mem after "
                               "CUDA graphs, which an idle server still leaves free)")
    model = load_model_config(model_config) if model_config else None
    if model_config:
        sources.append(f"model config {model_config}")
    return explain(report, info=info, model=model, sources=sources, mem_fraction_static=mem_fraction_static, metrics=metrics, gpu=gpu,
                   structural=structural)
