"""bench_serving metric definitions (§6.2) on hand-built request timelines with known answers."""

from __future__ import annotations

import pytest

from tuner.errors import ConfigError
from tuner.load.metrics import SLO, RequestRecord, request_itls_s, summarize


def _ok(rid: str, send: float, chunks: list[tuple[float, int]], end: float, *, input_len: int,
        prompt: int | None = None, cached: int | None = None) -> RequestRecord:
    return RequestRecord(
        rid=rid, send_time_s=send, first_token_time_s=chunks[0][0], end_time_s=end,
        chunk_times_s=[t for t, _ in chunks], chunk_tokens=[n for _, n in chunks],
        completion_tokens=sum(n for _, n in chunks), prompt_tokens=prompt, cached_tokens=cached,
        input_len=input_len, e2e_latency_s=end - send, finish_reason="length",
    )


# A: TTFT 100 ms; chunk gaps 20 ms (1 token), 40 ms (2 tokens -> 20, 20), 10 ms (1 token); 5 tokens; E2E 180 ms.
A = _ok("a", 0.0, [(0.10, 1), (0.12, 1), (0.16, 2), (0.17, 1)], 0.18, input_len=10, prompt=10, cached=5)
# B: TTFT 300 ms with 2 tokens in the first chunk (they add no ITL), then 50 ms; 3 tokens; E2E 400 ms.
B = _ok("b", 1.0, [(1.30, 2), (1.35, 1)], 1.40, input_len=20, prompt=20, cached=0)
C = RequestRecord(rid="c", send_time_s=0.5, status="error", error="HTTP 500", error_kind="http", input_len=7, end_time_s=0.6)
D = RequestRecord(rid="d", send_time_s=1.5, status="incomplete", error="cancelled", error_kind="cancelled", input_len=7,
                  chunk_times_s=[1.6], chunk_tokens=[1], first_token_time_s=1.6)


def test_per_request_ttft_itl_tpot() -> None:
    assert A.ttft_s == pytest.approx(0.100)
    assert request_itls_s(A) == pytest.approx([0.020, 0.020, 0.020, 0.010])
    assert A.tpot_s == pytest.approx((0.180 - 0.100) / (5 - 1))
    assert request_itls_s(B) == pytest.approx([0.050])
    assert B.tpot_s == pytest.approx((0.400 - 0.300) / (3 - 1))
    one = _ok("one", 0.0, [(0.05, 1)], 0.06, input_len=3)
    assert one.tpot_s is None and request_itls_s(one) == []


def test_summary_matches_hand_computed_values() -> None:
    s = summarize([A, B, C, D], duration_s=2.0)
    assert (s.completed, s.errored, s.incomplete) == (2, 1, 1)
    assert s.total_input_tokens == 30 and s.total_output_tokens == 8
    assert s.request_throughput == pytest.approx(1.0)
    assert s.input_throughput == pytest.approx(15.0)
    assert s.output_throughput == pytest.approx(4.0)
    assert s.total_throughput == pytest.approx(19.0)
    # TTFT [100, 300]: numpy linear percentiles.
    assert s.mean_ttft_ms == pytest.approx(200.0)
    assert s.median_ttft_ms == pytest.approx(200.0)
    assert s.p99_ttft_ms == pytest.approx(100 + 0.99 * 200)
    assert s.max_ttft_ms == pytest.approx(300.0)
    assert s.std_ttft_ms == pytest.approx(100.0)
    # ITL [20, 20, 20, 10, 50] -> sorted [10, 20, 20, 20, 50].
    assert s.mean_itl_ms == pytest.approx(24.0)
    assert s.median_itl_ms == pytest.approx(20.0)
    assert s.p90_itl_ms == pytest.approx(20 + 0.6 * 30)
    assert s.max_itl_ms == pytest.approx(50.0)
    # TPOT [20, 50]; E2E [180, 400].
    assert s.mean_tpot_ms == pytest.approx(35.0)
    assert s.p95_e2e_latency_ms == pytest.approx(180 + 0.95 * 220)
    # concurrency = sum of E2E / duration.
    assert s.concurrency == pytest.approx((0.18 + 0.40) / 2.0)
    assert s.error_rate == pytest.approx(1 / 3)
    assert s.cache_hit_rate == pytest.approx(5 / 30)
    assert s.goodput is None and s.slo_met is None


