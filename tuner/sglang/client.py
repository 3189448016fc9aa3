"""HTTP client for a running SGLang server: readiness, server info, model info, metrics, cache flush.

One concept: talking to SGLang's management endpoints (``shared/sglang-reference.md`` §5) with
``requests``, normalising what differs between versions (``/get_server_info`` vs ``/server_info``,
``memory_usage.graph`` a number before 0.5.23 and a dict per phase after, §5.2). Every transport
error becomes a :class:`~tuner.errors.ServerError` whose message names the URL and the fix.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import requests
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field

from tuner.errors import QualityError, ServerError
from tuner.sglang.failures import Failure, FailureClass
from tuner.sglang.levers import rank_tokens

__all__ = ["ServerInfo", "SGLangClient", "ServerNotReady", "GreedyAnswer", "greedy_answer", "url_problem"]

log = logging.getLogger(__name__)


def url_problem(url: str) -> str | None:
    """What is wrong with a server's base URL (an ``http://`` or ``https://`` URL with a host and,
    if given, a port from 1 to 65535), or ``None`` when it is usable. The one rule of the config's
    ``[service] url``, the load generator's ``--url`` and this client."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "not an http(s) URL with a host (write it like http://127.0.0.1:30000)"
    try:
        port = parts.port
    except ValueError as err:
        return f"a bad port ({err}; use a port from 1 to 65535)"
    if port == 0:
        return "port 0 (use a port from 1 to 65535)"
    return None


class ServerNotReady(ServerError):
    """The server did not become ready: it failed (``failure`` says how) or timed out.

    Attributes:
        failure: The classified failure: from the caller's ``failure_check`` (a log line, an
            exited process), or ``startup_timeout`` when the wait ran out.
    """

    def __init__(self, message: str, *, failure: Failure | None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.failure = failure


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, dict):
        vals = [n for v in x.values() if (n := _num(v)) is not None]
        return round(sum(vals), 6) if vals else None
    return None


def _int(x: Any) -> int | None:
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


