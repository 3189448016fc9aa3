"""Structural levers of SGLang's KV capacity, as facts: which exist, how each sizes the pool, where each runs.

One concept: the facts behind the ladder (:mod:`tuner.sglang.ladder`) and the study's rung
dimensions, each with its source. Four levers change capacity by more than the fraction can:

- **fp8 KV** (``--kv-cache-dtype fp8_e4m3``): 1 B per element instead of 2 (§1.3); the budget is
  unchanged; a DSA model's indexer row (132 B per layer) does not shrink (``shared/cases/ladder/README.md``).
- **DCP** (``--dcp-size N``, decode context parallelism): KV slots interleaved ``slot % N`` over
  the ranks, so the logical pool is ``N ×`` the per-rank one for plain MLA; a DSA indexer is
  replicated and priced ``× N`` in the per-rank cell, so the gain is ``N (kv + idx) / (kv + N idx)``
  (sglang#14194, #31514, #31821, ``pool_configurator._get_dsa_indexer_cache_token_multiplier``).
  From 0.5.21 the scheduler line and ``/get_server_info`` report the logical count
  (:data:`DCP_LOGICAL_REPORT_SINCE`), sglang#32730 with the math
  (``26462720 (3307840 per rank * dcp_size 8)``). ``--dcp-size`` must divide ``--tp-size``
  (0.5.23 ``arg_groups/attention_hook.py``).
- **DP attention** (``--enable-dp-attention --dp-size N``): attention runs at ``attn_tp = tp / N``,
  so the partitioned attention projections and the embedding grow ``tp / attn_tp`` times per GPU
  (``python/sglang/srt/models/deepseek_v2.py``); each DP rank has its own pool (MLA cell unchanged,
  MHA heads per rank ``kv_heads / attn_tp``), one request fits one rank's pool,
  ``max_running_requests // N``, ``chunked_prefill_size // N`` (§1.5b).
- **The draft model** (speculative decoding): where its KV and weights are paid, per version
  (§1.5; :func:`draft_budget`).

Which flags exist is read from the bundled flag tables (``tuner/data/flags-*.json``); a version
between two bundled tables that lacks a flag the newer table has is *unknown*, not "no". Where a
lever runs is the feasibility table in ``tuner/data/levers.json`` (GPU architecture × version ×
attention backend × attention type); a combination with no cell is unknown (``None``), never yes.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tuner.errors import FlagError
from tuner.sglang.flags import FlagTable
from tuner.sglang.memory import GIB
from tuner.sglang.modelconfig import ModelArch
from tuner.sglang.versions import at_least, release

__all__ = [
    "LEVER_FLAGS",
    "Verdict",
    "DraftBudget",
    "attention_type",
    "gpu_arch",
    "flag_available",
    "dsa_kv_settings",
    "dsa_backends",
    "feasibility",
    "draft_budget",
    "dp_attention_extra_weight_gib",
    "dcp_per_rank_cell_bytes",
    "dcp_gain",
    "DCP_LOGICAL_REPORT_SINCE",
    "rank_tokens",
    "supporting_backend",
    "default_backend",
    "table_for",
]

LeverName = Literal["fp8_kv", "dcp", "dp_attention", "speculative"]

LEVER_FLAGS: dict[str, tuple[str, ...]] = {
    "fp8_kv": ("kv_cache_dtype",),
    "dcp": ("dcp_size",),
    "dp_attention": ("enable_dp_attention", "dp_size"),
    "speculative": ("speculative_algorithm",),
}
"""SGLang field names each lever sets (the flag tables' ``dest``; ``dp_size`` is
``data_parallel_size`` before 0.5.23, resolved by :class:`~tuner.sglang.flags.FlagTable`)."""

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class Verdict(BaseModel):
    """A yes / no / unknown with its reason.

    Attributes:
        ok: ``True``, ``False``, or ``None`` (unknown: no fact says either way).
        why: The fact and its source, or what is missing.
    """

    model_config = _FROZEN

    ok: bool | None
    why: str


class DraftBudget(BaseModel):
    """Where a version pays the draft model (§1.5).

    Attributes:
        draft_kv: ``"reserve"`` (allocated after profiling, out of ``(1 − mfs) × B``) or ``"cell"``
            (inside the target's cell: ``cell × (1 + draft_layers / target_layers)``).
        draft_weights: ``"reserve"`` or ``"budget"`` (loaded before profiling, out of ``mfs × B``).
        headroom: The target pool is enlarged by ``mrr × steps × topk + mrr × draft_tokens + 100``.
        source: Where this is said.
    """

    model_config = _FROZEN

    draft_kv: Literal["reserve", "cell"]
    draft_weights: Literal["reserve", "budget"]
    headroom: bool
    source: str


@cache
def _data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(resources.files("tuner.data").joinpath("levers.json").read_text())
    return data


def attention_type(model: ModelArch) -> Literal["mha", "mla", "dsa"]:
    """``"dsa"`` for MLA with a DeepSeek NSA/DSA indexer, ``"mla"``, else ``"mha"`` (MHA and GQA)."""
    if model.attention == "mla":
        return "dsa" if model.index_head_dim else "mla"
    return "mha"


def gpu_arch(gpu: str | None) -> str | None:
    """The CUDA architecture (``"sm120"``) of a GPU name as nvidia-smi or a simulator preset
    spells it (``"NVIDIA RTX PRO 6000 Blackwell Server Edition"``, ``"RTX-PRO-6000-96GB"``), or an
    architecture given as such; ``None`` when not in ``levers.json``'s table."""
    if not gpu:
        return None
    text = gpu.strip()
    if text.lower().startswith("sm") and text[2:].isdigit():
        return text.lower()
    upper = text.upper()
    for row in _data()["gpu_arch"]:
        if row["match"].upper() in upper:
            return str(row["arch"])
    return None


@cache
def table_for(version: str) -> FlagTable:
    """:meth:`FlagTable.for_version`, read once per version (the ladder asks many times)."""
    return FlagTable.for_version(version)


def _neighbours(version: str) -> tuple[str | None, str | None]:
    """The bundled flag tables at or below and above ``version``."""
    wanted = release(version)
    bundled = FlagTable.bundled_versions()
    below = [v for v in bundled if release(v) <= wanted]
    above = [v for v in bundled if release(v) > wanted]
    return (below[-1] if below else None), (above[0] if above else None)


def flag_available(version: str, field: str, value: Any = None) -> Verdict:
    """Whether SGLang ``version`` accepts ``--<field>`` (and ``value`` among its choices), from the
    bundled flag tables.

    A version with its own table is answered by it. A version between two tables that lacks the
    flag in the older one but has it in the newer one is unknown (the flag came in between).

    Args:
        version: SGLang version (``"0.5.5"``, ``"0.5.16"``).
        field: SGLang field name (``dcp_size``, ``kv_cache_dtype``).
        value: A value the option must accept (checked against ``choices`` when it has them).

    Returns:
        The :class:`Verdict`, naming the table.

    Raises:
        FlagError: ``version`` is not a version number.
    """
    below, above = _neighbours(version)
    table = table_for(version)
    exact = below is not None and release(below) == release(version)
    flag = "--" + field.replace("_", "-")
    if table.has(field):
        opt = table.option(field)
        if value is not None and opt.choices is not None and value not in opt.choices:
            return Verdict(ok=False, why=f"SGLang {version}'s {flag} accepts {', '.join(map(str, opt.choices))}, not {value} (flag table {table.table_version})")
        return Verdict(ok=True, why=f"SGLang {version} has {flag} (flag table {table.table_version})")
    if not exact and above is not None and table_for(above).has(field):
        return Verdict(ok=None, why=f"{flag} is not in SGLang {table.table_version} but is in {above}; whether {version} has it is unknown")
    return Verdict(ok=False, why=f"SGLang {version} has no {flag} (flag table {table.table_version})")


def _matches(cell_value: Any, value: Any) -> bool:
    if cell_value == "*":
        return True
    return value in cell_value if isinstance(cell_value, list) else cell_value == value


def _in_range(cell: dict[str, Any], version: str) -> bool:
    """A cell's versions: ``versions`` (the releases its source was read at, exactly; a release
    between them is not covered), else ``min_version`` / ``max_version`` (either open)."""
    if "versions" in cell:
        return release(version) in {release(v) for v in cell["versions"]}
    lo, hi = cell.get("min_version"), cell.get("max_version")
    return (lo is None or at_least(version, lo)) and (hi is None or release(version) <= release(hi))


def feasibility(lever: str, *, gpu: str | None, version: str, backend: str | None, attention: str, value: str | None = None) -> Verdict:
    """The feasibility table's cell for one lever (``tuner/data/levers.json``).

    The most specific matching cell wins (one naming the value first, then fewest ``"*"``); no
    cell, or an unknown GPU, is unknown. ``backend`` ``None`` is SGLang's default choice for the GPU and model.
    A cell naming a ``value`` answers only for that value: an ``fp8_kv`` cell without one is the
    ``fp8_e4m3`` rung's (the dtype the study and the ladder add), a ``dcp`` cell without one holds
    whatever the KV dtype unless a cell for that dtype says otherwise.

    Args:
        lever: ``fp8_kv``, ``dcp`` or ``dp_attention``.
        gpu: GPU name or architecture (``None``: unknown).
        version: SGLang version.
        backend: ``--attention-backend`` (``None``: SGLang's default).
        attention: ``mha``, ``mla`` or ``dsa`` (:func:`attention_type`).
        value: The lever's value where cells depend on it (a KV dtype; for ``dcp`` the rung's
            ``--kv-cache-dtype``); ``None`` matches only the cells that name none.

    Returns:
        The :class:`Verdict` with the cell's source.
    """
    arch = gpu_arch(gpu)
    best: tuple[int, dict[str, Any]] | None = None
    for cell in _data()["feasibility"]:
        if cell["lever"] != lever or not _in_range(cell, version):
            continue
        if not (_matches(cell["attention"], attention) and _matches(cell["backend"], backend)):
            continue
        if "value" in cell and cell["value"] != value:
            continue
        if cell["gpu_arch"] != "*" and (arch is None or not _matches(cell["gpu_arch"], arch)):
            continue
        score = sum(cell[k] != "*" for k in ("gpu_arch", "attention", "backend")) + 10 * ("value" in cell)  # a cell for this value first
        if best is None or score > best[0]:
            best = (score, cell)
    where = f"{lever} on {arch or gpu or 'an unknown GPU'}, {attention}, backend {backend or 'default'}, SGLang {version}"
    if best is None:
        return Verdict(ok=None, why=f"{where}: no fact known (unknown)")
    cell = best[1]
    word = {True: "supported", False: "not supported", None: "unknown"}[cell["supported"]]
    return Verdict(ok=cell["supported"], why=f"{where}: {word} ({cell['source']})")


def supporting_backend(lever: str, *, gpu: str | None, version: str, attention: str) -> str | None:
    """A backend the table says supports ``lever`` here (a cell with ``supported: true`` naming
    one), or ``None``; the ladder adds it to the rung's flags when the default is not known to work."""
    arch = gpu_arch(gpu)
    for cell in _data()["feasibility"]:
        if cell["lever"] != lever or cell["supported"] is not True or not _in_range(cell, version):
            continue
        if not _matches(cell["attention"], attention) or cell["gpu_arch"] == "*" or arch is None or not _matches(cell["gpu_arch"], arch):
            continue
        named = [b for b in cell["backend"] if b] if isinstance(cell["backend"], list) else []
        if named:
            return str(named[0])
    return None


def default_backend(gpu: str | None, attention: str) -> Verdict:
    """SGLang's own ``--attention-backend`` when the command names none (``levers.json``
    ``default_backend``: 0.5.5 ``server_args.py``, 0.5.23 ``get_default_attn_backend``).

    Args:
        gpu: GPU name or architecture.
        attention: ``mha``, ``mla`` or ``dsa`` (:func:`attention_type`).

    Returns:
        A :class:`Verdict` whose ``why`` is the backend's name then its source after ``": "``
        (``ok`` ``True``), or ``ok`` ``None`` where the choice depends on more than the GPU and the
        attention type (SM100: the model class) or the GPU is not in the table.
    """
    arch = gpu_arch(gpu)
    for row in _data()["default_backend"]:
        if arch is not None and arch in row["gpu_arch"] and attention in row["attention"]:
            return Verdict(ok=True, why=f"{row['backend']}: {row['source']}")
    return Verdict(ok=None, why=f"SGLang's default attention backend for {attention} on {arch or gpu or 'an unknown GPU'} is not known here")


def draft_budget(version: str) -> DraftBudget:
    """Where SGLang ``version`` pays the draft model's KV and weights (§1.5, ``levers.json``)."""
    rows = [r for r in _data()["draft_budget"] if at_least(version, r["min_version"])]
    row = rows[-1]
    return DraftBudget(draft_kv=row["draft_kv"], draft_weights=row["draft_weights"], headroom=row["headroom"], source=row["source"])


def _attention_params_partitioned(model: ModelArch) -> int | None:
    """Attention weights per layer that tensor parallelism splits (``deepseek_v2.py``: q_b, kv_b and
    o projections for MLA, q_a / kv_a are replicated anyway; q, k, v, o for MHA)."""
    heads = model.num_attention_heads
    if heads is None:
        return None
    if model.attention == "mla":
        if None in (model.q_lora_rank, model.qk_nope_head_dim, model.v_head_dim, model.hidden_size, model.kv_lora_rank, model.qk_rope_head_dim):
            return None
        assert model.q_lora_rank and model.qk_nope_head_dim and model.v_head_dim and model.hidden_size and model.kv_lora_rank and model.qk_rope_head_dim
        q_b = model.q_lora_rank * heads * (model.qk_nope_head_dim + model.qk_rope_head_dim)
        kv_b = model.kv_lora_rank * heads * (model.qk_nope_head_dim + model.v_head_dim)
        o = heads * model.v_head_dim * model.hidden_size
        return q_b + kv_b + o
    if model.hidden_size is None or model.head_dim is None or model.num_kv_heads is None:
        return None
    return model.hidden_size * model.head_dim * (2 * heads + 2 * model.num_kv_heads)


def dp_attention_extra_weight_gib(model: ModelArch, *, tp: int, dp: int) -> tuple[float, float] | None:
    """Extra weights per GPU under DP attention: ``(attention GiB, embedding GiB)``.

    ``attention_params × bytes × (1 / attn_tp − 1 / tp) × layers`` and ``vocab × hidden × dtype
    bytes × (1 / attn_tp − 1 / tp)`` with ``attn_tp = tp / dp`` (the embedding is partitioned over
    the attention TP group; replicated at ``dp = tp``), ``python/sglang/srt/models/deepseek_v2.py``,
    §1.5b. Kimi-K2.5 at tp 8, dp 8: +8.55 GiB attention (bf16, excluded from its INT4 quantization)
    + 1.91 GiB embedding (``shared/cases/ladder/README.md``).

    Args:
        model: The model (needs hidden size, vocab, head and LoRA dims, attention weight bytes).
        tp: ``--tp-size``.
        dp: ``--dp-size`` with ``--enable-dp-attention``; must divide ``tp``.

    Returns:
        The two GiB figures, or ``None`` when the config lacks a needed field.
    """
    per_layer = _attention_params_partitioned(model)
    if per_layer is None or model.attn_weight_bytes is None or dp < 1 or tp % dp:
        return None
    share = 1 / (tp // dp) - 1 / tp
    attention = per_layer * model.num_layers * model.attn_weight_bytes * share / GIB
    dtype = 4.0 if "32" in model.torch_dtype else 2.0
    embedding = (model.vocab_size or 0) * (model.hidden_size or 0) * dtype * share / GIB
    return attention, embedding


def _indexer_row(model: ModelArch) -> float:
    """Bytes per token per layer of a DSA indexer K row (128 fp8 + 4 B scale = 132, §1.3); 0 without one."""
    return model.index_head_dim + model.index_head_dim / 128 * 4 if model.index_head_dim else 0.0


def dcp_per_rank_cell_bytes(cell_bytes: int, model: ModelArch, dcp: int, draft_layers: int = 0) -> int:
    """Per-rank KV cell under ``--dcp-size dcp``: unchanged for plain MLA; a DSA indexer row is
    replicated and priced ``× dcp`` (``pool_configurator._get_dsa_indexer_cache_token_multiplier``;
    SGLang's CPU test asserts ``(576 + 132 × 8) × L``). With an EAGLE/MTP draft inside a DSA
    model's cell (0.5.16+), 0.5.23 prices the draft's latent and indexer rows ``× dcp`` too
    (``DefaultPoolConfigurator.__init__``: ``draft_kv_size *= dcp_size``, ``draft_indexer_size *=
    dcp_size``): ``+ (dcp − 1) × cell × d / (L + d)``.

    Args:
        cell_bytes: The cell without DCP (:func:`~tuner.sglang.memory.cell_size_bytes`, with its
            draft term when speculative decoding is on).
        model: The model.
        dcp: DCP size.
        draft_layers: Draft layers inside ``cell_bytes`` (0: no draft term).
    """
    extra = 0.0
    if draft_layers and _indexer_row(model):
        extra = (dcp - 1) * cell_bytes * draft_layers / (model.num_layers + draft_layers)
    return int(round(cell_bytes + (dcp - 1) * _indexer_row(model) * model.num_layers + extra))


def dcp_gain(cell_bytes: int, model: ModelArch, dcp: int) -> float:
    """Logical capacity under DCP over the capacity without, at the same budget:
    ``dcp × cell / per_rank_cell`` = ``N (kv + idx) / (kv + N idx)`` (3.68× at N = 8 for 656/132)."""
    return dcp * cell_bytes / dcp_per_rank_cell_bytes(cell_bytes, model, dcp)


DCP_LOGICAL_REPORT_SINCE = "0.5.21"
"""From this release SGLang reports ``max_total_num_tokens`` in logical tokens on a DCP server:
one rank's rows × ``attn_dcp_size``, in the scheduler's startup line, ``/get_server_info`` and its
``memory_usage.token_capacity`` (``tp_worker.get_worker_info`` → ``ModelRunner.logical_max_total_num_tokens``
→ ``KVCacheConfigurator.logical_token_capacity``; read in 0.5.21, 0.5.22 and 0.5.23). 0.5.16-0.5.20
report one rank's rows. The KV line's ``#tokens`` is one rank's rows in every version."""


def rank_tokens(reported: int, *, dcp_size: int | None, version: str | None) -> int:
    """One rank's KV rows from the ``max_total_num_tokens`` a server reports (see
    :data:`DCP_LOGICAL_REPORT_SINCE`): ``reported // dcp_size`` on a DCP server of 0.5.21 or newer,
    else ``reported``; an unknown version is taken as reporting one rank's rows.

    Args:
        reported: The reported count (tokens).
        dcp_size: The server's ``--dcp-size`` (``None`` or 1: no DCP).
        version: The server's SGLang version (``None``: unknown).
    """
    if not dcp_size or dcp_size <= 1 or version is None:
        return reported
    try:
        logical = at_least(version, DCP_LOGICAL_REPORT_SINCE)
    except FlagError:  # not a version number: as an unknown version
        return reported
    return reported // dcp_size if logical else reported


def _sm_major(gpu: str | None) -> int | None:
    arch = gpu_arch(gpu)
    return int(arch[2:-1]) if arch and arch[2:].isdigit() and len(arch) >= 4 else None


def dsa_kv_settings(*, version: str, gpu: str | None, kv_cache_dtype: str, dcp: int = 1,
                    prefill_backend: str | None = None, decode_backend: str | None = None) -> tuple[str, bool]:
    """A DeepSeek DSA model's resolved KV dtype and whether its latent row is raw.

    ``auto`` becomes ``fp8_e4m3`` on SM ≥ 10 and ``bfloat16`` below (0.5.5 ``server_args.py``, 0.5.23
    ``arg_groups/overrides.py`` ``_dsa_kv_cache_dtype_default``); an unknown GPU keeps ``auto``. From
    0.5.23 the backends default to ``trtllm`` under ``--dcp-size > 1`` (``_dsa_dcp_overrides``),
    else fp8 → ``trtllm`` (SM ≥ 10) / ``flashmla_kv``, bf16 → decode ``trtllm`` (SM ≥ 10) / ``fa3``
    (``_dsa_split_backend_resolution``); a ``trtllm`` or both-``tilelang`` backend stores the raw
    ``(kv_lora_rank + qk_rope_head_dim) × elem`` row (``calculate_mla_kv_cache_dim``), the other
    fp8 backends the scaled 656 B row. Before 0.5.23 fp8 is the scaled row (0.5.5's
    ``flashmla_kv``; ladder-01).

    Args:
        version: SGLang version.
        gpu: GPU name or architecture (``None``: unknown).
        kv_cache_dtype: ``--kv-cache-dtype``.
        dcp: ``--dcp-size``.
        prefill_backend, decode_backend: ``--dsa-prefill-backend`` / ``--dsa-decode-backend`` when given.

    Returns:
        ``(dtype, raw_layout)``: the resolved dtype (``auto`` when the GPU is unknown) and whether
        the latent row is raw.
    """
    major = _sm_major(gpu)
    dtype = "bfloat16" if kv_cache_dtype == "bf16" else kv_cache_dtype
    if dtype == "auto" and major is not None:
        dtype = "fp8_e4m3" if major >= 10 else "bfloat16"
    if not at_least(version, "0.5.23") or dtype != "fp8_e4m3":
        return dtype, False
    prefill_backend, decode_backend = dsa_backends(gpu=gpu, kv_cache_dtype=dtype, dcp=dcp, prefill_backend=prefill_backend,
                                                   decode_backend=decode_backend)
    raw = "trtllm" in (prefill_backend, decode_backend) or prefill_backend == decode_backend == "tilelang"
    return dtype, raw


def dsa_backends(*, gpu: str | None, kv_cache_dtype: str, dcp: int = 1, prefill_backend: str | None = None,
                 decode_backend: str | None = None) -> tuple[str | None, str | None]:
    """0.5.23's DSA ``(prefill, decode)`` backends: the given ones, ``trtllm`` under ``--dcp-size > 1``
    (``_dsa_dcp_overrides``), else fp8 → ``trtllm`` (SM ≥ 10) / ``flashmla_kv``, bf16 →
    ``flashmla_sparse`` / ``trtllm`` (SM ≥ 10) or ``fa3`` (``_dsa_split_backend_resolution``); ``None``
    where the GPU is unknown."""
    if dcp > 1:
        prefill_backend, decode_backend = prefill_backend or "trtllm", decode_backend or "trtllm"
    major = _sm_major(gpu)
    if major is None:
        return prefill_backend, decode_backend
    if kv_cache_dtype == "fp8_e4m3":
        default = "trtllm" if major >= 10 else "flashmla_kv"
        return prefill_backend or default, decode_backend or default
    return prefill_backend or "flashmla_sparse", decode_backend or ("trtllm" if major >= 10 else "fa3")
