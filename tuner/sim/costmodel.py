"""The simulator's cost model: how long one forward step (prefill, decode or mixed) takes on a GPU,
and how much activation memory a step needs.

Step time is a roofline per kind of work, summed over the kinds that run one after another in a
layer, plus launch and communication overheads:

- **Linear layers** (attention projections, MLP / MoE experts, LM head):
  ``max(weight bytes read / (HBM B/W × eff_hbm), 2 × active params × tokens / (peak × eff_gemm))``.
  A MoE step reads every dense weight plus the share of expert weights its tokens touch,
  ``1 − (1 − k/E)^tokens`` (each token picks k of E experts); the expert part runs at
  ``eff_moe`` of the dense efficiency plus ``moe_layer_overhead_s`` per layer (routing).
- **Attention**: ``max(KV bytes read / (HBM B/W × eff_hbm), attention FLOPs / (peak × eff_attn))``.
  KV bytes read = the KV cell (``kv_cell_bytes``, §1.3, per GPU) × every cached token each
  sequence of the step attends to. FLOPs per (query, key) pair = ``2 × heads per rank × (d_qk +
  d_v) × layers`` (MHA/GQA: ``d_qk = d_v = head_dim``; MLA in its absorbed form: ``d_qk =
  kv_lora_rank + qk_rope_head_dim``, ``d_v = kv_lora_rank``). MLA's KV reads run at ``eff_mla``
  of the MHA read efficiency. A prefill (extend) step runs MLA in its MHA form instead (``d_qk =
  qk_nope_head_dim + qk_rope_head_dim``, ``d_v = v_head_dim``: 3.4x fewer FLOPs per pair for
  DeepSeek-V3): SGLang's CUDA backends (flashinfer, fa3, flashmla, cutlass_mla) dispatch an extend
  without a cached prefix, or with one at least ``chunked_prefix_cache_threshold`` long, to
  ``MHA_CHUNKED_KV`` / ``MHA_ONE_SHOT`` (0.5.5 ``models/deepseek_v2.py``
  ``_handle_attention_backend``); the model takes the MHA form for every extend.
- **Tensor parallelism**: two all-reduces of ``tokens × hidden × 2 B`` per layer, ring cost
  ``2 (tp − 1)/tp × bytes / link B/W`` plus a fixed latency each. Link B/W is NVLink for the SXM
  parts (H100, H200, A100) and PCIe for the others (L40S, L4, RTX PRO 6000).
- **Launch overhead**: a CUDA-graph decode step (batch ≤ the largest captured size, §2.1) pays a
  small fixed cost and runs its linear layers at the next captured size (the padded rows); an eager
  step (prefill, a decode batch above the largest captured graph, §2.1 "Decode batches larger than
  the largest captured size run eagerly", or one between captured sizes with
  ``--disable-cuda-graph-padding``) is bounded below by the CPU
  time to launch every layer's kernels: ``max(GPU time, layers × eager_layer_overhead_s)``.
  Case-21 (``shared/cases/case-21.json``: a 0.5B, 24-layer model on an RTX 4090, median TPOT
  30.6 ms beyond a bs-48 graph vs 5.3 ms with bs-128 graphs) bounds it at about 1 ms per layer;
  that TPOT also carries the larger eager batch (median 67 vs 23) and prefill interruptions, so
  the model takes 0.45 ms per layer (a 4x slower eager step for that model, 2x for an 8B one).
  This factor is not part of the aiconfigurator fit. A MoE layer launches several times a dense
  layer's kernels (router, top-k, token permutation, two grouped GEMMs, the shared expert), so a
  MoE model's eager step adds ``eager_moe_layer_overhead_s`` per layer: a short prefill of
  DeepSeek-R1 is bound by it (61 layers x 1.51 ms = 92 ms for a 1k prompt, where the GPU work is
  ~45 ms). Its value is what a 1k DeepSeek-R1 prompt's TTFT leaves once the request path is the
  one a dense model shows (``request_path_s``, below).
- **Per-GPU compute efficiency** (:data:`GPU_COMPUTE_EFF`): the compute-bound terms run at
  ``eff_gemm`` / ``eff_attn`` times the GPU family's factor (H100/H200 0.72: real prefill there is
  slower than the aiconfigurator fit said; A100 1).
- **DP attention** (``--enable-dp-attention --dp-size N``): each request lives on one DP rank
  (``data_parallel_controller.py`` dispatch), which attends to it with ``N ×`` the heads of TP
  attention; the ranks meet at every MoE layer, so a step's attention lasts as long as its busiest
  rank, ``ceil(n / N)`` of the ``n`` sequences (:func:`dp_rank_share`): one long request gets no
  help from the other ranks. The replicated attention weights are read every step (they are in the
  per-GPU weight bytes).
- **DCP** (``--dcp-size N``): each rank reads ``1/N`` of every request's KV, plus one gather of the
  partial outputs per layer (sglang#14194): slower small-batch decode.
- **DSA** (DeepSeek-V3.2): the latent KV is read for the ``index_topk`` selected keys only; the
  indexer reads every key's 132 B row per layer and scores it in fp8, on every DCP rank (its K is
  replicated, sglang#31821), so DCP does not split that part.
- **Speculative decoding** (optional): a decode step runs ``num_steps`` draft passes of a
  one-layer draft at the batch size, then one target verify pass over ``batch ×
  num_draft_tokens`` tokens, and yields ``accept_length`` tokens per request on average. Past the
  ridge the verify's compute grows with ``batch × num_draft_tokens``, which is where speculation
  loses at high concurrency (sglang#22246, #6995; :mod:`tuner.sim.speculative` states the
  sources, the step costs the engine uses and where the crossover lies).

The efficiency factors (``eff_hbm``, ``eff_gemm``, ``eff_attn``) and the graph-step overhead were
fitted once (log least squares) to aiconfigurator 0.12.0's offline SGLang (0.5.14 database)
estimates for Llama-3.1-8B (tp 1) and Llama-3.1-70B (tp 4, 8) on H100-SXM and H200-SXM: decode
TPOT at batch 1-256 with 1k and 4k inputs, and prefill TTFT of 512-16k tokens (96 points, RMS
error 6.3%). The MoE and MLA factors (``eff_moe``, ``eff_moe_read``, ``eff_mla``,
``moe_layer_overhead_s``, ``eager_moe_layer_overhead_s``), the request path (``request_path_s``,
``tokenize_s_per_token``) and the first batch's cold cost (``cold_prefill_s``) are fitted to real
SGLang measurements instead (issue 37): the training points of ``tests/benchmarks/fidelity/``
(DeepSeek-R1 FP8 tp 8 on H200, SGLang 0.5.6, InferenceMAX), replayed through the offline
evaluation, by coordinate search on the log error of output throughput, median TTFT, median / mean
TPOT and (weight 1/4) p99 TTFT; the Hopper compute factor on one prefill-bound Llama-3.1-8B run on
H100 (sglang#1060); the request path on one low-load dense run (Llama-3.1-8B on A100 at 4 requests/s,
SGLang 0.3.0, ``benchmark/benchmark_vllm_060/README.md``), with the MoE eager floor moved so that a
1k DeepSeek-R1 prompt keeps its fitted TTFT; the validation points measure the result
(``tests/benchmarks/bench_fidelity.py``; figures and the factor table in
``docs/simulator-fidelity.md``). aiconfigurator's DeepSeek-V3 estimates had priced the latent KV
read at 15 % of HBM bandwidth (``eff_mla`` 0.17), which made decode at 16-64 in flight 21-95 %
too slow. ``tuner/sim/data/calibration.json`` keeps the aiconfigurator figures, the commands and
each point's prediction; the constants below are the fitted values (dense efficiencies capped at
0.9), so nothing is read at run time.

Activation memory (for the runtime OOM of §1.6 / §4.4) is a stated model, not an SGLang fact:
the peak transient bytes of one layer's forward over ``n`` tokens, since a layer's temporaries are
freed before the next layer runs::

    act(n) = n × 2 B × (4 × hidden + qkv + max(3 × I_dense / tp, topk × (3 × I_moe / tp + hidden)))
             + n_seqs × vocab / tp × 4 B                      (fp32 logits of the last tokens)

    qkv = (heads + 2 × kv_heads) × head_dim / tp         (MHA / GQA)
        = heads × (kv_lora_rank + rope) / tp + kv_lora_rank + rope     (MLA)

``4 × hidden`` is the residual stream, its normed copy, the attention output and the MLP output;
the qkv term is the projection output; ``3 × I`` is the gate/up output (2 I) and the activated
product (I) of a dense MLP. A MoE layer materialises per-token copies for each of its ``topk``
experts: the gate/up and activated intermediates and one ``hidden``-wide output per expert before
the weighted sum (the shapes of a fused-MoE kernel's intermediate caches). So a bigger prefill
chunk needs proportionally more memory, which is what makes a large ``chunked_prefill_size`` at a
high ``mem_fraction_static`` fail under load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

__all__ = [
    "CostFactors", "CostInputs", "StepShape", "step_time_s", "decode_step_s", "activation_bytes", "load_back_s",
    "NVLINK_GB_S", "GPU_COMPUTE_EFF", "SCHEDULER_CPU", "dp_rank_share",
]

NVLINK_GB_S: Mapping[str, float] = MappingProxyType({"H100": 450.0, "H200": 450.0, "A100": 300.0, "B200": 900.0})
"""Effective NVLink all-reduce bandwidth per GPU, decimal GB/s, for GPU names starting with the
key (half the datasheet's bidirectional 900/600/1,800 GB/s). Other GPUs use their PCIe bandwidth."""

GPU_COMPUTE_EFF: Mapping[str, float] = MappingProxyType({"H100": 0.72, "H200": 0.72})
"""Per-GPU compute efficiency: the share of ``eff_gemm`` / ``eff_attn`` a GPU family reaches on its
compute-bound work (prefill, large batches), for GPU names starting with the key; 1 for the others.

The dense efficiencies were fitted to aiconfigurator's estimates on H100/H200, which real SGLang
does not reach there: prefill on H100 runs 33-78 % slower than those factors say while A100 matches
(issue 37's held-back real runs: the simulator's H100/A100 prefill ratio is 2.70, measured about
1.5). Fitted on one published prefill-bound run, ``sgl-pr1060-h100-llama8b-in8k-out8-burst1000``
(Llama-3.1-8B, 1,000 prompts of 4k tokens on average, 27,670 prompt tokens/s: sglang#1060,
``tests/benchmarks/fidelity/``); H200 is the same GH100 die at the same clocks and dense bf16 peak
(989 TFLOP/s), so it shares the factor; the DeepSeek-R1 H200 fidelity points agree (their bursts
drained 1.4-2x slower than the factor-less model said). A100 keeps 1 (it matches); L4, L40S,
RTX PRO 6000 and B200 keep 1 with no real measurement of their compute side here."""


@dataclass(frozen=True)
class CostFactors:
    """Efficiency factors and overheads of the cost model (fitted; see the module docstring).

    Attributes:
        eff_hbm: Achieved fraction of HBM bandwidth for weight and KV reads.
        eff_gemm: Achieved fraction of dense bf16 peak for linear layers.
        eff_attn: Achieved fraction of dense bf16 peak for attention.
        eff_moe: Extra efficiency of MoE expert GEMMs (grouped GEMMs over few tokens per
            expert) relative to dense linear layers.
        eff_moe_read: Extra efficiency of reading the touched experts' weights (a decode step),
            relative to ``eff_hbm``.
        eff_mla: Extra efficiency of MLA decode attention's KV reads relative to MHA's.
        moe_layer_overhead_s: Fixed cost per MoE layer per step (routing, token permutation).
        graph_step_overhead_s: Fixed cost of a CUDA-graph decode step (replay, sampling), seconds.
        eager_layer_overhead_s: CPU launch time per layer of an eager step, seconds.
        eager_moe_layer_overhead_s: Extra CPU launch time per layer of an eager step of a MoE
            model (router, top-k, token permutation, grouped GEMMs, shared expert: several times a
            dense layer's kernels), seconds.
        step_overhead_s: Scheduler cost of every step, seconds.
        per_seq_overhead_s: Scheduler cost per sequence in a step, seconds.
        allreduce_latency_s: Fixed latency of one tp all-reduce, seconds.
        request_path_s: Fixed time a request spends outside the GPU steps: HTTP, the hop to the
            scheduler and the first token's way back (:meth:`tuner.sim.engine.Engine.add_request`),
            seconds. 6 ms: fitted on a dense low-load run (Llama-3.1-8B, 1x A100, 4 requests/s,
            median TTFT 32.0 ms, SGLang 0.3.0 ``benchmark/benchmark_vllm_060/README.md``, replayed
            with that version's scheduler cost, :data:`SCHEDULER_CPU`); the held-out dense runs at
            8 requests/s and on 4x H100 (70B) measure it (``docs/simulator-fidelity.md``).
        tokenize_s_per_token: Tokenizer-manager time per prompt token of a text prompt, seconds
            (one request at a time).
        cold_prefill_s: Extra time of the first prefill batch a freshly started server runs, seconds
            (first use of a real batch's shapes: allocator growth, kernel JIT; SGLang's own start-up
            warm-up request is a few tokens, ``entrypoints/http_server.py`` ``_execute_server_warmup``).
    """

    eff_hbm: float = 0.88
    eff_gemm: float = 0.64
    eff_attn: float = 0.90
    eff_moe: float = 0.5
    eff_moe_read: float = 1.0
    eff_mla: float = 0.9
    moe_layer_overhead_s: float = 80e-6
    graph_step_overhead_s: float = 0.7e-3
    eager_layer_overhead_s: float = 0.45e-3
    eager_moe_layer_overhead_s: float = 1.06e-3
    step_overhead_s: float = 0.3e-3
    per_seq_overhead_s: float = 2e-6
    allreduce_latency_s: float = 20e-6
    request_path_s: float = 0.006
    tokenize_s_per_token: float = 3e-6
    cold_prefill_s: float = 0.8


SCHEDULER_CPU: Mapping[str, tuple[float, float]] = MappingProxyType({
    "0.5": (CostFactors.step_overhead_s, CostFactors.per_seq_overhead_s),
    "pre-0.4": (2.0e-3, 25e-6),
})
"""The scheduler's CPU cost, by scheduler generation (``--sim-scheduler``): ``(seconds per step,
seconds per running sequence per step)``, added to every step (``step_overhead_s`` and
``per_seq_overhead_s`` of :class:`CostFactors`).

``0.5`` (the default, every SGLang version this simulator mimics): 0.3 ms + 2 µs, the stated
defaults (not fitted; the fidelity points of 0.5.6 run with the overlap scheduler, whose TPOT they
match within ~4 %).

``pre-0.4``: SGLang 0.2-0.3, whose scheduler ran in the same loop as the GPU with no overlap (the
overlap scheduler came in 0.3.5 and became the default in 0.4: "an unoptimized inference engine can
spend as much as half of its time on CPU overhead", LMSYS, *SGLang v0.4*, 2024-12-04) and did
per-request Python work every step (building the batch, checking stop conditions, streaming each
token out). 25 µs per running request: fitted on sglang#1262's "main" run (0.2.14, Llama-3.1-8B on
one H100, ~2,000 requests decoding at once: median TPOT 152 ms where the GPU work is ~100 ms);
2.0 ms per step: fitted on the low-load median TPOT of Llama-3.1-8B on one A100 at 4 requests/s
(13.2 ms, 0.3.0, ``benchmark/benchmark_vllm_060/README.md``). The fidelity points of 0.2/0.3 run
with it (``tests/benchmarks/fidelity/points-sglang-dense.json``, ``sim_args``); their other points
measure it (``docs/simulator-fidelity.md``)."""


@dataclass(frozen=True)
class CostInputs:
    """Model, GPU, parallelism and speculative-decoding facts the cost model needs.

    Build it with :meth:`from_specs` from the simulator's model and GPU presets.

    Attributes:
        num_layers: Transformer layers.
        hidden_size: Hidden width.
        intermediate_size: Dense MLP width (0 for all-MoE models).
        num_attention_heads: Query heads.
        num_kv_heads: KV heads (1 latent head for MLA).
        head_dim: Per-head dim (MLA: ``qk_nope_head_dim + qk_rope_head_dim``).
        v_head_dim: Value head dim (0: ``head_dim``).
        vocab_size: Vocabulary size.
        params_total: Parameters of the whole model.
        params_active: Parameters used per token (MoE: dense + topk experts).
        weight_bytes_per_gpu: Resident weight bytes on each GPU.
        kv_cell_bytes: KV bytes per token per GPU (§1.3).
        tp_size: Tensor-parallel size.
        gpu_name: GPU preset name.
        gpu_memory_bytes: Total device memory, bytes (for the torch OOM text).
        hbm_gb_s: HBM bandwidth, decimal GB/s.
        bf16_tflops: Dense bf16 peak, TFLOP/s.
        pcie_gb_s: Host<->device bandwidth, decimal GB/s (HiCache load-back, §7).
        interconnect_gb_s: All-reduce link bandwidth, decimal GB/s.
        compute_eff: The GPU family's compute efficiency (:data:`GPU_COMPUTE_EFF`), multiplying
            ``eff_gemm`` and ``eff_attn``.
        is_mla: Multi-head latent attention (DeepSeek-V3 family).
        kv_lora_rank: MLA latent rank.
        qk_rope_head_dim: MLA rope dim.
        num_experts: Routed experts (0 = dense).
        experts_per_token: Experts per token (topk).
        moe_intermediate_size: Expert MLP width.
        dtype_bytes: Activation element size, bytes.
        spec_num_steps: Speculative draft steps (0 = off).
        spec_num_draft_tokens: Tokens verified per request per step.
        spec_accept_length: Mean tokens accepted per request per step.
        factors: Efficiency factors.
        dp_size: DP-attention size: each DP rank attends over its own requests (``1/dp`` of the
            batch's KV reads per GPU, with ``heads / attn_tp`` heads), §1.5b.
        dcp_size: Decode context parallelism: each rank reads ``1/dcp`` of every request's KV, then
            the partial outputs are gathered once per layer (sglang#14194: an extra collective per
            layer; its latency is what makes small-batch decode slower).
        index_cell_bytes: DeepSeek DSA: the indexer K bytes per token over all layers (132 × layers,
            :mod:`tuner.sim.dsa`), 0 without an indexer. ``kv_cell_bytes`` then holds the latent
            row plus this × dcp.
        index_topk: DSA: keys each query attends to after the indexer's selection (``index_topk``).
        index_n_heads, index_head_dim: DSA indexer heads and dim (its fp8 scores over every key).
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    params_total: int
    params_active: int
    weight_bytes_per_gpu: int
    kv_cell_bytes: int
    tp_size: int = 1
    gpu_name: str = "H100-80GB"
    gpu_memory_bytes: int = 81559 << 20
    hbm_gb_s: float = 3350.0
    bf16_tflops: float = 989.0
    pcie_gb_s: float = 64.0
    interconnect_gb_s: float = 450.0
    compute_eff: float = 1.0
    is_mla: bool = False
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    dtype_bytes: int = 2
    spec_num_steps: int = 0
    spec_num_draft_tokens: int = 0
    spec_accept_length: float = 1.0
    factors: CostFactors = CostFactors()
    v_head_dim: int = 0
    dp_size: int = 1
    dcp_size: int = 1
    index_cell_bytes: int = 0
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0

    @classmethod
    def from_specs(
        cls,
        model: Any,
        gpu: Any,
        *,
        tp_size: int,
        kv_cell_bytes: int,
        weight_bytes_per_gpu: int,
        spec_num_steps: int = 0,
        spec_num_draft_tokens: int = 0,
        spec_accept_length: float | None = None,
    ) -> CostInputs:
        """Build the inputs from a ``tuner.sim.models.ModelSpec`` and ``tuner.sim.gpus.GpuSpec``.

        Args:
            model: Model spec (read by attribute: layers, hidden, heads, MoE and MLA sizes, params).
            gpu: GPU spec (``name``, ``memory_mib``, ``hbm_gb_s``, ``bf16_tflops``, ``pcie_gb_s``).
            tp_size: Tensor-parallel size.
            kv_cell_bytes: KV bytes per token per GPU, as the memory ledger computed it (§1.3).
            weight_bytes_per_gpu: Resident weight bytes per GPU.
            spec_num_steps: Speculative draft steps (0 when speculative decoding is off).
            spec_num_draft_tokens: Draft tokens verified per request per step.
            spec_accept_length: Mean accepted tokens per step; default ``min(steps + 1, 1 +
                0.7 × steps)``, a typical EAGLE figure (an assumption, not an SGLang fact).
        """
        name = str(gpu.name)
        link = next((bw for prefix, bw in NVLINK_GB_S.items() if name.upper().startswith(prefix)), float(gpu.pcie_gb_s))
        compute_eff = next((e for prefix, e in GPU_COMPUTE_EFF.items() if name.upper().startswith(prefix)), 1.0)
        if spec_accept_length is None:
            spec_accept_length = min(spec_num_steps + 1.0, 1.0 + 0.7 * spec_num_steps) if spec_num_steps else 1.0
        is_mla = bool(getattr(model, "is_mla", False))
        return cls(
            num_layers=int(model.num_layers),
            hidden_size=int(model.hidden_size),
            intermediate_size=int(model.intermediate_size or 0),
            num_attention_heads=int(model.num_attention_heads),
            num_kv_heads=int(model.num_kv_heads or 1),
            head_dim=int(model.head_dim),
            vocab_size=int(model.vocab_size),
            params_total=int(model.params_total),
            params_active=int(model.params_active),
            weight_bytes_per_gpu=int(weight_bytes_per_gpu),
            kv_cell_bytes=int(kv_cell_bytes),
            tp_size=int(tp_size),
            gpu_name=name,
            gpu_memory_bytes=int(gpu.memory_mib) << 20,
            hbm_gb_s=float(gpu.hbm_gb_s),
            bf16_tflops=float(gpu.bf16_tflops),
            pcie_gb_s=float(gpu.pcie_gb_s),
            interconnect_gb_s=link,
            compute_eff=compute_eff,
            is_mla=is_mla,
            kv_lora_rank=int(getattr(model, "kv_lora_rank", 0) or 0),
            qk_rope_head_dim=int(getattr(model, "qk_rope_head_dim", 0) or 0),
            num_experts=int(getattr(model, "num_experts", 0) or 0),
            experts_per_token=int(getattr(model, "experts_per_token", 0) or 0),
            moe_intermediate_size=int(getattr(model, "moe_intermediate_size", 0) or 0),
            spec_num_steps=int(spec_num_steps),
            spec_num_draft_tokens=int(spec_num_draft_tokens),
            spec_accept_length=float(spec_accept_length),
            v_head_dim=int(getattr(model, "v_head_dim", 0) or 0),
        )

    def with_parallel(self, *, dp_size: int = 1, dcp_size: int = 1) -> CostInputs:
        """A copy with DP-attention and DCP sizes."""
        return replace(self, dp_size=max(1, dp_size), dcp_size=max(1, dcp_size))

    def with_dsa(self, *, index_cell_bytes: int, index_topk: int, index_n_heads: int, index_head_dim: int) -> CostInputs:
        """A copy for a DeepSeek DSA model (its indexer and top-k sparse attention)."""
        return replace(self, index_cell_bytes=index_cell_bytes, index_topk=index_topk, index_n_heads=index_n_heads,
                       index_head_dim=index_head_dim)

    def with_scheduler(self, generation: str) -> CostInputs:
        """A copy with the scheduler CPU cost of ``generation`` (a key of :data:`SCHEDULER_CPU`).

        Raises:
            KeyError: Unknown generation (the command line offers only the keys).
        """
        step_s, per_seq_s = SCHEDULER_CPU[generation]
        return replace(self, factors=replace(self.factors, step_overhead_s=step_s, per_seq_overhead_s=per_seq_s))

    def with_factors(self, factors: CostFactors) -> CostInputs:
        """A copy with other efficiency factors (used by the calibration fit)."""
        return replace(self, factors=factors)

    @property
    def peak_flops(self) -> float:
        """The dense bf16 peak this GPU reaches in SGLang's kernels before the work's own
        efficiency (``eff_gemm``, ``eff_attn``): datasheet peak × :attr:`compute_eff`, FLOP/s."""
        return self.bf16_tflops * 1e12 * self.compute_eff

    @property
    def speculative(self) -> bool:
        """Whether decode steps are speculative."""
        return self.spec_num_steps > 0 and self.spec_num_draft_tokens > 0


@dataclass(frozen=True)
class StepShape:
    """The work in one forward step.

    Attributes:
        num_tokens: Tokens computed (prefill extend tokens + decode tokens).
        num_seqs: Sequences in the step.
        attn_pairs: Σ over computed tokens of the context length each attends to (query-key
            pairs per layer per head).
        kv_read_tokens: Σ over sequences of the KV tokens read from the pool.
        eager: Whether the step runs without a CUDA graph.
        extend: A prefill (extend) step: MLA attention then runs in its MHA form (see
            :func:`step_time_s`).
    """

    num_tokens: int
    num_seqs: int
    attn_pairs: float
    kv_read_tokens: int
    eager: bool
    extend: bool = False


def _moe_split(c: CostInputs) -> tuple[float, float]:
    """(dense bytes, expert bytes) of the weights on one GPU, split by parameter count."""
    if c.num_experts <= 0 or c.experts_per_token <= 0 or c.moe_intermediate_size <= 0:
        return float(c.weight_bytes_per_gpu), 0.0
    expert_params = c.num_layers * c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size
    share = min(0.98, expert_params / max(1, c.params_total))
    return c.weight_bytes_per_gpu * (1 - share), c.weight_bytes_per_gpu * share


def _linear_s(c: CostInputs, num_tokens: int) -> float:
    f = c.factors
    bw = c.hbm_gb_s * 1e9 * f.eff_hbm
    peak = c.peak_flops * f.eff_gemm
    dense_b, expert_b = _moe_split(c)
    if not expert_b:
        return max(dense_b / bw, 2.0 * c.params_active / c.tp_size * num_tokens / peak)
    expert_active = min(0.98 * c.params_active, c.num_layers * c.experts_per_token * 3 * c.hidden_size * c.moe_intermediate_size)
    touched = 1.0 - (1.0 - c.experts_per_token / c.num_experts) ** num_tokens
    dense_s = max(dense_b / bw, 2.0 * (c.params_active - expert_active) / c.tp_size * num_tokens / peak)
    expert_s = max(expert_b * touched / (bw * f.eff_moe_read), 2.0 * expert_active / c.tp_size * num_tokens / (peak * f.eff_moe))
    return dense_s + expert_s + c.num_layers * f.moe_layer_overhead_s


def dp_rank_share(dp_size: int, num_seqs: int) -> float:
    """The share of a step's sequences the busiest DP-attention rank holds: ``ceil(n / dp) / n``.

    Under DP attention each request is dispatched to one DP rank, which schedules, holds and
    attends to it alone (``managers/data_parallel_controller.py``: round-robin or fewest requests,
    0.5.23), and the ranks meet at every MoE layer's gather, so a step lasts as long as its busiest
    rank: one request gets no help from the other ``dp − 1`` ranks (share 1, not ``1/dp``).
    """
    if dp_size <= 1 or num_seqs <= 0:
        return 1.0 / max(1, dp_size)
    return math.ceil(num_seqs / dp_size) / num_seqs


def _attn_s(c: CostInputs, attn_pairs: float, kv_read_tokens: int, num_seqs: int = 1, num_tokens: int = 1,
            extend: bool = False) -> float:
    f = c.factors
    heads = max(1, c.num_attention_heads // c.tp_size)
    if c.is_mla and extend and not c.index_topk:  # prefill: MHA over the decompressed K/V
        d_qk, d_v = c.head_dim, c.v_head_dim or c.head_dim
    elif c.is_mla:
        d_qk, d_v = c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank
    else:
        d_qk = d_v = c.head_dim
    # DP attention: the busiest rank attends over its requests with dp× the heads (attn_tp = tp / dp);
    # DCP: a rank holds and reads 1/dcp of each request's KV (flops split the same way).
    rank = dp_rank_share(c.dp_size, num_seqs)
    share = rank / c.dcp_size
    latent_cell, latent_tokens, pairs, index_s = float(c.kv_cell_bytes), float(kv_read_tokens), attn_pairs, 0.0
    if c.index_topk:  # DSA: the latent is read for the top-k keys only; the indexer scores every key
        latent_cell -= c.index_cell_bytes * c.dcp_size
        latent_tokens = min(latent_tokens, num_seqs * c.index_topk)
        pairs = min(attn_pairs, num_tokens * c.index_topk)
        # the indexer K is replicated under DCP (sglang#31821): every rank scores all of its requests' keys
        index_read = c.index_cell_bytes * kv_read_tokens * rank
        index_flops = 2.0 * c.index_n_heads * c.index_head_dim * c.num_layers * attn_pairs * rank / 2  # fp8: twice the bf16 rate
        index_s = max(index_read / (c.hbm_gb_s * 1e9 * f.eff_hbm), index_flops / (c.peak_flops * f.eff_attn))
    flops = 2.0 * heads * (d_qk + d_v) * c.num_layers * pairs * c.dp_size * share
    read = latent_cell * latent_tokens * share
    eff_read = f.eff_hbm * (f.eff_mla if c.is_mla else 1.0)
    return max(read / (c.hbm_gb_s * 1e9 * eff_read), flops / (c.peak_flops * f.eff_attn)) + index_s


def _comm_s(c: CostInputs, num_tokens: int) -> float:
    if c.tp_size <= 1:
        return 0.0
    nbytes = num_tokens * c.hidden_size * c.dtype_bytes
    one = 2.0 * (c.tp_size - 1) / c.tp_size * nbytes / (c.interconnect_gb_s * 1e9) + c.factors.allreduce_latency_s
    return 2 * c.num_layers * one


def _dcp_comm_s(c: CostInputs, num_seqs: int) -> float:
    """DCP's gather of partial attention outputs and their log-sum-exp, once per layer."""
    if c.dcp_size <= 1:
        return 0.0
    heads = max(1, c.num_attention_heads // c.tp_size)
    d_v = c.kv_lora_rank if c.is_mla else c.head_dim
    nbytes = num_seqs * heads * (d_v + 1) * 4
    one = (c.dcp_size - 1) / c.dcp_size * nbytes / (c.interconnect_gb_s * 1e9) + c.factors.allreduce_latency_s
    return c.num_layers * one


def step_time_s(c: CostInputs, shape: StepShape) -> float:
    """Time of one forward step, seconds.

    Args:
        c: Model, GPU and parallelism facts.
        shape: The tokens, sequences, attention pairs and KV reads of the step.

    Returns:
        Seconds; 0 for an empty step.
    """
    if shape.num_tokens <= 0:
        return 0.0
    f = c.factors
    gpu_s = (_linear_s(c, shape.num_tokens)
             + _attn_s(c, shape.attn_pairs, shape.kv_read_tokens, shape.num_seqs, shape.num_tokens, shape.extend)
             + _comm_s(c, shape.num_tokens))
    gpu_s += _dcp_comm_s(c, shape.num_seqs)
    if shape.eager:
        per_layer = f.eager_layer_overhead_s + (f.eager_moe_layer_overhead_s if c.num_experts > 0 else 0.0)
        gpu_s = max(gpu_s, c.num_layers * per_layer)
    else:
        gpu_s += f.graph_step_overhead_s
    return gpu_s + f.step_overhead_s + f.per_seq_overhead_s * shape.num_seqs


def decode_step_s(c: CostInputs, batch_size: int, kv_tokens: int, *, eager: bool, padded_bs: int | None = None) -> float:
    """Time of one decode step (speculative when ``c`` says so), seconds.

    A graph step replays the graph of the next captured size (§2.1, ``replay_prepare``): its linear
    layers and all-reduces run over ``padded_bs`` rows; the padded rows attend to a one-token
    sequence (``seq_len_fill_value``), so the attention work stays the real batch's.

    Args:
        c: Cost inputs.
        batch_size: Running requests.
        kv_tokens: Σ of their current sequence lengths (KV read per step), tokens.
        eager: True when the batch runs without a CUDA graph (above the largest captured size, or
            not a captured size with padding off).
        padded_bs: The captured size the graph step replays (``None``: ``batch_size``).
    """
    if batch_size <= 0:
        return 0.0
    rows = batch_size if eager or padded_bs is None else max(batch_size, padded_bs)
    if not c.speculative:
        return step_time_s(c, StepShape(rows, batch_size, float(kv_tokens), kv_tokens, eager))
    k = c.spec_num_draft_tokens
    verify = step_time_s(c, StepShape(rows * k, batch_size, float(kv_tokens) * k, kv_tokens, eager))
    draft_one = c.weight_bytes_per_gpu / max(1, c.num_layers) / (c.hbm_gb_s * 1e9 * c.factors.eff_hbm)
    draft = c.spec_num_steps * (draft_one + c.factors.graph_step_overhead_s)
    return verify + draft


def load_back_s(c: CostInputs, num_tokens: int) -> float:
    """Time to copy ``num_tokens`` tokens of KV from the host tier over PCIe (§7), seconds."""
    return num_tokens * c.kv_cell_bytes / (c.pcie_gb_s * 1e9)


def activation_bytes(c: CostInputs, num_tokens: int, num_seqs: int = 1) -> int:
    """Peak activation bytes of a forward step over ``num_tokens`` tokens (see module docstring).

    Args:
        c: Cost inputs.
        num_tokens: Tokens computed in the step.
        num_seqs: Sequences whose last token produces logits.

    Returns:
        Bytes; monotone in ``num_tokens``.
    """
    tp = c.tp_size
    if c.is_mla:
        qkv = c.num_attention_heads * (c.kv_lora_rank + c.qk_rope_head_dim) / tp + c.kv_lora_rank + c.qk_rope_head_dim
    else:
        qkv = (c.num_attention_heads + 2 * c.num_kv_heads) * c.head_dim / tp
    dense_mlp = 3 * c.intermediate_size / tp
    moe = c.experts_per_token * (3 * c.moe_intermediate_size / tp + c.hidden_size) if c.num_experts else 0.0
    per_token = 4 * c.hidden_size + qkv + max(dense_mlp, moe)
    return int(num_tokens * c.dtype_bytes * per_token + num_seqs * c.vocab_size / tp * 4)
