"""The service as a server under test: :class:`LaunchedServer` implements :class:`tuner.trial.ServerUnderTest`.

A launcher restarts the service with each candidate's command line and watches it
(:mod:`tuner.launch`); the HTTP load generator loads it (:mod:`tuner.load`); the GPU monitor reads
its memory (:mod:`tuner.gpu`); ``/get_server_info`` and ``/metrics`` come from SGLang's client
(:mod:`tuner.sglang.client`); the host's memory from :func:`tuner.launch.hostmem.read_host_memory`.
This is the one module at the trial's level that imports :mod:`tuner.launch`; the composition root
(:mod:`tuner.entrypoints`) builds it and hands it to :class:`tuner.trial.TrialExecutor`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from tuner.config import TunerConfig
from tuner.errors import HookError, LaunchError, LoadError, ServerError, ServiceControlError, TunerError
from tuner.gpu import GPUMonitor, GPUWindow
from tuner.launch.base import Launcher, LaunchPhase
from tuner.launch.hooks import run_hook
from tuner.launch.hostmem import read_host_memory
from tuner.load import LiveStats, run_load_sync
from tuner.sglang.client import GreedyAnswer, ServerInfo, SGLangClient
from tuner.sglang.failures import Failure, FailureClass
from tuner.sglang.hicache import HostMemory
from tuner.sglang.logs import LogWatcher, parse_log
from tuner.study.budget import prior_trial_cost_s
from tuner.study.job import PhaseProgress
from tuner.trial import LoadOutcome, LoadPlan, StartOutcome, host_pools

__all__ = ["LaunchedServer"]

_log = logging.getLogger(__name__)


class LaunchedServer:
    """The service behind its launcher, loaded over HTTP (implements :class:`tuner.trial.ServerUnderTest`).

    Args:
        config: The validated config (``[service]``: the URL, launcher kind, unit or command).
        launcher: The service's launcher, inside its :meth:`~tuner.launch.base.Launcher.session`.
        gpu: The GPU monitor, or ``None`` (then no GPU memory is read: no activation peak).
        environment: The environment facts (:func:`tuner.entrypoints.resolve_environment`).

    Raises:
        LaunchError: The service's current command line cannot be read.

    .. note:: :meth:`start` restarts the production service; call it inside the launcher's session.
    """

    def __init__(self, config: TunerConfig, launcher: Launcher, *, gpu: GPUMonitor | None = None,
                 environment: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self.launcher = launcher
        self.gpu = gpu
        self.url = config.service.url
        self._environment = dict(environment or {})
        self._baseline_argv = list(launcher.current_argv())
        self._pinned_now_bytes = 0  # host pools of the server the tuner started last (freed at its restart)

    # ---- the study's facts ---------------------------------------------------------------------------

    def environment(self) -> dict[str, Any]:
        """``sglang_version``, ``gpu_name``, ``gpu_count``, ``driver_version``, ``model``, ``gpu_total_mib``."""
        return dict(self._environment)

    def target(self) -> dict[str, Any]:
        """``launcher``, ``unit`` or ``command``, ``url``."""
        service = self.config.service
        out: dict[str, Any] = {"launcher": service.launcher, "url": service.url}
        if service.launcher == "systemd":
            out["unit"] = service.unit
        else:
            out["command"] = list(service.command or [])
        return out

    def baseline_argv(self) -> list[str]:
        """The command the service ran before the study (read once, when this was built)."""
        return list(self._baseline_argv)

    def prior_cost_s(self) -> float:
        """A first trial's expected cost, seconds (:func:`tuner.study.budget.prior_trial_cost_s`)."""
        return prior_trial_cost_s(self.config)

    def host_memory(self) -> HostMemory:
        """The host's memory before a launch (:func:`tuner.launch.hostmem.read_host_memory`): the
        simulator's ``/sim/host_memory`` or ``/proc/meminfo``, the unit's ``MemoryMax``, and the
        host pools the server the tuner started last pins (its restart frees them)."""
        return read_host_memory(self._baseline_argv, url=self.url, unit=getattr(self.launcher, "unit", None),
                                pinned_now_bytes=self._pinned_now_bytes)

    # ---- one trial ------------------------------------------------------------------------------------

    def start(self, argv: list[str], *, timeout_s: float,
              on_progress: Callable[[PhaseProgress], None]) -> StartOutcome:
        """Restart the service with ``argv`` and wait until it is ready or failed.

        A start that could not be issued (or whose wait broke) is a crash without log lines; a
        server that did not become ready is the launcher's classification, else its log's failure
        line, else a crash naming the phase it ended in.

        Args:
            argv: The full server command line.
            timeout_s: How long to wait for the ready line, seconds.
            on_progress: Called with each new SGLang startup line (from a reader thread).

        Raises:
            ServiceControlError: The host refused the change (a read-only drop-in folder);
                nothing was stopped.
            HookError: A ``[service]`` hook failed. ``pre_restart``: the service is not
                restarted, neither for this trial nor by the session's final restore
                (:meth:`~tuner.launch.base.GuardedLauncher.hold`; the message says what it runs
                and what to do). ``post_ready``: the server is up on ``argv`` but was not returned;
                the run stops and the session restores it.
        """
        self._pinned_now_bytes = 0
        try:
            self.hook("pre_restart", "trial")
        except HookError as err:
            raise HookError(f"{err.message}; {self.launcher.hold()}", hook=err.hook, hint=err.hint) from None
        try:
            self.launcher.start(argv)
            with _StartupLines(self.launcher, on_progress):
                state = self.launcher.wait(timeout_s=timeout_s)
        except ServiceControlError:
            raise  # the host refused the change (read-only drop-in folder): not a server crash
        except (LaunchError, ServerError) as err:
            return StartOutcome(failure=Failure(failure_class=FailureClass.CRASH, evidence=str(err)))
        lines = self.launcher.logs()
        report = parse_log(lines)
        if state.phase != LaunchPhase.READY:
            return StartOutcome(failure=state.failure or report.failure or Failure(
                failure_class=FailureClass.CRASH, evidence=f"server {state.phase.value} before ready"
            ), log_lines=lines)
        pools = host_pools(report, argv)
        if pools is not None:
            self._pinned_now_bytes = int(pools[0] * 1e9 * pools[1])
        try:
            self.hook("post_ready", "trial")
        except HookError as err:
            raise HookError(f"{err.message} once the trial's server was ready; the run stops and the service "
                            "is restored", hook=err.hook, hint=err.hint) from None
        return StartOutcome(failure=None, log_lines=lines)

    def hook(self, name: str, reason: str) -> None:
        """Run ``[service]`` hook ``name`` (``pre_restart``/``post_ready``) if the config names one
        (:func:`tuner.launch.hooks.run_hook`; ``reason``: ``trial`` or ``restore``).

        Raises:
            HookError: The hook failed (what that does to the service is the caller's rule).
        """
        command = getattr(self.config.service, name)
        if command:
            run_hook(name, command, timeout_s=self.config.service.hook_timeout_s,
                     context={"SGLANG_TUNER_URL": self.url, "SGLANG_TUNER_REASON": reason})

    def info(self) -> ServerInfo:
        """``/get_server_info``, normalised.

        Raises:
            ServerError: The server did not answer (10 s).
        """
        return SGLangClient(self.url, timeout_s=10.0).server_info()

    def logs(self) -> list[str]:
        """Every server log line since the last :meth:`start`."""
        return self.launcher.logs()

    def gpu_used_mib(self) -> float:
        """GPU memory in use now on the most loaded GPU, MiB; 0.0 without a monitor or a reading."""
        if self.gpu is None:
            return 0.0
        try:
            return max((g.used_mib for g in self.gpu.snapshot()), default=0.0)
        except TunerError:
            return 0.0

    def metrics(self) -> dict[str, float] | None:
        """A ``/metrics`` scrape (§5.5), or ``None`` without ``--enable-metrics`` or an answer (5 s)."""
        try:
            return SGLangClient(self.url, timeout_s=5.0).metrics()
        except ServerError:
            return None

    def generate(self, texts: list[str], max_new_tokens: int, timeout_s: float) -> list[GreedyAnswer]:
        """Greedy answers with logprobs from the server (:meth:`SGLangClient.greedy_answers`).

        Raises:
            QualityError: The server returns no logprobs.
            ServerError: It did not answer in ``timeout_s`` seconds.
        """
        with SGLangClient(self.url, timeout_s=timeout_s) as client:
            return client.greedy_answers(texts, max_new_tokens=max_new_tokens, timeout_s=timeout_s)

    def load(self, plan: LoadPlan, on_tick: Callable[[LiveStats], bool | None] | None) -> LoadOutcome:
        """Run ``plan`` with the HTTP load generator (:func:`tuner.load.run_load_sync`) while the GPU
        monitor samples; then ask the launcher whether the server survived it.

        Returns:
            The outcome; a :class:`~tuner.errors.LoadError` becomes its ``load_error``.
        """
        result, error = None, None
        with self._window() as window:
            try:
                result = run_load_sync(
                    self.url, plan.workload, concurrency=plan.concurrency, rate=plan.rate, warmup_s=plan.warmup_s,
                    duration_s=plan.duration_s, max_requests=plan.max_requests, slo=plan.slo, on_tick=on_tick,
                    timeout_s=plan.timeout_s, request_timeout_s=plan.request_timeout_s, seed=plan.seed,
                    ramp_s=plan.ramp_s, cooldown_s=plan.cooldown_s,
                )
            except LoadError as err:
                error = str(err)
            peak_mib = _window_peak_mib(window)
        return LoadOutcome(result=result, failure=self._runtime_failure(), load_error=error, peak_gpu_used_mib=peak_mib)

    # ---- pieces ---------------------------------------------------------------------------------------

    def _runtime_failure(self) -> Failure | None:
        """The server's death under load, classified (the launcher's, else the log's, else a crash)."""
        state = self.launcher.state()
        if state.phase in (LaunchPhase.FAILED, LaunchPhase.EXITED):
            failure = state.failure or parse_log(self.launcher.logs()).failure
            return failure or Failure(failure_class=FailureClass.CRASH, evidence=f"server {state.phase.value} under load")
        return None

    def _window(self) -> contextlib.AbstractContextManager[GPUWindow | None]:
        if self.gpu is None:
            return contextlib.nullcontext(None)
        return self.gpu.window()