def test_slo_goodput_attainment_and_violations() -> None:
    slo = SLO(ttft_ms={"p99": 250}, itl_ms={"p50": 25})
    s = summarize([A, B, C, D], duration_s=2.0, slo=slo)
    # Per request: A meets (TTFT 100 <= 250, own median ITL 20 <= 25); B misses (TTFT 300).
    assert s.goodput == pytest.approx(0.5)
    # Attainment counts the errored request as a miss; the incomplete one is not judged.
    assert s.slo_attainment == pytest.approx(1 / 3)
    assert s.slo_violations["p99_ttft_ms"] == pytest.approx((100 + 0.99 * 200) / 250 - 1)
    assert s.slo_violations["median_itl_ms"] == pytest.approx(20 / 25 - 1)
    assert s.slo_met is False
    met = summarize([A], duration_s=1.0, slo=SLO(ttft_ms={"p99": 150}, tpot_ms={"mean": 25}))
    assert met.slo_met is True and met.slo_attainment == 1.0
    # The loosest per-request limit applies: p50 100 ms and p99 350 ms -> B (300 ms) meets it.
    loose = summarize([A, B], duration_s=1.0, slo=SLO(ttft_ms={"p50": 100, "p99": 350}))
    assert loose.goodput == pytest.approx(2.0)


def test_empty_window_has_no_latency_and_unmeasured_violations() -> None:
    s = summarize([C], duration_s=1.0, slo=SLO(ttft_ms={"p99": 100}))
    assert s.completed == 0 and s.p99_ttft_ms is None and s.cache_hit_rate is None
    assert s.slo_met is False and s.slo_violations == {"p99_ttft_ms": None}


def test_cache_hit_rate_counts_missing_completions_details_as_zero() -> None:
    # /v1/completions reports cached_tokens only when > 0.
    hit = _ok("h", 0.0, [(0.1, 1)], 0.2, input_len=100, prompt=100, cached=60)
    miss = _ok("m", 0.0, [(0.1, 1)], 0.2, input_len=100, prompt=100, cached=None)
    assert summarize([hit, miss], 1.0).cache_hit_rate == pytest.approx(0.3)
    assert summarize([miss], 1.0).cache_hit_rate is None


def test_slo_parse_and_errors() -> None:
    slo = SLO.parse("p99_ttft_ms=2000, p50_itl_ms=100,mean_tpot_ms=40,max_e2e_latency_ms=9000")
    assert slo.ttft_ms == {"p99": 2000} and slo.itl_ms == {"median": 100}
    assert slo.tpot_ms == {"mean": 40} and slo.e2e_latency_ms == {"max": 9000}
    for bad in ("p99_ttft=2000", "p99_ttft_ms", "p42_ttft_ms=1", "p99_foo_ms=1", "p99_ttft_ms=-5", "p99_ttft_ms=abc",
                "p99_itl_ms=inf", "p99_itl_ms=nan", "p99_itl_ms=10,p99_itl_ms=20", "p50_itl_ms=10,median_itl_ms=20"):
        with pytest.raises(ConfigError) as info:
            SLO.parse(bad)
        message = str(info.value)
        assert "\n" not in message and bad.split("=")[0] in message and "--slo" in message


def _err(rid: str, error: str, kind: str = "http") -> RequestRecord:
    return RequestRecord(rid=rid, send_time_s=0.0, end_time_s=0.1, status="error", error=error, error_kind=kind)


