"""Simulated models: the architecture facts of a Hugging Face ``config.json`` and their weight bytes.

A model is a directory holding a ``config.json`` in the Hugging Face format, or the name of a
bundled preset (``tuner/data/models/<name>/config.json``, facts copied from the public
configs). Parameters are counted from the config: embeddings, attention (GQA or MLA), dense and
MoE MLPs, lm_head. Weight bytes follow the quantization config; a preset may state its per-GPU
weight size where quantization makes the count ambiguous (``data/model_presets.json``).
KV-cache facts (§1.3 of ``shared/sglang-reference.md``) use ``num_kv_heads``/``head_dim`` for
MHA/GQA and ``kv_lora_rank + qk_rope_head_dim`` for MLA.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tuner.sim.errors import SimError

__all__ = [
    "ModelSpec",
    "load_model",
    "weight_bytes_per_gpu",
    "dp_attention_extra_bytes",
    "model_presets",
    "DTYPE_BYTES",
    "GIB",
]

GIB = 1 << 30
"""Bytes per GiB (SGLang's "GB" in GPU log lines, §0 Units)."""

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float": 4, "half": 2}
"""Bytes per element of a checkpoint ``torch_dtype``."""

_DSA_ARCHS = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "MistralLarge3ForCausalLM")
"""Architectures SGLang 0.5.23 treats as DSA when ``index_topk`` is set (``is_deepseek_dsa``, a subset)."""

