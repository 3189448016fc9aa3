"""The capacity ladder: what each structural lever would give this deployment, before any restart.

One concept: from one observed start (a calibrated :class:`~tuner.sglang.memory.KVCapacityModel`)
plus the model's config, each lever alone and in the useful combinations is priced with SGLang's
rules (:mod:`tuner.sglang.levers`): KV tokens per rank, logical tokens across the deployment, the
longest single request that fits, free memory after CUDA graphs, whether it starts, whether it
exists on this version / GPU / backend, and whether it changes numerics
(:func:`tuner.sglang.numerics.numerics_changes`).

The memory rule (``shared/sglang-reference.md`` §1.2): ``tokens = floor((mfs × B − S') / cell')``
page-aligned, with ``S'`` the observed static memory plus what the lever adds before profiling
(DP attention's replicated weights; 0.5.23's draft weights) and ``cell'`` the observed cell scaled
by the lever's cell over the observed one (fp8 element size, DP attention heads, DCP's replicated
indexer, the 0.5.16+ draft term). Free after graphs: the observed value minus the fraction moved
into the budget, minus what the lever adds to the reserve (the draft model where the version pays
it there, §1.5; a req_to_token table of ``max_running_requests // dp`` rows per DP rank, §1.5b).
CUDA graphs and the other reserve are taken as observed (a lever's own graphs are not known from
one start: the study's boot probe measures them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from tuner.sglang.flags import FlagTable
from tuner.sglang.levers import (
    Verdict,
    attention_type,
    dcp_per_rank_cell_bytes,
    dp_attention_extra_weight_gib,
    draft_budget,
    dsa_backends,
    dsa_kv_settings,
    feasibility,
    flag_available,
    supporting_backend,
    table_for,
)
from tuner.sglang.memory import GIB, KVCapacityModel, cell_size_bytes, kv_elem_bytes
from tuner.sglang.modelconfig import ModelArch
from tuner.sglang.numerics import numerics_changes
from tuner.sglang.versions import at_least

__all__ = ["Rung", "LadderBase", "PricedLever", "evaluate", "ladder", "fraction_ceiling", "per_request_max_tokens"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")
_FP8 = "fp8_e4m3"


class Rung(BaseModel):
    """One rung of the ladder (``tuner explain --json``'s ``ladder`` items).

    Attributes:
        lever: SGLang field names → values this rung sets over the deployment
            (``{"kv_cache_dtype": "fp8_e4m3"}``; ``{}`` = as observed; ``speculative_algorithm``
            ``None`` = speculative decoding off).
        tokens_per_rank: ``max_total_num_tokens`` of one rank's pool (DCP: per rank, before
            × dcp); ≤ 0 = ``Not enough memory``; ``None`` = not computable from the inputs.
        logical_tokens: Tokens resident across the deployment (× dp under DP attention, × dcp under DCP).
        per_request_max_tokens: The longest single request, ``min(context_len − 1, pool − 1)`` with
            pool = one rank's (DP attention) or the logical one (DCP), §1.4.
        free_after_graphs_gib: Predicted free GPU memory after CUDA graphs (GiB per GPU).
        starts: ``True`` / ``False`` (the arithmetic in ``why``) / ``None`` (unknown).
        available: The flags exist in this SGLang version and the feasibility table allows the
            GPU × backend × attention type (``None``: unknown there).
        changes_numerics: The rung differs from the deployment in a numerics flag.
        why: The arithmetic and the facts, with sources.
    """

    model_config = _FROZEN

    lever: dict[str, Any]
    tokens_per_rank: int | None
    logical_tokens: int | None
    per_request_max_tokens: int | None
    free_after_graphs_gib: float | None
    starts: bool | None
    available: bool | None
    changes_numerics: bool
    why: str


class _Named(Protocol):
    @property
    def name(self) -> str:
        """An SGLang field name."""
        ...


@runtime_checkable
class PricedLever(Protocol):
    """What the ladder reads of a structural lever's declaration (:class:`tuner.knobs.Lever`): the
    layers above hand :data:`tuner.knobs.LEVERS` in (:attr:`LadderBase.levers`); this module, a
    fact of SGLang's, never imports them."""

    @property
    def name(self) -> str:
        """The feasibility table's lever (``tuner/data/levers.json``)."""
        ...

    @property
    def flag(self) -> str:
        """The SGLang field whose value in a rung's flags turns the lever on."""
        ...

    @property
    def knob(self) -> _Named:
        """The knob row (its ``name``: the field that sizes the lever)."""
        ...

    @property
    def switch(self) -> str | None:
        """A flag the knob's value turns on and off (then the table is asked about the switch, not the size)."""
        ...

    @property
    def probe(self) -> Any:
        """The value the flag table is asked about (``None``: the flag alone)."""
        ...

    def unavailable(self, value: Any, *, version: str | None, tp: int) -> str | None:
        """Why ``value`` cannot launch at ``--tp-size tp`` (``version`` ``None``: the layout's rules only)."""
        ...


