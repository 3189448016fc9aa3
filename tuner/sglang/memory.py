"""The KV-capacity model: SGLang's token pool as a function of ``mem_fraction_static``.

One concept: SGLang's memory rule (``shared/sglang-reference.md`` §1.2, §1.4, §8)::

    max_total_num_tokens(mfs) = floor((mfs × B − S) × 2^30 / cell) // page × page, capped

with ``B`` the free GPU memory at the baseline (GiB, MIN over ranks, §1.1), ``S`` the static
memory allocated between the baseline and profiling (weights ``W`` plus anything else ``X``, §8),
and ``cell`` the KV bytes per token per GPU (§1.3, §1.5). ``mfs`` is a share of the *whole*
baseline for weights **plus** KV, not of what is left after the weights (§1.2). The reserve
``(1 − mfs) × B`` holds the req_to_token table, CUDA graphs, the draft model (0.5.5/0.5.10) and
activations (§1.6); what is left after graphs is the runtime headroom (§8).

The model is monotone in ``mfs``, so one observed start calibrates it (:meth:`KVCapacityModel.from_report`)
and predicts every other fraction; :func:`must_fail` turns failed starts into proofs that skip
configs without a restart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from tuner.errors import LogError
from tuner.sglang.failures import FailureClass
from tuner.sglang.logs import LogReport, RankMemory
from tuner.sglang.modelconfig import ModelArch
from tuner.sglang.versions import at_least

__all__ = [
    "GIB",
    "kv_elem_bytes",
    "cell_size_bytes",
    "req_to_token_gib",
    "max_req_input_len",
    "context_len_from_max_req_input_len",
    "effective_max_running_requests",
    "sglang_reserve_gib",
    "tokens_from_pool_drop",
    "KVCapacityModel",
    "must_fail",
]

GIB = 2**30
"""Bytes per GiB; SGLang's GPU "GB" is GiB (§0 Units)."""

_SPECULATIVE = {"EAGLE", "EAGLE3", "NEXTN", "MTP", "STANDALONE"}
_DTYPE_BYTES = {
    "bfloat16": 2.0, "bf16": 2.0, "float16": 2.0, "fp16": 2.0, "half": 2.0, "float32": 4.0, "fp32": 4.0, "float": 4.0,
    "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "fp8": 1.0,
    "mxfp8": 1.0 + 1.0 / 32,
    "fp4_e2m1": 0.5 + 1.0 / 16, "nvfp4": 0.5 + 1.0 / 16, "fp4_mx_block16": 0.5 + 1.0 / 16,
}


def kv_elem_bytes(model: ModelArch, kv_cache_dtype: str = "auto") -> float:
    """Bytes per KV element (§1.3): ``auto`` = the model dtype, or fp8 when the checkpoint's quant
    config says ``kv_cache_quant_algo: FP8``; fp8 = 1 B; FP4 = half a byte plus a scale per 16
    (approximation of the scale buffers); mxfp8 adds a 1/32 scale term.

    Raises:
        ValueError: An unknown KV dtype.
    """
    dtype = kv_cache_dtype.lower().replace("torch.", "")
    if dtype == "auto":
        if model.kv_cache_quant_algo and model.kv_cache_quant_algo.startswith("FP8"):
            return 1.0
        dtype = model.torch_dtype.lower().replace("torch.", "")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")
    return _DTYPE_BYTES[dtype]