_DATA = resources.files("tuner.sim") / "data"
_MODELS = resources.files("tuner.data") / "models"  # the one copy of the bundled model configs


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts of one model that decide memory and compute.

    Attributes:
        name: Preset name or the directory's name.
        architectures: ``config.json`` ``architectures`` (e.g. ``("LlamaForCausalLM",)``).
        num_layers: Transformer layers (``num_hidden_layers``), excluding MTP layers.
        hidden_size, intermediate_size: Model width and dense MLP width.
        num_attention_heads, num_kv_heads: Query heads and KV heads.
        head_dim: Query/key head dim (MLA: ``qk_nope_head_dim + qk_rope_head_dim``).
        v_head_dim: Value head dim (= head_dim for MHA/GQA).
        kv_lora_rank, qk_rope_head_dim: MLA latent rank and rope dim; ``kv_lora_rank`` set means MLA.
        vocab_size, max_position_embeddings: Vocabulary and context length of the config.
        num_experts, experts_per_token, moe_intermediate_size: Routed experts (None if dense).
        num_nextn_predict_layers: MTP layers (the draft of NEXTN/EAGLE for DeepSeek-family models).
        torch_dtype: Checkpoint dtype, e.g. ``"bfloat16"``.
        weight_bits: Effective bits per weight over all parameters (16 for bf16, ~8 for fp8, ~4.x
            for int4 experts with 16-bit attention).
        params_total: Parameters counted from the config (without MTP layers).
        params_active: Parameters used per token (MoE: the routed top-k plus shared experts).
        weight_gib_per_gpu: Stated per-GPU weight size, GiB, at ``weight_gib_tp_size`` (None when
            the count decides).
        weight_gib_tp_size: The tp size ``weight_gib_per_gpu`` was stated for.
        quant_method: ``quantization_config.quant_method`` or None.
        kv_cache_fp8: The checkpoint says ``kv_cache_quant_algo: FP8`` (auto KV dtype becomes fp8, §1.3).
        replicated_weight_bytes: Weight bytes every tp rank holds in full (norms, MLA's low-rank
            a-projections, the router).
        sharded_weight_bytes: Weight bytes split across tp ranks.
        attention_sharded_bytes: The tp-split part of the attention projections (MLA: q_b, kv_b,
            o; MHA: q, k, v, o), all layers: DP attention splits them over ``tp / dp`` instead.
        embedding_bytes: The input embedding (split over the attention TP group under DP attention).
        index_head_dim, index_n_heads, index_topk: The DeepSeek DSA lightning indexer (V3.2), None
            without one; its weights (``wq_b``, ``wk``, ``weights_proj``) are ``ReplicatedLinear``
            on every rank (0.5.23 ``layers/attention/dsa/dsa_indexer.py``).
    """

    name: str
    architectures: tuple[str, ...]
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    kv_lora_rank: int | None
    qk_rope_head_dim: int | None
    vocab_size: int
    max_position_embeddings: int
    num_experts: int | None
    experts_per_token: int | None
    moe_intermediate_size: int | None
    num_nextn_predict_layers: int
    torch_dtype: str
    weight_bits: float
    params_total: int
    params_active: int
    weight_gib_per_gpu: float | None = None
    weight_gib_tp_size: int = 1
    quant_method: str | None = None
    kv_cache_fp8: bool = False
    replicated_weight_bytes: int = 0
    sharded_weight_bytes: int = 0
    attention_sharded_bytes: int = 0
    embedding_bytes: int = 0
    index_head_dim: int | None = None
    index_n_heads: int | None = None
    index_topk: int | None = None

    @property
    def is_dsa(self) -> bool:
        """DeepSeek sparse attention: a DeepSeek-family MLA model whose config has ``index_topk``
        (``is_deepseek_dsa``, 0.5.23 ``python/sglang/srt/configs/model_config.py``)."""
        return self.is_mla and self.index_topk is not None and self.model_class in _DSA_ARCHS

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): one latent KV head."""
        return self.kv_lora_rank is not None

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the checkpoint dtype (the ``auto`` KV dtype, §1.3)."""
        return DTYPE_BYTES.get(self.torch_dtype, 2)

    @property
    def model_class(self) -> str:
        """The SGLang model class printed in ``Load weight end. type=...`` (§4.2)."""
        return self.architectures[0] if self.architectures else "LlamaForCausalLM"


def model_presets() -> list[str]:
    """Names of the bundled model presets."""
    return sorted(p.name for p in _MODELS.iterdir() if (p / "config.json").is_file())


def _require(cfg: dict[str, Any], key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise SimError(
            f"{source} lacks the field {key!r} needed to size the model; add it from the model's "
            "published config.json."
        )
    return cfg[key]


def _read_config(path_or_preset: str) -> tuple[str, dict[str, Any], str, dict[str, Any]]:
    """Return (name, config dict, source description, stated facts)."""
    stated_all = json.loads((_DATA / "model_presets.json").read_text())
    path = Path(path_or_preset).expanduser()
    if path.is_dir():
        file = path / "config.json"
        name = path.name
    elif path.name == "config.json" and path.is_file():
        file, name = path, path.parent.name
    elif path_or_preset in model_presets():
        file = Path(str(_MODELS / path_or_preset / "config.json"))
        name = path_or_preset
    else:
        raise SimError(
            f"--model-path {path_or_preset!r} is neither a directory with a config.json nor a "
            f"preset. Presets: {', '.join(model_presets())}."
        )
    try:
        cfg = json.loads(file.read_text())
    except FileNotFoundError:
        raise SimError(f"{file} does not exist; --model-path needs a Hugging Face config.json.") from None
    except (OSError, ValueError) as err:
        raise SimError(f"{file} is not readable JSON ({err}); fix or replace the config.json.") from None
    if not isinstance(cfg, dict):
        raise SimError(f"{file} is not a JSON object; --model-path needs a Hugging Face config.json.")
    # Multimodal wrappers keep the language model under text_config.
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures", [])}
    stated = stated_all.get(name, {}) if file.is_relative_to(Path(str(_MODELS))) else {}
    return name, cfg, str(file), stated


def _quant_bits(cfg: dict[str, Any]) -> tuple[str | None, float, tuple[str, ...]]:
    """(quant_method, bits of quantized linear weights, module groups left at 16 bits)."""
    qc = cfg.get("quantization_config") or {}
    method = qc.get("quant_method")
    if not method:
        return None, 8.0 * DTYPE_BYTES.get(cfg.get("torch_dtype", "bfloat16"), 2), ()
    ignore = tuple(str(x).lower() for x in qc.get("ignore", ()) or ())
    if method in ("fp8", "modelopt", "w8a8_fp8", "fbgemm_fp8"):
        return method, 8.0, ignore
    weights = qc.get("weights") or {}
    if "num_bits" in weights:
        bits = float(weights["num_bits"])
        group = weights.get("group_size") or 0
        # One 16-bit scale per group (compressed-tensors pack-quantized, GPTQ/AWQ alike).
        return method, bits + (16.0 / group if group else 0.0), ignore
    if "bits" in qc:
        group = qc.get("group_size") or 0
        return method, float(qc["bits"]) + (16.0 / group if group and group > 0 else 0.0), ignore
    raise SimError(
        f"quantization_config.quant_method={method!r} is not simulated; use fp8, compressed-tensors "
        "or a config with weights.num_bits."
    )


def load_model(path_or_preset: str) -> ModelSpec:
    """Read a model from a directory holding ``config.json``, or a bundled preset name.

    Args:
        path_or_preset: ``--model-path``: a directory, a ``config.json`` file, or a preset
            (``llama-3.1-8b``, ``llama-3.1-70b``, ``qwen3-32b``, ``deepseek-v3``, ``deepseek-v3.2`` (DSA),
            ``kimi-k2.5-int4``).

    Returns:
        The model's facts with its parameter count and weight bytes split into replicated and
        tp-sharded parts.

    Raises:
        SimError: Not a directory or preset, unreadable JSON, or a needed field missing (the
            message names the field).
    """
    name, cfg, source, stated = _read_config(path_or_preset)
    hidden = int(_require(cfg, "hidden_size", source))
    layers = int(_require(cfg, "num_hidden_layers", source))
    heads = int(_require(cfg, "num_attention_heads", source))
    vocab = int(_require(cfg, "vocab_size", source))
    max_pos = int(_require(cfg, "max_position_embeddings", source))
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    kv_lora = cfg.get("kv_lora_rank")
    n_experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    moe_inter = cfg.get("moe_intermediate_size")
    if n_experts:
        top_k = int(_require(cfg, "num_experts_per_tok", source))
        moe_inter = int(moe_inter or _require(cfg, "intermediate_size", source))
        inter = int(cfg.get("intermediate_size") or moe_inter)
    else:
        top_k = None
        inter = int(_require(cfg, "intermediate_size", source))

    # ---- attention parameters per layer (sharded / replicated) ----
    if kv_lora is not None:
        kv_lora = int(kv_lora)
        rope = int(_require(cfg, "qk_rope_head_dim", source))
        nope = int(_require(cfg, "qk_nope_head_dim", source))
        v_dim = int(_require(cfg, "v_head_dim", source))
        q_lora = cfg.get("q_lora_rank")
        head_dim = nope + rope
        kv_heads = 1
        if q_lora:
            q_rep = hidden * int(q_lora) + int(q_lora)  # q_a_proj + q_a_layernorm
            q_shard = int(q_lora) * heads * head_dim
        else:
            q_rep, q_shard = 0, hidden * heads * head_dim
        attn_rep = q_rep + hidden * (kv_lora + rope) + kv_lora  # kv_a_proj_with_mqa + norm
        attn_shard = q_shard + kv_lora * heads * (nope + v_dim) + heads * v_dim * hidden
    else:
        rope = None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        v_dim = head_dim
        attn_rep = 0
        attn_shard = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    norm_rep = 2 * hidden  # input and post-attention RMSNorm

    # ---- MLP parameters ----
    dense_mlp = 3 * hidden * inter
    first_dense = int(cfg.get("first_k_dense_replace") or 0) if n_experts else layers
    moe_layers = layers - first_dense if n_experts else 0
    n_shared = int(cfg.get("n_shared_experts") or 0)
    expert = 3 * hidden * int(moe_inter or 0)
    routed_total = moe_layers * int(n_experts or 0) * expert
    shared_total = moe_layers * n_shared * expert
    router = moe_layers * hidden * int(n_experts or 0)

    # ---- the DSA indexer per layer, replicated (wq_b, wk quantized; weights_proj bf16) ----
    idx_dim, idx_heads = cfg.get("index_head_dim"), cfg.get("index_n_heads")
    indexer_q = indexer_bf16 = 0
    if kv_lora is not None and cfg.get("index_topk") is not None and idx_dim and idx_heads:
        indexer_q = int(cfg.get("q_lora_rank") or hidden) * int(idx_heads) * int(idx_dim) + hidden * int(idx_dim)
        indexer_bf16 = hidden * int(idx_heads) + 2 * int(idx_dim)  # weights_proj + k_norm

    embed = vocab * hidden
    lm_head = 0 if cfg.get("tie_word_embeddings") else vocab * hidden
    attention_total = layers * (attn_rep + attn_shard)
    dense_total = first_dense * dense_mlp
    params_total = (
        embed + lm_head + attention_total + dense_total + routed_total + shared_total + router
        + layers * norm_rep + hidden + layers * (indexer_q + indexer_bf16)
    )
    params_active = params_total - routed_total + moe_layers * int(top_k or 0) * expert

    # ---- bytes by quantization ----
    method, qbits, ignore = _quant_bits(cfg)
    full = DTYPE_BYTES.get(dtype, 2)

    def linear_bytes(n_params: int, group: str) -> float:
        if method is None or _ignored(group, ignore):
            return n_params * full
        return n_params * qbits / 8.0

    rep_bytes = (
        layers * attn_rep * (qbits / 8.0 if method and not _ignored("attention", ignore) else full)
        + (layers * norm_rep + hidden) * full
        + router * full
        + layers * (indexer_q * (qbits / 8.0 if method and not _ignored("attention", ignore) else full) + indexer_bf16 * 2)
    )
    shard_bytes = (
        embed * full
        + lm_head * (qbits / 8.0 if method == "fp8_lm_head" else full)
        + linear_bytes(layers * attn_shard, "attention")
        + linear_bytes(dense_total, "dense mlp")
        + linear_bytes(shared_total, "shared_experts")
        + linear_bytes(routed_total, "experts")
    )
    weight_bits = 8.0 * (rep_bytes + shard_bytes) / params_total
    return ModelSpec(
        name=name,
        architectures=tuple(cfg.get("architectures") or ()),
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_dim,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        num_experts=int(n_experts) if n_experts else None,
        experts_per_token=top_k,
        moe_intermediate_size=int(moe_inter) if n_experts and moe_inter else None,
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        torch_dtype=dtype,
        weight_bits=round(weight_bits, 3),
        params_total=int(params_total),
        params_active=int(params_active),
        weight_gib_per_gpu=stated.get("weight_gib_per_gpu"),
        weight_gib_tp_size=int(stated.get("weight_gib_tp_size", 1)),
        quant_method=method,
        kv_cache_fp8=str((cfg.get("quantization_config") or {}).get("kv_cache_quant_algo", "")).upper()
        == "FP8",
        replicated_weight_bytes=int(rep_bytes),
        sharded_weight_bytes=int(shard_bytes),
        attention_sharded_bytes=int(linear_bytes(layers * attn_shard, "attention")),
        embedding_bytes=int(embed * full),
        index_head_dim=int(idx_dim) if idx_dim else None,
        index_n_heads=int(idx_heads) if idx_heads else None,
        index_topk=int(cfg["index_topk"]) if cfg.get("index_topk") is not None else None,
    )


def _ignored(group: str, ignore: tuple[str, ...]) -> bool:
    """True when the quantization config's ``ignore`` list names this module group exactly."""
    return group in ignore