class LadderBase(BaseModel):
    """The observed deployment the ladder starts from.

    Attributes:
        memory: The memory model calibrated on the observed start.
        model: The model's architecture (``None``: only the fraction's rungs are computable).
        version: SGLang version of the deployment.
        tp: ``--tp-size``.
        dp: DP-attention size in use (1 = off).
        mem_fraction_static: The observed fraction.
        kv_cache_dtype: ``--kv-cache-dtype`` in use.
        speculative_algorithm: ``--speculative-algorithm`` in use (``None`` = off).
        attention_backend: ``--attention-backend`` (``None`` = SGLang's default).
        context_len: The server's context length.
        page_size: Tokens per page.
        gpu: GPU name or architecture (``None``: unknown; feasibility cells then answer unknown).
        draft_weight_gib, draft_kv_gib, draft_graph_gib: The draft model's own lines (§4.1).
        graphs_captured: Whether the start captured CUDA graphs (``False``: its free memory is what
            is left once started, not after graphs; ``None``: not known, e.g. from a URL).
        spec_headroom_tokens: Tokens 0.5.5 added to the observed pool for speculative decoding
            (``max_num_reqs × steps × topk + max_num_reqs × draft_tokens + 100``, §1.5), 0 otherwise;
            ``memory`` must price the profiled budget, i.e. the observed count less these (a model
            calibrated on the logged count holds them in its budget: add ``headroom × cell`` to its
            static memory, as :func:`tuner.sglang.explain.explain` does).
        flags: The deployment's flags by SGLang field name (for the numerics comparison).
        levers: The structural levers' declarations (:data:`tuner.knobs.LEVERS`, handed in by the
            rung proposer and ``tuner explain``'s command): which flag turns each on, the
            feasibility table's name for it, its layout rules. Empty: no lever's cell or rule is
            asked. Not dumped.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    memory: KVCapacityModel
    model: ModelArch | None = None
    version: str = "0.5.5"
    tp: int = 1
    dp: int = 1
    mem_fraction_static: float
    kv_cache_dtype: str = "auto"
    speculative_algorithm: str | None = None
    attention_backend: str | None = None
    context_len: int | None = None
    page_size: int = 1
    gpu: str | None = None
    draft_weight_gib: float | None = None
    draft_kv_gib: float | None = None
    graphs_captured: bool | None = None
    draft_graph_gib: float | None = None
    spec_headroom_tokens: int = 0
    flags: dict[str, Any] = Field(default_factory=dict)
    levers: tuple[PricedLever, ...] = Field(default=(), exclude=True)


class _Shape(BaseModel):
    """A rung's resolved settings."""

    model_config = _FROZEN

    version: str
    mfs: float
    dtype: str
    spec: str | None
    dp: int
    dcp: int
    backend: str | None
    dsa_backends: tuple[str | None, str | None] = (None, None)


