"""The simulator's offline evaluation behind :class:`tuner.trial.ServerUnderTest` (virtual time).

Used by the fast study tests, the decision trace and the search-quality, many-hosts and HiCache
benchmarks: :class:`OfflineExecutor` is the product's own :class:`tuner.trial.TrialExecutor` on an
:class:`OfflineServer`, so every phase of a trial (render, start, probe, measure, stress, record)
is the product's code. Only the server differs: a start sizes a simulated server from the
rendered command line (:func:`tuner.sim.evaluate.size_server`'s startup log), and a load runs the
engine on a virtual clock (:func:`tuner.sim.evaluate.evaluate`), so a trial costs a fraction of a
second instead of minutes.

How the offline server stands in for the real one:

- ``/get_server_info`` answers nothing (every resolved value comes from the startup log, as a
  real trial reads it when the server lacks one); ``/metrics`` holds the engine's counters when
  the command has ``--enable-metrics``; the GPU monitor reads the simulated GPU (``--sim-gpu``):
  the memory in use after startup, and under load that plus the largest step's activations.
- The measured window is a closed loop over a pool of the workload's requests (as many as the
  streams send in a window: ``max(64, 6 × concurrency)``, or ``pool_requests``), cut at
  ``warmup_s + duration_s`` of virtual time; its metrics include the warm-up. Each start draws a
  speed factor ``1 + u``, ``u`` uniform in ``[-noise, noise]`` (seeded by the study's seed), by
  which the window's throughput is multiplied and its latencies divided.
- The stress load (a capacity probe) runs until every request finished, as the load generator
  waits for every measured request. No per-request records: :func:`tuner.trial.measure_gap` then
  bounds the E2E latency from below by the window.
- A server that died under load is classified by the product's log parser; the log keeps the
  startup lines, every retraction line and each load's last lines.
- Time is virtual: each start advances :meth:`OfflineServer.now_s` by ``launch_s`` (1 s), so a
  launched trial's ``duration_s`` is 1.0.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from array import array
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from tuner.config import TunerConfig
from tuner.errors import ServerError
from tuner.launch.hostmem import read_host_memory
from tuner.load import SLO, LiveStats, LoadResult, Workload, build_workload
from tuner.load.metrics import LoadSummary, itl_exceedance, itl_exceedance_low, slo_violations
from tuner.records import TrialRecord
from tuner.sglang.client import GreedyAnswer, ServerInfo, greedy_answer
from tuner.sglang.failures import Failure, FailureClass
from tuner.sglang.flags import FlagTable, flag_value, parse_argv
from tuner.sglang.hicache import HostMemory
from tuner.sglang.logs import parse_log
from tuner.sim.answers import NumericsFault, answer
from tuner.sim.args import parse_args as parse_sim_args
from tuner.sim.engine import SimRequest
from tuner.sim.evaluate import EvalResult, evaluate
from tuner.sim.gpus import get_gpu
from tuner.sim.models import load_model
from tuner.sim.server import _WORDS, tokenize
from tuner.study.job import PhaseProgress, TrialJob
from tuner.trial import LoadOutcome, LoadPlan, StartOutcome, TrialExecutor

__all__ = ["OfflineServer", "OfflineExecutor"]

_MEMO: dict[tuple, EvalResult] = {}
"""Offline evaluations by (argv, requests, concurrency, duration): the simulated world is
deterministic, so a config measured once (by the grid, another seed, another strategy) is not
simulated again."""
_LAST_LINES = 5
"""Engine log lines a load keeps at its end (a crash's lines), besides every retraction line."""
_COUNTERS = ("prompt_tokens_total", "cached_tokens_total", "load_back_tokens_total")
"""The engine counters ``/metrics`` exports that the trial reads (hit rates by tier)."""


def _evaluate(argv: list[str], requests: Callable[[], Iterable[SimRequest]], key: str, *, startup_lines: int = 0,
              **kwargs: Any) -> EvalResult:
    """:func:`evaluate`, memoized; ``requests`` is built only when the result is not known yet. A
    load keeps, of its engine lines (after the ``startup_lines`` of the start), every retraction
    line and the last :data:`_LAST_LINES`."""
    memo_key = (tuple(argv), key, tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                                              for k, v in kwargs.items())))
    if memo_key not in _MEMO:
        result = evaluate(argv, requests(), **kwargs)
        if key != "probe":
            engine = result.log_lines[startup_lines:]
            kept = [line for line in engine[:-_LAST_LINES] if "Retract requests" in line] + engine[-_LAST_LINES:]
            result = dataclasses.replace(result, log_lines=kept)
        _MEMO[memo_key] = result
    return _MEMO[memo_key]


