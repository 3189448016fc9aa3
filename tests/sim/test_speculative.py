"""Speculative decoding in the simulator: acceptance by prompt class and draft shape, the step
costs, SGLang's refusals, and the acceptance fields of responses and /get_server_info."""

from __future__ import annotations

import random

import pytest
import requests

from tests.support.sim import run_to_exit, spawn, wait_ready
from tuner.sim import costmodel, startup
from tuner.sim.engine import SimRequest
from tuner.sim.evaluate import evaluate, size_server
from tuner.sim.speculative import accept_length, classify_ids, classify_text, refusal, tree_error

KIMI = ["--model-path", "kimi-k2.5-int4", "--trust-remote-code", "--tp-size", "8", "--sim-gpu",
        "RTX-PRO-6000-96GB", "--mem-fraction-static", "0.88"]
CHAT = ("Could you explain how the scheduler decides which requests to admit when the pool is almost "
        "full and several long prompts are waiting in the queue at the same time ? I would like to "
        "understand the trade off between the batch size and the latency of each request .")
CODE = "def add(a, b):\n    return (a + b)\n\nfor i in range(10):\n    print(add(i, i))\n"


def _shape(steps: int, topk: int, draft: int) -> list[str]:
    return ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", str(draft)]


def test_prompt_classes_and_acceptance_order() -> None:
    rng = random.Random(0)
    assert classify_ids([rng.randrange(16, 160000) for _ in range(500)]) == "raw"
    words = CHAT.split() * 3
    assert classify_ids([hash(w) % 160000 for w in words]) == "chat"
    assert classify_text(CHAT) == "chat" and classify_text(CODE) == "code"
    # Random prompts overstate acceptance; more steps accept more, with diminishing returns.
    chain = [accept_length(0.68, s, 1, s + 1) for s in (1, 2, 3, 4, 5)]
    assert chain == sorted(chain) and chain[1] - chain[0] > chain[4] - chain[3]
    assert accept_length(0.86, 3, 1, 4) > accept_length(0.78, 3, 1, 4) > accept_length(0.68, 3, 1, 4)
    # A 3-step chain accepts 48.5 % of its drafts on chat (lightseekorg/tokenspeed#1305).
    assert (accept_length(0.68, 3, 1, 4) - 1) / 3 == pytest.approx(0.485, abs=0.01)
    assert accept_length(0.68, 5, 4, 8) > accept_length(0.68, 5, 1, 6)


def test_sglang_refusals_per_version() -> None:
    assert refusal("0.5.5", "EAGLE3", 3, 4, 8, 16, None) is not None and "'flashinfer' backend" in refusal(
        "0.5.5", "EAGLE3", 3, 4, 8, 16, None)
    assert refusal("0.5.5", "EAGLE3", 3, 4, 8, 16, "flashinfer") is None
    assert "('flashinfer', 'fa3', 'triton')" in refusal("0.5.23", "EAGLE3", 3, 4, 8, 16, "flashmla")
    assert refusal("0.5.23", "EAGLE3", 3, 4, 8, 1, None) is None
    assert refusal("0.5.5", "EAGLE3", None, 4, None, 1, None) == "AssertionError"
    assert tree_error(2, 2, 8) is not None and tree_error(2, 2, 7) is None  # 2 + 1*4 candidates


def test_refused_shape_exits_with_sglangs_message(tmp_path) -> None:
    status, log = run_to_exit([*KIMI, "--sim-version", "0.5.23", *_shape(3, 4, 8), "--page-size", "64",
                               "--attention-backend", "flashmla"], tmp_path)
    assert status != 0 and "speculative_eagle_topk > 1 with page_size > 1 is only supported on" in log


