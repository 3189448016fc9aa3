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

from typing import NamedTuple

from tuner.sglang.versions import at_least

__all__ = ["SpecShape", "DRAFT_ALGORITHMS", "auto_shape", "resolve_shape", "shape_refusal", "tree_candidates"]

DRAFT_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
"""``--speculative-algorithm`` values that run a draft model (NGRAM has none)."""

_DEEPSEEK_LIKE = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV2ForCausalLM", "GptOssForCausalLM")


class SpecShape(NamedTuple):
    """A draft shape: ``speculative_num_steps``, ``speculative_eagle_topk``,
    ``speculative_num_draft_tokens`` (tokens verified per request per step, the root included)."""

    num_steps: int
    eagle_topk: int
    num_draft_tokens: int


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

