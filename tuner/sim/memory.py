"""The simulated device-memory ledger: SGLang's defaults and KV-pool sizing, per GPU, by version.

Everything here is arithmetic on bytes, re-derived from ``shared/sglang-reference.md``:
defaults (§2.1 chunked_prefill_size / cuda_graph_max_bs by GPU size, §2.2 mem_fraction_static,
§2.3 max_running_requests, §1.5 speculative decoding), the two free-memory measurements (§1.1),
the pool formula (§1.2), cell sizes (§1.3), caps and page rounding (§1.4), the
``+page_size`` dummy rows, the req_to_token table (§1.6), CUDA-graph capture lists (§2.1) and the
HiCache host pool (§7). :func:`plan_memory` walks the startup stages on every rank and stops at
the first stage that does not fit, recording which (the log wording is :mod:`tuner.sim.startup`'s).

Simulator-own constants (not SGLang facts, fitted so that §1.8's reference deployment and the
handed cases come out right; see :data:`GRAPH_BYTES_PER_LAYER_MOE`):
the CUDA context / NCCL buffers (:mod:`tuner.sim.gpus`), the attention workspace, and CUDA-graph
memory, modelled as a fixed cost per captured batch size and layer plus the activations of the
largest captured batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from tuner.sim.args import ParsedArgs
from tuner.sim.dsa import DsaConfig, resolve_dsa
from tuner.sim.errors import SimError
from tuner.sim.gpus import MIB, GpuSpec
from tuner.sim.models import GIB, ModelSpec, dp_attention_extra_bytes, load_model, weight_bytes_per_gpu
from tuner.sim.speculative import check_flags, profiled_cell

__all__ = [
    "ServerConfig",
    "SpecConfig",
    "DraftSpec",
    "MemoryPlan",
    "RankMemory",
    "StartupFailure",
    "resolve_server_config",
    "plan_memory",
    "cell_size_bytes",
    "capture_batch_sizes",
    "graph_bytes",
    "default_mem_fraction_static",
    "ATTENTION_WORKSPACE_BYTES",
    "GRAPH_BYTES_PER_LAYER_DENSE",
    "GRAPH_BYTES_PER_LAYER_MOE",
]

ATTENTION_WORKSPACE_BYTES = 256 * MIB
"""Attention-backend workspace allocated between ``Memory pool end`` and graph capture (simulator's)."""

GRAPH_BYTES_PER_LAYER_DENSE = 360 * 1024
"""CUDA-graph bytes per captured batch size and dense layer (simulator's).

Anchored on SGLang's own estimate in the default-fraction reserve, ``cuda_graph_max_bs × 2`` MB
(§2.2: about 0.5 GB for Llama-3.1-8B's 36 sizes × 32 layers at max_bs 256, ~1 GB at 512), and
case-21 (a 0.5B model, 8 sizes × 24 layers: 0.15 GB logged, ~0.1 GiB here).
"""

GRAPH_BYTES_PER_LAYER_MOE = int(0.525 * 1024 * 1024)
"""CUDA-graph bytes per captured batch size, MoE layer and token per request (simulator's).

Verify graphs of speculative decoding hold ``num_draft_tokens`` tokens per request, so their
per-graph cost is that many times larger. Fitted to §1.8 (Kimi-K2.5 + EAGLE-3, tp 8, mfs 0.88,
23 verify sizes × 61 layers × 4 tokens: ≈7.43 GiB left after graphs). It lets case-01
(Qwen3-235B-A22B, tp 4, 52 sizes × 94 layers) start at 0.93 as it did (~2.6 GiB of graphs);
case-19's 6.19 GB (Llama-4-Maverick, 52 × 48, a reported anomaly) comes out at ~1.4 GiB.
"""

HICACHE_HOST_RESERVE_BYTES = 10 * GIB
"""Host RAM SGLang leaves free when sizing the HiCache host pool: ``available - 10 GiB`` (§4.3, §7)."""

KV_DTYPE_BYTES = {
    "bfloat16": 2.0, "float16": 2.0, "float32": 4.0, "bf16": 2.0,
    "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "mxfp8": 1.0 + 1.0 / 32,
    "fp4_e2m1": 0.5 + 1.0 / 16, "nvfp4": 0.5 + 1.0 / 16, "fp4_mx_block16": 0.5 + 1.0 / 16,
}
"""Bytes per KV element by resolved ``--kv-cache-dtype`` (§1.3; fp4 carries one scale per 16)."""

TORCH_DTYPE_NAMES = {
    "bfloat16": "torch.bfloat16", "bf16": "torch.bfloat16", "float16": "torch.float16",
    "float32": "torch.float32", "fp8_e4m3": "torch.float8_e4m3fn", "fp8_e5m2": "torch.float8_e5m2",
    "mxfp8": "torch.float8_e4m3fn", "fp4_e2m1": "torch.uint8", "nvfp4": "torch.uint8",
    "fp4_mx_block16": "torch.uint8",
}
"""How SGLang prints each KV dtype (``Using KV cache dtype: torch.bfloat16``, §4.2)."""

_DEEPSEEK_LIKE = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV2ForCausalLM",
                  "GptOssForCausalLM")


@dataclass(frozen=True)
class SpecConfig:
    """Resolved speculative decoding (§1.5).

    Attributes:
        algorithm: ``EAGLE``, ``EAGLE3``, ``STANDALONE`` or ``NGRAM`` (``NEXTN`` becomes EAGLE).
        num_steps, eagle_topk, num_draft_tokens: Resolved draft shape.
    """

    algorithm: str
    num_steps: int
    eagle_topk: int
    num_draft_tokens: int


@dataclass(frozen=True)
class DraftSpec:
    """The draft model of EAGLE / STANDALONE as the memory ledger sees it.

    Attributes:
        name: Where it came from (a path, ``"<mtp>"`` or ``"<eagle-head>"``).
        model_class: Class printed in the draft's ``Load weight end`` line.
        num_layers: Draft attention layers (the KV pool's layer count).
        hidden_size: Draft width (for graph memory).
        weight_bytes: Draft weight bytes per GPU.
        cell_bytes: Draft KV bytes per token per GPU.
    """

    name: str
    model_class: str
    num_layers: int
    hidden_size: int
    weight_bytes: int
    cell_bytes: int