def test_top_errors_group_texts_that_differ_in_numbers_and_failure_names_the_cause() -> None:
    too_long = "HTTP 400 from http://h/generate: Input length ({n} tokens) exceeds the maximum allowed length (131066 tokens)."
    errors = [_err(str(n), too_long.format(n=n)) for n in (200000, 150000, 180000)]
    errors += [_err("t", "no complete answer within 600 s", "timeout"), D]  # D: incomplete, not an error
    s = summarize([*errors], duration_s=1.0)
    assert [(e.count, e.kind) for e in s.top_errors] == [(3, "http"), (1, "timeout")]
    assert s.top_errors[0].example == too_long.format(n=200000)
    reason = s.failure(max_error_rate=1.0)  # no request completed fails at any threshold
    assert reason is not None and reason.startswith("no request completed (4 errored, 1 incomplete)")
    assert "(3x): HTTP 400" in reason and "Input length (200000 tokens)" in reason
    # One error in three finished requests: 33 % fails a 10 % threshold, passes a 50 % one.
    mixed = summarize([A, B, C], duration_s=1.0)
    assert "1 of 3 requests errored (error rate 33.3% > --max-error-rate 0.1)" in (mixed.failure(0.1) or "")
    cut = summarize([D], duration_s=1.0).failure(0.1) or ""  # only a cancelled request: the window was too short
    assert cut.startswith("no request completed (0 errored, 1 incomplete)") and "--duration" in cut
    assert mixed.failure(0.5) is None and summarize([A], 1.0).failure(0.0) is None
    assert "top_errors" not in mixed.metrics()


def test_itl_exceedance_is_the_share_of_gaps_over_the_limit_per_allowed_share() -> None:
    import numpy as np

    from tuner.load.metrics import itl_exceedance

    gaps = np.array([10.0] * 985 + [50.0] * 15)  # 1.5 % of the gaps above 35 ms
    assert itl_exceedance(SLO(itl_ms={"p99": 35}), gaps) == pytest.approx(1.5)
    assert itl_exceedance(SLO(itl_ms={"p90": 35}), gaps) == pytest.approx(0.15)
    # The binding limit counts: p99 at 35 ms (1.5) over p90 at 5 ms (every gap: 10).
    assert itl_exceedance(SLO(itl_ms={"p99": 35, "p90": 5}), gaps) == pytest.approx(10.0)
    assert itl_exceedance(SLO(itl_ms={"mean": 35}), gaps) is None  # not a share of the gaps
    assert itl_exceedance(SLO(ttft_ms={"p99": 35}), gaps) is None
    assert itl_exceedance(SLO(itl_ms={"p99": 35}), np.empty(0)) is None
    # In a window: A's gaps are 20, 20, 20, 10 ms and B's 50 ms: 1 of 5 above 25 ms, p50 allows half.
    assert summarize([A, B], 2.0, slo=SLO(itl_ms={"p50": 25})).itl_exceedance == pytest.approx(0.4)
    assert summarize([A, B], 2.0).itl_exceedance is None


def test_itl_exceedance_low_counts_decode_steps_not_gaps() -> None:
    import numpy as np

    from tuner.load.metrics import itl_exceedance_low

    slo = SLO(itl_ms={"p99": 35})
    gaps = np.array([10.0] * 9_700 + [50.0] * 300)  # 3 % slow: exceedance 3
    # At 1 request in flight the 10,000 gaps are 10,000 steps: 300 slow, bound (300 − 1.645·√300) / 100.
    assert itl_exceedance_low(slo, gaps, 1.0) == pytest.approx((300 - 1.645 * 300 ** 0.5) / 100)
    # At 100 in flight they are 100 steps, 3 slow: no more than the 1 allowed by the noise.
    low = itl_exceedance_low(slo, gaps, 100.0)
    assert low is not None and low == pytest.approx(max(0.0, 3 - 1.645 * 3 ** 0.5)) and low <= 1.0
    assert itl_exceedance_low(SLO(itl_ms={"mean": 35}), gaps, 1.0) is None