def _noisy(result: EvalResult, factor: float) -> EvalResult:
    """``result`` on a run ``factor`` times as fast (throughput × factor, latencies ÷ factor)."""
    if factor == 1.0:
        return result
    scale = lambda v: None if v is None else v / factor  # noqa: E731
    return dataclasses.replace(
        result, output_throughput=result.output_throughput * factor,
        request_throughput=result.request_throughput * factor,
        p99_ttft_ms=scale(result.p99_ttft_ms), p99_itl_ms=scale(result.p99_itl_ms),
        itls_ms=array("f", (v / factor for v in result.itls_ms)),
        mean_ttft_ms=scale(result.mean_ttft_ms), p50_ttft_ms=scale(result.p50_ttft_ms),
        p99_tpot_ms=scale(result.p99_tpot_ms), mean_e2e_latency_ms=scale(result.mean_e2e_latency_ms),
    )


def _sim_requests(workload: Workload, limit: int, after: dict[str, str] | None = None) -> list[SimRequest]:
    out = []
    for i, req in enumerate(workload.passes()):
        if i >= limit:
            break
        out.append(SimRequest(rid=req.rid, input_ids=list(req.input_ids), max_new_tokens=req.max_new_tokens,
                              prompt_class=req.prompt_class))
        if after is not None and req.after is not None:
            after[req.rid] = req.after  # turn k waits for turn k-1, as the load generator does
    return out


def _summary(result: EvalResult, slo: SLO | None) -> LoadSummary:
    """The simulator's window as the load generator's summary (the metrics it has; SLO by the
    product's :func:`tuner.load.metrics.slo_violations` and :func:`~tuner.load.metrics.itl_exceedance`; the hit rate as ``/generate`` reports
    ``cached_tokens``)."""
    duration = max(result.duration_s, 1e-9)
    fields: dict[str, Any] = {
        "mean_ttft_ms": result.mean_ttft_ms, "median_ttft_ms": result.p50_ttft_ms, "p99_ttft_ms": result.p99_ttft_ms,
        "p99_itl_ms": result.p99_itl_ms, "p99_tpot_ms": result.p99_tpot_ms,
        "mean_e2e_latency_ms": result.mean_e2e_latency_ms,
    }
    errored = result.rejected + (1 if result.error else 0)
    done = result.completed
    concurrency = (result.mean_e2e_latency_ms or 0.0) / 1000 * done / duration
    return LoadSummary(
        duration=result.duration_s, completed=done, errored=errored, incomplete=0, total_input_tokens=0,
        total_output_tokens=result.total_output_tokens, request_throughput=result.request_throughput,
        input_throughput=0.0, output_throughput=result.output_throughput,
        total_throughput=result.output_throughput,
        concurrency=concurrency,
        error_rate=errored / (done + errored) if done or errored else 0.0,
        cache_hit_rate=result.cache_hit_rate if done else None,
        accept_length=(result.counters["spec_accepted_total"] / result.counters["spec_forward_total"]
                       if result.counters.get("spec_forward_total") else None),
        slo_violations=slo_violations(slo, fields) if slo is not None else {},
        **_exceedance(slo, np.asarray(result.itls_ms), concurrency), **fields,
    )


def _exceedance(slo: SLO | None, itls_ms: np.ndarray, concurrency: float) -> dict[str, float | None]:
    """The window's ITL exceedance and its lower bound (the product's functions)."""
    if slo is None:
        return {}
    return {"itl_exceedance": itl_exceedance(slo, itls_ms),
            "itl_exceedance_low": itl_exceedance_low(slo, itls_ms, concurrency)}