def _shape(base: LadderBase, flags: Mapping[str, Any], version: str | None) -> _Shape:
    dp = int(flags.get("dp_size") or base.dp) if flags.get("enable_dp_attention", base.dp > 1) else 1
    dtype, dcp = str(flags.get("kv_cache_dtype", base.kv_cache_dtype)), int(flags.get("dcp_size") or 1)
    backends = (flags.get("dsa_prefill_backend"), flags.get("dsa_decode_backend"))
    if backends == (None, None) and dtype == base.kv_cache_dtype:  # SGLang re-resolves them with the dtype (see _kv for DCP)
        backends = (base.flags.get("dsa_prefill_backend"), base.flags.get("dsa_decode_backend"))
    return _Shape(
        version=version or base.version, mfs=float(flags.get("mem_fraction_static", base.mem_fraction_static)), dtype=dtype,
        spec=flags["speculative_algorithm"] if "speculative_algorithm" in flags else base.speculative_algorithm,
        dp=dp, dcp=dcp, backend=flags.get("attention_backend", base.attention_backend), dsa_backends=backends,
    )


def _kv(base: LadderBase, s: _Shape) -> tuple[str, bool]:
    """The rung's resolved KV dtype and, for a DSA model, whether its latent row is raw
    (:func:`~tuner.sglang.levers.dsa_kv_settings`). The deployment's logged DSA backends hold while
    the rung keeps its KV dtype, DCP included: 0.5.23's ``_dsa_dcp_overrides``
    (``arg_groups/model_overrides/deepseek_v2.py``) puts ``trtllm`` only where a backend is unset, and
    a logged ``flashmla_kv`` is either the operator's choice (kept) or the Hopper fp8 default
    (``_dsa_split_backend_resolution``: "flashmla_kv on Hopper, trtllm on Blackwell"), where DCP
    runs only with it named; so the rung keeps the baseline's 656 B scaled row, not trtllm's raw
    576 B. With no logged backend, SGLang's defaults for the rung."""
    if base.model is None or attention_type(base.model) != "dsa":
        return s.dtype, False
    return dsa_kv_settings(version=s.version, gpu=base.gpu, kv_cache_dtype=s.dtype, dcp=s.dcp,
                           prefill_backend=s.dsa_backends[0], decode_backend=s.dsa_backends[1])


def _base_shape(base: LadderBase) -> _Shape:
    return _shape(base, {}, None)


def _cell(base: LadderBase, s: _Shape) -> int | None:
    """The rung's per-rank cell: the observed cell × formula(rung) / formula(observed)."""
    b = _base_shape(base)
    if s.dtype == b.dtype and s.dp == b.dp and s.dcp == 1 and s.spec == b.spec and s.version == b.version and s.dsa_backends == b.dsa_backends:
        return base.memory.cell_bytes
    if base.model is None:
        return None

    def formula(x: _Shape) -> int:
        dtype, raw = _kv(base, x)
        return cell_size_bytes(base.model, tp=base.tp, kv_cache_dtype=dtype, version=x.version,  # type: ignore[arg-type]
                               speculative_algorithm=x.spec, dp_attention_size=x.dp, dsa_raw=raw)

    cell = base.memory.cell_bytes * formula(s) / formula(b)
    draft = 0
    if s.spec and at_least(s.version, "0.5.16"):  # the draft term inside the cell (§1.5), as cell_size_bytes counts it
        draft = base.model.num_nextn_predict_layers or 1
    return dcp_per_rank_cell_bytes(int(round(cell)), base.model, s.dcp, draft)


def _dp_weights(base: LadderBase, dp: int) -> float | None:
    if dp <= 1:
        return 0.0
    if base.model is None:
        return None
    extra = dp_attention_extra_weight_gib(base.model, tp=base.tp, dp=dp)
    return None if extra is None else sum(extra)


def _draft_in_budget(base: LadderBase, s: _Shape) -> float | None:
    if not s.spec or draft_budget(s.version).draft_weights != "budget":
        return 0.0
    return base.draft_weight_gib


