"""DeepSeek sparse attention (DSA, DeepSeek-V3.2) in the simulator: SGLang 0.5.23's server-args rules and pool cell.

Read from SGLang 0.5.23's source (``pip download --no-deps sglang==0.5.23``):

- ``arg_groups/model_overrides/deepseek_v2.py`` ``_deepseek_family_overrides``: attention backend
  ``dsa`` when none is given; ``--page-size`` forced to ``64 × index_kpool`` ("Setting page size to
  64 for DeepSeek DSA."); with ``--dcp-size > 1`` (``_dsa_dcp_overrides``) both DSA backends default
  to ``trtllm``, HiCache is refused and ``--speculative-eagle-topk`` must be 1.
- ``arg_groups/overrides.py`` ``_dsa_kv_cache_dtype_default``: ``auto`` KV becomes ``fp8_e4m3`` on
  SM ≥ 10 and ``bfloat16`` below; anything but bf16/fp8_e4m3 fails the assertion "DeepSeek DSA only
  supports bf16/bfloat16 or fp8_e4m3 kv_cache_dtype". ``_dsa_split_backend_resolution``: fp8 →
  ``trtllm`` (SM ≥ 10) or ``flashmla_kv``; bf16 → prefill ``flashmla_sparse``, decode ``trtllm``
  (SM ≥ 10) or ``fa3``; ``_check_dsa_backend_constraints`` refuses the ROCm-only ``triton`` backend
  on CUDA and CUDA TileLang fp8 KV that mixes layouts, runs with DCP or below SM89.
- ``mem_cache/kv_cache_configurator.py`` ``calculate_mla_kv_cache_dim``: the latent row is raw
  (``kv_lora_rank + qk_rope_head_dim`` elements) when a DSA backend is ``trtllm`` or both are
  ``tilelang``; otherwise fp8 KV stores ``kv_lora_rank`` fp8 + ``kv_lora_rank / 128 × 4`` B scales +
  ``qk_rope_head_dim × 2`` B bf16 rope (656 B for 512/64).
- ``model_executor/pool_configurator.py`` ``DefaultPoolConfigurator``: the indexer K row
  (``index_head_dim + index_head_dim / 128 × 4`` = 132 B, uint8) per layer is priced ``× dcp_size``
  (replicated under DCP while the latent shards: sglang#31821, #39330); with an EAGLE/MTP draft the
  cell adds ``int(kv × draft_layers / layers) × dcp + 132 × draft_layers × dcp``.
- ``mem_cache/memory_pool.py`` ``DSATokenToKVPool`` / ``mem_cache/index_key_cache.py``: the index
  buffer's ``index_buf_size = (size + page) × dcp − page`` rounds up to ``(size + page) × dcp`` rows
  per layer, reported with the latent rows in the pool's ``KV size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tuner.sim.errors import SimError
from tuner.sim.gpus import GpuSpec
from tuner.sim.models import ModelSpec

__all__ = ["DsaConfig", "resolve_dsa", "INDEX_QUANT_BLOCK"]

INDEX_QUANT_BLOCK = 128
"""``DSATokenToKVPool.quant_block_size``: one fp32 scale (4 B) per 128 fp8 elements."""


@dataclass(frozen=True)
class DsaConfig:
    """A DSA model's resolved KV settings.

    Attributes:
        kv_cache_dtype: ``fp8_e4m3`` or ``bfloat16``.
        prefill_backend, decode_backend: The DSA attention backends.
        raw_layout: The latent row is ``(kv_lora_rank + qk_rope_head_dim) × elem`` (trtllm /
            TileLang), else the scaled fp8 row.
        latent_row_bytes: Latent KV bytes per token per layer.
        indexer_row_bytes: Indexer K bytes per token per layer (132 for ``index_head_dim`` 128).
        page_size: The forced page size (64).
        warnings: SGLang's log lines while resolving.
    """

    kv_cache_dtype: str
    prefill_backend: str
    decode_backend: str
    raw_layout: bool
    latent_row_bytes: float
    indexer_row_bytes: float
    page_size: int
    warnings: tuple[str, ...]

    def cell_bytes(self, layers: int, dcp: int) -> float:
        """Per-rank profile cell of the target: ``(latent + indexer × dcp) × layers``."""
        return (self.latent_row_bytes + self.indexer_row_bytes * dcp) * layers

    def draft_cell_bytes(self, layers: int, draft_layers: int, dcp: int) -> int:
        """What an EAGLE/MTP draft adds to the cell: ``int(latent × layers × d / layers) × dcp + indexer × d × dcp``."""
        kv = int(self.latent_row_bytes * layers * draft_layers / layers)
        return kv * dcp + int(self.indexer_row_bytes * draft_layers) * dcp

    def pool_bytes(self, tokens: int, layers: int, dcp: int) -> int:
        """Bytes of the target pool as ``DSATokenToKVPool`` allocates it (rows + one dummy page)."""
        return int((tokens + self.page_size) * self.cell_bytes(layers, dcp))


def _backends(v: dict[str, Any], dtype: str, major: int, dcp: int) -> tuple[str, str]:
    prefill, decode = v.get("dsa_prefill_backend"), v.get("dsa_decode_backend")
    if dcp > 1:  # _dsa_dcp_overrides
        prefill, decode = prefill or "trtllm", decode or "trtllm"
    if dtype == "fp8_e4m3":
        default = "trtllm" if major >= 10 else "flashmla_kv"
        return prefill or default, decode or default
    return prefill or "flashmla_sparse", decode or ("trtllm" if major >= 10 else "fa3")


def _check(dtype: str, prefill: str, decode: str, dcp: int, gpu: GpuSpec) -> None:
    """``_check_dsa_backend_constraints`` on CUDA (the simulator mimics CUDA GPUs only)."""
    chosen = {prefill, decode}
    if "triton" in chosen:
        raise SimError("ValueError: The triton DSA backend is only supported on ROCm/HIP. Pick an alternative DSA backend "
                       "for CUDA (flashmla_kv on Hopper, trtllm on Blackwell).")
    if dtype != "fp8_e4m3" or "tilelang" not in chosen:
        return
    if prefill != "tilelang" or decode != "tilelang":
        raise SimError("ValueError: CUDA TileLang FP8 KV requires both DSA backends to be tilelang; raw and scaled FP8 KV "
                       "layouts cannot be mixed.")
    if dcp > 1:
        raise SimError("ValueError: CUDA TileLang FP8 KV does not support --dcp-size > 1.")
    if gpu.compute_capability < (8, 9):
        raise SimError("ValueError: CUDA TileLang FP8 KV requires SM89 or newer.")


def resolve_dsa(v: dict[str, Any], model: ModelSpec, gpu: GpuSpec, version: str, dcp: int) -> DsaConfig:
    """Apply 0.5.23's DSA rules to the parsed server args.

    Args:
        v: Parsed server args (SGLang field names).
        model: A DSA model (:attr:`ModelSpec.is_dsa`).
        gpu: The simulated GPU (its compute capability picks the defaults).
        version: The mimicked SGLang version; DSA is simulated with 0.5.23's rules only.
        dcp: ``--dcp-size``.

    Returns:
        The resolved :class:`DsaConfig`.

    Raises:
        SimError: SGLang's refusals (dtype assertion, backend constraints, DSA DCP with HiCache or
            ``--speculative-eagle-topk`` > 1), or a version other than 0.5.23 (a simulator limit:
            the 0.5.5 / 0.5.10 DSA pool rules are not modelled).
    """
    if version != "0.5.23":
        raise SimError(f"the simulator models DeepSeek DSA models ({model.name}) with SGLang 0.5.23's rules only; "
                       "pass --sim-version 0.5.23.")
    major = gpu.compute_capability[0]
    warnings: list[str] = []
    if dcp > 1:
        if v.get("enable_hierarchical_cache"):
            raise SimError("ValueError: DSA DCP does not support HiSparse or HiCache.")
        if v.get("speculative_eagle_topk") not in (None, 1):
            raise SimError("ValueError: DSA DCP requires --speculative-eagle-topk 1.")
    dtype = str(v.get("kv_cache_dtype") or "auto")
    if dtype == "auto":
        dtype = "fp8_e4m3" if major >= 10 else "bfloat16"
        warnings.append(f"Setting KV cache dtype to {dtype} for DeepSeek DSA on SM{major} device.")
    if dtype == "bf16":
        dtype = "bfloat16"
    if dtype not in ("bfloat16", "fp8_e4m3"):
        raise SimError("AssertionError: DeepSeek DSA only supports bf16/bfloat16 or fp8_e4m3 kv_cache_dtype")
    prefill, decode = _backends(v, dtype, major, dcp)
    _check(dtype, prefill, decode, dcp, gpu)
    warnings.append(f"Set DSA backends for {dtype} KV Cache: prefill={prefill}, decode={decode}.")
    page = 64  # 64 × index_kpool (1 for DeepSeek-V3.2)
    warnings.append(f"Setting page size to {page} for DeepSeek DSA.")
    assert model.kv_lora_rank is not None and model.qk_rope_head_dim is not None
    elem = 1.0 if dtype == "fp8_e4m3" else 2.0
    raw = "trtllm" in (prefill, decode) or (prefill == decode == "tilelang") or dtype != "fp8_e4m3"
    latent = ((model.kv_lora_rank + model.qk_rope_head_dim) * elem if raw
              else model.kv_lora_rank + model.kv_lora_rank // INDEX_QUANT_BLOCK * 4 + model.qk_rope_head_dim * 2)
    idx = model.index_head_dim or 128
    return DsaConfig(kv_cache_dtype=dtype, prefill_backend=prefill, decode_backend=decode, raw_layout=raw,
                     latent_row_bytes=float(latent), indexer_row_bytes=float(idx + idx // INDEX_QUANT_BLOCK * 4),
                     page_size=page, warnings=tuple(warnings))