def _counted_bytes_per_gpu(model: ModelSpec, tp: int) -> float:
    return model.replicated_weight_bytes + model.sharded_weight_bytes / tp


def dp_attention_extra_bytes(model: ModelSpec, tp: int, dp: int) -> int:
    """Extra weight bytes per GPU under ``--enable-dp-attention --dp-size dp``: the attention
    projections and the embedding are split over ``attn_tp = tp / dp`` ranks instead of ``tp``
    (``python/sglang/srt/models/deepseek_v2.py``; ``shared/sglang-reference.md`` §1.5b)."""
    if dp <= 1:
        return 0
    share = 1 / (tp // dp) - 1 / tp
    return int((model.attention_sharded_bytes + model.embedding_bytes) * share)


def weight_bytes_per_gpu(model: ModelSpec, tp: int) -> int:
    """Weight bytes each GPU holds at tensor parallelism ``tp``.

    Replicated parts (norms, MLA's a-projections, the router) are held in full; the rest is split
    ``1/tp``. A stated size (``weight_gib_per_gpu`` at ``weight_gib_tp_size``) is used as is at
    its tp, and scaled by the counted ratio at another tp.

    Args:
        model: The model.
        tp: Tensor-parallel size, ≥ 1.

    Returns:
        Bytes per GPU.
    """
    counted = _counted_bytes_per_gpu(model, tp)
    if model.weight_gib_per_gpu is None:
        return int(counted)
    at_stated = _counted_bytes_per_gpu(model, model.weight_gib_tp_size)
    return int(model.weight_gib_per_gpu * GIB * counted / at_stated)