def _static(base: LadderBase, s: _Shape) -> float | None:
    """``S'``: observed static + DP attention's extra weights + draft weights the version loads before profiling."""
    b = _base_shape(base)
    delta = 0.0
    if s.dp != b.dp:
        new, old = _dp_weights(base, s.dp), _dp_weights(base, b.dp)
        if new is None or old is None:
            return None
        delta += new - old
    draft_new, draft_old = _draft_in_budget(base, s), _draft_in_budget(base, b)
    if draft_new != draft_old:
        if draft_new is None or draft_old is None:
            return None
        delta += draft_new - draft_old
    return base.memory.static_gib + delta


def _draft_reserve(base: LadderBase, s: _Shape, tokens: int, cell: int) -> float | None:
    """What the draft model takes from the reserve at this rung (§1.5, :func:`draft_budget`)."""
    if not s.spec:
        return 0.0
    rule = draft_budget(s.version)
    total = base.draft_graph_gib or 0.0
    if rule.draft_weights == "reserve":
        if base.draft_weight_gib is None:
            return None
        total += base.draft_weight_gib
    if rule.draft_kv == "reserve" and base.draft_kv_gib:
        obs = base.memory.observed_tokens or tokens
        model = base.model
        ratio = 1.0 if model is None else kv_elem_bytes(model, _kv(base, s)[0]) / kv_elem_bytes(model, _kv(base, _base_shape(base))[0])
        total += base.draft_kv_gib * tokens / max(1, obs) * ratio
    return total


def _headroom(base: LadderBase, s: _Shape) -> int:
    """0.5.5's speculative headroom rows at this rung (per DP rank: max_num_reqs // dp, §1.5b)."""
    if not s.spec or not base.spec_headroom_tokens or not draft_budget(s.version).headroom:
        return 0
    b = _base_shape(base)
    if not b.spec:
        return 0
    return (base.spec_headroom_tokens - 100) * b.dp // s.dp + 100


def _tokens(base: LadderBase, m: KVCapacityModel, s: _Shape) -> int:
    """SGLang's count (§1.4 order): floor(budget / cell), + the speculative headroom, cap, page."""
    raw = math.floor(m.kv_budget_gib(s.mfs) * GIB / m.cell_bytes) + _headroom(base, s)  # added before the ≤ 0 check (§1.4)
    if raw <= 0:
        return raw
    if m.max_total_tokens is not None:
        raw = min(raw, m.max_total_tokens)
    return raw // base.page_size * base.page_size


def fraction_ceiling(free_after_graphs_gib: float, mem_fraction_static: float, baseline_gib: float, *, floor_gib: float = 0.0) -> float:
    """The largest fraction (0.001 steps) whose reserve still covers what the observed start used:
    ``mfs + (free − floor) / B`` rounded down (§1.2: each +0.01 moves ``0.01 × B`` GiB from the
    reserve into the pool; a start with 0.00 GB free after graphs is the upper bound, ladder-09)."""
    return math.floor((mem_fraction_static + (free_after_graphs_gib - floor_gib) / baseline_gib) * 1000 + 1e-6) / 1000


def _free(base: LadderBase, s: _Shape, tokens: int, cell: int) -> float | None:
    m = base.memory
    if m.observed_free_after_graphs_gib is None or m.observed_mem_fraction_static is None:
        return None
    b = _base_shape(base)
    new, old = _draft_reserve(base, s, tokens, cell), _draft_reserve(base, b, m.observed_tokens or tokens, m.cell_bytes)
    if new is None or old is None:
        return None
    r2t = (m.observed_req_to_token_gib or 0.0) * (b.dp / s.dp - 1)
    return m.observed_free_after_graphs_gib - (s.mfs - m.observed_mem_fraction_static) * m.baseline_gib - (new - old) - r2t