def _layer_cell(model: ModelArch, tp: int, elem: float, dsa_raw: bool = False) -> float:
    """KV bytes per token per layer on one GPU (§1.3)."""
    if model.attention == "mla":
        assert model.kv_lora_rank is not None and model.qk_rope_head_dim is not None
        if model.index_head_dim and elem == 1.0 and not dsa_raw:
            # NSA/flashmla fp8 row: fp8 latent + 4 B scale per 128 + bf16 rope (656 B for 512/64)
            return model.kv_lora_rank + model.kv_lora_rank / 128 * 4 + model.qk_rope_head_dim * 2
        return (model.kv_lora_rank + model.qk_rope_head_dim) * elem  # not divided by tp
    assert model.head_dim is not None and model.num_kv_heads is not None
    heads = max(1, model.num_kv_heads // max(1, tp))  # replicated below one head per rank
    return heads * (model.head_dim + (model.v_head_dim or model.head_dim)) * elem


def cell_size_bytes(
    model: ModelArch,
    *,
    tp: int = 1,
    kv_cache_dtype: str = "auto",
    version: str = "0.5.5",
    draft: ModelArch | None = None,
    speculative_algorithm: str | None = None,
    dp_attention_size: int = 1,
    dsa_raw: bool = False,
) -> int:
    """KV-cache bytes per token per GPU, as SGLang sizes the pool (§1.3, §1.5, §1.5b).

    MHA/GQA: ``max(1, kv_heads // attn_tp) × (head_dim + v_head_dim) × layers × elem``; MLA:
    ``(kv_lora_rank + qk_rope_head_dim) × layers × elem``, not divided by TP (a DSA/NSA model's
    fp8 row is ``kv_lora_rank + kv_lora_rank/128 × 4 + qk_rope_head_dim × 2`` = 656 B per layer,
    ``shared/cases/ladder/README.md``, ladder-01); the DeepSeek NSA indexer adds ``(index_head_dim + index_head_dim/128×4) × layers × 1 B``. From 0.5.16 on,
    speculative decoding puts the draft KV inside the cell: ``cell × (1 + draft_layers /
    target_layers)`` with the draft's layers = ``num_nextn_predict_layers`` (MTP), the draft
    model's layers, or 1 (an EAGLE head) (§1.5). Before 0.5.16 the draft KV comes out of the
    reserve instead, so the cell is the target's alone.

    Args:
        model: The target model.
        tp: Tensor-parallel size.
        kv_cache_dtype: SGLang's ``--kv-cache-dtype``.
        version: SGLang version (decides the speculative rule).
        draft: The draft model, if a separate one.
        speculative_algorithm: ``--speculative-algorithm`` (``None`` = off).
        dp_attention_size: DP-attention size; ``attn_tp = tp / dp`` (§1.5b).
        dsa_raw: A DSA model's latent row is the raw ``(kv_lora_rank + qk_rope_head_dim) × elem``
            (0.5.23 with a ``trtllm`` or both-``tilelang`` DSA backend,
            ``kv_cache_configurator.calculate_mla_kv_cache_dim``;
            :func:`tuner.sglang.levers.dsa_kv_settings` decides it).

    Returns:
        Bytes per token (rounded to an integer).

    Raises:
        ValueError: Unknown KV dtype.
    """
    elem = kv_elem_bytes(model, kv_cache_dtype)
    attn_tp = max(1, tp // max(1, dp_attention_size))
    cell = _layer_cell(model, attn_tp, elem, dsa_raw) * model.kv_layers  # hybrid models: full-attention layers only
    if model.attention == "mla" and model.index_head_dim:
        cell += (model.index_head_dim + model.index_head_dim / 128 * 4) * model.num_layers
    algo = (speculative_algorithm or "").upper()
    if algo in _SPECULATIVE and at_least(version, "0.5.16"):
        if draft is not None:
            draft_layers = draft.num_layers
        elif model.num_nextn_predict_layers:
            draft_layers = model.num_nextn_predict_layers
        else:
            draft_layers = 1
        cell *= 1 + draft_layers / model.kv_layers
    return int(round(cell))


def req_to_token_gib(max_running_requests: int, context_len: int, *, num_draft_tokens: int = 0) -> float:
    """GiB of the req_to_token table: int32 ``[max_num_reqs, context_len + 4 (+ draft tokens)]`` (§1.6)."""
    return max_running_requests * (context_len + 4 + num_draft_tokens) * 4 / GIB


def max_req_input_len(max_total_num_tokens: int, context_len: int) -> int:
    """Longest accepted input: ``min(context_len − 1, max_total_num_tokens − 1) − 5`` (§1.4, case-26)."""
    return min(context_len - 1, max_total_num_tokens - 1) - 5


def context_len_from_max_req_input_len(max_total_num_tokens: int, max_req_input_len: int) -> int | None:
    """The ``context_len`` a server's ``max_req_input_len`` implies (the inverse of
    :func:`max_req_input_len`, §1.4), or ``None`` when the pool set it: then ``context_len ≥
    max_total_num_tokens`` and only that bound is known.

    Args:
        max_total_num_tokens: The KV pool, tokens.
        max_req_input_len: ``/get_server_info``'s ``max_req_input_len``, tokens.
    """
    implied = max_req_input_len + 6
    return implied if implied < max_total_num_tokens else None


def effective_max_running_requests(
    max_total_num_tokens: int, context_len: int, *, requested: int | None = None, version: str = "0.5.5",
    speculative_algorithm: str | None = None, dp_size: int = 1,
) -> int:
    """SGLang's effective ``max_running_requests`` (§2.3, §1.5).

    The req_to_token pool holds ``requested``, else ``clamp(int(tokens / context_len × 512), 2048,
    4096)`` requests. 0.5.5: ``min(requested // dp or tokens // 2, pool)``; 0.5.10: a requested
    value is also capped by that estimate; 0.5.16+: ``min(requested // dp, tokens // 2)``.
    Speculative decoding with no request sets 48 first (§1.5).

    Args:
        max_total_num_tokens: The KV pool.
        context_len: The server's context length.
        requested: ``--max-running-requests`` (``None`` = unset).
        version: SGLang version.
        speculative_algorithm: ``--speculative-algorithm``, if any.
        dp_size: DP-attention size.

    Returns:
        The effective value.
    """
    if requested is None and (speculative_algorithm or "").upper() in _SPECULATIVE:
        requested = 48
    estimate = min(4096, max(2048, int(max_total_num_tokens / context_len * 512)))
    if at_least(version, "0.5.16"):
        return min(requested // dp_size, max_total_num_tokens // 2) if requested else min(estimate, max_total_num_tokens // 2)
    pool = requested if requested is not None else estimate
    value = requested // dp_size if requested is not None else max_total_num_tokens // 2
    if requested is not None and at_least(version, "0.5.10"):
        pool = min(pool, estimate)
    return min(value, pool)


def sglang_reserve_gib(*, chunked_prefill_size: int | None, cuda_graph_max_bs: int | None, tp_size: int = 1, pp_size: int = 1) -> float:
    """SGLang 0.5.5's own estimate of what runs out of the reserve (§2.2), without the >60 GB floor:
    ``512 + max(chunked_prefill_size, 2048) × 1.5 + cuda_graph_max_bs × 2 + tp × pp / 8 × 1024`` MB."""
    chunk = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else 16384
    mb = 512 + max(chunk, 2048) * 1.5 + (cuda_graph_max_bs or 0) * 2 + tp_size * pp_size / 8 * 1024
    return mb / 1024


def tokens_from_pool_drop(drop_gib: float, cell_bytes: int, *, max_running_requests: int, context_len: int, page_size: int = 1) -> int:
    """Token count implied by the drop of free memory from ``Load weight end`` to ``Memory pool end``:
    that drop is the KV pool (``(tokens + page) × cell``, §1.3) plus the req_to_token table (§1.6)."""
    kv_gib = drop_gib - req_to_token_gib(max_running_requests, context_len)
    return int(kv_gib * GIB / cell_bytes) - page_size


def _after_pool_free(rank: RankMemory) -> float | None:
    """Free GiB right after the KV pool: ``Memory pool end. avail mem``, else ``Capture cuda graph begin ... avail mem``."""
    return rank.memory_pool_end_avail_gib if rank.memory_pool_end_avail_gib is not None else rank.graph_begin_avail_gib


class KVCapacityModel(BaseModel):
    """``max_total_num_tokens`` and runtime headroom as functions of ``mem_fraction_static``.

    Attributes:
        baseline_gib: ``B``, free GPU memory at the baseline (MIN over ranks).
        static_gib: ``S = W + X``, memory allocated between baseline and profiling.
        weight_gib: ``W`` alone, for display (``None`` when unknown).
        cell_bytes: KV bytes per token per GPU.
        source: ``"log"`` (calibrated from an observed start) or ``"first_principles"``.
        observed_mem_fraction_static / observed_tokens: the calibration point, if any.
        observed_free_after_graphs_gib: ``available_gpu_mem`` at the calibration point.
        observed_graph_gib / observed_graph_max_bs: CUDA-graph memory and largest captured bs.
        observed_req_to_token_gib: the req_to_token table at the calibration point.
        other_reserve_gib: what else the reserve held at the calibration point (attention
            workspace, draft model, allocator slack): reserve − req_to_token − graphs − free.
        max_total_tokens: a ``--max-total-tokens`` cap, if known (§1.4).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    baseline_gib: float
    static_gib: float
    weight_gib: float | None = None
    cell_bytes: int
    source: str = "first_principles"
    observed_mem_fraction_static: float | None = None
    observed_tokens: int | None = None
    observed_free_after_graphs_gib: float | None = None
    observed_graph_gib: float | None = None
    observed_graph_max_bs: int | None = None
    observed_req_to_token_gib: float | None = None
    other_reserve_gib: float | None = None
    max_total_tokens: int | None = None

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_first_principles(cls, gpu_total_gib: float, weight_gib: float, cell_bytes: int, overhead_gib: float = 1.56) -> KVCapacityModel:
        """A model without an observed start.

        Args:
            gpu_total_gib: GPU memory (nvidia-smi total, GiB).
            weight_gib: Weights per GPU (GiB).
            cell_bytes: :func:`cell_size_bytes`.
            overhead_gib: Memory in use at the baseline (CUDA context, NCCL and custom
                all-reduce buffers); §1.8 measured 1.56 GiB at tp 8, §8 says "about 1–2 GiB".

        Returns:
            The model (``static_gib = weight_gib``: nothing else allocated before profiling).
        """
        return cls(baseline_gib=gpu_total_gib - overhead_gib, static_gib=weight_gib, weight_gib=weight_gib, cell_bytes=cell_bytes)

    @classmethod
    def from_report(cls, report: LogReport, cell_bytes: int | None, mem_fraction_static: float, *, max_total_tokens: int | None = None) -> KVCapacityModel:
        """Calibrate from one observed start (§8: one point gives ``B`` and predicts every mfs).

        ``B`` is the smallest ``Load weight begin. avail mem`` over ranks (else weights + free
        after weights). ``S`` is solved from the logged token count,
        ``S = mfs × B − tokens × cell``, unless a ``--max-total-tokens`` cap made the
        count smaller than the budget, in which case ``S = B − free after weights``.

        Args:
            report: A parsed log with the weight lines and a token count.
            cell_bytes: Bytes per token per GPU; ``None`` derives it from the logged KV size
                (``KV size / (tokens + 1)``).
            mem_fraction_static: The fraction that start used.
            max_total_tokens: A known ``--max-total-tokens`` of that start.

        Returns:
            The calibrated model.

        Raises:
            LogError: The log lacks the weight lines or the KV token count.
        """
        ranks = [r for r in report.ranks.values() if r.weight_gib is not None or r.load_begin_avail_gib is not None]
        prim = report.primary()
        tokens = report.max_total_num_tokens
        if not ranks and prim is not None and _after_pool_free(prim) is not None and tokens and tokens > 0:
            return cls._from_pool_end(report, cell_bytes, mem_fraction_static, max_total_tokens=max_total_tokens)
        if not ranks or prim is None:
            raise LogError("the log has no 'Load weight' lines, so the memory model cannot be calibrated", hint="pass the log of a whole server start (from 'Load weight begin')")
        begins = [r.load_begin_avail_gib for r in ranks if r.load_begin_avail_gib is not None]
        ends = [r.weight_end_avail_gib for r in ranks if r.weight_end_avail_gib is not None]
        weight = max((r.weight_gib for r in ranks if r.weight_gib is not None), default=None)
        if begins:
            baseline = min(begins)
        elif ends and weight is not None:
            baseline = min(ends) + weight
        else:
            raise LogError("the log has neither 'Load weight begin. avail mem' nor both weight numbers", hint="pass the log of a whole server start")
        kv_gib = prim.kv_pool_gib
        if cell_bytes is None:
            if not tokens or kv_gib is None:
                raise LogError("the log has no 'KV Cache is allocated' size, so the KV cell size is unknown", hint="pass --model-config with the model's config.json")
            cell_bytes = int(round(kv_gib * GIB / (tokens + 1)))
        cap = max_total_tokens or report.max_total_tokens_requested
        capped = cap is not None and tokens is not None and tokens >= cap - 1
        if tokens and tokens > 0 and not capped:
            static = mem_fraction_static * baseline - (tokens + 0.5) * cell_bytes / GIB  # mid-cell: floor()
        elif ends:
            static = baseline - min(ends)
        else:
            raise LogError("the log has no KV token count and no 'Load weight end' line", hint="pass the log of a whole server start")
        sched = report.scheduler
        free = sched.available_gpu_mem_gib if sched and sched.available_gpu_mem_gib is not None else prim.graph_end_avail_gib
        graph = (prim.graph_gib or 0.0) + ((prim.draft.graph_gib or 0.0) if prim.draft else 0.0) if prim.graph_gib is not None else None
        if graph is None and sched is not None and sched.available_gpu_mem_gib is not None:
            graph = 0.0  # the start finished without a capture line: CUDA graphs were disabled
        r2t = None
        if sched and sched.max_running_requests and sched.context_len:
            r2t = req_to_token_gib(sched.max_running_requests, sched.context_len)
        other = None
        if free is not None and graph is not None and r2t is not None:
            other = (1 - mem_fraction_static) * baseline - r2t - graph - free
        return cls(
            baseline_gib=baseline, static_gib=static, weight_gib=weight, cell_bytes=cell_bytes, source="log",
            observed_mem_fraction_static=mem_fraction_static, observed_tokens=tokens,
            observed_free_after_graphs_gib=free, observed_graph_gib=graph, observed_graph_max_bs=prim.cuda_graph_max_bs,
            observed_req_to_token_gib=r2t, other_reserve_gib=other, max_total_tokens=cap,
        )

    @classmethod
    def _from_pool_end(cls, report: LogReport, cell_bytes: int | None, mem_fraction_static: float, *,
                       max_total_tokens: int | None = None) -> KVCapacityModel:
        """Calibrate a log without weight lines from its KV line and ``Memory pool end`` (else the
        ``avail mem`` of ``Capture cuda graph begin``, the next free-memory reading).

        SGLang sizes the pool as ``rest = post − pre × (1 − mfs)`` (§1.2) and then allocates the
        req_to_token table and the pool before printing ``Memory pool end. avail mem=F``
        (0.5.5.post3 ``model_runner.py`` ``init_memory_pool``), so ``F = post − r2t − (tokens + page) × cell``
        and ``pre = (F + r2t + ½ cell) / (1 − mfs)``; ``S = mfs × pre − (tokens + ½) × cell``. The
        req_to_token table comes from the scheduler line (``max_running_requests``, ``context_len``).

        Raises:
            LogError: No cell size, or the numbers leave no room for weights (``S ≤ 0``: memory
                outside SGLang's accounting; ``Load weight begin`` would settle the baseline).
        """
        prim = report.primary()
        tokens = report.max_total_num_tokens
        free = _after_pool_free(prim) if prim is not None else None
        assert prim is not None and free is not None and tokens
        kv_gib = prim.kv_pool_gib
        if cell_bytes is None:
            if kv_gib is None:
                raise LogError("the log has no 'Load weight' lines and no KV size, so the memory model cannot be calibrated",
                               hint="pass --model-config with the model's config.json, or the log from 'Load weight begin'")
            cell_bytes = int(round(kv_gib * GIB / (tokens + 1)))
        sched = report.scheduler
        r2t = req_to_token_gib(sched.max_running_requests, sched.context_len) if sched and sched.max_running_requests and sched.context_len else 0.0
        baseline = (free + r2t + 0.5 * cell_bytes / GIB) / (1 - mem_fraction_static)
        static = mem_fraction_static * baseline - (tokens + 0.5) * cell_bytes / GIB
        if static <= 0:
            raise LogError(f"'Memory pool end. avail mem={free:.2f} GB' leaves less than the (1 − {mem_fraction_static:g}) reserve SGLang keeps "
                           "for this pool: memory outside SGLang's accounting, so the baseline cannot be back-solved",
                           hint="the log's 'Load weight begin. avail mem' line would settle the baseline")
        sched_free = sched.available_gpu_mem_gib if sched and sched.available_gpu_mem_gib is not None else prim.graph_end_avail_gib
        return cls(baseline_gib=baseline, static_gib=static, cell_bytes=cell_bytes, source="log (back-solved from the free memory after the KV pool, no weight lines)",
                   observed_mem_fraction_static=mem_fraction_static, observed_tokens=tokens, observed_free_after_graphs_gib=sched_free,
                   observed_graph_gib=prim.graph_gib, observed_graph_max_bs=prim.cuda_graph_max_bs, observed_req_to_token_gib=r2t or None,
                   max_total_tokens=max_total_tokens or report.max_total_tokens_requested)

    # -- predictions --------------------------------------------------------------------------

    def kv_budget_gib(self, mem_fraction_static: float) -> float:
        """``mfs × B − S``: the profiled KV budget in GiB (§1.2); ≤ 0 means startup KV OOM."""
        return mem_fraction_static * self.baseline_gib - self.static_gib

    def tokens(self, mem_fraction_static: float, *, page_size: int = 1, max_total_tokens: int | None = None) -> int:
        """Predicted ``max_total_num_tokens`` (§1.2, §1.4): floor, cap, page alignment.

        Args:
            mem_fraction_static: The fraction.
            page_size: Tokens per page (alignment).
            max_total_tokens: A ``--max-total-tokens`` cap (default: the model's own, if any).

        Returns:
            Tokens; ≤ 0 means the start fails with ``Not enough memory`` (§4.3).
        """
        raw = math.floor(self.kv_budget_gib(mem_fraction_static) * GIB / self.cell_bytes)
        if raw <= 0:
            return raw
        cap = max_total_tokens if max_total_tokens is not None else self.max_total_tokens
        if cap is not None:
            raw = min(raw, cap)
        return raw // page_size * page_size

    def min_fraction(self, *, page_size: int = 1) -> float:
        """Smallest ``mem_fraction_static`` whose pool holds one page (> 1 when no fraction starts)."""
        return self.fraction_for_tokens(page_size, page_size=page_size)

    def fraction_for_tokens(self, tokens: int, *, page_size: int = 1) -> float:
        """Fraction whose pool holds at least ``tokens`` (rounded up to whole pages)."""
        pages = math.ceil(tokens / page_size) * page_size
        return (self.static_gib + pages * self.cell_bytes / GIB) / self.baseline_gib

    def tokens_per_hundredth(self) -> float:
        """Δtokens per +0.01 of fraction: ``0.01 × B × 2^30 / cell`` (≈14.4k in §1.8)."""
        return 0.01 * self.baseline_gib * GIB / self.cell_bytes

    def reserve_gib(self, mem_fraction_static: float) -> float:
        """The ``(1 − mfs) × B`` reserve (§1.2)."""
        return (1 - mem_fraction_static) * self.baseline_gib

    def graph_gib(self, cuda_graph_max_bs: int | None) -> float | None:
        """CUDA-graph memory: the observed amount, scaled linearly with the largest captured batch
        size when it differs (graphs grow with ``cuda_graph_max_bs``, §1.6); ``None`` if unknown."""
        if self.observed_graph_gib is None:
            return None
        if cuda_graph_max_bs and self.observed_graph_max_bs:
            return self.observed_graph_gib * cuda_graph_max_bs / self.observed_graph_max_bs
        return self.observed_graph_gib

    def headroom_gib(
        self,
        mem_fraction_static: float,
        *,
        max_running_requests: int,
        context_len: int,
        cuda_graph_max_bs: int | None = None,
        chunked_prefill_size: int | None = None,
        graph_gib: float | None = None,
        other_reserve_gib: float | None = None,
        num_draft_tokens: int = 0,
    ) -> float:
        """Predicted free GPU memory after graphs, the runtime headroom for activations (§1.6, §8).

        ``(1 − mfs) × B − req_to_token − graphs − other``. Graphs and other default to what the
        calibration start showed (graphs scaled by ``cuda_graph_max_bs``); without a calibration
        they default to SGLang's own reserve rule of §2.2 (which also counts the activation of a
        ``chunked_prefill_size`` chunk, so the result is then what is left after one chunk).

        Args:
            mem_fraction_static: The fraction.
            max_running_requests: The req_to_token pool size (effective value).
            context_len: Context length of the server.
            cuda_graph_max_bs: Largest captured decode batch.
            chunked_prefill_size: Chunk size (first-principles estimate only).
            graph_gib: Override the graph memory.
            other_reserve_gib: Override the rest of the reserve.
            num_draft_tokens: Speculative draft tokens per request (req_to_token width).

        Returns:
            GiB; negative means the start or the first large batch runs out of memory.
        """
        r2t = req_to_token_gib(max_running_requests, context_len, num_draft_tokens=num_draft_tokens)
        graphs = graph_gib if graph_gib is not None else self.graph_gib(cuda_graph_max_bs)
        other = other_reserve_gib if other_reserve_gib is not None else self.other_reserve_gib
        if graphs is None or other is None:
            graphs, other = 0.0, sglang_reserve_gib(chunked_prefill_size=chunked_prefill_size, cuda_graph_max_bs=cuda_graph_max_bs)
        return self.reserve_gib(mem_fraction_static) - r2t - graphs - other


# ---------------------------------------------------------------------------------------------
# Monotone bounds for the study
# ---------------------------------------------------------------------------------------------

_RESERVE_KNOBS = ("max_running_requests", "cuda_graph_max_bs", "chunked_prefill_size", "max_prefill_tokens", "context_length")
"""Knobs whose larger values take more of the ``1 − mfs`` reserve (§1.6)."""


def _knob(value: Any) -> float | None:
    if value is None:
        return None
    v = float(value)
    return math.inf if v <= 0 else v  # chunked_prefill_size -1: no chunking, the largest activations


_HOST_KNOBS = ("hicache_size", "hicache_ratio", "mem_fraction_static")


def _host_pool_at_least(candidate: Mapping[str, Any], failed: Mapping[str, Any]) -> bool:
    """True when ``candidate``'s HiCache host pool is at least ``failed``'s, all else equal (§7)."""
    if not candidate.get("enable_hierarchical_cache"):
        return False
    others = (set(candidate) | set(failed)) - {*_HOST_KNOBS, *_RESERVE_KNOBS}
    if any(candidate.get(k) != failed.get(k) for k in others):
        return False
    size, failed_size = candidate.get("hicache_size") or 0, failed.get("hicache_size") or 0
    if size > 0 or failed_size > 0:
        return size > 0 and failed_size > 0 and size >= failed_size
    pairs = [(candidate.get(k), failed.get(k)) for k in ("hicache_ratio", "mem_fraction_static")]
    return all(a is not None and b is not None and a >= b for a, b in pairs)


def must_fail(candidate: Mapping[str, Any], failures: Iterable[tuple[Mapping[str, Any], FailureClass]]) -> tuple[bool, int | None]:
    """Whether an earlier failed start proves that ``candidate`` fails too (monotone bounds, §1.2).

    - CUDA-graph OOM at fraction ``x`` (the reserve was too small): any fraction ≥ ``x`` with
      every reserve knob (``max_running_requests``, ``cuda_graph_max_bs``, ``chunked_prefill_size``,
      ``max_prefill_tokens``, ``context_length``) ≥ the failed one fails.
    - Startup KV OOM at ``x`` (``mfs × B`` below the weights): any fraction ≤ ``x`` fails; the
      reserve knobs do not enter the profiled budget.
    - Weight-load OOM: fails at every fraction and reserve setting (weights load first).
    - Host-memory failure of the hierarchical cache: a host pool at least as large fails too:
      ``hicache_size`` ≥ the failed one (it overrides the ratio), or with the ratio (size unset)
      ``hicache_ratio`` ≥ and ``mem_fraction_static`` ≥ the failed ones (the host pool is the device
      pool × ratio, §7); reserve knobs may differ.

    Every other parameter must be equal (``None`` = SGLang's default counts as a value).

    Args:
        candidate: Parameters by SGLang field name; needs ``mem_fraction_static``.
        failures: ``(params, failure class)`` of earlier starts.

    Returns:
        ``(True, index of the proving failure)`` or ``(False, None)``.
    """
    mfs = candidate.get("mem_fraction_static")
    for i, (params, cls) in enumerate(failures):
        if cls is FailureClass.HOST_MEMORY:
            if _host_pool_at_least(candidate, params):
                return True, i
            continue
        others = (set(candidate) | set(params)) - {"mem_fraction_static", *_RESERVE_KNOBS}
        if any(candidate.get(k) != params.get(k) for k in others):
            continue
        failed_mfs = params.get("mem_fraction_static")
        if cls is FailureClass.WEIGHT_LOAD_OOM:
            return True, i  # weights load before mfs or any reserve knob matters
        if mfs is None or failed_mfs is None:
            continue
        if cls is FailureClass.STARTUP_KV_OOM and mfs <= failed_mfs:
            return True, i
        if cls is FailureClass.CUDA_GRAPH_OOM and mfs >= failed_mfs:
            ok = True
            for k in _RESERVE_KNOBS:
                a, b = _knob(candidate.get(k)), _knob(params.get(k))
                if a == b:
                    continue
                if a is None or b is None or a < b:
                    ok = False
                    break
            if ok:
                return True, i
    return False, None