@dataclass(frozen=True)
class ServerConfig:
    """Server args after SGLang's default logic (§2), as the scheduler would run with them.

    Attributes:
        version: Mimicked version key (``0.5.5``, ``0.5.10``, ``0.5.23``).
        model: The target model. gpu: The GPU preset. tp_size: Tensor parallelism.
        mem_fraction_static: Given or defaulted (§2.2).
        chunked_prefill_size: Tokens per prefill chunk, None when disabled (§2.1, §2.4).
        max_prefill_tokens: Token budget of one prefill batch (§2.4).
        max_running_requests: The user's value, or 48 with speculative decoding (§1.5), else None.
        max_total_tokens: ``--max-total-tokens`` cap or None (§1.4).
        page_size: Resolved page size (None → 1 on CUDA, §2.4).
        context_len: ``--context-length`` or the model's ``max_position_embeddings``.
        kv_cache_dtype: Resolved KV dtype name (``auto`` → the model dtype, §1.3).
        cuda_graph_max_bs: Largest decode batch captured (§2.1), 0 when graphs are disabled.
        cuda_graph_bs: The capture list before the cut at max_num_reqs (§2.1).
        disable_cuda_graph: No graphs at all.
        disable_cuda_graph_padding: ``--disable-cuda-graph-padding``: every size ``1..max_bs`` is
            captured, and a batch that is not a captured size runs eagerly (§2.1).
        prefill_graphs: Prefill-side graphs are captured too: 0.5.10's piecewise CUDA graphs (on
            unless speculative decoding, HiCache or ``--disable-piecewise-cuda-graph``, §2.2) and
            0.5.23's target prefill graphs (unless ``--disable-prefill-cuda-graph``).
        schedule_policy, schedule_conservativeness, enable_mixed_chunk, disable_radix_cache:
            scheduler knobs (§2.4).
        speculative: Resolved speculative decoding or None. draft: its draft model or None.
        enable_hierarchical_cache, hicache_ratio, hicache_size_gb, hicache_write_policy,
            hicache_ratio_auto (0.5.23, neither ratio nor size given: the ratio shrinks to fit
            ``--hicache-host-memory-fraction`` of host RAM over all ranks, §3.2),
            hicache_io_backend, hicache_mem_layout: HiCache (§7); size in decimal GB per rank.
        served_model_name: Name in ``/v1/models``.
        decode_log_interval: Decode steps between ``Decode batch`` lines.
        enable_metrics, enable_cache_report: Observability switches (§5).
        host, port: HTTP bind address.
        server_args: Every ServerArgs field (flat) with resolved values, for ``/get_server_info``.
        warnings: Lines SGLang logs while resolving (flag not simulated, mrr reset to 48...).
        dp_size: DP-attention size (1 = off): each DP rank has its own pool, the attention
            projections and embedding are split over ``tp / dp`` (§1.5b).
        dcp_size: Decode context parallelism (0.5.23 ``--dcp-size``): each request's KV is
            interleaved over ``dcp`` ranks, so the logical pool is ``dcp ×`` the per-rank one.
        dsa: A DeepSeek DSA model's resolved KV dtype, backends and row layout
            (:mod:`tuner.sim.dsa`), None for other models.
    """

    version: str
    model: ModelSpec
    gpu: GpuSpec
    tp_size: int
    mem_fraction_static: float
    chunked_prefill_size: int | None
    max_prefill_tokens: int
    max_running_requests: int | None
    max_total_tokens: int | None
    page_size: int
    context_len: int
    kv_cache_dtype: str
    cuda_graph_max_bs: int
    cuda_graph_bs: tuple[int, ...]
    disable_cuda_graph: bool
    prefill_graphs: bool
    schedule_policy: str
    schedule_conservativeness: float
    enable_mixed_chunk: bool
    disable_radix_cache: bool
    speculative: SpecConfig | None
    draft: DraftSpec | None
    enable_hierarchical_cache: bool
    hicache_ratio: float
    hicache_ratio_auto: bool
    hicache_host_memory_fraction: float
    hicache_size_gb: float
    hicache_write_policy: str
    hicache_io_backend: str
    hicache_mem_layout: str
    served_model_name: str
    decode_log_interval: int
    enable_metrics: bool
    enable_cache_report: bool
    host: str
    port: int
    server_args: dict[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    disable_cuda_graph_padding: bool = False
    dp_size: int = 1
    dcp_size: int = 1
    dsa: DsaConfig | None = None

    @property
    def target_cell_bytes(self) -> float:
        """The target pool's profile cell per rank (§1.3; DSA: latent row + indexer row × dcp)."""
        if self.dsa is not None:
            return self.dsa.cell_bytes(self.model.num_layers, self.dcp_size)
        return cell_size_bytes(self.model, self.attn_tp_size, self.kv_elem_bytes, version=self.version)

    @property
    def attn_tp_size(self) -> int:
        """Attention tensor parallelism: ``tp / dp`` under DP attention (§1.5b)."""
        return max(1, self.tp_size // self.dp_size)

    @property
    def kv_elem_bytes(self) -> float:
        """Bytes per KV element of the resolved dtype."""
        return KV_DTYPE_BYTES[self.kv_cache_dtype]


# ---------------------------------------------------------------- defaults (§2)


def _gpu_tier(memory_mib: int, tp: int, version: str) -> tuple[int, int]:
    """(chunked_prefill_size, cuda_graph_max_bs) by GPU memory in MiB (§2.1)."""
    big_tp = tp >= 4
    if memory_mib < 20480:
        return 2048, 8
    if memory_mib < 35840:
        if version == "0.5.23":
            return 4096, 160 if big_tp else 48
        return 2048, 80 if big_tp else 24
    if memory_mib < 61440:
        return 4096, 160 if big_tp else 32
    if memory_mib < 163840:
        return 8192, 512 if big_tp else 256
    return 16384, 512


PIECEWISE_GRAPH_TOKEN_SIZES = 58
"""Captured token sizes of the piecewise (prefill) CUDA graphs in the 0.5.10/0.5.23 reserve.

Not stated in the reference; 58 × 8 MB reproduces §2.2's 0.5.10 table (0.858 at tp 1, 0.844 at
tp 8 on the 97,887 MiB GPU) exactly.
"""


def default_mem_fraction_static(
    *,
    version: str,
    gpu_mib: int,
    tp: int,
    chunked_prefill_size: int | None,
    max_prefill_tokens: int,
    cuda_graph_max_bs: int,
    speculative_algorithm: str | None,
    is_mla: bool,
    piecewise: bool,
) -> float:
    """SGLang's default ``mem_fraction_static`` when the flag is unset (§2.2).

    Args:
        version: ``0.5.5``, ``0.5.10`` or ``0.5.23``.
        gpu_mib: nvidia-smi total memory, MiB.
        tp: Tensor parallelism (pp is 1 here).
        chunked_prefill_size: Resolved chunk size (None: chunking off, ``max_prefill_tokens`` counts).
        max_prefill_tokens: Prefill batch budget.
        cuda_graph_max_bs: Resolved decode graph max batch size.
        speculative_algorithm: Resolved algorithm or None.
        is_mla: MLA model (0.5.10+ graph reserve).
        piecewise: Piecewise CUDA graphs on (0.5.10: on unless spec decoding or HiCache...).

    Returns:
        The fraction, rounded to 3 decimals as SGLang does.
    """
    tokens = chunked_prefill_size if chunked_prefill_size else max_prefill_tokens
    reserved = 512 + max(tokens, 2048) * 1.5 + tp / 8 * 1024
    if version == "0.5.23":
        reserved = 512 + tokens * 1.5 + tp / 8 * 1024
        reserved += cuda_graph_max_bs * 2 + (1536 if is_mla else 8 * PIECEWISE_GRAPH_TOKEN_SIZES)
    else:
        reserved += cuda_graph_max_bs * 2
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10240)
    if version != "0.5.23":
        if speculative_algorithm in ("EAGLE", "EAGLE3"):
            reserved += 4096 if version == "0.5.10" else 2048
        elif speculative_algorithm == "STANDALONE":
            reserved += 6144
        if version == "0.5.10" and piecewise:
            reserved += 1536 if is_mla else 8 * PIECEWISE_GRAPH_TOKEN_SIZES
    return round((gpu_mib - reserved) / gpu_mib, 3)


def capture_batch_sizes(max_bs: int, speculative: bool, disable_padding: bool = False,
                        version: str = "0.5.5") -> tuple[int, ...]:
    """0.5.5's ``_generate_cuda_graph_batch_sizes`` cut at ``max_bs`` (§2.1; 0.5.10 and 0.5.23's
    ``generate_decode_cuda_graph_batch_sizes`` read alike, and append ``max_bs`` when the list
    lacks it): every size ``1..max_bs`` with ``--disable-cuda-graph-padding``."""
    if disable_padding:
        sizes = list(range(1, max_bs + 1))
    elif speculative:
        sizes = (list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4))
                 + list(range(72, 257, 8)) + list(range(272, max(max_bs, 272) + 1, 16)))
    else:
        sizes = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 497, 16))
                 + list(range(512, max(max_bs, 512) + 1, 32)))
    out = [s for s in sizes if s <= max_bs]
    if version != "0.5.5" and max_bs > 0 and max_bs not in out:
        out.append(max_bs)
    return tuple(out)