class ServerInfo(BaseModel):
    """``/get_server_info`` normalised across versions (§5.2). Absent values are ``None``.

    Attributes:
        version: SGLang's ``version``.
        max_total_num_tokens: One rank's KV pool tokens (top level, else ``memory_usage.token_capacity``;
            a DCP server of 0.5.21+ reports the logical count, divided here by ``dcp_size``:
            :func:`~tuner.sglang.levers.rank_tokens`).
        dcp_size: ``--dcp-size`` (``None`` where the version has no DCP).
        effective_max_running_requests: ``internal_states[0].effective_max_running_requests_per_dp``
            (0.5.10+); ``None` on 0.5.5, read it from the scheduler log line there (§2.3).
        max_running_requests: The *input* server arg (``None`` = auto).
        chunked_prefill_size, max_prefill_tokens, page_size, context_length, max_req_input_len,
        mem_fraction_static, cuda_graph_max_bs, tp_size, dp_size, kv_cache_dtype,
        speculative_algorithm, enable_hierarchical_cache, hicache_ratio, hicache_size,
        disable_radix_cache, max_total_tokens: server args (0.5.23 names mapped to the canonical
        ones: ``cuda_graph_max_bs_decode`` → ``cuda_graph_max_bs``).
        weight_gib, kvcache_gib: ``memory_usage.weight`` / ``.kvcache`` of ``internal_states[0]``.
        graph_gib: ``memory_usage.graph``, summed over phases when it is a dict (0.5.23).
        startup_available_gib: ``memory_usage.startup_available`` (0.5.23).
        avg_spec_accept_length: ``internal_states[0].avg_spec_accept_length``: speculative
            decoding's mean tokens per verify step since start (present after the first logged
            decode window; ``Scheduler.get_internal_state``, 0.5.23 ``internal_state.py``).
        raw: The whole JSON.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str | None = None
    max_total_num_tokens: int | None = None
    effective_max_running_requests: int | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int | None = None
    page_size: int | None = None
    context_length: int | None = None
    max_req_input_len: int | None = None
    mem_fraction_static: float | None = None
    cuda_graph_max_bs: int | None = None
    tp_size: int | None = None
    dp_size: int | None = None
    dcp_size: int | None = None
    kv_cache_dtype: str | None = None
    speculative_algorithm: str | None = None
    enable_hierarchical_cache: bool | None = None
    hicache_ratio: float | None = None
    hicache_size: float | None = None
    disable_radix_cache: bool | None = None
    max_total_tokens: int | None = None
    model_path: str | None = None
    weight_gib: float | None = None
    kvcache_gib: float | None = None
    graph_gib: float | None = None
    startup_available_gib: float | None = None
    avg_spec_accept_length: float | None = None
    raw: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServerInfo:
        """Normalise a ``/get_server_info`` or ``/server_info`` body of any version (§5.2)."""
        states = data.get("internal_states") or [{}]
        state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
        mem = state["memory_usage"] if isinstance(state.get("memory_usage"), dict) else {}

        def arg(*names: str) -> Any:
            for name in names:
                for src in (data, state):
                    if src.get(name) is not None:
                        return src[name]
            return None

        version = str(data["version"]) if data.get("version") is not None else None
        dcp = _int(arg("dcp_size"))
        tokens = _int(data.get("max_total_num_tokens")) or _int(mem.get("token_capacity"))
        return cls(
            version=version,
            max_total_num_tokens=rank_tokens(tokens, dcp_size=dcp, version=version) if tokens else tokens,
            effective_max_running_requests=_int(state.get("effective_max_running_requests_per_dp")),
            max_running_requests=_int(arg("max_running_requests")),
            chunked_prefill_size=_int(arg("chunked_prefill_size")),
            max_prefill_tokens=_int(arg("max_prefill_tokens")),
            page_size=_int(arg("page_size")),
            context_length=_int(arg("context_length")),
            max_req_input_len=_int(arg("max_req_input_len")),
            mem_fraction_static=_num(arg("mem_fraction_static")),
            cuda_graph_max_bs=_int(arg("cuda_graph_max_bs", "cuda_graph_max_bs_decode")),
            tp_size=_int(arg("tp_size", "tensor_parallel_size")),
            dp_size=_int(arg("dp_size", "data_parallel_size")),
            dcp_size=dcp,
            kv_cache_dtype=arg("kv_cache_dtype"),
            speculative_algorithm=arg("speculative_algorithm"),
            enable_hierarchical_cache=arg("enable_hierarchical_cache"),
            hicache_ratio=_num(arg("hicache_ratio")),
            hicache_size=_num(arg("hicache_size")),
            disable_radix_cache=arg("disable_radix_cache"),
            max_total_tokens=_int(arg("max_total_tokens")),
            model_path=arg("model_path"),
            weight_gib=_num(mem.get("weight")),
            kvcache_gib=_num(mem.get("kvcache")),
            graph_gib=_num(mem.get("graph")),
            startup_available_gib=_num(mem.get("startup_available")),
            avg_spec_accept_length=_num(state.get("avg_spec_accept_length")),
            raw=data,
        )


class GreedyAnswer(BaseModel):
    """One greedy answer of SGLang's native ``/generate`` with ``return_logprob``.

    Attributes:
        token_ids: The output token ids.
        logprobs: The chosen tokens' logprobs (nats), one per output token: ``meta_info.
            output_token_logprobs``' ``[logprob, token_id, text]`` triples
            (``TokenizerManager.add_logprob_to_meta_info``, SGLang ``python/sglang/srt/managers/
            tokenizer_manager.py``).
        text: The output text.
    """

    model_config = ConfigDict(frozen=True)

    token_ids: list[int]
    logprobs: list[float]
    text: str = ""


_NO_LOGPROBS_HINT = ("the quality gate needs SGLang's native /generate with return_logprob (§5.3): point [service] url "
                     "at the SGLang server itself, not a proxy or an OpenAI-only endpoint, or set [quality] enabled = false "
                     "(then a candidate that changes numerics can never be applied)")


def greedy_answer(url: str, item: Any) -> GreedyAnswer:
    """One ``/generate`` result → :class:`GreedyAnswer`.

    Raises:
        QualityError: No ``meta_info.output_token_logprobs`` (naming the fix).
    """
    meta = item.get("meta_info") if isinstance(item, dict) else None
    triples = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(triples, list) or (not triples and (meta or {}).get("completion_tokens")):
        raise QualityError(f"the server at {url} returned no output_token_logprobs for /generate with return_logprob",
                           hint=_NO_LOGPROBS_HINT)
    try:
        logprobs = [float(t[0]) for t in triples]
        ids = [int(t[1]) for t in triples]
    except (TypeError, ValueError, IndexError) as err:
        raise QualityError(f"the server at {url} returned malformed output_token_logprobs ({err})",
                           hint=_NO_LOGPROBS_HINT) from err
    return GreedyAnswer(token_ids=ids, logprobs=logprobs, text=str(item.get("text") or ""))


class SGLangClient:
    """A client of one SGLang server's management endpoints.

    Args:
        url: Base URL, e.g. ``http://127.0.0.1:30000``.
        timeout_s: Timeout of each HTTP request.

    Raises:
        ServerError: ``url`` is not a usable server URL (:func:`url_problem`).
    """

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        problem = url_problem(url)
        if problem is not None:
            raise ServerError(f"server URL {url!r}: {problem}", hint="pass one like http://127.0.0.1:30000")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._session = requests.Session()
        self._answered: dict[tuple[str, ...], str] = {}  # _json's paths → the one that answered

    def close(self) -> None:
        """Close the HTTP session."""
        self._session.close()

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport --------------------------------------------------------------------------

    def _request(self, method: str, path: str, *, timeout_s: float | None = None, body: Any = None) -> requests.Response:
        try:
            return self._session.request(method, self.url + path, timeout=timeout_s or self.timeout_s, json=body)
        except requests.Timeout as err:
            raise ServerError(
                f"cannot reach the SGLang server at {self.url}: {path} timed out after {timeout_s or self.timeout_s:.0f} s",
                hint="check that the server is up and not overloaded, or raise the timeout",
            ) from err
        except requests.RequestException as err:
            reason = type(err).__name__
            if isinstance(err, requests.ConnectionError):
                reason = "connection refused or host unreachable"
            raise ServerError(
                f"cannot reach the SGLang server at {self.url}: {reason}",
                hint="check that it runs and listens there (systemctl status UNIT), or pass the right --url",
            ) from err

    def _json(self, *paths: str) -> dict[str, Any]:
        """GET the first path that exists (404 → try the next; the one that answered is asked
        first from then on) and decode its JSON."""
        resp = None
        known = self._answered.get(paths)
        for path in ([known] if known else []) + [p for p in paths if p != known]:
            resp = self._request("GET", path)
            if resp.status_code != 404:
                self._answered[paths] = path
                break
        assert resp is not None
        if resp.status_code != 200:
            raise ServerError(
                f"SGLang server at {self.url} answered {resp.status_code} on {resp.request.path_url}",
                hint="is this an SGLang server, and has it finished starting?",
            )
        try:
            data = resp.json()
        except ValueError as err:
            raise ServerError(f"SGLang server at {self.url} sent non-JSON on {resp.request.path_url}", hint="is this an SGLang server?") from err
        if not isinstance(data, dict):
            raise ServerError(f"SGLang server at {self.url} sent a JSON {type(data).__name__} on {resp.request.path_url}, not an object", hint="is this an SGLang server?")
        return data

    # -- endpoints --------------------------------------------------------------------------

    def health(self) -> bool:
        """``GET /health`` (§5.1): True on 200; False on 503 or while nothing listens yet.

        Unlike the other calls this does not raise when the server cannot be reached: during a
        start that is the normal state.
        """
        try:
            resp = self._session.get(self.url + "/health", timeout=self.timeout_s)
        except requests.RequestException:
            return False
        return resp.status_code == 200

    def greedy_answers(self, texts: list[str], *, max_new_tokens: int, timeout_s: float) -> list[GreedyAnswer]:
        """Greedy answers with the chosen tokens' logprobs: one batch ``POST /generate`` (§5.3) of
        ``{"text": [...], "sampling_params": {"temperature": 0, "max_new_tokens": N},
        "return_logprob": true}`` (``GenerateReqInput``, SGLang ``python/sglang/srt/managers/
        io_struct.py``; temperature 0 is greedy).

        Args:
            texts: The prompts.
            max_new_tokens: Output tokens per answer at most.
            timeout_s: Limit of the whole request, seconds.

        Returns:
            One answer per prompt, in order.

        Raises:
            QualityError: The server has no native ``/generate`` or returns no logprobs.
            ServerError: Unreachable, timed out, or an error status.
        """
        body = {"text": list(texts), "return_logprob": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": int(max_new_tokens)}}
        resp = self._request("POST", "/generate", timeout_s=timeout_s, body=body)
        if resp.status_code == 404:
            raise QualityError(f"the server at {self.url} has no /generate (404)", hint=_NO_LOGPROBS_HINT)
        if resp.status_code != 200:
            raise ServerError(f"SGLang server at {self.url} answered {resp.status_code} on /generate: {resp.text[:200]}",
                              hint="check the server log")
        try:
            data = resp.json()
        except ValueError as err:
            raise QualityError(f"the server at {self.url} sent non-JSON on /generate", hint=_NO_LOGPROBS_HINT) from err
        items = data if isinstance(data, list) else [data]
        if len(items) != len(texts):
            raise QualityError(f"the server at {self.url} answered {len(items)} of {len(texts)} prompts on /generate",
                               hint=_NO_LOGPROBS_HINT)
        return [greedy_answer(self.url, item) for item in items]

    def server_info(self) -> ServerInfo:
        """``GET /server_info`` (0.5.10+), falling back to ``/get_server_info`` (0.5.5; deprecated in
        0.5.23, which logs a warning per call of it; §5.2).

        Raises:
            ServerError: Unreachable, non-200, or not JSON.
        """
        return ServerInfo.from_json(self._json("/server_info", "/get_server_info"))

    def model_info(self) -> dict[str, Any]:
        """``GET /model_info`` (0.5.10+), falling back to ``/get_model_info`` (0.5.5; deprecated in
        0.5.23, which logs a warning per call of it; §5.1).

        Raises:
            ServerError: Unreachable, non-200, or not JSON.
        """
        return self._json("/model_info", "/get_model_info")

    def metrics(self) -> dict[str, float]:
        """Scrape ``/metrics`` (§5.5) with ``prometheus_client``'s parser.

        Returns:
            Sample name → value, summed over label sets (ranks). Histogram buckets and summary
            quantiles keep their bound in the key: ``name{le="0.5"}``, ``name{quantile="0.99"}``.

        Raises:
            ServerError: Unreachable, ``/metrics`` missing (launch with ``--enable-metrics``), or
                unparsable.
        """
        resp = self._request("GET", "/metrics")
        if resp.status_code == 404:
            raise ServerError(f"SGLang server at {self.url} has no /metrics", hint="launch it with --enable-metrics")
        if resp.status_code != 200:
            raise ServerError(f"SGLang server at {self.url} answered {resp.status_code} on /metrics", hint="check the server log")
        out: dict[str, float] = {}
        try:
            for family in text_string_to_metric_families(resp.text):
                for sample in family.samples:
                    key = sample.name
                    for bound in ("le", "quantile"):
                        if bound in sample.labels:
                            key = f'{sample.name}{{{bound}="{sample.labels[bound]}"}}'
                    out[key] = out.get(key, 0.0) + float(sample.value)
        except ValueError as err:
            raise ServerError(f"cannot parse /metrics of {self.url}: {err}", hint="is this an SGLang server with --enable-metrics?") from err
        return out

    def flush_cache(self) -> bool:
        """``POST /flush_cache`` (§5.4): True when flushed, False when refused (requests pending).

        Raises:
            ServerError: Unreachable or another status.
        """
        resp = self._request("POST", "/flush_cache")
        if resp.status_code == 200:
            return True
        if resp.status_code == 400:
            return False
        raise ServerError(f"SGLang server at {self.url} answered {resp.status_code} on /flush_cache", hint="check the server log")

    def wait_ready(
        self,
        timeout_s: float,
        *,
        failure_check: Callable[[], Failure | None] | None = None,
        poll_s: float = 0.5,
    ) -> ServerInfo:
        """Wait until ``/health`` answers 200, then return the server info.

        Fails fast: ``failure_check`` (e.g. a :class:`~tuner.sglang.logs.LogWatcher`'s failure, or
        an exited process) is called before every poll, and a failure it returns ends the wait
        at once instead of waiting out the timeout.

        Args:
            timeout_s: Longest wait (a large model loads for minutes; §4.2 item 10).
            failure_check: Returns a :class:`Failure` when the server is known to have failed.
            poll_s: Pause between polls.

        Returns:
            :meth:`server_info` of the ready server.

        Raises:
            ServerNotReady: The check reported a failure (``.failure`` is it), or ``timeout_s``
                passed (``.failure`` is a ``startup_timeout``).
            ServerError: Ready but ``/get_server_info`` failed.
        """
        deadline = time.monotonic() + timeout_s
        max_polls = int(timeout_s / max(poll_s, 0.01)) + 2
        for _ in range(max_polls):
            if failure_check is not None and (failure := failure_check()) is not None:
                raise ServerNotReady(
                    f"SGLang server at {self.url} failed while starting: {failure.failure_class.value}: {failure.evidence}",
                    failure=failure,
                    hint="see `tuner explain` on its log",
                )
            if self.health():
                return self.server_info()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(poll_s, remaining))
        failure = Failure(failure_class=FailureClass.STARTUP_TIMEOUT, evidence=f"/health not ready after {timeout_s:.0f} s")
        raise ServerNotReady(
            f"SGLang server at {self.url} not ready after {timeout_s:.0f} s",
            failure=failure,
            hint="raise the start timeout (large models load for minutes) or check the server log",
        )
