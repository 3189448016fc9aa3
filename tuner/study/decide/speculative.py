"""Speculative decoding's draft shape in the decision chain: the screen that never launches a shape
SGLang refuses (or one it would run as an already measured shape), and the proposer that tries the
best config's neighbouring shapes and speculation off (``shared/sglang-reference.md`` §1.5).

The rules are SGLang's, per version (:mod:`tuner.sglang.speculative`): a topk above 1 with paged
KV on a backend that cannot build the tree, ``trtllm_mha`` with a topk above 1, more verified
tokens than the tree offers; and at topk 1 SGLang verifies ``steps + 1`` tokens whatever
``speculative_num_draft_tokens`` says, so two such candidates are one launch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tuner.records import Constraints, Prediction, TrialRecord
from tuner.sglang.flags import flag_int, flag_value
from tuner.sglang.speculative import SpecShape, resolve_shape, shape_refusal
from tuner.study.decide import Proposal, Skip
from tuner.study.space import SPEC_SHAPE_KNOBS, config_key
from tuner.study.view import StudyView

__all__ = ["SpeculativeRules", "SpeculativeShapes", "launched_shape"]


def launched_shape(params: Mapping[str, Any], view: StudyView) -> SpecShape | None:
    """The shape SGLang would run for ``params`` (None: speculation off or not searched); a knob
    the params leave out is the space's first choice (the baseline's)."""
    space = view.space
    if not space.searches("speculative_algorithm") or params.get("speculative_algorithm") is False:
        return None
    values = []
    for name in SPEC_SHAPE_KNOBS:
        value = params.get(name)
        if value is None:
            grid = space.grid(name)
            if not grid:
                return None
            value = grid[0]
        values.append(int(value))
    return resolve_shape(*values)


def _canonical(params: Mapping[str, Any], view: StudyView) -> tuple[tuple[str, Any], ...]:
    """``params`` on the grid with the shape SGLang runs (topk 1: draft tokens = steps + 1)."""
    snapped = view.space.snap(dict(params))
    shape = launched_shape(snapped, view)
    if shape is not None:
        snapped.update(zip(SPEC_SHAPE_KNOBS, shape, strict=True))
    return config_key(snapped)


class SpeculativeRules:
    """A draft shape SGLang refuses (its message and the rule), or one it runs as an already
    measured config (topk 1 resolves the draft tokens), needs no launch.

    Args:
        version: The SGLang version (its rules).
        argv: The service's command line (``--page-size``, ``--attention-backend``).
    """

    def __init__(self, version: str, argv: Sequence[str]) -> None:
        self.version = version
        self.page_size = flag_int(argv, "--page-size") or 1
        self.backend = flag_value(argv, "--attention-backend")

    def why_not(self, params: Mapping[str, Any], view: StudyView) -> Skip | None:
        shape = launched_shape(params, view)
        if shape is None:
            return None
        page = int(params.get("page_size") or self.page_size)
        refused = shape_refusal(self.version, shape, page_size=page, attention_backend=self.backend)
        if refused is not None:
            return Skip(f"SGLang {self.version} refuses speculative shape {tuple(shape)}: {refused}", view.baseline)
        if int(params.get("speculative_eagle_topk") or shape.eagle_topk) == 1:
            key = _canonical(params, view)
            for number, record in view.finished:
                if record.params and record.outcome in ("ok", "failed") and _canonical(record.params, view) == key:
                    return Skip(f"the same launch as trial {number}: at speculative_eagle_topk 1 SGLang verifies "
                                f"speculative_num_steps + 1 = {shape.num_draft_tokens} tokens whatever "
                                "speculative_num_draft_tokens says", number)
        return None


WHY = "speculative shape next to the best so far"
"""How the proposer's trials say why they ran (their prediction's ``why`` starts with it)."""

SHAPE_PROPOSALS = 4
"""The proposer's trials per study at most: off, one step fewer, one more, the baseline's shape."""


class SpeculativeShapes:
    """Once the planner has a best config, try its neighbouring draft shapes: speculation off, one
    step fewer and one more (topk 1), and the baseline's tree, each at the best config's other knobs;
    the first one not tried yet and not refused (:class:`SpeculativeRules` screens it), at most
    :data:`SHAPE_PROPOSALS` per study (the sampler searches the rest of the space)."""

    def __init__(self, rules: SpeculativeRules) -> None:
        self.rules = rules

    def propose(self, view: StudyView) -> Proposal | None:
        space = view.space
        if not space.searches("speculative_algorithm"):
            return None
        asked = sum(1 for _, r in view.finished if (r.prediction.why or "").startswith(WHY))
        best = _best(view)
        if best is None or asked >= SHAPE_PROPOSALS:
            return None
        number, params = best
        record = dict(view.finished)[number]
        for candidate in _neighbour_shapes(params, view, record):
            snapped = space.snap(candidate)
            if config_key(snapped) in view.tried or self.rules.why_not(snapped, view) is not None:
                continue
            return Proposal(params=snapped, kind="predicted",
                            prediction=Prediction(why=f"{WHY} (trial {number})"))
        return None


def _best(view: StudyView) -> tuple[int, dict[str, Any]] | None:
    """The fastest feasible measured config so far (its number and params)."""
    ok = [(n, r) for n, r in view.finished
          if r.outcome == "ok" and Constraints.feasible_values(r.constraints) and r.output_throughput_tok_s]
    if not ok:
        return None
    number, record = max(ok, key=lambda nr: nr[1].output_throughput_tok_s or 0.0)
    return number, dict(record.params)


def _neighbour_shapes(params: Mapping[str, Any], view: StudyView, record: TrialRecord) -> list[dict[str, Any]]:
    """Speculation off and one step fewer (they need less memory) at the best's knobs, then one
    step more at a fraction lowered by its predicted extra graph memory, then the baseline's shape."""
    space = view.space
    base = space.snap(dict(params))
    shape = launched_shape(base, view)
    if shape is None:  # off: back on at the baseline's shape
        return [{**base, **space.snap({**base, "speculative_algorithm": True})}]
    steps_grid = space.grid("speculative_num_steps")
    drafts = space.grid("speculative_num_draft_tokens")

    def chain(steps: int) -> dict[str, Any]:
        return {**base, "speculative_num_steps": steps, "speculative_eagle_topk": 1,
                "speculative_num_draft_tokens": _draft_choice(drafts, steps + 1)}

    out: list[dict[str, Any]] = [{k: v for k, v in base.items() if k not in SPEC_SHAPE_KNOBS} | {"speculative_algorithm": False}]
    if shape.num_steps - 1 in steps_grid:
        out.append(chain(shape.num_steps - 1))
    if shape.num_steps + 1 in steps_grid:
        out.append(_with_graph_room(chain(shape.num_steps + 1), shape.num_draft_tokens, shape.num_steps + 2, record, view))
    first = {name: space.grid(name)[0] for name in SPEC_SHAPE_KNOBS if space.grid(name)}
    out.append({**base, **first})
    return out


def _with_graph_room(candidate: dict[str, Any], tokens_now: int, tokens_next: int, record: TrialRecord,
                     view: StudyView) -> dict[str, Any]:
    """``candidate`` at a fraction lowered by the verify graphs' predicted growth: the target's
    graphs hold ``num_draft_tokens`` tokens per request (§2.1), so they grow by ``graph_gib ×
    (next − now) / now``, taken from the fraction (``/ B``) so the runtime headroom stays."""
    graph, model = record.memory.graph_gib, record.memory.capacity_model
    mfs = candidate.get("mem_fraction_static")
    if graph is None or model is None or mfs is None or tokens_next <= tokens_now:
        return candidate
    extra = graph * (tokens_next - tokens_now) / max(tokens_now, 1)
    fractions = [f for f in view.space.fractions() if f <= float(mfs) - extra / model.baseline_gib + 1e-9]
    return {**candidate, "mem_fraction_static": fractions[-1]} if fractions else candidate


def _draft_choice(grid: Sequence[int], want: int) -> int:
    """The draft-tokens choice nearest ``want`` (SGLang resolves it at topk 1 anyway)."""
    return min(grid, key=lambda v: abs(v - want)) if grid else want