def _availability(base: LadderBase, flags: Mapping[str, Any]) -> Verdict:
    """The rung's flags on the running version, and the feasibility table's cells."""
    verdicts: list[Verdict] = []
    attn = attention_type(base.model) if base.model else None
    backend = flags.get("attention_backend", base.attention_backend)
    if attn == "dsa" and at_least(base.version, "0.5.23"):  # the feasibility cells name the DSA decode backend
        s = _shape(base, flags, None)
        backend = dsa_backends(gpu=base.gpu, kv_cache_dtype=_kv(base, s)[0], dcp=s.dcp, prefill_backend=s.dsa_backends[0],
                               decode_backend=s.dsa_backends[1])[1]
    sized = {lever.knob.name for lever in base.levers if lever.switch}  # the switch is asked, not the size
    probed = {lever.flag for lever in base.levers if lever.probe is not None}  # a value the flag table lists
    for field, value in flags.items():
        if field == "mem_fraction_static" or value is None or field in sized:
            continue
        verdicts.append(flag_available(base.version, field, value if field in probed else None))
    for lever in base.levers:  # the cells of each lever the rung turns on (a DCP cell names the rung's KV dtype)
        if flags.get(lever.flag) and attn is not None:
            verdicts.append(feasibility(lever.name, gpu=base.gpu, version=base.version, backend=backend, attention=attn,
                                        value=flags.get("kv_cache_dtype")))
    for lever in base.levers:  # the layout's rules (a size dividing --tp-size), on the lever's value in the rung
        value = flags.get(lever.knob.name if lever.knob.name in flags or lever.switch else lever.flag)
        if value is not None and (why := lever.unavailable(value, version=None, tp=base.tp)):
            verdicts.append(Verdict(ok=False, why=why))
    if not verdicts:
        return Verdict(ok=True, why="")
    bad = [v for v in verdicts if v.ok is False]
    unknown = [v for v in verdicts if v.ok is None]
    pick = bad or unknown
    return Verdict(ok=False if bad else (None if unknown else True), why="; ".join(v.why for v in (pick or verdicts[-1:])))


def evaluate(base: LadderBase, flags: Mapping[str, Any], *, version: str | None = None, note: str = "") -> Rung:
    """Price one rung.

    Args:
        base: The observed deployment.
        flags: SGLang field names → values over the deployment (``mem_fraction_static``,
            ``kv_cache_dtype``, ``dcp_size``, ``enable_dp_attention`` + ``dp_size``,
            ``speculative_algorithm`` (``None`` = off), ``attention_backend``).
        version: Price it with another SGLang version's rules (availability is still the
            deployment's version's).
        note: Extra words for ``why``.

    Returns:
        The :class:`Rung`.
    """
    s = _shape(base, flags, version)
    avail = _availability(base, flags)
    numerics = bool(numerics_changes({**base.flags, **flags}, base.flags))
    cell, static = _cell(base, s), _static(base, s)
    words = [note] if note else []
    if cell is None or static is None:
        words.append("needs the model's config.json (--model-config) and the draft's weight line to price this lever")
        return Rung(lever=dict(flags), tokens_per_rank=None, logical_tokens=None, per_request_max_tokens=None, free_after_graphs_gib=None,
                    starts=None, available=avail.ok, changes_numerics=numerics, why="; ".join(w for w in [*words, avail.why] if w))
    m = base.memory.model_copy(update={"static_gib": static, "cell_bytes": cell})
    tokens = _tokens(base, m, s)
    budget = m.kv_budget_gib(s.mfs)
    if tokens <= 0:
        need = (m.static_gib + (base.page_size - _headroom(base, s)) * m.cell_bytes / GIB) / m.baseline_gib
        words.append(f"does not start: static memory {static:.2f} GiB > {s.mfs:g} × baseline {m.baseline_gib:.2f} = {s.mfs * m.baseline_gib:.2f} GiB "
                     f"('Not enough memory', §4.3); needs mem_fraction_static ≥ {math.ceil(need * 1000) / 1000:.3f} to start")
        return Rung(lever=dict(flags), tokens_per_rank=tokens, logical_tokens=0, per_request_max_tokens=0,
                    free_after_graphs_gib=_round(_free(base, s, 0, cell)), starts=False, available=avail.ok, changes_numerics=numerics,
                    why="; ".join(w for w in [*words, avail.why] if w))
    logical = tokens * s.dcp * s.dp
    one = logical if s.dcp > 1 else tokens
    per_request = per_request_max_tokens(one, base.context_len)
    free = _free(base, s, tokens, cell)
    starts = None if free is None else free >= 0
    head = _headroom(base, s)
    plus = f" + {head:,} speculative headroom (0.5.5, §1.5)" if head else ""
    words.append(f"KV budget {s.mfs:g} × {m.baseline_gib:.2f} − {static:.2f} = {budget:.2f} GiB / {cell:,} B per token{plus} = {tokens:,} per rank")
    if s.dp > 1 or s.dcp > 1:
        words.append(f"logical {tokens:,} × {s.dcp * s.dp} = {logical:,}")
    if free is not None:
        words.append(f"{_free_words(base)} {free:.2f} GiB" + ("" if starts else " < 0: the reserve does not cover graphs and activations (does not start)"))
    return Rung(lever=dict(flags), tokens_per_rank=tokens, logical_tokens=logical, per_request_max_tokens=per_request,
                free_after_graphs_gib=_round(free), starts=starts, available=avail.ok, changes_numerics=numerics,
                why="; ".join(w for w in [*words, avail.why] if w))


