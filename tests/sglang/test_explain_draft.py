"""`tuner explain` on a 0.5.23 log of a speculative MLA deployment: the draft's KV under-budget
(0.5.16+ budgets the draft at the target's per-layer cell; an MHA draft needs more, out of the
reserve), checked against the simulator's own ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import run_tuner
from tests.support.sim import spawn, wait_ready
from tuner.sim import startup
from tuner.sim.models import GIB

MHA_DRAFT = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 7168,
             "intermediate_size": 18432, "num_hidden_layers": 1, "num_attention_heads": 64,
             "num_key_value_heads": 64, "head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840,
             "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 10000}


def _explain(tmp_path: Path, args: list[str]) -> tuple[dict, list[str]]:
    sim = spawn(args, tmp_path)
    try:
        wait_ready(sim)
        log = tmp_path / "server.log"
        log.write_text(sim.log())
    finally:
        sim.stop()
    done = run_tuner("explain", "--log", str(log), "--json", timeout_s=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), args


def test_mha_draft_on_mla_target_is_under_budgeted_by_the_ledgers_amount(tmp_path: Path) -> None:
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(MHA_DRAFT))
    args = ["--model-path", "deepseek-v3", "--trust-remote-code", "--tp-size", "8", "--sim-gpu", "H200-141GB",
            "--sim-version", "0.5.23", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
            str(draft), "--mem-fraction-static", "0.85"]
    out, _ = _explain(tmp_path, args)
    trap = next(t for t in out["traps"] if t["id"] == "draft_kv_under_budget")
    _, plan = startup.plan_from_argv(args)
    budgeted = plan.max_total_num_tokens * plan.target_cell_bytes * (1 / plan.config.model.num_layers)
    expected = (plan.draft_kv_bytes - budgeted) / GIB
    assert expected > 1.0  # 8 KV heads x 256 x 2 B per rank vs the MLA cell's 1,152 B per layer
    got = float(trap["title"].split(" GiB")[0].rsplit(" ", 1)[1])
    assert got == pytest.approx(expected, abs=0.05)
    assert trap["lever"]["knob"] == "mem_fraction_static"


def test_a_draft_at_the_targets_geometry_is_not_under_budgeted(tmp_path: Path) -> None:
    out, _ = _explain(tmp_path, ["--model-path", "kimi-k2.5-int4", "--trust-remote-code", "--tp-size", "8",
                                 "--sim-gpu", "RTX-PRO-6000-96GB", "--sim-version", "0.5.23",
                                 "--speculative-algorithm", "EAGLE3", "--mem-fraction-static", "0.88"])
    assert "draft_kv_under_budget" not in {t["id"] for t in out["traps"]}
