"""Metrics: per-request records and their bench_serving-compatible summary, SLOs and goodput.

Definitions follow ``sglang.bench_serving``'s ``calculate_metrics`` (``shared/sglang-reference.md``
§6.2) exactly:

* throughputs = totals / duration; ``input`` uses the requested prompt length (exact here, token
  ids are sent), ``output`` the server's ``completion_tokens``;
* TTFT = time from send to the first non-empty streamed chunk;
* ITL = for every later chunk, the gap to the previous non-empty chunk divided by the chunk's new
  tokens, repeated once per new token (the first chunk's extra tokens add no ITL);
* TPOT = (E2E latency − TTFT) / (output_len − 1), only for output_len > 1;
* E2E latency = send to end of stream (the ``[DONE]`` line);
* ``concurrency`` = Σ E2E latency / duration (mean requests in flight);
* percentiles are ``numpy.percentile`` (linear), ``median`` is p50, ``std`` the population std.

Added here (GuideLLM-style, failures kept visible): ``errored`` / ``incomplete`` counts, error
rate, the most common errors (:class:`ErrorCount`, so a failed run says why), the prefix-cache
hit rate Σ cached_tokens / Σ prompt_tokens from the server's own usage fields (§5.3), and SLOs: a limit per percentile of TTFT / ITL / TPOT / E2E, goodput (requests/s
meeting every per-request limit, bench_serving's ``--goodput``), attainment and violations.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tuner.errors import ConfigError

__all__ = [
    "PERCENTILE_KEYS",
    "SLO_METRICS",
    "SLO",
    "RequestRecord",
    "ErrorCount",
    "LoadSummary",
    "summarize",
    "quantile_interval",
    "slo_violations",
    "itl_exceedance",
    "itl_exceedance_low",
    "top_errors",
    "request_itls_s",
    "TIERS",
    "tier_hits_from_metrics",
]

PERCENTILE_KEYS: tuple[str, ...] = ("mean", "median", "p50", "p90", "p95", "p99", "max")
"""Keys an SLO limit may use; ``p50`` is stored as ``median``."""
SLO_METRICS: tuple[str, ...] = ("ttft", "itl", "tpot", "e2e_latency")
"""Latency metrics an SLO may bound."""
_STAT_KEYS = ("mean", "median", "std", "p90", "p95", "p99", "max")
_TOP_ERRORS = 3
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _canonical(key: str) -> str:
    return "median" if key == "p50" else key


class SLO(BaseModel):
    """Latency limits, in ms, keyed by percentile per metric.

    ``SLO(ttft_ms={"p99": 2000}, itl_ms={"p99": 100})`` means p99 TTFT ≤ 2000 ms and p99 ITL ≤ 100 ms.

    Per request (goodput and attainment), a request meets the SLO when it completed and its own
    TTFT, TPOT and E2E latency are within the *loosest* limit given for that metric (bench_serving's
    ``--goodput`` checks these three), and, when ITL limits are given, its own ITL at each limit's
    percentile is within that limit. Strict types: a limit written as a string (``{ p99 = "2000" }``)
    is refused, not read as a number.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    ttft_ms: dict[str, float] = Field(default_factory=dict)
    itl_ms: dict[str, float] = Field(default_factory=dict)
    tpot_ms: dict[str, float] = Field(default_factory=dict)
    e2e_latency_ms: dict[str, float] = Field(default_factory=dict)

    @field_validator("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms")
    @classmethod
    def _check_limits(cls, value: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, limit in value.items():
            if key not in PERCENTILE_KEYS:
                raise ValueError(f"percentile {key!r} is not one of {', '.join(PERCENTILE_KEYS)}")
            if not 0 < limit < math.inf:
                raise ValueError(f"limit {limit} for {key!r} must be a finite number > 0 ms")
            out[_canonical(key)] = float(limit)
        return out

    @classmethod
    def parse(cls, text: str) -> SLO:
        """Parse ``"p99_ttft_ms=2000,p99_itl_ms=100"`` (keys: ``<percentile>_<metric>_ms``).

        Raises:
            ConfigError: A malformed item, an unknown percentile or metric, a limit given twice, or a
                limit that is not a finite number > 0.
        """
        limits: dict[str, dict[str, float]] = {m: {} for m in SLO_METRICS}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, raw = item.partition("=")
            pct, _, rest = name.strip().partition("_")
            metric = rest.removesuffix("_ms")
            try:
                if not sep or not rest.endswith("_ms") or metric not in SLO_METRICS:
                    raise ValueError(item)
                if _canonical(pct) in map(_canonical, limits[metric]):
                    raise ConfigError(f"SLO limit {name.strip()!r} is given twice in {text!r}",
                                      hint="give each <percentile>_<metric>_ms once in --slo")
                limits[metric][pct] = float(raw)
            except ValueError as err:
                raise ConfigError(
                    f"SLO item {item!r} is not <percentile>_<metric>_ms=<limit>",
                    hint="write e.g. --slo \"p99_ttft_ms=2000,p99_itl_ms=100\" (metrics: ttft, itl, tpot, e2e_latency)",
                ) from err
        try:
            return cls(**{f"{m}_ms": v for m, v in limits.items()})
        except ValidationError as err:
            reason = err.errors()[0]["msg"].removeprefix("Value error, ")
            raise ConfigError(
                f"SLO {text!r} is invalid: {reason}",
                hint="fix --slo: percentiles mean, p50, p90, p95, p99, max; limits finite and > 0 ms",
            ) from err

    def items(self) -> list[tuple[str, str, float]]:
        """``(metric, percentile_key, limit_ms)`` for every limit, e.g. ``("ttft", "p99", 2000.0)``."""
        return [
            (metric, key, limit)
            for metric in SLO_METRICS
            for key, limit in getattr(self, f"{metric}_ms").items()
        ]

    def is_empty(self) -> bool:
        """Whether no limit is set."""
        return not self.items()


class RequestRecord(BaseModel):
    """What happened to one request. Times are seconds since the run's start (monotonic clock).

    Attributes:
        rid: The request id.
        phase: ``warmup``, ``measure`` or ``cooldown`` (the phase it was sent in).
        status: ``ok`` (stream finished), ``error`` (HTTP, transport or server error),
            ``incomplete`` (cancelled: the run stopped or the server died before it finished).
        send_time_s: When the request was sent.
        first_token_time_s: Arrival of the first non-empty chunk, ``None`` when none arrived.
        end_time_s: End of the stream, the error, or the cancellation.
        chunk_times_s: Arrival time of every non-empty chunk.
        chunk_tokens: New output tokens in each chunk (from the server's ``completion_tokens``).
        prompt_tokens: The server's ``prompt_tokens`` (never counted client-side).
        completion_tokens: The server's ``completion_tokens``.
        cached_tokens: The server's ``cached_tokens`` (prefix-cache hit), if reported.
        cached_tiers: The server's ``cached_tokens_details`` by tier (``device``, ``host``,
            ``storage``; tokens), when it reports them (0.5.10+ with HiCache hits, §5.3).
        finish_reason: ``length``, ``stop``, ``abort``, ... as the server said.
        error: The error, one line, when ``status != "ok"``.
        error_kind: ``connect``, ``disconnect``, ``timeout``, ``http``, ``server``, ``cancelled``.
        input_len: Requested prompt length in tokens.
        max_new_tokens: Requested output length in tokens.
        e2e_latency_s: ``end_time_s - send_time_s`` for finished requests.
        group: The request's prefix group or session.
        server_rid: The server's id of the request (``meta_info.id`` / ``id``), to find it in logs.
        spec_verify_ct: The server's ``spec_verify_ct`` (verify steps of speculative decoding,
            ``/generate`` only, §5.3); its accept length is ``completion_tokens / spec_verify_ct``.
        prompt_class: The workload's class of the prompt (``raw``, ``chat``, ``code``), if known.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rid: str
    phase: Literal["warmup", "measure", "cooldown"] = "measure"
    status: Literal["ok", "error", "incomplete"] = "ok"
    send_time_s: float
    first_token_time_s: float | None = None
    end_time_s: float | None = None
    chunk_times_s: list[float] = Field(default_factory=list)
    chunk_tokens: list[int] = Field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_tiers: dict[str, int] | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_kind: str | None = None
    input_len: int = 0
    max_new_tokens: int = 0
    e2e_latency_s: float | None = None
    group: str | None = None
    server_rid: str | None = None
    spec_verify_ct: int | None = None
    prompt_class: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token (s), ``None`` without a non-empty chunk."""
        if self.first_token_time_s is None:
            return None
        return self.first_token_time_s - self.send_time_s

    @property
    def tpot_s(self) -> float | None:
        """(E2E − TTFT)/(output_len − 1) (s); ``None`` unless finished with output_len > 1."""
        ttft = self.ttft_s
        n = self.completion_tokens
        if self.status != "ok" or ttft is None or self.e2e_latency_s is None or not n or n <= 1:
            return None
        return (self.e2e_latency_s - ttft) / (n - 1)


def _itls_s(record: RequestRecord) -> np.ndarray:
    if len(record.chunk_times_s) < 2:
        return np.empty(0)
    tokens = np.asarray(record.chunk_tokens[1:])
    gaps = np.diff(np.asarray(record.chunk_times_s)) / np.maximum(tokens, 1)
    return np.repeat(gaps, np.maximum(tokens, 0))


def request_itls_s(record: RequestRecord) -> list[float]:
    """The ITL values of one request (s), bench_serving's way (§6.2).

    Every chunk after the first non-empty one contributes ``gap / new_tokens``, once per new token.
    """
    return _itls_s(record).tolist()


class ErrorCount(BaseModel):
    """Errored requests that failed the same way.

    Attributes:
        count: How many errored requests had this error.
        kind: Their ``error_kind`` (``http``, ``server``, ``timeout``, ...).
        example: The first such request's error text; errors differing only in numbers (token
            counts, ports) count as one.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    count: int
    kind: str | None = None
    example: str


def top_errors(records: Sequence[RequestRecord], limit: int = _TOP_ERRORS) -> list[ErrorCount]:
    """The most common errors of the errored records, most frequent first.

    Args:
        records: Records of any status; only ``status == "error"`` ones count.
        limit: Most groups returned.

    Returns:
        Up to ``limit`` :class:`ErrorCount`; errors whose texts differ only in their numbers form
        one group (``Input length (N tokens) ...``), shown by their first example.
    """
    counts: Counter[tuple[str | None, str]] = Counter()
    examples: dict[tuple[str | None, str], str] = {}
    for r in records:
        if r.status == "error":
            text = r.error or "unknown error"
            key = (r.error_kind, _NUMBER.sub("#", text))
            counts[key] += 1
            examples.setdefault(key, text)
    return [ErrorCount(count=n, kind=key[0], example=examples[key]) for key, n in counts.most_common(limit)]


class LoadSummary(BaseModel):
    """bench_serving's result keys (§6.2) plus failure counts, cache hit rate and SLO results.

    Latency fields are ms; ``None`` when nothing was measured. Throughputs: requests/s, tokens/s.
    ``p99_ttft_low_ms``/``p99_ttft_high_ms`` (and ITL's) bound each p99 at 95 % confidence
(:func:`quantile_interval`; ``high`` is ``None`` when too few requests bound it from above: a p99
over fewer than ~370 requests is close to their maximum); ``itl_count`` is the token gaps the ITL
figures are over (TTFT's count is ``completed``).
``top_errors`` holds the most common errors of the window (empty when none errored).
``itl_exceedance`` is the share of the window's token gaps above the SLO's ITL limit over the share
its percentile allows (:func:`itl_exceedance`; ≤ 1 holds), ``None`` without a percentile ITL limit;
``itl_exceedance_low`` its 95 % lower bound over the window's decode steps (:func:`itl_exceedance_low`).
    ``device_hit_rate`` / ``host_hit_rate`` / ``storage_hit_rate`` split ``cache_hit_rate`` by the
    tier that served the hit (shares of prompt tokens, 0-1) when the server reported
    ``cached_tokens_details`` (§5.3, 0.5.10+); :func:`tier_hits_from_metrics` gives the same split
    from ``/metrics`` counters for versions without it.
    ``accept_length`` is speculative decoding's mean tokens per verify step over the window's
    finished requests (Σ ``completion_tokens`` / Σ ``spec_verify_ct``: SGLang's per-request
    ``spec_accept_length`` pooled, §5.3), ``accept_length_by_class`` the same per prompt class
    (``raw``, ``chat``, ``code``); None / empty when the server reported no ``spec_verify_ct``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    duration: float
    completed: int
    errored: int
    incomplete: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    mean_ttft_ms: float | None = None
    median_ttft_ms: float | None = None
    std_ttft_ms: float | None = None
    p90_ttft_ms: float | None = None
    p95_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    max_ttft_ms: float | None = None
    mean_itl_ms: float | None = None
    median_itl_ms: float | None = None
    std_itl_ms: float | None = None
    p90_itl_ms: float | None = None
    p95_itl_ms: float | None = None
    p99_itl_ms: float | None = None
    max_itl_ms: float | None = None
    p99_ttft_low_ms: float | None = None
    p99_ttft_high_ms: float | None = None
    p99_itl_low_ms: float | None = None
    p99_itl_high_ms: float | None = None
    itl_count: int | None = None
    mean_tpot_ms: float | None = None
    median_tpot_ms: float | None = None
    std_tpot_ms: float | None = None
    p90_tpot_ms: float | None = None
    p95_tpot_ms: float | None = None
    p99_tpot_ms: float | None = None
    max_tpot_ms: float | None = None
    mean_e2e_latency_ms: float | None = None
    median_e2e_latency_ms: float | None = None
    std_e2e_latency_ms: float | None = None
    p90_e2e_latency_ms: float | None = None
    p95_e2e_latency_ms: float | None = None
    p99_e2e_latency_ms: float | None = None
    max_e2e_latency_ms: float | None = None
    concurrency: float
    error_rate: float
    total_prompt_tokens: int | None = None
    total_cached_tokens: int | None = None
    cache_hit_rate: float | None = None
    device_hit_rate: float | None = None
    host_hit_rate: float | None = None
    storage_hit_rate: float | None = None
    accept_length: float | None = None
    accept_length_by_class: dict[str, float] = Field(default_factory=dict)
    goodput: float | None = None
    slo_attainment: float | None = None
    slo_met: bool | None = None
    slo_violations: dict[str, float | None] = Field(default_factory=dict)
    itl_exceedance: float | None = None
    itl_exceedance_low: float | None = None
    top_errors: list[ErrorCount] = Field(default_factory=list)

    def failure(self, max_error_rate: float) -> str | None:
        """Why this window does not describe a working server, or ``None`` when it does.

        Args:
            max_error_rate: Highest tolerated share of errored requests among those finished (0-1).

        Returns:
            One line naming the problem and the fix: no request completed, or the error rate exceeds
            ``max_error_rate``, with the most common error when requests errored.
        """
        judged = self.completed + self.errored
        if self.completed == 0:
            reason = f"no request completed ({self.errored} errored, {self.incomplete} incomplete)"
        elif self.error_rate > max_error_rate:
            reason = (f"{self.errored} of {judged} requests errored "
                      f"(error rate {self.error_rate:.1%} > --max-error-rate {max_error_rate:g})")
        else:
            return None
        if not self.top_errors:
            return reason + " — the window ended before any request finished: lengthen --duration or use --max-requests"
        worst = self.top_errors[0]
        return (f"{reason}; most often ({worst.count}x): {worst.example} — fix that cause (request sizes, "
                f"--url, the server) or raise --max-error-rate")

    def metrics(self) -> dict[str, float | None]:
        """The numeric fields as a flat dict (for :class:`tuner.records.PhaseResult.metrics`)."""
        flat = {
            k: (float(v) if v is not None else None)
            for k, v in self.model_dump(exclude={"slo_violations", "slo_met", "top_errors",
                                                 "accept_length_by_class"}).items()
        }
        flat.update({f"accept_length_{cls}": v for cls, v in self.accept_length_by_class.items()})
        return flat


def _stats(values_ms: np.ndarray) -> dict[str, float | None]:
    if values_ms.size == 0:
        return dict.fromkeys(_STAT_KEYS)
    p90, p95, p99 = np.percentile(values_ms, [90, 95, 99])
    return {
        "mean": float(values_ms.mean()),
        "median": float(np.median(values_ms)),
        "std": float(values_ms.std()),
        "p90": float(p90),
        "p95": float(p95),
        "p99": float(p99),
        "max": float(values_ms.max()),
    }


def quantile_interval(values: Sequence[float] | np.ndarray, q: float = 0.99,
                      confidence: float = 0.95) -> tuple[float | None, float | None]:
    """A distribution-free confidence interval of the ``q`` quantile of ``values``: order
    statistics ``x_(l) ≤ Q_q ≤ x_(u)`` with the number of values below ``Q_q`` binomial(n, q).

    Args:
        values: The sample (any unit; the bounds are in it).
        q: The quantile (0.99: p99).
        confidence: Two-sided level (0.95).

    Returns:
        ``(low, high)``; ``low`` ``None`` when the sample cannot bound it from below, ``high``
        ``None`` when it cannot bound it from above (e.g. p99 over 50 requests: ``x_(48)``
        to ``None``); ``(None, None)`` for an empty sample.
    """
    xs = np.sort(np.asarray(values, dtype=float))
    n = int(xs.size)
    if n == 0:
        return None, None
    tail = (1.0 - confidence) / 2
    # cdf[j] = P(Binomial(n, q) <= j), j = 0..n, in log space so that n may be large (every token gap)
    i = np.arange(1, n + 1)
    log_choose = np.concatenate([[0.0], np.cumsum(np.log((n - i + 1) / i))])
    j = np.arange(n + 1)
    log_pmf = log_choose + j * math.log(q) + (n - j) * math.log1p(-q)
    pmf = np.exp(log_pmf - log_pmf.max())
    cdf = np.cumsum(pmf) / pmf.sum()
    c = int(np.searchsorted(cdf[:n], tail + 1e-12, side="right"))  # P(B < c) <= tail: x_(c) is below Q_q
    first = int(np.searchsorted(cdf[:n], 1 - tail - 1e-12, side="left"))  # P(B <= first) >= 1 - tail
    low = float(xs[c - 1]) if c >= 1 else None
    high = float(xs[first]) if first < n else None
    return low, high


def _stat_of(values_ms: np.ndarray, key: str) -> float:
    arr = values_ms
    if key == "mean":
        return float(arr.mean())
    if key == "max":
        return float(arr.max())
    return float(np.percentile(arr, _percent(key)))


def _percent(key: str) -> int:
    """The percentile of a percentile key, 0-100 (``median``: 50, ``p99``: 99)."""
    return 50 if key == "median" else int(key[1:])


def _meets(record: RequestRecord, slo: SLO, itls_ms: np.ndarray) -> bool:
    if record.status != "ok":
        return False
    per_request = {
        "ttft": None if record.ttft_s is None else record.ttft_s * 1000,
        # bench_serving: a request with output_len <= 1 has TPOT 0 for goodput.
        "tpot": (record.tpot_s or 0.0) * 1000,
        "e2e_latency": None if record.e2e_latency_s is None else record.e2e_latency_s * 1000,
    }
    for metric, value in per_request.items():
        limits = getattr(slo, f"{metric}_ms")
        if limits and (value is None or value > max(limits.values())):
            return False
    for key, limit in slo.itl_ms.items():
        if itls_ms.size and _stat_of(itls_ms, key) > limit:
            return False
    return True


TIERS = ("device", "host", "storage")
"""HiCache tiers in ``cached_tokens_details`` (§5.3, §7): GPU pool, pinned host pool, L3 storage."""


def _tier_rates(reporting: Sequence[RequestRecord], prompt_total: int, cached_total: int) -> dict[str, float | None]:
    # Details appear only on requests with a HiCache hit (§5.3); a request without them that had a
    # hit was served by the device pool (the radix cache alone).
    if not prompt_total or not any(r.cached_tiers for r in reporting):
        return {}
    sums = dict.fromkeys(TIERS, 0)
    for r in reporting:
        if r.cached_tiers:
            for tier in TIERS:
                sums[tier] += int(r.cached_tiers.get(tier) or 0)
        else:
            sums["device"] += r.cached_tokens or 0
    storage = sums["storage"] if any(r.cached_tiers and "storage" in r.cached_tiers for r in reporting) else None
    return {"device_hit_rate": sums["device"] / prompt_total, "host_hit_rate": sums["host"] / prompt_total,
            "storage_hit_rate": None if storage is None else storage / prompt_total}


def tier_hits_from_metrics(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float] | None:
    """Hit rates by tier from two ``/metrics`` scrapes around a window (§5.5), for versions whose
    responses carry no ``cached_tokens_details`` (0.5.5).

    ``Δsglang:cached_tokens_total / Δsglang:prompt_tokens_total`` is the hit rate; the host tier's
    share is ``Δsglang:load_back_tokens_total`` (prefixes loaded back from host memory, §7), the
    L3 tier's ``Δsglang:prefetched_tokens_total`` (0 without a storage backend); the device tier is
    the rest. The load-back counter counts every load-back in the window, so the split is exact
    when nothing but the window's requests ran.

    Args:
        before, after: :meth:`tuner.sglang.client.SGLangClient.metrics` scrapes (sample → value).

    Returns:
        ``{"cache_hit_rate", "device_hit_rate", "host_hit_rate", "storage_hit_rate"}`` (0-1 of the
        window's prompt tokens), or ``None`` when the counters are missing or no prompt was counted.
    """
    def delta(name: str) -> float | None:
        key = f"sglang:{name}_total"
        if key not in after:
            return None
        return max(0.0, after[key] - before.get(key, 0.0))

    prompt, cached = delta("prompt_tokens"), delta("cached_tokens")
    if not prompt or cached is None:
        return None
    host = min(delta("load_back_tokens") or 0.0, cached)
    storage = min(delta("prefetched_tokens") or 0.0, cached - host)
    return {"cache_hit_rate": cached / prompt, "device_hit_rate": (cached - host - storage) / prompt,
            "host_hit_rate": host / prompt, "storage_hit_rate": storage / prompt}
def slo_violations(slo: SLO, measured: Mapping[str, float | None]) -> dict[str, float | None]:
    """Each limit's relative overshoot, ``measured / limit − 1`` (≤ 0 when it holds).

    Args:
        slo: The limits.
        measured: Summary fields by name (``p99_ttft_ms``, ``p99_itl_ms``, ...; ms).

    Returns:
        ``{"p99_ttft_ms": 0.12, ...}`` for every limit; ``None`` where nothing was measured.
    """
    out: dict[str, float | None] = {}
    for metric, key, limit in slo.items():
        value = measured.get(f"{key}_{metric}_ms")
        out[f"{key}_{metric}_ms"] = None if value is None else float(value) / limit - 1
    return out


def itl_exceedance(slo: SLO, itls_ms: np.ndarray) -> float | None:
    """How far the window's token gaps exceed the SLO's ITL limits, as a smooth measure of load.

    A ``pXX`` limit ``L`` holds when at most ``1 − XX/100`` of the gaps are above ``L`` (the p99:
    1 %). The exceedance of that limit is the share of gaps above ``L`` over that allowed share:
    ≤ 1 holds, 2 means twice the allowed slow gaps. Unlike the p99 itself, it moves smoothly with
    the load: the p99 ITL of a chunked-prefill server is a quantile of a mixture of decode-only
    steps and steps a prefill chunk joins, so it jumps from one population to the next as the
    requests in flight grow, while the share of slow gaps grows with the prefills' rate (every
    request in flight adds one prompt per its output length). ITL windows hold tens of thousands
    of gaps, so the share is measured finely (a TTFT window holds one sample per request).

    Args:
        slo: The limits; its percentile ITL limits count (``median`` as p50; ``mean``/``max`` do not).
        itls_ms: The window's token gaps, ms.

    Returns:
        The largest exceedance over the percentile ITL limits, ``None`` when there is none or
        no gap was measured.
    """
    return max((share / allowed for share, allowed in _slow_shares(slo, itls_ms)), default=None)


def itl_exceedance_low(slo: SLO, itls_ms: np.ndarray, concurrency: float) -> float | None:
    """A 95 % lower bound of :func:`itl_exceedance`: the exceedance the window's slow decode
    steps still support.

    The gaps of one decode step are one observation, not ``concurrency`` of them: every request in
    the batch gets its next token from the same step. So a window of ``n`` gaps at ``c`` requests in
    flight holds about ``n / c`` steps, and a p99 limit allows 1 % of them to be slow; ``k`` slow
    steps are a Poisson count, bounded below by ``k − 1.645 √k`` (one-sided 95 %, normal
    approximation). A window whose bound is ≤ 1 broke the limit by no more than its sampling noise
    (a few slow steps more or less), so it proves nothing of larger loads.

    Args:
        slo: The limits (as :func:`itl_exceedance`).
        itls_ms: The window's token gaps, ms.
        concurrency: Mean requests in flight over the window (≥ the decode batch: the bound errs low).

    Returns:
        The largest lower bound over the percentile ITL limits, ``None`` as :func:`itl_exceedance`.
    """
    steps = np.asarray(itls_ms).size / max(1.0, concurrency)
    bounds = []
    for share, allowed in _slow_shares(slo, itls_ms):
        slow = share * steps
        bounds.append(max(0.0, slow - 1.645 * math.sqrt(slow)) / (allowed * steps))
    return max(bounds, default=None)


def _slow_shares(slo: SLO, itls_ms: np.ndarray) -> list[tuple[float, float]]:
    """Per percentile ITL limit of ``slo`` (``median`` as p50), ``(share of the gaps above it,
    share it allows)``; empty without such a limit or without gaps."""
    values = np.asarray(itls_ms, dtype=float)
    if not values.size:
        return []
    return [(float(np.count_nonzero(values > limit)) / values.size, 1.0 - _percent(key) / 100)
            for key, limit in slo.itl_ms.items() if key not in ("mean", "max")]


def _acceptance(done: Sequence[RequestRecord]) -> dict[str, Any]:
    """``accept_length`` and ``accept_length_by_class`` of finished requests (see :class:`LoadSummary`)."""
    spec = [r for r in done if r.spec_verify_ct and r.completion_tokens]
    if not spec:
        return {}
    by_class: dict[str, list[int]] = {}
    for r in spec:
        tally = by_class.setdefault(r.prompt_class or "unknown", [0, 0])
        tally[0] += r.completion_tokens or 0
        tally[1] += r.spec_verify_ct or 0
    total_ct = sum(t[0] for t in by_class.values())
    total_verify = sum(t[1] for t in by_class.values())
    return {"accept_length": total_ct / total_verify,
            "accept_length_by_class": {k: t[0] / t[1] for k, t in sorted(by_class.items())}}


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None) -> LoadSummary:
    """Summarize the measured requests of one window.

    Args:
        records: The records to count (the caller picks the phase; every record given counts).
        duration_s: The window's length in seconds (the throughput denominator, §6.2).
        slo: Latency limits; adds goodput, attainment, ``slo_met`` and ``slo_violations``.

    Returns:
        The :class:`LoadSummary`.
    """
    duration = max(duration_s, 1e-9)
    done = [r for r in records if r.status == "ok"]
    errored = sum(1 for r in records if r.status == "error")
    incomplete = sum(1 for r in records if r.status == "incomplete")
    ttft, tpot, e2e = [], [], []
    per_request_itls: list[np.ndarray] = []
    total_input = total_output = 0
    for r in done:
        total_input += r.input_len
        total_output += r.completion_tokens or 0
        if r.ttft_s is not None:
            ttft.append(r.ttft_s * 1000)
        if r.tpot_s is not None:
            tpot.append(r.tpot_s * 1000)
        if r.e2e_latency_s is not None:
            e2e.append(r.e2e_latency_s * 1000)
        per_request_itls.append(_itls_s(r) * 1000)
    itl = np.concatenate(per_request_itls) if per_request_itls else np.empty(0)
    fields: dict[str, Any] = {}
    for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e_latency", e2e)):
        for key, value in _stats(np.asarray(values, dtype=float)).items():
            fields[f"{key}_{name}_ms"] = value
    for name, values in (("ttft", ttft), ("itl", itl)):
        fields[f"p99_{name}_low_ms"], fields[f"p99_{name}_high_ms"] = quantile_interval(values)
    fields["itl_count"] = int(itl.size)
    # /v1/completions reports cached_tokens only when > 0 (§5.3): once any request reported it,
    # a request that did not had no hit.
    any_cached = any(r.cached_tokens is not None for r in done)
    reporting = [r for r in done if r.prompt_tokens is not None and any_cached]
    prompt_total = sum(r.prompt_tokens or 0 for r in reporting)
    cached_total = sum(r.cached_tokens or 0 for r in reporting)
    tiers = _tier_rates(reporting, prompt_total, cached_total)
    fields.update(
        duration=duration_s,
        completed=len(done),
        errored=errored,
        incomplete=incomplete,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(done) / duration,
        input_throughput=total_input / duration,
        output_throughput=total_output / duration,
        total_throughput=(total_input + total_output) / duration,
        concurrency=sum(e2e) / 1000 / duration,
        error_rate=errored / (len(done) + errored) if done or errored else 0.0,
        total_prompt_tokens=prompt_total if reporting else None,
        total_cached_tokens=cached_total if reporting else None,
        cache_hit_rate=cached_total / prompt_total if reporting and prompt_total else None,
        top_errors=top_errors(records),
        **tiers,
        **_acceptance(done),
    )
    if slo is not None and not slo.is_empty():
        good = sum(1 for r, own in zip(done, per_request_itls, strict=True) if _meets(r, slo, own))
        judged = len(done) + errored
        violations = slo_violations(slo, fields)
        fields.update(
            goodput=good / duration,
            slo_attainment=good / judged if judged else None,
            slo_met=bool(done) and all(v is not None and v <= 0 for v in violations.values()),
            slo_violations=violations,
            itl_exceedance=itl_exceedance(slo, itl),
            itl_exceedance_low=itl_exceedance_low(slo, itl, fields["concurrency"]),
        )
    return LoadSummary(**fields)
