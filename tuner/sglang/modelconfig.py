"""Model architecture facts read from a Hugging Face ``config.json``: what decides KV memory.

One concept: :class:`ModelArch`, the typed subset of a model config that SGLang's KV-cache
sizing uses (``shared/sglang-reference.md`` §1.3): attention kind (MHA/GQA or MLA), layers, KV
heads, head dims, MLA ranks, the DeepSeek NSA indexer, the model dtype, a checkpoint-level FP8
KV-cache quantization, and the MTP layers used as a draft (§1.5).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tuner.errors import ModelConfigError

__all__ = ["ModelArch", "load_model_config", "model_arch_from_dict"]


class ModelArch(BaseModel):
    """Architecture facts of one model (text tower), as SGLang's KV sizing reads them (§1.3).

    Attributes:
        name: A label (the config's directory name or ``model_type``).
        model_type: HF ``model_type``.
        architectures: HF ``architectures``.
        attention: ``"mla"`` when the config has ``kv_lora_rank`` (DeepSeek-V2/V3, Kimi-K2), else
            ``"mha"`` (MHA and GQA).
        num_layers: ``num_hidden_layers``.
        num_attention_heads: Query heads.
        num_kv_heads: ``num_key_value_heads`` (defaults to the query heads, plain MHA).
        head_dim: ``head_dim``, else ``hidden_size // num_attention_heads``.
        v_head_dim: Value head dim (MHA: ``head_dim``).
        kv_lora_rank, qk_rope_head_dim: MLA latent sizes.
        index_head_dim: DeepSeek-V3.2 NSA indexer head dim, if any.
        torch_dtype: Model dtype (``bfloat16``).
        kv_cache_quant_algo: ``"FP8"`` when the checkpoint's quant config says so (§1.3: ``auto``
            KV dtype then becomes fp8_e4m3).
        num_nextn_predict_layers: MTP layers (the NEXTN/EAGLE draft of DeepSeek-family models).
        max_position_embeddings: The model's context length.
        hidden_size, vocab_size, q_lora_rank, qk_nope_head_dim: what the attention projections and
            the embedding weigh (DP attention replicates them, §1.5b); ``None`` when not in the config.
        attn_weight_bytes: Bytes per attention-projection weight: 1 when the checkpoint quantizes
            them to fp8, the model dtype's bytes when it has no quantization or lists attention in
            its quantization ``ignore`` list (compressed-tensors), else ``None`` (not known here).
        full_attention_layers: Hybrid linear-attention models (Qwen3-Next, Qwen3.5 GDN): the layers
            with a KV cache, the others keep a Mamba/GDN state instead; from ``layer_types``
            (``"full_attention"`` entries) or ``full_attention_interval`` (layer ``l`` is full when
            ``(l + 1) % interval == 0``, 0.5.23 ``configs/qwen3_next.py`` ``layers_block_type``).
            ``None`` for models whose every layer has KV.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    model_type: str | None = None
    architectures: list[str] = []
    attention: Literal["mha", "mla"]
    num_layers: int
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    index_head_dim: int | None = None
    torch_dtype: str = "bfloat16"
    kv_cache_quant_algo: str | None = None
    num_nextn_predict_layers: int | None = None
    max_position_embeddings: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    attn_weight_bytes: float | None = None
    full_attention_layers: int | None = None

    @property
    def kv_layers(self) -> int:
        """Layers with a KV cache: the full-attention ones of a hybrid model, else all (§1.3)."""
        return self.num_layers if self.full_attention_layers is None else self.full_attention_layers