def per_request_max_tokens(pool_tokens: int, context_len: int | None) -> int:
    """The longest single request (input + output tokens) a pool of ``pool_tokens`` holds:
    ``min(context_len − 1, pool − 1)`` (§1.4). ``pool_tokens`` is one DP rank's pool under DP
    attention (a request lives on one rank) and the logical pool (per rank × dcp) under DCP."""
    return min(context_len - 1, pool_tokens - 1) if context_len else pool_tokens - 1


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _newest_with(field: str) -> str | None:
    have = [v for v in FlagTable.bundled_versions() if table_for(v).has(field)]
    return have[-1] if have else None


def _fp8_flags(base: LadderBase) -> dict[str, Any]:
    """fp8 KV, with the backend the table says supports it where the deployment's is not known to."""
    flags: dict[str, Any] = {"kv_cache_dtype": _FP8}
    lever = next((lv for lv in base.levers if lv.flag == "kv_cache_dtype"), None)
    if base.model is None or lever is None:
        return flags
    attn = attention_type(base.model)
    if feasibility(lever.name, gpu=base.gpu, version=base.version, backend=base.attention_backend, attention=attn).ok is True:
        return flags
    for version in (base.version, *reversed(FlagTable.bundled_versions())):
        backend = supporting_backend(lever.name, gpu=base.gpu, version=version, attention=attn)
        if backend:
            flags["attention_backend"] = backend
            break
    return flags


def _ceiling(base: LadderBase, flags: Mapping[str, Any], version: str | None = None) -> float | None:
    """The rung's own fraction ceiling: :func:`fraction_ceiling` of its reserve, then lowered by
    0.001 while the rung would not start (on 0.5.5/0.5.10 the draft KV grows with the pool, §1.5)."""
    probe = evaluate(base, flags, version=version)
    if probe.free_after_graphs_gib is None:
        return None
    s = _shape(base, flags, version)
    ceil = fraction_ceiling(probe.free_after_graphs_gib, s.mfs, base.memory.baseline_gib)
    for _ in range(200):
        if ceil <= 0 or evaluate(base, {**flags, "mem_fraction_static": ceil}, version=version).starts is not False:
            break
        ceil = round(ceil - 0.001, 3)
    return ceil


def _free_words(base: LadderBase) -> str:
    """How a rung's free memory is named: after CUDA graphs, or once started when none were captured."""
    return "free once started (no CUDA graphs captured)" if base.graphs_captured is False else "free after graphs"


