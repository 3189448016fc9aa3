"""SGLang's rules between the speculative-decoding flags, per version, as the tuner applies them
before a launch (``shared/sglang-reference.md`` §1.5).

Read from SGLang's source:

- 0.5.5 ``python/sglang/srt/server_args.py`` ``_handle_speculative_decoding`` and 0.5.23
  ``python/sglang/srt/arg_groups/speculative_hook.py`` ``_handle_eagle_family`` (EAGLE, EAGLE3,
  STANDALONE; NEXTN is renamed EAGLE):

  - ``speculative_num_steps`` unset: ``speculative_eagle_topk`` and ``speculative_num_draft_tokens``
    must be unset too (a bare ``assert``), and the three are chosen by ``auto_choose_speculative_params``
    ((3, 1, 4) for DeepSeek-like models and STANDALONE, else (5, 4, 8));
  - ``speculative_eagle_topk == 1``: ``speculative_num_draft_tokens`` is set to ``steps + 1`` (a
    warning, not a refusal: two candidates that differ only there are the same launch);
  - ``speculative_eagle_topk > 1`` with ``page_size > 1``: refused unless the attention backend is
    ``flashinfer`` (0.5.5) or one of ``flashinfer``, ``fa3``, ``triton`` (0.5.23);
  - the ``trtllm_mha`` backend refuses ``speculative_eagle_topk > 1``;
  - ``max_running_requests`` unset becomes 48.

- The draft tree (``speculative/eagle_utils.py`` ``build_tree_kernel_efficient``): the verified
  tokens are the root plus the best ``speculative_num_draft_tokens − 1`` of
  ``topk + (steps − 1) × topk²`` candidates (``torch.topk``): more fail at the first draft
  (``selected index k out of range``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pydantic import BaseModel, ConfigDict

from tuner.sglang.versions import at_least

if TYPE_CHECKING:
    from tuner.sglang.logs import LogReport

__all__ = ["SpecShape", "DraftMemory", "DRAFT_ALGORITHMS", "SPEC_MAX_RUNNING_REQUESTS", "speculative_max_running_requests", "auto_shape", "kv_elem_bytes", "resolve_shape", "shape_refusal",
           "tree_candidates"]

DRAFT_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
"""``--speculative-algorithm`` values that run a draft model (NGRAM has none)."""

_DEEPSEEK_LIKE = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV2ForCausalLM", "GptOssForCausalLM")


class SpecShape(NamedTuple):
    """A draft shape: ``speculative_num_steps``, ``speculative_eagle_topk``,
    ``speculative_num_draft_tokens`` (tokens verified per request per step, the root included)."""

    num_steps: int
    eagle_topk: int
    num_draft_tokens: int


SPEC_MAX_RUNNING_REQUESTS = 48
"""``max_running_requests`` SGLang sets when it is unset and a draft algorithm (EAGLE, EAGLE3,
STANDALONE; NEXTN is EAGLE) is on: 0.5.5.post3 ``srt/server_args.py`` ``_handle_speculative_decoding``
line 1550 (``self.max_running_requests = 48`` with the warning "Max running requests is reset to
48 for speculative decoding"), 0.5.23 ``arg_groups/speculative_hook.py`` ``_handle_eagle_family``."""


def speculative_max_running_requests(algorithm: str | None) -> int | None:
    """The ``max_running_requests`` a speculative server runs with when the arguments omit it.

    Args:
        algorithm: ``--speculative-algorithm`` (``None``: off).

    Returns:
        :data:`SPEC_MAX_RUNNING_REQUESTS` for a draft algorithm of :data:`DRAFT_ALGORITHMS`, else
        ``None`` (NGRAM and no speculation keep SGLang's non-speculative default).
    """
    return SPEC_MAX_RUNNING_REQUESTS if algorithm is not None and str(algorithm).upper() in DRAFT_ALGORITHMS else None


def auto_shape(architecture: str | None, algorithm: str) -> SpecShape:
    """SGLang's ``auto_choose_speculative_params``: (3, 1, 4) for DeepSeek-like models and
    STANDALONE, else (5, 4, 8) (§1.5)."""
    if architecture in _DEEPSEEK_LIKE or algorithm.upper() == "STANDALONE":
        return SpecShape(3, 1, 4)
    return SpecShape(5, 4, 8)


def resolve_shape(num_steps: int, eagle_topk: int, num_draft_tokens: int) -> SpecShape:
    """The shape SGLang runs: ``topk == 1`` forces ``num_draft_tokens = steps + 1`` (§1.5)."""
    if eagle_topk == 1:
        return SpecShape(num_steps, 1, num_steps + 1)
    return SpecShape(num_steps, eagle_topk, num_draft_tokens)


def tree_candidates(num_steps: int, eagle_topk: int) -> int:
    """Draft tokens the tree offers for verification besides the root: ``topk + (steps − 1) × topk²``."""
    return eagle_topk + max(num_steps - 1, 0) * eagle_topk * eagle_topk


def shape_refusal(version: str, shape: SpecShape, *, page_size: int = 1, attention_backend: str | None = None
                  ) -> str | None:
    """Why SGLang ``version`` refuses ``shape`` (its own message, and the rule), or None when it runs.

    Args:
        version: SGLang version, e.g. ``"0.5.5.post3"`` or ``"0.5.23"``.
        shape: The shape as it would be launched (:func:`resolve_shape` first).
        page_size: ``--page-size`` (tokens). attention_backend: ``--attention-backend`` or None.

    Returns:
        One line: SGLang's error text, then where the rule lives; None when the shape is valid.
    """
    steps, topk, draft = shape
    if steps < 1 or topk < 1 or draft < 2:
        return (f"speculative_num_steps={steps}, speculative_eagle_topk={topk}, speculative_num_draft_tokens={draft}: "
                "SGLang needs at least one step, one branch and two verified tokens")
    if attention_backend == "trtllm_mha" and topk > 1:
        return ("ValueError: trtllm_mha backend only supports topk = 1 for speculative decoding. "
                "(SGLang's speculative argument checks)")
    if topk > 1 and page_size > 1:
        if at_least(version, "0.5.16"):
            allowed = ("flashinfer", "fa3", "triton")
            if attention_backend not in allowed:
                return (f"ValueError: speculative_eagle_topk > 1 with page_size > 1 is only supported on {allowed}; "
                        f"got attention_backend={attention_backend!r}. (speculative_hook.py _handle_eagle_family)")
        elif attention_backend != "flashinfer":
            return ("ValueError: speculative_eagle_topk > 1 with page_size > 1 is unstable and produces incorrect "
                    "results for paged attention backends. This combination is only supported for the 'flashinfer' "
                    "backend. (server_args.py _handle_speculative_decoding)")
    if draft - 1 > tree_candidates(steps, topk):
        return (f"RuntimeError: selected index k out of range: speculative_num_draft_tokens − 1 = {draft - 1} exceeds "
                f"the {tree_candidates(steps, topk)} draft candidates of {steps} steps × topk {topk} "
                "(eagle_utils.py build_tree_kernel_efficient)")
    return None



class DraftMemory(BaseModel):
    """The draft model's memory on one GPU, as a trial's typed fact (§1.5): learned from a start's
    log, and predicted for an unlaunched candidate from it (:meth:`predict`). GiB = 2^30 bytes.

    Attributes:
        weight_gib: The draft's weights (its ``Load weight end ... mem usage``).
        kv_gib: The draft's KV pool (its ``KV Cache is allocated`` line); ``kv_tokens`` its tokens.
        graph_gib: The draft's CUDA graphs (its ``Capture ... end`` lines).
        verify_graph_gib: The target's verify graphs (0.5.23's verify capture lines), which hold
            ``num_draft_tokens`` tokens per request.
        num_draft_tokens: The shape's verified tokens per request.
        capture_sizes: Batch sizes captured (the graphs' count).
        in_budget: 0.5.16+: the draft's weights and KV are inside the profiled budget (else the
            reserve pays for them).
        kv_dtype: The draft pool's dtype as given (``--speculative-draft-kv-cache-dtype``, else the
            target's ``--kv-cache-dtype`` it follows; ``auto`` is the model's own), or None.
    """

    model_config = ConfigDict(frozen=True)

    weight_gib: float | None = None
    kv_gib: float | None = None
    kv_tokens: int | None = None
    graph_gib: float | None = None
    verify_graph_gib: float | None = None
    num_draft_tokens: int = 1
    capture_sizes: int = 0
    in_budget: bool = False
    kv_dtype: str | None = None

    @classmethod
    def from_report(cls, report: LogReport, shape: SpecShape, kv_dtype: str | None = None) -> DraftMemory | None:
        """The draft's facts from a started server's log (the binding rank's lines), or None
        without a draft; ``kv_dtype`` the draft pool's dtype as launched."""
        prim = report.primary()
        draft = prim.draft if prim is not None else None
        if prim is None or draft is None:
            return None
        kv = draft.kv_size_gib if draft.kv_size_gib is not None else (
            (draft.k_size_gib or 0.0) + (draft.v_size_gib or 0.0) if draft.k_size_gib is not None else None)
        return cls(weight_gib=draft.weight_gib, kv_gib=kv, kv_tokens=draft.kv_tokens, graph_gib=draft.graph_gib,
                   verify_graph_gib=prim.verify_graph_gib, num_draft_tokens=shape.num_draft_tokens,
                   capture_sizes=len(draft.graph_bs or prim.graph_bs or ()),
                   in_budget=report.version_format in ("0.5.16", "0.5.23"), kv_dtype=kv_dtype)

    def predict(self, shape: SpecShape, *, tokens: int, capture_sizes: int | None = None,
                kv_dtype: str | None = None) -> DraftMemory:
        """The same draft at another shape, pool size, capture list and pool dtype: its weights
        stay, its KV scales with the pool's tokens and bytes per element (``kv_dtype``; None: this
        one's), its graphs with the captured sizes, and the target's verify graphs with
        ``num_draft_tokens`` × captured sizes (each holds that many tokens a request, §2.1)."""
        sizes = capture_sizes if capture_sizes is not None else self.capture_sizes
        size_ratio = sizes / self.capture_sizes if self.capture_sizes else 1.0
        dtype = kv_dtype or self.kv_dtype
        elem = kv_elem_bytes(dtype) / kv_elem_bytes(self.kv_dtype)
        kv = self.kv_gib * tokens / self.kv_tokens * elem if self.kv_gib is not None and self.kv_tokens else None
        verify = (self.verify_graph_gib * shape.num_draft_tokens / max(self.num_draft_tokens, 1) * size_ratio
                  if self.verify_graph_gib is not None else None)
        graph = self.graph_gib * size_ratio if self.graph_gib is not None else None
        return self.model_copy(update={"kv_gib": kv, "kv_tokens": tokens, "graph_gib": graph, "verify_graph_gib": verify,
                                       "num_draft_tokens": shape.num_draft_tokens, "capture_sizes": sizes,
                                       "kv_dtype": dtype})


def kv_elem_bytes(dtype: str | None) -> float:
    """Bytes per KV element of a ``--kv-cache-dtype`` / ``--speculative-draft-kv-cache-dtype``
    value: 1 for the fp8 ones, else 2 (``auto`` or unknown: a 16-bit model's own dtype; §1.3)."""
    return 1.0 if dtype is not None and dtype.startswith("fp8") else 2.0