class OfflineServer:
    """The simulator's offline evaluation as a :class:`tuner.trial.ServerUnderTest`.

    Args:
        config: The scenario's config (``[service] command`` is ``python -m tuner.sim ...``).
        world_seed: Seed of the simulated world (the workload's draw); default the study's seed.
        noise: Relative run-to-run spread of the measured speed (see the module docstring).
        pool_requests: Requests of the measured window's pool (default ``max(64, 6 × concurrency)``).
        launch_s: Virtual seconds one start takes (a launched trial's ``duration_s``).
    """

    def __init__(self, config: TunerConfig, *, world_seed: int | None = None, noise: float = 0.0,
                 pool_requests: int | None = None, launch_s: float = 1.0) -> None:
        command = list(config.service.command or [])
        self.sim_argv = command[command.index("tuner.sim") + 1:] if "tuner.sim" in command else command
        self.table = FlagTable.for_version(flag_value(self.sim_argv, "--sim-version") or "0.5.5")
        self.world_seed = config.study.seed if world_seed is None else world_seed
        self.workload = build_workload(config.workload, seed=self.world_seed)
        self.noise = noise
        self.pool_requests = pool_requests
        self.launch_s = launch_s
        gpu = flag_value(self.sim_argv, "--sim-gpu")
        self._gpu_total_mib = float(get_gpu(gpu).memory_mib) if gpu else 0.0
        self._rng = random.Random(config.study.seed * 7919 + 17)
        self._pools: dict[tuple[str, int], list[SimRequest]] = {}
        self._after: dict[str, str] = {}
        self._now_s = 0.0
        self._argv: list[str] = []
        self._startup: EvalResult | None = None  # the running server's start (None: none runs)
        self._lines: list[str] = []
        self._factor = 1.0
        self._counters: dict[str, float] | None = None

    def now_s(self) -> float:
        """The virtual clock, seconds (advanced by ``launch_s`` at each start)."""
        return self._now_s

    # ---- the study's facts ---------------------------------------------------------------------------

    def environment(self) -> dict[str, Any]:
        """The simulated GPU (``--sim-gpu``), SGLang version and model of the command line."""
        return {"sglang_version": self.table.version, "gpu_name": flag_value(self.sim_argv, "--sim-gpu") or "H100-80GB",
                "driver_version": "simulated", "model": parse_argv(self.sim_argv, self.table).get("model_path")}

    def target(self) -> dict[str, Any]:
        """``launcher`` ``offline`` and the simulator's command."""
        return {"launcher": "offline", "command": self.sim_argv}

    def baseline_argv(self) -> list[str]:
        """The scenario's simulator command (its SGLang flags and ``--sim-*``)."""
        return list(self.sim_argv)

    def prior_cost_s(self) -> float:
        """One launch: :attr:`launch_s` virtual seconds."""
        return self.launch_s

    def host_memory(self) -> HostMemory:
        """The simulated host, read by the product from the command line (nothing runs offline)."""
        return read_host_memory(["-m", "tuner.sim", *self.sim_argv])

    # ---- one trial ------------------------------------------------------------------------------------

    def start(self, argv: list[str], *, timeout_s: float,
              on_progress: Callable[[PhaseProgress], None]) -> StartOutcome:
        """Size a simulated server from ``argv``; ready, or its startup failure from its log."""
        self._now_s += self.launch_s
        probe = _evaluate(argv, lambda: [], "probe", concurrency=1, duration_s=0.0)
        self._factor = 1.0 + self._rng.uniform(-self.noise, self.noise) if self.noise else 1.0
        self._argv, self._lines = list(argv), list(probe.log_lines)
        if not probe.started:
            self._startup, self._counters = None, None
            return StartOutcome(failure=parse_log(self._lines).failure or Failure(
                failure_class=FailureClass.CRASH, evidence=probe.startup_failure or "startup failed"),
                log_lines=list(self._lines))
        self._startup = probe
        self._counters = dict.fromkeys(_COUNTERS, 0.0) if "--enable-metrics" in argv else None
        return StartOutcome(failure=None, log_lines=list(self._lines))

    def info(self) -> ServerInfo:
        """An empty answer: every value is read from the startup log."""
        return ServerInfo.from_json({})

    def generate(self, texts: list[str], max_new_tokens: int, timeout_s: float) -> list[GreedyAnswer]:
        """The simulated model's greedy answers under the running command's numerics (and its
        ``--sim-numerics-fault``), as the simulator's ``/generate`` with ``return_logprob`` gives them.

        Raises:
            ServerError: No server runs.
            QualityError: ``--sim-no-logprobs`` (the product's client reads the body).
        """
        if self._startup is None:
            raise ServerError("the server is not running")
        parsed = parse_sim_args(self._argv)
        fault = NumericsFault(parsed.sim.numerics_fault) if parsed.sim.numerics_fault else None
        vocab = load_model(str(parsed.server["model_path"])).vocab_size
        out = []
        for text in texts:
            got = answer(text, tokenize(text, vocab), max_new_tokens, parsed.server, vocab_size=vocab, words=_WORDS,
                         fault=fault)
            meta: dict[str, Any] = {"completion_tokens": len(got.token_ids)}
            if not parsed.sim.no_logprobs:  # --sim-no-logprobs: as a proxy in front of SGLang answers
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
            out.append(greedy_answer("offline", {"text": got.text, "output_ids": got.token_ids, "meta_info": meta}))
        return out

    def logs(self) -> list[str]:
        """The startup lines, then each load's retraction lines and last lines."""
        return list(self._lines)

    def gpu_used_mib(self) -> float:
        """The simulated GPU's memory in use after startup (its size − the free memory after graphs), MiB."""
        if self._startup is None or not self._gpu_total_mib:
            return 0.0
        return self._gpu_total_mib - self._startup.free_gib_after_graphs * 1024

    def metrics(self) -> dict[str, float] | None:
        """The engine's counters since the start (``--enable-metrics``), ``None`` without or once dead."""
        if self._startup is None or self._counters is None:
            return None
        return {f"sglang:{name}": value for name, value in self._counters.items()}

    def load(self, plan: LoadPlan, on_tick: Callable[[LiveStats], bool | None] | None) -> LoadOutcome:
        """Run ``plan`` on the engine, on virtual time (``on_tick`` is never called)."""
        if self._startup is None:
            return LoadOutcome(result=None, load_error="the server is not running")
        startup_lines = len(self._startup.log_lines)
        result = (self._stress(plan, startup_lines) if plan.name == "stress" else
                  self._steady(plan, startup_lines) if plan.name == "steady" else self._window(plan, startup_lines))
        self._lines.extend(result.log_lines)
        if self._counters is not None:
            for name in _COUNTERS:
                self._counters[name] += result.counters.get(name, 0)
        after_start_mib = self.gpu_used_mib()
        peak_mib = after_start_mib + result.peak_activation_gib * 1024 if after_start_mib else 0.0
        failure = self._died(result)
        if failure is not None:
            self._startup = None
        return LoadOutcome(result=LoadResult(
            summary=_summary(result, plan.slo), workload=plan.workload.describe(),
            settings={"concurrency": plan.concurrency, "offline": True}, partial=failure is not None,
            stop_reason=f"server died mid-run: {failure.evidence}" if failure is not None else None,
        ), failure=failure, peak_gpu_used_mib=peak_mib)

    def _window(self, plan: LoadPlan, startup_lines: int) -> EvalResult:
        """The measured window: the pool's requests in a closed loop, cut at ``warmup_s + duration_s``."""
        pool = self._pool(plan)
        key = f"{plan.workload.describe()}|{len(pool)}"
        return _noisy(_evaluate(self._argv, lambda: pool, key, startup_lines=startup_lines,
                                concurrency=plan.concurrency, duration_s=plan.warmup_s + plan.duration_s,
                                after=self._after), self._factor)

    def _steady(self, plan: LoadPlan, startup_lines: int) -> EvalResult:
        """A steady window of sessions: the closed loop started over the plan's ramp, its warm-up
        excluded, cut at ``warmup_s + duration_s``. Its requests are drawn per call (a window's
        prompts are its own, and longest prompts would fill memory if every window's were kept).
        As the load generator's window, it holds at least ``concurrency`` sends and its requests
        run to their end, the streams sending on meanwhile (``plan.cooldown_s``)."""
        n = self.pool_requests or max(64, 6 * plan.concurrency)
        after: dict[str, str] = {}
        key = f"steady|{plan.workload.describe()}|{n}"

        def pool() -> Iterable[SimRequest]:
            if plan.workload.has_dependencies:  # turns wait for turns: the whole pool, with their order
                return _sim_requests(plan.workload, n, after)
            return (SimRequest(rid=r.rid, input_ids=r.input_ids, max_new_tokens=r.max_new_tokens,
                               prompt_class=r.prompt_class)
                    for r in itertools.islice(plan.workload.passes(), n))  # drawn as the window sends them

        return _noisy(_evaluate(self._argv, pool, key,
                                startup_lines=startup_lines, concurrency=plan.concurrency,
                                send_until_s=plan.warmup_s + plan.duration_s, min_measured=plan.concurrency,
                                after=after, ramp_s=plan.ramp_s, measure_from_s=plan.warmup_s,
                                steady=plan.cooldown_s > 0), self._factor)

    def _stress(self, plan: LoadPlan, startup_lines: int) -> EvalResult:
        """The stress load, every request to its end. The trial's stress workload is a capacity
        probe: its requests all have the context's length and random token ids that share no
        prefix, so the outcome does not depend on the seed: one evaluation per (size, context)."""
        n = plan.workload.num_requests or plan.concurrency
        key = f"stress|{n}|{plan.workload.context_tokens}"
        return _evaluate(self._argv, lambda: _sim_requests(plan.workload, n), key,
                         startup_lines=startup_lines, concurrency=plan.concurrency)

    def _pool(self, plan: LoadPlan) -> list[SimRequest]:
        """The measured window's requests: as many as a closed loop of ``concurrency`` streams
        sends in a window (the real load generator's stream is endless), ``max_requests`` at most."""
        n = self.pool_requests or max(64, 6 * plan.concurrency)
        if plan.max_requests:
            n = min(n, plan.max_requests)
        key = (plan.workload.describe(), n)
        if key not in self._pools:
            self._pools[key] = _sim_requests(plan.workload, n, self._after)
        return self._pools[key]

    def _died(self, result: EvalResult) -> Failure | None:
        """The server's death under load, classified by the product's log parser."""
        if not (result.runtime_oom or result.error):
            return None
        return parse_log(self._lines).failure or Failure(
            failure_class=FailureClass.RUNTIME_OOM if result.runtime_oom else FailureClass.CRASH,
            evidence=result.error or "runtime OOM under load")