def test_speculation_wins_at_low_concurrency_and_fewer_draft_tokens_cost_less_per_step() -> None:
    base = [*KIMI, "--sim-version", "0.5.23", "--max-running-requests", "64"]
    _, off = startup.plan_from_argv(base)
    _, on = startup.plan_from_argv([*base, *_shape(3, 1, 4)])
    e_off, e_on = startup.engine_spec(off), startup.engine_spec(on)
    assert e_on.speculative is not None and on.draft_kv_bytes > 0
    one_off = costmodel.decode_step_s(e_off.cost, 1, 2000, eager=False)
    one_on = e_on.speculative.decode_step_s(e_on.cost, 1, 2000, eager=False)
    acc = e_on.speculative.request_accept_length("chat", "r")
    assert acc / one_on > 1.05 / one_off  # chat tokens per second at batch 1: speculation wins
    # Graph memory grows with the verify tokens per request.
    _, wide = startup.plan_from_argv([*base, *_shape(3, 1, 4)[:2], "--speculative-num-steps", "5",
                                      "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "6"])
    assert wide.graph_bytes > on.graph_bytes > off.graph_bytes


@pytest.mark.parametrize("version", ["0.5.5", "0.5.23"])
def test_responses_carry_per_request_acceptance_and_server_average(tmp_path, version: str) -> None:
    sim = spawn([*KIMI, "--sim-version", version, *_shape(3, 1, 4)], tmp_path)
    try:
        wait_ready(sim)
        rng = random.Random(1)
        sent = {"raw": {"input_ids": [rng.randrange(16, 150000) for _ in range(300)]},
                "chat": {"text": CHAT}, "code": {"text": CODE * 4}}
        lengths = {}
        total_ct = total_verify = 0
        for name, prompt in sent.items():
            got = []
            for i in range(3):
                meta = requests.post(f"{sim.url}/generate", json={**prompt, "rid": f"{name}-{i}", "sampling_params": {
                    "max_new_tokens": 400, "ignore_eos": True}}, timeout=60).json()["meta_info"]
                assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
                key = "spec_num_correct_drafts" if version == "0.5.23" else "spec_accept_token_num"
                assert meta[key] == meta["completion_tokens"] - meta["spec_verify_ct"]
                got.append(meta["spec_accept_length"])
                total_ct += meta["completion_tokens"]
                total_verify += meta["spec_verify_ct"]
            lengths[name] = sum(got) / len(got)
        assert lengths["raw"] > lengths["code"] > lengths["chat"] > 1.5
        state = requests.get(f"{sim.url}/get_server_info", timeout=10).json()["internal_states"][0]
        assert state["avg_spec_accept_length"] == pytest.approx(total_ct / total_verify, rel=0.05)
    finally:
        sim.stop()


def test_the_crossover_fewer_draft_tokens_then_speculation_off_as_the_batch_grows() -> None:
    """On a model whose decode turns compute-bound in the batches memory allows (Llama-3.1-70B,
    tp 8, H100), the verify forward over ``batch × num_draft_tokens`` tokens costs as much as it
    accepts: the best chain is deep at one request in flight, shallower at 64, and at 256
    speculation off wins (sglang#22246: step 4 at batch 1 vs step 2 at batch 64; sglang#6995:
    Llama-2-70B at high throughput, EAGLE 2/4/4 below no speculation)."""
    rng = random.Random(0)
    base = ["--model-path", "llama-3.1-70b", "--tp-size", "8", "--sim-gpu", "H100-80GB", "--sim-version", "0.5.23",
            "--mem-fraction-static", "0.85", "--max-running-requests", "512", "--cuda-graph-max-bs-decode", "512"]

    def tok_s(extra: list[str], concurrency: int) -> float:
        reqs = [SimRequest(f"r{i}", [rng.randrange(100, 30000) for _ in range(512)], 128, True, 0.0, "chat")
                for i in range(max(3 * concurrency, 4))]
        result = evaluate([*base, *extra], reqs, concurrency=concurrency)
        assert result.started and result.error is None
        return result.output_throughput

    depths = (1, 2, 3, 4)
    by_batch = {bs: (tok_s([], bs), [tok_s(_shape(d, 1, d + 1), bs) for d in depths]) for bs in (1, 64, 256)}
    off, chain = by_batch[1]
    assert max(chain) > 1.5 * off and depths[chain.index(max(chain))] >= 3
    off, chain = by_batch[64]
    assert max(chain) > off and depths[chain.index(max(chain))] < 4
    off, chain = by_batch[256]
    assert off > 1.1 * max(chain) and depths[chain.index(max(chain))] <= 2


def test_a_smaller_draft_kv_dtype_halves_the_draft_pool_and_leaves_the_rest_free() -> None:
    """0.5.23 budgets the draft's pool as the target cell's share by layers; an fp8 draft pool
    takes half of it and the other half stays free (the flag's help text)."""
    args = [*KIMI, "--sim-version", "0.5.23", "--max-running-requests", "64", *_shape(3, 1, 4)]
    _, bf16 = startup.plan_from_argv(args)
    _, fp8 = startup.plan_from_argv([*args, "--speculative-draft-kv-cache-dtype", "fp8_e4m3"])
    assert fp8.max_total_num_tokens == bf16.max_total_num_tokens
    assert fp8.draft_kv_bytes == pytest.approx(bf16.draft_kv_bytes / 2, rel=0.01)
    freed = (size_server([*args, "--speculative-draft-kv-cache-dtype", "fp8_e4m3"]).free_gib_after_graphs
             - size_server(args).free_gib_after_graphs)
    assert freed == pytest.approx(bf16.draft_kv_bytes / 2 / 2**30, rel=0.05)