def _captured(sizes: tuple[int, ...], pool: int) -> tuple[int, ...]:
    """The sizes of ``sizes`` captured with a req_to_token pool of ``pool`` rows (§2.1)."""
    out = list(sizes)
    if out and max(out) > pool:
        out.append(pool)
    return tuple(sorted({b for b in out if b <= pool}))


def cell_size_bytes(model: ModelSpec, tp: int, elem_bytes: float, num_layers: int | None = None,
                    version: str = "0.5.5") -> float:
    """KV bytes per token per GPU (§1.3).

    MHA/GQA: ``max(1, kv_heads // tp) × (head_dim + v_head_dim) × layers × elem`` (0.5.5 writes
    ``2 × head_dim``, the same for these models). MLA: ``(kv_lora_rank + qk_rope_head_dim) ×
    layers × elem``, not divided by tp.
    """
    layers = model.num_layers if num_layers is None else num_layers
    if model.is_mla:
        return (model.kv_lora_rank + model.qk_rope_head_dim) * layers * elem_bytes
    heads = max(1, model.num_kv_heads // tp)
    dims = 2 * model.head_dim if version == "0.5.5" else model.head_dim + model.v_head_dim
    return heads * dims * layers * elem_bytes


def _resolve_spec(v: dict[str, Any], model: ModelSpec) -> SpecConfig | None:
    algo = v.get("speculative_algorithm")
    if not algo:
        return None
    algo = str(algo).upper()
    if algo == "NEXTN":
        algo = "EAGLE"
    steps, topk, draft = v.get("speculative_num_steps"), v.get("speculative_eagle_topk"), v.get(
        "speculative_num_draft_tokens")
    if algo == "NGRAM":
        return SpecConfig("NGRAM", steps or 0, topk or 0, draft or 0)
    if steps is None or topk is None or draft is None:
        auto = (3, 1, 4) if (model.model_class in _DEEPSEEK_LIKE or algo == "STANDALONE") else (5, 4, 8)
        steps = auto[0] if steps is None else steps
        topk = auto[1] if topk is None else topk
        draft = auto[2] if draft is None else draft
    if topk == 1:
        draft = steps + 1
    return SpecConfig(algo, int(steps), int(topk), int(draft))


def _draft_elem(v: dict[str, Any], model: ModelSpec, target_elem: float) -> float:
    """Bytes per element of the draft's KV pool: ``--speculative-draft-kv-cache-dtype`` (0.5.23's
    flag; ``auto`` is the draft's own dtype), else the target's (``kv_cache_dtype.py``
    ``configure_kv_cache_dtype``: "Default follows --kv-cache-dtype"). The draft's pool is then
    smaller than the share of the budget SGLang profiled for it (``cell × draft_layers /
    target_layers``), and the saving is free memory (the flag's help: "raise
    --mem-fraction-static to convert it into KV capacity")."""
    dtype = v.get("speculative_draft_kv_cache_dtype")
    if dtype is None:
        return target_elem
    dtype = model.torch_dtype if dtype == "auto" else str(dtype)
    if dtype not in KV_DTYPE_BYTES:
        raise SimError(f"--speculative-draft-kv-cache-dtype {dtype!r} is not simulated; use auto, bf16, fp8_e4m3 "
                       "or fp8_e5m2.")
    return KV_DTYPE_BYTES[dtype]


def _resolve_draft(v: dict[str, Any], model: ModelSpec, spec: SpecConfig | None, tp: int,
                   elem: float, version: str, warnings: list[str]) -> DraftSpec | None:
    """The draft model: a config dir, the model's MTP layers, or a one-layer EAGLE head (simulator's)."""
    if spec is None or spec.algorithm == "NGRAM":
        return None
    path = v.get("speculative_draft_model_path")
    if path:
        try:
            draft = load_model(path)
        except SimError as err:
            draft = None
            if spec.algorithm == "STANDALONE":
                raise SimError(f"--speculative-draft-model-path: {err}") from None
            warnings.append(
                f"Draft model {path!r} has no local config.json; simulating a one-layer "
                f"{spec.algorithm} head derived from the target model."
            )
        if draft is not None:
            return DraftSpec(str(path), draft.model_class, draft.num_layers, draft.hidden_size,
                             weight_bytes_per_gpu(draft, tp),
                             int(cell_size_bytes(draft, tp, elem, version=version)))
    h = model.hidden_size
    if model.num_nextn_predict_layers and not path:
        n = model.num_nextn_predict_layers
        per_layer = (weight_bytes_per_gpu(model, tp) - 2 * model.vocab_size * h * 2 / tp) / model.num_layers
        weights = n * per_layer + 2 * h * h * 2 / tp  # MTP layer + eh_proj; embeddings shared
        return DraftSpec("<mtp>", model.model_class.replace("ForCausalLM", "ForCausalLMNextN"), n, h,
                         int(weights), int(cell_size_bytes(model, tp, elem, n, version)))
    weights = 2 * (4 * h * h + 3 * h * model.intermediate_size + model.vocab_size * h) / tp
    cls = "LlamaForCausalLMEagle3" if spec.algorithm == "EAGLE3" else "LlamaForCausalLMEagle"
    return DraftSpec("<eagle-head>", cls, 1, h, int(weights), int(cell_size_bytes(model, tp, elem, 1, version)))


def resolve_server_config(parsed: ParsedArgs, gpu: GpuSpec, model: ModelSpec) -> ServerConfig:
    """Apply SGLang's default logic (§2, §1.5, §7) to a parsed command line.

    Args:
        parsed: The command line. gpu: The simulated GPU. model: The target model.

    Returns:
        The resolved configuration.

    Raises:
        SimError: A combination SGLang rejects while resolving server args (e.g. a
            ``--kv-cache-dtype`` this simulator does not know, a draft model that cannot be read).
    """
    v = dict(parsed.server)
    version = parsed.sim.version
    warnings = list(parsed.warnings)
    tp = int(v.get("tp_size") or 1)
    spec = _resolve_spec(v, model)
    dp, dcp = _resolve_parallel(v, model, tp)
    if spec is not None:  # SGLang's refusals of a draft shape, and its adjustment warning
        check_flags(v, spec.algorithm, spec.num_steps, spec.eagle_topk, spec.num_draft_tokens, version, warnings)
    chunk_default, max_bs_default = _gpu_tier(gpu.memory_mib, tp, version)
    chunk = v.get("chunked_prefill_size")
    chunk = chunk_default if chunk is None else chunk
    chunk = None if chunk is not None and chunk <= 0 else chunk
    if dp > 1 and chunk is not None:
        chunk //= dp  # _handle_data_parallelism (0.5.5 server_args.py)
        warnings.append(f"DP attention is enabled. The chunked prefill size is adjusted to {chunk} to avoid MoE kernel issues. ")
    max_prefill = int(v.get("max_prefill_tokens") or 16384)

    mrr = v.get("max_running_requests")
    if spec is not None and spec.algorithm != "NGRAM" and mrr is None:
        mrr = 48
        warnings.append("Max running requests is reset to 48 for speculative decoding. You can override "
                        "this by explicitly setting --max-running-requests.")

    if version == "0.5.23":
        disable_graph = bool(v.get("disable_cuda_graph") or v.get("disable_decode_cuda_graph"))
        user_bs, user_list = v.get("cuda_graph_max_bs_decode"), v.get("cuda_graph_bs_decode")
    else:
        disable_graph = bool(v.get("disable_cuda_graph"))
        user_bs, user_list = v.get("cuda_graph_max_bs"), v.get("cuda_graph_bs")
    if user_list:
        bs_list = tuple(sorted(set(int(b) for b in user_list)))
        max_bs = max(bs_list)
    else:
        max_bs = int(user_bs) if user_bs else max_bs_default
        if version == "0.5.23" and not user_bs and mrr is not None and max_bs > mrr:
            max_bs = int(mrr)
        bs_list = capture_batch_sizes(max_bs, spec is not None and spec.algorithm != "NGRAM",
                                      bool(v.get("disable_cuda_graph_padding")), version)

    kv_dtype, dsa = _resolve_kv_dtype(v, model, gpu, version, dcp, warnings)
    elem = KV_DTYPE_BYTES[kv_dtype]

    hicache = bool(v.get("enable_hierarchical_cache"))
    piecewise = version == "0.5.10" and not (spec or hicache or v.get("disable_piecewise_cuda_graph"))
    prefill_graphs = not disable_graph and (
        piecewise or (version == "0.5.23" and not (v.get("disable_prefill_cuda_graph") or v.get("disable_cuda_graph"))))
    mfs = v.get("mem_fraction_static")
    if mfs is None:
        mfs = default_mem_fraction_static(
            version=version, gpu_mib=gpu.memory_mib, tp=tp, chunked_prefill_size=chunk,
            max_prefill_tokens=max_prefill, cuda_graph_max_bs=max_bs,
            speculative_algorithm=spec.algorithm if spec else None, is_mla=model.is_mla,
            piecewise=piecewise,
        )
    draft = _resolve_draft(v, model, spec, tp, _draft_elem(v, model, elem), version, warnings)
    context_len = int(v.get("context_length") or model.max_position_embeddings)
    page = dsa.page_size if dsa is not None else int(v.get("page_size") or 1)
    hicache_ratio = v.get("hicache_ratio")
    ratio_auto = version == "0.5.23" and hicache_ratio is None and not v.get("hicache_size")
    hicache_ratio = 2.0 if hicache_ratio is None else float(hicache_ratio)
    served = v.get("served_model_name") or v["model_path"]
    resolved = {
        **v,
        "tp_size": tp,
        "mem_fraction_static": mfs,
        "chunked_prefill_size": chunk if chunk is not None else -1,
        "page_size": page,
        "kv_cache_dtype": v.get("kv_cache_dtype") or "auto",
        "served_model_name": served,
        "context_length": v.get("context_length"),
        "max_running_requests": mrr,
    }
    if version == "0.5.23":
        resolved["cuda_graph_max_bs_decode"] = max_bs
    else:
        resolved["cuda_graph_max_bs"] = max_bs
    if spec is not None:
        resolved.update(speculative_algorithm=spec.algorithm, speculative_num_steps=spec.num_steps,
                        speculative_eagle_topk=spec.eagle_topk,
                        speculative_num_draft_tokens=spec.num_draft_tokens)
    if hicache:
        resolved["hicache_ratio"] = hicache_ratio
    if dsa is not None:
        resolved.update(kv_cache_dtype=dsa.kv_cache_dtype, attention_backend=v.get("attention_backend") or "dsa",
                        dsa_prefill_backend=dsa.prefill_backend, dsa_decode_backend=dsa.decode_backend)
    return ServerConfig(
        version=version, model=model, gpu=gpu, tp_size=tp, mem_fraction_static=float(mfs),
        chunked_prefill_size=chunk, max_prefill_tokens=max_prefill, max_running_requests=mrr,
        max_total_tokens=v.get("max_total_tokens"), page_size=page, context_len=context_len,
        kv_cache_dtype=kv_dtype, cuda_graph_max_bs=0 if disable_graph else max_bs,
        cuda_graph_bs=() if disable_graph else bs_list, disable_cuda_graph=disable_graph,
        prefill_graphs=prefill_graphs, disable_cuda_graph_padding=bool(v.get("disable_cuda_graph_padding")),
        schedule_policy=str(v.get("schedule_policy") or "fcfs"),
        schedule_conservativeness=float(v.get("schedule_conservativeness") or 1.0) * (0.3 if dp > 1 else 1.0),
        enable_mixed_chunk=bool(v.get("enable_mixed_chunk")) and spec is None,
        disable_radix_cache=bool(v.get("disable_radix_cache")),
        speculative=spec, draft=draft,
        enable_hierarchical_cache=hicache, hicache_ratio=hicache_ratio, hicache_ratio_auto=ratio_auto,
        hicache_host_memory_fraction=float(v.get("hicache_host_memory_fraction") or 0.8),
        hicache_size_gb=float(v.get("hicache_size") or 0),
        hicache_write_policy=str(v.get("hicache_write_policy") or "write_through"),
        hicache_io_backend=str(v.get("hicache_io_backend") or "kernel"),
        hicache_mem_layout=str(v.get("hicache_mem_layout") or "layer_first"),
        served_model_name=str(served),
        decode_log_interval=int(v.get("decode_log_interval") or 40),
        enable_metrics=bool(v.get("enable_metrics")),
        enable_cache_report=bool(v.get("enable_cache_report")),
        host=str(v.get("host") or "127.0.0.1"), port=30000 if v.get("port") is None else int(v["port"]),
        server_args=resolved, warnings=tuple(warnings), dp_size=dp, dcp_size=dcp, dsa=dsa,
    )


def _resolve_kv_dtype(v: dict[str, Any], model: ModelSpec, gpu: GpuSpec, version: str, dcp: int,
                      warnings: list[str]) -> tuple[str, DsaConfig | None]:
    """The resolved KV dtype (§1.3) and, for a DSA model, its :class:`~tuner.sim.dsa.DsaConfig`.

    Raises:
        SimError: A dtype the simulator does not know, mxfp8 below SM100 (0.5.23
            ``arg_groups/kv_cache_hook.py`` ``handle_mxfp8_kv_cache_compatibility``), or a DSA refusal.
    """
    dsa = resolve_dsa(v, model, gpu, version, dcp) if model.is_dsa else None
    if dsa is not None:
        warnings.extend(dsa.warnings)
    kv_dtype = dsa.kv_cache_dtype if dsa is not None else str(v.get("kv_cache_dtype") or "auto")
    if kv_dtype == "auto":
        kv_dtype = "fp8_e4m3" if model.kv_cache_fp8 else model.torch_dtype
    if kv_dtype not in KV_DTYPE_BYTES:
        raise SimError(f"--kv-cache-dtype {kv_dtype!r} is not simulated; use auto, bf16, fp8_e4m3 or fp8_e5m2.")
    if kv_dtype == "mxfp8" and gpu.compute_capability[0] < 10:
        raise SimError("ValueError: --kv-cache-dtype mxfp8 requires an SM100+ (Blackwell) GPU for the block-scaled operands "
                       "used by the FA4 MXFP8 attention path.")
    return kv_dtype, dsa


def _resolve_parallel(v: dict[str, Any], model: ModelSpec, tp: int) -> tuple[int, int]:
    """``(dp-attention size, dcp size)`` with SGLang's checks (§1.5b; 0.5.23 ``arg_groups/attention_hook.py``).

    Raises:
        SimError: dp does not divide tp (SGLang asserts ``tp_size % dp_size == 0``), dcp does not
            divide tp, or dcp on a model that is not MLA (the simulator models DCP for MLA only,
            sglang#14194).
    """
    dp = int(v.get("dp_size") or 1)
    dp = dp if v.get("enable_dp_attention") and dp > 1 else 1
    if tp % dp:
        raise SimError(f"AssertionError: tp_size {tp} % dp_size {dp} != 0 (_handle_data_parallelism asserts "
                       "self.tp_size % self.dp_size == 0); pass a --dp-size that divides --tp-size.")
    dcp = int(v.get("dcp_size") or 1)
    if dcp > 1 and tp % dcp:
        raise SimError(f"ValueError: --dcp-size {dcp} must divide --tp-size {tp}.")
    if dcp > 1 and not model.is_mla:
        raise SimError(f"--dcp-size {dcp}: the simulator models decode context parallelism for MLA models only "
                       "(sglang#14194); pass --dcp-size 1.")
    return dp, dcp


# ---------------------------------------------------------------- the ledger


@dataclass(frozen=True)
class RankMemory:
    """Free device memory of one rank (bytes) after each startup stage, as ``avail mem`` reports it.

    Attributes are ``None`` for stages not reached.
    """

    rank: int
    total: int
    foreign: int
    before_init: int
    after_init: int
    after_weights: int | None = None
    after_pool: int | None = None
    before_capture: int | None = None
    after_capture: int | None = None
    draft_before_weights: int | None = None
    draft_after_weights: int | None = None
    draft_after_pool: int | None = None
    draft_after_capture: int | None = None


@dataclass(frozen=True)
class StartupFailure:
    """Where and why startup stops (worded by :mod:`tuner.sim.startup`, §4.3).

    Attributes:
        kind: ``unbalanced``, ``weight_oom``, ``kv_no_budget`` (0.5.23's early check),
            ``not_enough_memory``, ``pool_oom`` (req_to_token + KV do not fit), ``pool_too_small``,
            ``graph_oom``, ``draft_weight_oom``, ``draft_kv_oom``,
            ``draft_graph_oom``, ``host_memory``, ``host_smaller_than_device``, ``host_oom_kill``
            (the ranks' pinned host pools pass SGLang's own check, which reads the host's available
            memory, but exceed the service's cgroup ``memory.max``: the kernel's OOM killer ends the
            process at the rank whose pool crosses the limit; ``requested_bytes`` is the pinned
            total by then, ``free_bytes`` the limit), ``tp_not_divisible`` (the heads do not split
            over ``--tp``: SGLang's ``divide()`` assertion while the model's layers are built, so
            before any weight is loaded).
        rank: The rank that raises.
        requested_bytes: What the failing allocation asked for (0 when not an allocation).
        free_bytes: What was free on that rank.
        detail: Extra numbers for the message (e.g. the unbalanced check's values).
    """

    kind: str
    rank: int
    requested_bytes: int = 0
    free_bytes: int = 0
    detail: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryPlan:
    """The ledger of one startup: every number the §4.2 lines print, per rank.

    Attributes:
        config: The resolved server config.
        ranks: Free memory per rank after each stage reached.
        comm_bytes: Memory taken by the distributed init per rank.
        baseline_bytes: ``pre_model_load_memory``: min free over ranks after init (§1.1).
        weight_bytes: Target weights per GPU.
        post_load_bytes: Min free over ranks after weights (0.5.23: and draft weights).
        cell_bytes: KV bytes per token per GPU used for profiling (0.5.23 with a draft: incl. it).
        target_cell_bytes: The target pool's own cell.
        profiled_tokens: ``floor(rest × 2^30 / cell)`` before caps (may be negative).
        max_total_num_tokens: After the spec adjustment, the cap and page rounding (0 when failed
            before).
        kv_bytes: Target KV pool bytes per GPU (``(tokens + page) × cell``).
        k_bytes, v_bytes: The K and V halves (MHA); ``v_bytes`` 0 for MLA.
        max_num_reqs: req_to_token pool rows.
        req_to_token_bytes: The table's bytes per GPU.
        max_running_requests: Effective value (§2.3).
        capture_bs: Batch sizes captured (after the cut at max_num_reqs).
        graph_bytes: Target decode (or verify) CUDA-graph bytes per GPU.
        prefill_graph_bytes: Piecewise / prefill CUDA-graph bytes per GPU (0.5.10+, see
            :data:`PIECEWISE_GRAPH_TOKEN_SIZES`): the amount the default fraction reserves for them.
        draft_kv_bytes, draft_graph_bytes: The draft worker's pool and graphs.
        hicache_host_tokens, hicache_host_bytes: Host pool per rank (0 without HiCache).
        host_memory_bytes: The simulated host's RAM (one host; every rank's pool comes out of it).
        cgroup_max_bytes: The server's cgroup ``memory.max``, None when unlimited.
        warnings: Lines logged while sizing (``max_total_tokens=... is larger than ...``).
        failure: The first stage that did not fit, or None.
    """

    config: ServerConfig
    ranks: tuple[RankMemory, ...]
    comm_bytes: int
    baseline_bytes: int
    weight_bytes: int
    post_load_bytes: int = 0
    cell_bytes: float = 0.0
    target_cell_bytes: float = 0.0
    profiled_tokens: int = 0
    max_total_num_tokens: int = 0
    kv_bytes: int = 0
    k_bytes: int = 0
    v_bytes: int = 0
    max_num_reqs: int = 0
    req_to_token_bytes: int = 0
    max_running_requests: int = 0
    capture_bs: tuple[int, ...] = ()
    graph_bytes: int = 0
    prefill_graph_bytes: int = 0
    draft_kv_bytes: int = 0
    draft_graph_bytes: int = 0
    hicache_host_tokens: int = 0
    hicache_host_bytes: int = 0
    host_memory_bytes: int = 0
    cgroup_max_bytes: int | None = None
    warnings: tuple[str, ...] = ()
    failure: StartupFailure | None = None

    @property
    def available_bytes(self) -> int:
        """Min free over ranks after startup (the headroom left for activations)."""
        last = [self._last_free(r) for r in self.ranks]
        return min(last)

    @staticmethod
    def _last_free(r: RankMemory) -> int:
        for value in (r.draft_after_capture, r.draft_after_pool, r.draft_after_weights,
                      r.draft_before_weights, r.after_capture, r.before_capture, r.after_pool,
                      r.after_weights, r.after_init):
            if value is not None:
                return value
        return r.before_init

    def used_bytes(self, rank: int) -> int:
        """Device memory in use on ``rank`` (all processes, as NVML counts it) after startup."""
        r = self.ranks[rank]
        return r.total - self._last_free(r)

    @property
    def request_pool_tokens(self) -> int:
        """The pool one request can use: one rank's (DP attention: its own DP rank's), × dcp under
        DCP (a request's KV is interleaved over the DCP ranks)."""
        return self.max_total_num_tokens * self.config.dcp_size

    @property
    def reported_tokens(self) -> int:
        """``max_total_num_tokens`` as the scheduler line, ``/get_server_info`` and its
        ``memory_usage.token_capacity`` print it: one DP rank's logical tokens (its rows × dcp) on
        0.5.23 (``tp_worker.get_worker_info`` returns ``ModelRunner.logical_max_total_num_tokens``
        since 0.5.21), one rank's rows before (the KV line's ``#tokens`` always)."""
        return self.max_total_num_tokens * (self.config.dcp_size if self.config.version == "0.5.23" else 1)

    @property
    def logical_tokens(self) -> int:
        """Tokens resident across the deployment: the per-rank pool × dp (DP attention) × dcp."""
        return self.max_total_num_tokens * self.config.dcp_size * self.config.dp_size

    @property
    def weight_gib(self) -> float:
        """Weights per GPU, GiB."""
        return self.weight_bytes / GIB


def graph_bytes(bs_list: tuple[int, ...], layers: int, per_layer_bytes: int, hidden: int, tokens_per_req: int,
                mlp_width_per_rank: float, vocab_per_rank: float) -> int:
    """CUDA-graph memory of one runner (simulator's model, see :data:`GRAPH_BYTES_PER_LAYER_MOE`).

    Args:
        bs_list: Captured batch sizes. layers: Layers in the graph.
        per_layer_bytes: Fixed bytes per captured size and layer (dense or MoE).
        hidden: Model width. tokens_per_req: Tokens per request per step (1 for decode,
            num_draft_tokens for verify).
        mlp_width_per_rank: MLP intermediate width active per token on one rank.
        vocab_per_rank: Vocabulary slice of one rank (logits).

    Returns:
        Bytes per GPU: a fixed cost per captured size and layer plus the activations of the
        largest batch (bf16 hidden states, MLP intermediates, fp32 logits).
    """
    if not bs_list:
        return 0
    per_token = 2 * (8 * hidden + 3 * mlp_width_per_rank) + 4 * vocab_per_rank
    return int(len(bs_list) * layers * per_layer_bytes + max(bs_list) * tokens_per_req * per_token)


def _mlp_width(model: ModelSpec, tp: int) -> float:
    if model.num_experts:
        return (model.moe_intermediate_size or 0) * (model.experts_per_token or 1) / tp
    return model.intermediate_size / tp


def _uneven_heads(model: ModelSpec, tp: int) -> tuple[int, int] | None:
    """``(numerator, denominator)`` of the first head split SGLang's ``divide()`` rejects at ``tp``
    ranks (query heads over tp; KV heads over tp, or tp over KV heads when fewer), else None."""
    if model.num_attention_heads % tp:
        return model.num_attention_heads, tp
    if model.is_mla:
        return None
    kv = model.num_kv_heads
    if kv >= tp and kv % tp:
        return kv, tp
    if kv < tp and tp % kv:
        return tp, kv
    return None


def plan_memory(cfg: ServerConfig, *, foreign_bytes: int = 0, host_memory_bytes: int = 512 * GIB,
                cgroup_max_bytes: int | None = None) -> MemoryPlan:
    """Walk SGLang's startup allocations on every rank; stop at the first that does not fit.

    Args:
        cfg: The resolved server config.
        foreign_bytes: Memory a foreign process holds on GPU 0 (lowers the baseline, §1.2).
        host_memory_bytes: Host RAM for the HiCache host pool check (§7): one host, every rank's
            pinned pool comes out of it.
        cgroup_max_bytes: The server's cgroup ``memory.max`` (a systemd unit's ``MemoryMax=``), or
            None when unlimited; pinned host pools are charged to it.

    Returns:
        The ledger, with ``failure`` set when startup fails (§4.3).
    """
    plan = _plan_memory(cfg, foreign_bytes, host_memory_bytes, cgroup_max_bytes)
    return replace(plan, host_memory_bytes=host_memory_bytes, cgroup_max_bytes=cgroup_max_bytes)


def _plan_memory(cfg: ServerConfig, foreign_bytes: int, host_memory_bytes: int, cgroup_max_bytes: int | None  # noqa: C901 - over the complexity ceiling when it was set (15); it only goes down
                 ) -> MemoryPlan:
    gpu, model, tp, version = cfg.gpu, cfg.model, cfg.tp_size, cfg.version
    total = gpu.memory_bytes
    comm = gpu.comm_bytes(tp)
    ranks = []
    for r in range(tp):
        foreign = foreign_bytes if r == 0 else 0
        before = total - gpu.context_bytes(1) - foreign
        ranks.append(RankMemory(r, total, foreign, before, before - comm))
    baseline = min(r.after_init for r in ranks)
    weights = weight_bytes_per_gpu(model, tp) + dp_attention_extra_bytes(model, tp, cfg.dp_size)
    plan = MemoryPlan(config=cfg, ranks=tuple(ranks), comm_bytes=comm, baseline_bytes=baseline,
                      weight_bytes=weights)

    # §1.1 unbalanced check, raised by the ranks whose local free memory is large.
    if tp > 1:
        for r in ranks:
            if baseline < r.after_init * 0.9:
                return replace(plan, failure=StartupFailure(
                    "unbalanced", r.rank, detail={"min_per_gpu_memory": baseline / GIB,
                                                  "local_gpu_memory": r.after_init / GIB}))

    # SGLang splits the query heads, and the KV heads (or replicates them when fewer than tp), over
    # the tp ranks with ``divide()`` (``QKVParallelLinear``); an uneven split asserts while the
    # layers are built, before any weight is loaded. MLA has one latent KV head, replicated.
    uneven = _uneven_heads(model, tp)
    if uneven is not None:
        return replace(plan, failure=StartupFailure(
            "tp_not_divisible", 0, detail={"numerator": uneven[0], "denominator": uneven[1]}))

    # Weights (0.5.23: the draft weights are loaded before profiling too, §1.5).
    draft = cfg.draft
    early_draft = draft.weight_bytes if (draft and version == "0.5.23") else 0
    for r in sorted(ranks, key=lambda x: x.after_init):
        if weights + early_draft > r.after_init:
            ranks = [replace(x, after_weights=None) for x in ranks]
            return replace(plan, failure=StartupFailure("weight_oom", r.rank, weights, r.after_init))
    ranks = [replace(r, after_weights=r.after_init - weights - early_draft) for r in ranks]
    post_load = min(r.after_weights for r in ranks)
    plan = replace(plan, ranks=tuple(ranks), post_load_bytes=post_load)

    # §1.2 / §1.3: profile.
    mfs = cfg.mem_fraction_static
    rest = post_load - baseline * (1 - mfs)
    target_cell = cfg.target_cell_bytes
    cell = target_cell
    if draft and version == "0.5.23" and cfg.dsa is not None:  # DSA: latent share + draft indexer, × dcp
        cell = target_cell + cfg.dsa.draft_cell_bytes(model.num_layers, draft.num_layers, cfg.dcp_size)
    elif draft and version == "0.5.23":  # the target's cell scaled by the draft's layers, not its geometry
        cell = profiled_cell(target_cell, draft.num_layers, model.num_layers)
    profiled = math.floor(rest / cell)
    plan = replace(plan, cell_bytes=cell, target_cell_bytes=target_cell, profiled_tokens=profiled)
    if version == "0.5.23" and rest <= 0:
        return replace(plan, failure=StartupFailure(
            "kv_no_budget", 0, detail={"available_gib": post_load / GIB, "pre_gib": baseline / GIB,
                                       "mfs": mfs}))

    # §2.3 req_to_token pool size, from the profiled count (0.5.5 order).
    est = min(max(int(profiled / cfg.context_len * 512), 2048), 4096)
    user = cfg.max_running_requests
    if user is not None:
        user = max(1, user // cfg.dp_size)  # per DP rank (§1.5b)
    if version == "0.5.5":
        max_num_reqs = user if user is not None else est
    elif version == "0.5.10":
        max_num_reqs = min(user, est) if user is not None else est
    else:
        max_num_reqs = user if user is not None else est

    # §1.4 / §1.5 adjustments.
    tokens = profiled
    spec = cfg.speculative
    if spec and draft and version == "0.5.5":
        tokens += max_num_reqs * spec.num_steps * spec.eagle_topk + max_num_reqs * spec.num_draft_tokens + 100
    warnings: list[str] = []
    if cfg.max_total_tokens is not None:
        if cfg.max_total_tokens > tokens:
            warnings.append(f"max_total_tokens={cfg.max_total_tokens} is larger than the profiled value "
                            f"{tokens}. Use the profiled value instead.")
        tokens = min(tokens, cfg.max_total_tokens)
    tokens = tokens // cfg.page_size * cfg.page_size
    plan = replace(plan, warnings=tuple(warnings))
    if tokens <= 0:
        return replace(plan, max_total_num_tokens=tokens, failure=StartupFailure("not_enough_memory", 0))
    if version == "0.5.23":
        max_num_reqs = min(max_num_reqs, tokens // 2) if user is not None else min(max_num_reqs, max(tokens // 2, 1))
        if user is not None and max_num_reqs < user:
            warnings.append(f"max_running_requests was reduced from the requested {user} to {max_num_reqs} "
                            "(per dp worker) due to the available KV cache capacity.")
    max_num_reqs = max(1, max_num_reqs)
    effective_mrr = min(tokens // 2 if user is None else user, max_num_reqs)

    rows = tokens + cfg.page_size
    kv = cfg.dsa.pool_bytes(tokens, model.num_layers, cfg.dcp_size) if cfg.dsa else int(rows * target_cell)
    if model.is_mla:
        k_b, v_b = kv, 0
    else:
        heads = max(1, model.num_kv_heads // cfg.attn_tp_size)
        k_b = int(rows * heads * model.head_dim * model.num_layers * cfg.kv_elem_bytes)
        v_b = kv - k_b
    draft_kv_early = int(rows * draft.cell_bytes) if (draft and version == "0.5.23") else 0
    r2t = max_num_reqs * (cfg.context_len + 4 + (spec.num_draft_tokens if spec and draft else 0)) * 4
    ranks = [replace(r, after_pool=r.after_weights - kv - draft_kv_early - r2t) for r in ranks]
    plan = replace(plan, ranks=tuple(ranks), max_total_num_tokens=tokens, kv_bytes=kv, k_bytes=k_b,
                   v_bytes=v_b, max_num_reqs=max_num_reqs, req_to_token_bytes=r2t,
                   max_running_requests=effective_mrr, warnings=tuple(warnings),
                   draft_kv_bytes=draft_kv_early)
    if min(r.after_pool for r in ranks) < 0:
        r = min(ranks, key=lambda x: x.after_pool)
        return replace(plan, failure=StartupFailure("draft_kv_oom" if draft_kv_early else "pool_oom",
                                                    r.rank, kv + draft_kv_early + r2t, r.after_weights))

    # CUDA graphs of the target (§2.1, ``get_batch_sizes_to_capture``: when the list goes above the
    # req_to_token pool, the pool size is added, then the sizes above the pool are dropped).
    bs = _captured(cfg.cuda_graph_bs, max_num_reqs)
    tokens_per_req = spec.num_draft_tokens if (spec and draft) else 1
    per_layer = GRAPH_BYTES_PER_LAYER_MOE if model.num_experts else GRAPH_BYTES_PER_LAYER_DENSE
    g = graph_bytes(bs, model.num_layers, per_layer * tokens_per_req, model.hidden_size, tokens_per_req,
                    _mlp_width(model, tp),
                    model.vocab_size / tp)
    pg = 0
    if cfg.prefill_graphs:
        pg = (1536 if model.is_mla else 8 * PIECEWISE_GRAPH_TOKEN_SIZES) * MIB
    ranks = [replace(r, before_capture=r.after_pool - ATTENTION_WORKSPACE_BYTES) for r in ranks]
    plan = replace(plan, ranks=tuple(ranks), capture_bs=bs, graph_bytes=g, prefill_graph_bytes=pg)
    worst = min(ranks, key=lambda x: x.before_capture)
    if worst.before_capture < 0 or g + pg > worst.before_capture:
        return replace(plan, failure=StartupFailure("graph_oom", worst.rank, g + pg, max(worst.before_capture, 0)))
    ranks = [replace(r, after_capture=r.before_capture - g - pg) for r in ranks]
    plan = replace(plan, ranks=tuple(ranks))

    # 0.5.23: the draft's weights and KV are in place; its graphs come out of the reserve (§1.5).
    if draft and spec and version == "0.5.23" and bs:
        dg = graph_bytes(bs, draft.num_layers, GRAPH_BYTES_PER_LAYER_DENSE, draft.hidden_size,
                         max(spec.eagle_topk, 1), draft.hidden_size * 3 / tp, model.vocab_size / tp)
        worst = min(ranks, key=lambda x: x.after_capture)
        plan = replace(plan, draft_graph_bytes=dg)
        if dg > worst.after_capture:
            return replace(plan, failure=StartupFailure("draft_graph_oom", worst.rank, dg, max(worst.after_capture, 0)))
        ranks = [replace(r, draft_after_capture=r.after_capture - dg) for r in ranks]
        plan = replace(plan, ranks=tuple(ranks))

    # The draft worker of 0.5.5 / 0.5.10: created after the target is up, outside the budget (§1.5).
    if draft and version != "0.5.23":
        ranks = [replace(r, draft_before_weights=r.after_capture) for r in ranks]
        worst = min(ranks, key=lambda x: x.draft_before_weights)
        if draft.weight_bytes > worst.draft_before_weights:
            return replace(plan, ranks=tuple(ranks), failure=StartupFailure(
                "draft_weight_oom", worst.rank, draft.weight_bytes, worst.draft_before_weights))
        ranks = [replace(r, draft_after_weights=r.draft_before_weights - draft.weight_bytes) for r in ranks]
        dkv = int(rows * draft.cell_bytes)
        worst = min(ranks, key=lambda x: x.draft_after_weights)
        plan = replace(plan, ranks=tuple(ranks), draft_kv_bytes=dkv)
        if dkv > worst.draft_after_weights:
            return replace(plan, failure=StartupFailure("draft_kv_oom", worst.rank, dkv, worst.draft_after_weights))
        ranks = [replace(r, draft_after_pool=r.draft_after_weights - dkv) for r in ranks]
        dg = graph_bytes(bs, draft.num_layers, GRAPH_BYTES_PER_LAYER_DENSE, draft.hidden_size,
                         max(spec.eagle_topk, 1), draft.hidden_size * 3 / tp, model.vocab_size / tp)
        worst = min(ranks, key=lambda x: x.draft_after_pool)
        plan = replace(plan, ranks=tuple(ranks), draft_graph_bytes=dg)
        if bs and dg > worst.draft_after_pool:
            return replace(plan, failure=StartupFailure("draft_graph_oom", worst.rank, dg, worst.draft_after_pool))
        ranks = [replace(r, draft_after_capture=r.draft_after_pool - dg) for r in ranks]
        plan = replace(plan, ranks=tuple(ranks))

    # §1.4: the scheduler needs room for one request (``Memory pool size is too small``, §4.3).
    if min(cfg.context_len - 1, tokens - 1) - 5 <= 0:
        return replace(plan, failure=StartupFailure("pool_too_small", 0))

    # §7 HiCache host pool, per rank, against host RAM.
    if cfg.enable_hierarchical_cache:
        per_token = _host_bytes_per_token(cfg)
        if cfg.hicache_size_gb > 0:
            host_tokens = int(cfg.hicache_size_gb * 1e9 // per_token)
        else:
            host_tokens = int(tokens * cfg.hicache_ratio)
            if cfg.hicache_ratio_auto:
                fit = int(cfg.hicache_host_memory_fraction * host_memory_bytes / (tp * per_token))
                host_tokens = min(host_tokens, fit)
        host_tokens = (host_tokens // cfg.page_size + 1) * cfg.page_size
        host_bytes = int(host_tokens * per_token)
        plan = replace(plan, hicache_host_tokens=host_tokens, hicache_host_bytes=host_bytes)
        if version != "0.5.23" and host_tokens <= tokens:
            return replace(plan, failure=StartupFailure("host_smaller_than_device", 0, host_bytes))
        for r in range(tp):
            free = host_memory_bytes - HICACHE_HOST_RESERVE_BYTES - r * host_bytes
            if host_bytes > free:
                return replace(plan, failure=StartupFailure("host_memory", r, host_bytes, max(free, 0)))
            if cgroup_max_bytes is not None and (r + 1) * host_bytes > cgroup_max_bytes:
                return replace(plan, failure=StartupFailure("host_oom_kill", r, (r + 1) * host_bytes,
                                                            cgroup_max_bytes))
    return plan


def _host_bytes_per_token(cfg: ServerConfig) -> float:
    """HiCache host bytes per token per rank (§7): the device cell of the target."""
    return cfg.target_cell_bytes
