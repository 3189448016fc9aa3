"""Speculative decoding in the simulator: acceptance by prompt class and draft shape, the draft and
verify step costs, SGLang's refusals of draft shapes, and the acceptance fields SGLang reports.

Acceptance (simulator's model, anchored on published figures):

- Every prompt belongs to a class: ``chat`` (natural-language text), ``code`` (source text) or
  ``raw`` (random token ids, bench_serving's ``random-ids``). A draft head predicts the target's
  next token with a per-token probability ``alpha`` that depends on the class (:data:`PROMPT_ALPHA`:
  a 3-step chain accepts 48.5 % of its drafts on chat, 74.6 % on raw completions, as one EAGLE-3
  draft did in lightseekorg/tokenspeed#1305: random prompts overstate acceptance, because the
  target's continuation of noise is repetitive; code in between). Each request draws its own
  ``alpha`` around the class mean (±8 %, from its rid).
- A draft tree of ``speculative_num_steps`` levels, ``speculative_eagle_topk`` branches a level and
  ``speculative_num_draft_tokens`` verified tokens (the root included) reaches depth
  ``D = min(steps, draft_tokens - 1)`` with ``w = min(topk, (draft_tokens - 1) / D)`` candidates a
  level; a level is accepted with ``alpha_w = 1 - (1 - alpha) / sqrt(w)`` and the mean accept
  length (bonus token included, SGLang's ``accept len``) is ``sum(alpha_w ** i, i = 0..D)``.
  More steps, wider trees and more draft tokens accept more, with diminishing returns
  (sglang#21599, #22246).

Cost of one speculative decode step (simulator's): ``num_steps`` draft forwards of the draft model
over ``bs × topk`` tokens, a draft-extend forward over ``bs × draft_tokens`` tokens, and one target
verify forward over ``bs × draft_tokens`` tokens (:func:`tuner.sim.costmodel.step_time_s`), plus
the tree build and acceptance sampling on the host, which SGLang does not overlap when the overlap
scheduler is off for speculative decoding (§1.5), per step and per request. At low concurrency the
verify forward is bound by weight reads, so accepted tokens come nearly free; once the batch's
``bs × draft_tokens`` verify tokens pass the roofline's ridge the forward is bound by compute
over them, so each extra draft token costs what it is worth: the best chain gets shallower as the
batch grows, then speculation loses. SGLang's own measurements: Qwen3-235B-A22B runs best at step
4 at batch 1 but step 2 at batch 64, GLM-4.7-FP8 at step 7 vs 3 (sglang#22246, the AutoSpec PR on
#21599's adaptive steps, whose per-batch tiers in #24055 default to steps 1/3/7 below 64 requests
and 1/2/5-6 above); Llama-2-70B on H20 tp 2 at high throughput serves 0.62 req/s without
speculation, 0.52 with EAGLE 2/4/4 and 0.56 with 1/2/2 (sglang#6995). The simulator reproduces
the crossover where the compute bound falls within the batches memory allows (Llama-3.1-70B tp 8
on H100: the best chain 4 steps at one request in flight, 3 at 64, off at 256;
``tests/sim/test_speculative.py``). It does not on the reference twin (Kimi-K2.5 INT4, 384
experts, 8 a token, on RTX PRO 6000): its INT4 experts stay bound by weight reads up to ~2.4k
tokens a step (each expert sees ``tokens × 8 / 384`` of them; the ridge of 1.8 TB/s against
504 TFLOP/s is ~50 tokens an INT4 expert), past what its KV pool can run at once, so there more
draft tokens keep paying at 64 in flight and the draft costs capacity, not throughput.

SGLang's refusals (``server_args.py`` ``_handle_speculative_decoding`` in 0.5.5; 0.5.23
``python/sglang/srt/arg_groups/speculative_hook.py`` ``_handle_eagle_family``) are in
:func:`refusal`; ``speculative_num_draft_tokens - 1`` beyond the tree's candidates fails at the
first draft (``torch.topk`` in ``build_tree_kernel_efficient``, ``speculative/eagle_utils.py``),
which is :func:`tree_error`.

Reported fields (``tokenizer_manager.py`` ``_calculate_spec_decoding_metrics``):
0.5.5/0.5.10: ``spec_verify_ct``, ``spec_accept_rate`` (accepted drafts over ``verify_ct ×
num_steps``), ``spec_accept_length`` (``completion_tokens / verify_ct``), ``spec_accept_token_num``,
``spec_draft_token_num``; 0.5.16+/0.5.23: ``spec_accept_rate`` (correct drafts over ``verify_ct ×
(num_draft_tokens - 1)``), ``spec_accept_length``, ``spec_num_correct_drafts``,
``spec_num_proposed_drafts``, ``spec_verify_ct``. ``/get_server_info`` ``internal_states[i].
avg_spec_accept_length`` is Σ(accepted + 1) over Σ request-steps of the logged decode windows
(``update_spec_metrics``, 0.5.5 ``scheduler_metrics_mixin.py``).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tuner.sim import costmodel
from tuner.sim.costmodel import CostInputs, StepShape
from tuner.sim.errors import SimError

if TYPE_CHECKING:
    from tuner.sim.memory import MemoryPlan

__all__ = [
    "PROMPT_ALPHA",
    "SpecModel",
    "TextIds",
    "accept_length",
    "check_flags",
    "classify_ids",
    "classify_text",
    "meta_fields",
    "refusal",
    "spec_model",
    "profiled_cell",
    "tree_error",
]

PROMPT_ALPHA = {"chat": 0.68, "code": 0.78, "raw": 0.86}
"""Per-token draft acceptance by prompt class (simulator's): a 3-step chain then accepts 48.5 % of
its drafts on chat and 74.6 % on raw completions, the rates of one EAGLE-3 draft in
lightseekorg/tokenspeed#1305; code in between (62 %)."""

HOST_STEP_S = 0.5e-3
"""Host time per speculative step (tree build, verify sampling), not overlapped (simulator's)."""

HOST_PER_REQ_S = 60e-6
"""Host time per request per speculative step (simulator's)."""

_CODE_CHARS = re.compile(r"[{}();=\[\]<>]|def |return |import |#include|function |=>|::")


class TextIds(list[int]):
    """Token ids of a text prompt, with the prompt's class (``chat`` or ``code``)."""

    def __init__(self, ids: list[int], prompt_class: str) -> None:
        super().__init__(ids)
        self.prompt_class = prompt_class


def classify_text(text: str) -> str:
    """``code`` when the text reads as source (symbols and keywords per line), else ``chat``."""
    lines = max(1, text.count("\n") + 1)
    hits = len(_CODE_CHARS.findall(text))
    return "code" if hits >= max(3, lines) and hits * 40 >= len(text) else "chat"


def classify_ids(ids: list[int] | tuple[int, ...]) -> str:
    """``raw`` for token ids that repeat no more than random draws do, else ``chat``.

    Natural text repeats its common tokens (a Zipf law): a few hundred tokens already repeat a
    quarter of them. Random ids over a vocabulary of 32k+ almost never repeat.
    """
    n = len(ids)
    if n < 16:
        return "raw"
    return "chat" if 1 - len(set(ids)) / n > 0.15 else "raw"


def accept_length(alpha: float, steps: int, topk: int, draft_tokens: int) -> float:
    """Mean tokens per verify step (bonus included) of a draft tree; see the module docstring."""
    depth = min(steps, draft_tokens - 1)
    if depth <= 0:
        return 1.0
    width = max(1.0, min(float(topk), (draft_tokens - 1) / depth))
    a = 1.0 - (1.0 - alpha) / math.sqrt(width)
    return sum(a ** i for i in range(depth + 1))


def tree_error(steps: int, topk: int, draft_tokens: int) -> str | None:
    """torch's error when ``draft_tokens - 1`` exceeds the tree's candidates
    (``topk + (steps - 1) × topk²``), else None."""
    candidates = topk + max(steps - 1, 0) * topk * topk
    if draft_tokens - 1 > candidates:
        return "RuntimeError: selected index k out of range"
    return None


def refusal(version: str, algorithm: str, steps: Any, topk: Any, draft_tokens: Any, page_size: int,
            attention_backend: str | None) -> str | None:
    """SGLang's startup refusal of a draft shape (its own message), else None.

    Args:
        version: ``0.5.5``, ``0.5.10`` or ``0.5.23``. algorithm: resolved algorithm.
        steps, topk, draft_tokens: The flags as given (None when not given).
        page_size: ``--page-size``. attention_backend: ``--attention-backend`` or None.
    """
    if algorithm not in ("EAGLE", "EAGLE3", "STANDALONE"):
        return None
    if steps is None and (topk is not None or draft_tokens is not None):
        return "AssertionError"  # a bare assert in both versions
    if steps is not None and (topk is None or draft_tokens is None) and version != "0.5.23":
        return "TypeError: '>' not supported between instances of 'NoneType' and 'int'"
    if topk is None:
        return None
    if attention_backend == "trtllm_mha" and topk > 1:
        return "ValueError: trtllm_mha backend only supports topk = 1 for speculative decoding."
    if topk > 1 and page_size > 1:
        if version == "0.5.23":
            allowed = ("flashinfer", "fa3", "triton")
            if attention_backend not in allowed:
                return ("ValueError: speculative_eagle_topk > 1 with page_size > 1 is only supported on "
                        f"{allowed}; got attention_backend={attention_backend!r}. Use page_size == 1 or one "
                        "of those backends.")
        elif attention_backend != "flashinfer":
            return ("ValueError: speculative_eagle_topk > 1 with page_size > 1 is unstable and produces "
                    "incorrect results for paged attention backends. This combination is only supported "
                    "for the 'flashinfer' backend.")
    return None


@dataclass(frozen=True)
class SpecModel:
    """The resolved draft shape and draft model, as the engine's decode step needs them.

    Attributes:
        num_steps, eagle_topk, num_draft_tokens: Resolved flags (§1.5).
        draft_weight_bytes: Draft weight bytes per GPU. draft_layers: Draft layers.
        version: SGLang version mimicked (field names).
    """

    num_steps: int
    eagle_topk: int
    num_draft_tokens: int
    draft_weight_bytes: int
    draft_layers: int
    version: str = "0.5.5"

    def request_accept_length(self, prompt_class: str, rid: str) -> float:
        """One request's mean accept length: its class's alpha, ±8 % from the rid."""
        jitter = (zlib.crc32(rid.encode()) % 1001) / 1000 * 0.16 - 0.08
        alpha = min(0.97, max(0.05, PROMPT_ALPHA.get(prompt_class, PROMPT_ALPHA["chat"]) * (1 + jitter)))
        return accept_length(alpha, self.num_steps, self.eagle_topk, self.num_draft_tokens)

    def decode_step_s(self, c: CostInputs, batch_size: int, kv_tokens: int, *, eager: bool,
                      padded_bs: int | None = None) -> float:
        """Seconds of one speculative decode step of ``batch_size`` requests (module docstring)."""
        if batch_size <= 0:
            return 0.0
        rows = batch_size if eager or padded_bs is None else max(batch_size, padded_bs)
        k = self.num_draft_tokens
        verify = costmodel.step_time_s(c, StepShape(rows * k, batch_size, float(kv_tokens) * k, kv_tokens, eager))
        f = c.factors
        bw = c.hbm_gb_s * 1e9 * f.eff_hbm
        peak = c.peak_flops * f.eff_gemm
        draft_params = self.draft_weight_bytes / c.dtype_bytes
        one = max(self.draft_weight_bytes / bw, 2.0 * draft_params * rows * self.eagle_topk / peak)
        extend = max(self.draft_weight_bytes / bw, 2.0 * draft_params * rows * k / peak)
        # The draft's steps replay as one CUDA graph (EAGLEDraftCudaGraphRunner), the extend as another.
        draft = self.num_steps * one + extend + 2 * f.graph_step_overhead_s
        host = HOST_STEP_S + HOST_PER_REQ_S * batch_size * self.eagle_topk
        return verify + draft + host

    def meta(self, completion_tokens: int, verify_ct: int) -> dict[str, Any]:
        """The response's ``meta_info`` speculative fields (module docstring), per version."""
        return meta_fields(self.version, completion_tokens, verify_ct, self.num_steps, self.num_draft_tokens)


def meta_fields(version: str, completion_tokens: int, verify_ct: int, num_steps: int,
                num_draft_tokens: int) -> dict[str, Any]:
    """SGLang's ``meta_info`` speculative fields for one request (module docstring)."""
    if verify_ct <= 0:
        return {} if version == "0.5.23" else {"spec_accept_rate": 0.0, "spec_accept_length": 0, "spec_verify_ct": 0}
    accepted = max(0, completion_tokens - verify_ct)
    length = completion_tokens / verify_ct
    if version == "0.5.23":
        proposed = verify_ct * max(num_draft_tokens - 1, 1)
        return {"spec_accept_rate": accepted / proposed, "spec_accept_length": length,
                "spec_num_correct_drafts": accepted, "spec_num_proposed_drafts": proposed,
                "spec_verify_ct": verify_ct}
    drafted = verify_ct * max(num_steps, 1)
    return {"spec_accept_rate": accepted / drafted, "spec_accept_length": length, "spec_verify_ct": verify_ct,
            "spec_accept_token_num": accepted, "spec_draft_token_num": drafted}


def check_flags(v: dict[str, Any], algorithm: str, steps: int, topk: int, draft_tokens: int, version: str,
                warnings: list[str]) -> None:
    """Refuse a draft shape as SGLang does, and add its adjustment warning to ``warnings``.

    Args:
        v: The parsed flags (SGLang's dests). algorithm, steps, topk, draft_tokens: Resolved shape.
        version: SGLang version mimicked. warnings: Startup warnings, appended to.

    Raises:
        SimError: SGLang's message (:func:`refusal`, :func:`tree_error`).
    """
    given = (v.get("speculative_num_steps"), v.get("speculative_eagle_topk"), v.get("speculative_num_draft_tokens"))
    refused = refusal(version, algorithm, *given, int(v.get("page_size") or 1), v.get("attention_backend"))
    if refused is None and algorithm in ("EAGLE", "EAGLE3", "STANDALONE"):
        refused = tree_error(steps, topk, draft_tokens)
    if refused is not None:
        raise SimError(refused)
    if topk == 1 and given[2] is not None and given[2] != steps + 1:
        warnings.append("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
                        "speculative_eagle_topk == 1")


def profiled_cell(target_cell: float, draft_layers: int, target_layers: int) -> float:
    """0.5.16+'s per-token cell with a draft model: ``cell × (1 + draft_layers / target_layers)``
    (``DefaultPoolConfigurator.__init__``, ``pool_configurator.py``, §1.5). The draft's own pool is
    then allocated at its own geometry: an MHA draft on an MLA target needs more than this share,
    and the rest comes out of the reserve (the under-budget ``tuner explain`` reports)."""
    return target_cell * (1 + draft_layers / max(target_layers, 1))


def spec_model(plan: MemoryPlan) -> SpecModel | None:
    """The engine's :class:`SpecModel` of a started server (None without a draft model)."""
    cfg = plan.config
    spec, draft = cfg.speculative, cfg.draft
    if spec is None or draft is None:
        return None
    return SpecModel(spec.num_steps, max(spec.eagle_topk, 1), spec.num_draft_tokens, draft.weight_bytes,
                     draft.num_layers, cfg.version)