def _at_ceiling(base: LadderBase, flags: dict[str, Any], version: str | None = None, note: str = "") -> Rung | None:
    ceil = _ceiling(base, flags, version)
    if ceil is None or ceil <= 0 or ceil >= 1:
        return None
    return evaluate(base, {**flags, "mem_fraction_static": ceil}, version=version,
                    note=(note + "; " if note else "") + f"at this rung's fraction ceiling {ceil:.3f} ({_free_words(base)} ≈ 0, as the observed start used the reserve)")


def _dp_rungs(base: LadderBase, fp8: dict[str, Any]) -> list[Rung]:
    if base.tp <= 1 or base.dp > 1 or base.model is None or base.model.attention != "mla":
        return []
    dp = {"enable_dp_attention": True, "dp_size": base.tp}
    extra = dp_attention_extra_weight_gib(base.model, tp=base.tp, dp=base.tp)
    words = (f"DP attention dp {base.tp}: attention weights +{extra[0]:.2f} GiB and embedding +{extra[1]:.2f} GiB per GPU (attn_tp 1, "
             "deepseek_v2.py); one pool per DP rank, one request ≤ one rank's pool, max_running_requests and chunked_prefill_size // dp (§1.5b)"
             if extra else "DP attention")
    out = [evaluate(base, dp, note=words)]
    for flags in (dp, {**fp8, **dp}) if fp8 else (dp,):
        rung = _at_ceiling(base, dict(flags), note=words)
        if rung is not None:
            out.append(rung)
    return out


def _dcp_rungs(base: LadderBase, fp8: dict[str, Any]) -> list[Rung]:
    if base.tp <= 1 or base.model is None or base.model.attention != "mla":
        return []
    version = None if flag_available(base.version, "dcp_size").ok else _newest_with("dcp_size")
    if version is None and not flag_available(base.version, "dcp_size").ok:
        return []
    note = f"priced with SGLang {version}'s rules (draft budget: {draft_budget(version).source})" if version else ""
    note = "; ".join(w for w in (f"DCP {base.tp}: KV interleaved slot % {base.tp} over the ranks, a request spans the logical pool "
                                  "(sglang#14194, #31514; DSA indexer replicated ×dcp, #31821)", note) if w)
    dcp = {"dcp_size": base.tp}
    rungs = [evaluate(base, dcp, version=version, note=note)]
    return rungs + [evaluate(base, {**fp8, **dcp}, version=version, note=note)] if fp8 else rungs


def ladder(base: LadderBase) -> list[Rung]:
    """Every rung: as observed, the fraction's ceiling, fp8 KV (alone and at its ceiling), DP
    attention at dp = tp (at the observed fraction and at its ceiling, alone and with fp8), DCP at
    dcp = tp (priced with the newest version that has it when this one does not), speculative
    decoding off (at the observed fraction and at its ceiling). Levers the model or version cannot
    take are left out (DP attention and DCP for MLA models at tp > 1; fp8 when the KV is fp8 already).

    Args:
        base: The observed deployment.

    Returns:
        The rungs, the observed one first.
    """
    rungs = [evaluate(base, {}, note="as observed")]
    top = _at_ceiling(base, {})
    if top is not None:
        rungs.append(top)
    fp8: dict[str, Any] = {}
    elem = None if base.model is None else kv_elem_bytes(base.model, _kv(base, _base_shape(base))[0])
    if base.model is not None and elem is not None and elem > 1:
        fp8 = _fp8_flags(base)
        rungs.append(evaluate(base, fp8, note=f"fp8 KV: {elem:g} → 1 B per element (§1.3)"))
        top = _at_ceiling(base, dict(fp8))
        if top is not None:
            rungs.append(top)
    rungs += _dp_rungs(base, fp8)
    rungs += _dcp_rungs(base, fp8)
    if base.speculative_algorithm:
        off: dict[str, Any] = {"speculative_algorithm": None}
        rungs.append(evaluate(base, off, note="speculative decoding off: frees the draft's weights, KV and graphs (§1.5), at a decode-speed cost"))
        for flags in (off, {**fp8, **off}) if fp8 else (off,):
            top = _at_ceiling(base, dict(flags))
            if top is not None:
                rungs.append(top)
    return rungs