def _window_peak_mib(window: GPUWindow | None) -> float:
    """The highest GPU memory in use in a sampling window, MiB (0.0 without one)."""
    if window is None:
        return 0.0
    return max((p.peak_used_mib for p in window.peaks), default=0.0)


class _StartupLines:
    """While a server starts, report each new SGLang line of its log (a reader thread on
    :meth:`Launcher.logs`, which the launcher's own wait keeps filling): the startup's progress
    is the last phase line (``Load weight end``, ``KV Cache is allocated``, ``Capture cuda graph``).

    Args:
        launcher: The launcher whose :meth:`~Launcher.wait` runs meanwhile.
        report: Called with a :class:`PhaseProgress` per new SGLang line (from the reader thread).
        poll_s: How often the log is read, seconds.
    """

    def __init__(self, launcher: Launcher, report: Callable[[PhaseProgress], None], poll_s: float = 0.25) -> None:
        self._launcher, self._report, self._poll_s = launcher, report, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tuner-startup-lines", daemon=True)
        self._begun = time.monotonic()

    def __enter__(self) -> _StartupLines:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _watch(self) -> None:
        watcher, seen, last = LogWatcher(), 0, None
        while not self._stop.wait(self._poll_s):
            lines = self._launcher.logs()
            watcher.feed_many(lines[seen:])
            seen = len(lines)
            if watcher.last_line and watcher.last_line != last:
                last = watcher.last_line
                try:
                    self._report(PhaseProgress(line=last[:200], stage=watcher.phase,
                                               elapsed_s=round(time.monotonic() - self._begun, 1)))
                except Exception as err:  # noqa: BLE001 - a progress display must never end a trial
                    _log.debug("startup progress not shown: %s", err)