class OfflineExecutor(TrialExecutor):
    """The product's :class:`~tuner.trial.TrialExecutor` on an :class:`OfflineServer`, keeping
    what it ran for the benchmarks and tests.

    Args:
        config: The scenario's config.
        world_seed, noise, pool_requests: See :class:`OfflineServer`.

    Attributes:
        offline: The server.
        history: ``(trial number, record)`` of every trial run, in order.
        launches: Trials run (every call of :meth:`run`).
        failures: Trials whose outcome is ``failed``.
    """

    def __init__(self, config: TunerConfig, *, world_seed: int | None = None, noise: float = 0.0,
                 pool_requests: int | None = None) -> None:
        server = OfflineServer(config, world_seed=world_seed, noise=noise, pool_requests=pool_requests)
        super().__init__(config, server, server.table, workload=server.workload, clock=server.now_s)
        self.offline = server
        self.history: list[tuple[int, TrialRecord]] = []
        self.launches = 0
        self.failures = 0

    def run(self, job: TrialJob, on_phase: Callable[..., None]) -> TrialRecord:
        """:meth:`TrialExecutor.run`, kept in :attr:`history`."""
        self.launches += 1
        record = super().run(job, on_phase)
        self.failures += record.outcome == "failed"
        self.history.append((job.number, record))
        return record
