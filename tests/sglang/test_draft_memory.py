"""The draft's memory as a typed fact: learned from one start's log (the simulator as a real
process) and predicted for unlaunched shapes, pool sizes and request slots, within 10 % of what
the simulator's startup path allocates for them (0.5.23, the reference twin and an MHA draft)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.sim import spawn, wait_ready
from tuner.sglang.graphs import captured_bs, default_capture_bs
from tuner.sglang.logs import parse_log
from tuner.sglang.speculative import DraftMemory, SpecShape
from tuner.sim import startup
from tuner.sim.models import GIB

TWIN = ["--model-path", "kimi-k2.5-int4", "--trust-remote-code", "--tp-size", "8", "--sim-gpu",
        "RTX-PRO-6000-96GB", "--sim-version", "0.5.23", "--speculative-algorithm", "EAGLE3"]


def _shape_args(shape: SpecShape) -> list[str]:
    return ["--speculative-num-steps", str(shape.num_steps), "--speculative-eagle-topk", str(shape.eagle_topk),
            "--speculative-num-draft-tokens", str(shape.num_draft_tokens)]


def _close(predicted: float | None, actual_bytes: int) -> None:
    assert predicted is not None
    assert predicted == pytest.approx(actual_bytes / GIB, rel=0.10, abs=0.02)


@pytest.mark.parametrize("draft", [None, "mha"])
def test_draft_memory_learned_from_one_start_predicts_other_candidates(tmp_path: Path, draft: str | None) -> None:
    base = list(TWIN)
    if draft == "mha":
        d = tmp_path / "draft"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 7168,
            "intermediate_size": 18432, "num_hidden_layers": 1, "num_attention_heads": 64, "num_key_value_heads": 32,
            "head_dim": 128, "vocab_size": 163840, "max_position_embeddings": 262144, "torch_dtype": "bfloat16"}))
        base += ["--speculative-draft-model-path", str(d)]
    seen = SpecShape(3, 1, 4)
    args = [*base, *_shape_args(seen), "--mem-fraction-static", "0.88", "--max-running-requests", "48"]
    sim = spawn(args, tmp_path)
    try:
        wait_ready(sim)
        report = parse_log(sim.log().splitlines())
    finally:
        sim.stop()
    learned = DraftMemory.from_report(report, seen)
    assert learned is not None and learned.in_budget and learned.capture_sizes > 0
    for shape, mfs, mrr in ((SpecShape(5, 1, 6), 0.9, 48), (SpecShape(2, 1, 3), 0.92, 32), (SpecShape(4, 1, 5), 0.86, 24)):
        _, plan = startup.plan_from_argv([*base, *_shape_args(shape), "--mem-fraction-static", str(mfs),
                                          "--max-running-requests", str(mrr)])
        assert plan.failure is None
        sizes = len(captured_bs(default_capture_bs(mrr, speculative=True, version="0.5.23"), mrr))
        got = learned.predict(shape, tokens=plan.max_total_num_tokens, capture_sizes=sizes)
        _close(got.kv_gib, plan.draft_kv_bytes)
        _close(got.graph_gib, plan.draft_graph_bytes)
        _close(got.verify_graph_gib, plan.graph_bytes)
        _close(got.weight_gib, plan.config.draft.weight_bytes)
