"""The simulated model's greedy answers (:mod:`tuner.sim.answers`): a deterministic function of the
prompt and the launch's numerics; an fp8 KV cache drifts late, speculative decoding changes
nothing, a planted fault breaks the answers."""

from __future__ import annotations

import pytest

from tests.support.sim import run_to_exit
from tuner.sim.answers import NumericsFault, answer, numerics_drift
from tuner.sim.server import _WORDS, tokenize

VOCAB = 128256
PROMPTS = [f"prompt {i} " + " ".join(_WORDS[(i * 7 + k) % len(_WORDS)] for k in range(30 + 400 * (i % 3)))
           for i in range(24)]


def _answers(args: dict, fault: NumericsFault | None = None, n: int = 48) -> list[list[int]]:
    return [answer(p, tokenize(p, VOCAB), n, args, vocab_size=VOCAB, words=_WORDS, fault=fault).token_ids
            for p in PROMPTS]


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def test_answers_are_deterministic_and_speculative_decoding_under_greedy_changes_nothing() -> None:
    base = _answers({})
    assert base == _answers({"kv_cache_dtype": "auto", "attention_backend": None})
    spec = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 4}
    assert _answers(spec) == base
    assert numerics_drift(spec) == ("", 0.0, 0.0, False)


def test_an_fp8_kv_cache_changes_a_few_answers_late() -> None:
    base, fp8 = _answers({}), _answers({"kv_cache_dtype": "fp8_e4m3"})
    firsts = [d for a, b in zip(base, fp8, strict=True) if (d := _first_divergence(a, b)) is not None]
    assert 0 < len(firsts) <= len(PROMPTS) // 3  # a few
    assert min(firsts) >= 8  # late: the opening of an answer is confident


def test_a_planted_fault_breaks_the_answers_of_its_flags_only() -> None:
    fault = NumericsFault("kv_cache_dtype=fp8_e4m3")
    base = _answers({})
    broken = _answers({"kv_cache_dtype": "fp8_e4m3"}, fault)
    assert all((d := _first_divergence(a, b)) is not None and d <= 3 for a, b in zip(base, broken, strict=True))
    assert _answers({"kv_cache_dtype": "fp8_e5m2"}, fault) == _answers({"kv_cache_dtype": "fp8_e5m2"})
    assert NumericsFault("--kv-cache-dtype=FP8_E4M3,dcp_size=2").flags == {"kv_cache_dtype": "fp8_e4m3", "dcp_size": "2"}


def test_arithmetic_prompts_are_answered_with_the_right_number_first() -> None:
    got = answer("What is 12 * 13? Answer with the number only.", [1, 2], 4, {}, vocab_size=VOCAB, words=_WORDS)
    assert got.text.split()[0] == "156" and len(got.logprobs) == 4 and all(lp <= 0 for lp in got.logprobs)


def test_a_malformed_numerics_fault_is_refused_at_startup(tmp_path) -> None:  # type: ignore[no-untyped-def]
    status, log = run_to_exit(["--model-path", "llama-3.1-8b", "--sim-numerics-fault", "fp8"], tmp_path)
    assert status != 0 and "--sim-numerics-fault 'fp8' must be NAME=VALUE" in log


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "fp4_e2m1"])
def test_every_low_precision_kv_dtype_drifts_more_with_context(kv: str) -> None:
    _, sigma0, growth, _ = numerics_drift({"kv_cache_dtype": kv})
    assert sigma0 > 0 and growth > 0


def _share_equal(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def test_a_graded_fault_degrades_answers_by_its_size_from_its_token() -> None:
    """``:NATS`` is a noise per token added to the launch's drift (tokens flip where it passes the
    margin), ``@TOKEN`` where it starts; the old spelling still breaks answers from token 0."""
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    healthy = _answers(fp8)
    shares = [_share_equal(healthy, _answers(fp8, NumericsFault(f"kv_cache_dtype=fp8_e4m3:{size}")))
              for size in (0.02, 0.2, 1.0)]
    assert 1.0 >= shares[0] > shares[1] > shares[2], shares  # more nats, fewer answers unchanged
    late = _answers(fp8, NumericsFault("kv_cache_dtype=fp8_e4m3:1.0@24"))
    firsts = [d for a, b in zip(healthy, late, strict=True) if (d := _first_divergence(a, b)) is not None]
    assert firsts and min(firsts) >= 24
    assert NumericsFault("kv_cache_dtype=fp8_e4m3").size is None and NumericsFault("a=b:0.5@3").start == 3
    for bad in ("kv_cache_dtype=fp8_e4m3:-1", "kv_cache_dtype=fp8_e4m3:x", "kv_cache_dtype=fp8_e4m3@-2"):
        with pytest.raises(ValueError, match="nats per token above 0"):
            NumericsFault(bad)


def test_a_malformed_graded_fault_is_refused_at_startup(tmp_path) -> None:  # type: ignore[no-untyped-def]
    status, log = run_to_exit(["--model-path", "llama-3.1-8b", "--sim-numerics-fault", "kv_cache_dtype=fp8_e4m3:big"],
                              tmp_path)
    assert status != 0 and "the size after ':' must be nats per token above 0" in log