def _full_attention_layers(cfg: Mapping[str, Any], layers: int) -> int | None:
    """Full-attention layers of a hybrid linear-attention config (see :class:`ModelArch`)."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and any(t in ("linear_attention", "mamba") for t in types):
        return sum(1 for t in types if t in ("full_attention", "attention"))
    interval = cfg.get("full_attention_interval")
    if isinstance(interval, int) and not isinstance(interval, bool) and interval > 1:
        return sum(1 for i in range(layers) if (i + 1) % interval == 0)
    return None


_DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0}


def _attn_weight_bytes(cfg: Mapping[str, Any], quant: Any) -> float | None:
    """Bytes per attention weight (see :class:`ModelArch`); ``None`` when the quantization is not
    one this rule reads."""
    dtype = _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", ""))
    if not quant:
        return dtype
    if not isinstance(quant, Mapping):
        return None
    ignore = " ".join(str(x) for x in quant.get("ignore") or quant.get("modules_to_not_convert") or [])
    if "attention" in ignore or "self_attn" in ignore:
        return dtype
    if str(quant.get("quant_method", "")).lower() == "fp8":
        return 1.0
    return None


def _need(cfg: Mapping[str, Any], key: str, source: str) -> Any:
    value = cfg.get(key)
    if value is None:
        raise ModelConfigError(
            f"model config {source} lacks {key}",
            hint="pass the model's own Hugging Face config.json (--model-config PATH)",
        )
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"model config {source} has {key}={value!r}, not a positive integer", hint="pass the model's own Hugging Face config.json")
    return value


def model_arch_from_dict(cfg: Mapping[str, Any], *, source: str = "config.json", name: str | None = None) -> ModelArch:
    """Read :class:`ModelArch` from a parsed HF config (wrappers with ``text_config`` included).

    Args:
        cfg: The JSON object.
        source: What it came from, for messages.
        name: A label; defaults to ``model_type``.

    Returns:
        The architecture facts.

    Raises:
        ModelConfigError: A field the KV model needs is missing or not a positive integer.
    """
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg["text_config"], "quantization_config": cfg.get("quantization_config") or cfg["text_config"].get("quantization_config")}
    layers = _need(cfg, "num_hidden_layers", source)
    quant = cfg.get("quantization_config") or {}
    kv_algo = quant.get("kv_cache_quant_algo") if isinstance(quant, Mapping) else None
    common: dict[str, Any] = {
        "name": name or str(cfg.get("model_type") or "model"),
        "model_type": cfg.get("model_type"),
        "architectures": list(cfg.get("architectures") or []),
        "num_layers": layers,
        "torch_dtype": str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        "kv_cache_quant_algo": str(kv_algo).upper() if kv_algo else None,
        "num_nextn_predict_layers": cfg.get("num_nextn_predict_layers"),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "num_attention_heads": cfg.get("num_attention_heads"),
        "hidden_size": cfg.get("hidden_size"),
        "vocab_size": cfg.get("vocab_size"),
        "attn_weight_bytes": _attn_weight_bytes(cfg, quant),
        "full_attention_layers": _full_attention_layers(cfg, layers),
    }
    if cfg.get("kv_lora_rank") is not None:
        return ModelArch(
            attention="mla",
            kv_lora_rank=_need(cfg, "kv_lora_rank", source),
            qk_rope_head_dim=_need(cfg, "qk_rope_head_dim", source),
            index_head_dim=cfg.get("index_head_dim"),
            q_lora_rank=cfg.get("q_lora_rank"),
            qk_nope_head_dim=cfg.get("qk_nope_head_dim"),
            v_head_dim=cfg.get("v_head_dim"),
            num_kv_heads=1,
            **common,
        )
    heads = _need(cfg, "num_attention_heads", source)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        head_dim = _need(cfg, "hidden_size", source) // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return ModelArch(attention="mha", num_kv_heads=int(kv_heads), head_dim=int(head_dim), v_head_dim=int(cfg.get("v_head_dim") or head_dim), **common)


def load_model_config(path: Path | str) -> ModelArch:
    """Read a Hugging Face ``config.json`` (or the model directory holding it).

    Args:
        path: ``.../config.json`` or the directory.

    Returns:
        The :class:`ModelArch`, named after the directory.

    Raises:
        ModelConfigError: Missing, unreadable, not JSON, or lacking a needed field.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(file.read_text())
    except FileNotFoundError as err:
        raise ModelConfigError(f"model config {file} does not exist", hint="pass the model's config.json or its directory") from err
    except (OSError, UnicodeDecodeError) as err:
        raise ModelConfigError(f"cannot read model config {file}", hint="pass a readable Hugging Face config.json") from err
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"model config {file} is not JSON (line {err.lineno})", hint="pass a Hugging Face config.json") from err
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"model config {file} is not a JSON object", hint="pass a Hugging Face config.json")
    return model_arch_from_dict(cfg, source=str(file), name=file.parent.name or None)
