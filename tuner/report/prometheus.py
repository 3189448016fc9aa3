"""A run's progress as Prometheus metrics, in a textfile for node_exporter's textfile collector.

``tuner run --prometheus-textfile /var/lib/node_exporter/textfile/sglang-tuner.prom`` rewrites
the file (atomically, :func:`prometheus_client.write_to_textfile`) at every step of the run, so
the operator's Prometheus and Grafana see that the tuner is restarting the production service,
how far it has come and what it found (``configs/grafana-sglang-tuner.json`` is a dashboard for
these series). The metrics come from the run's :class:`tuner.study.progress.Progress` events:

- ``sglang_tuner_info{study, host, storage}`` 1 (the storage URL with its password masked);
- ``sglang_tuner_restarts_total`` and ``sglang_tuner_last_restart_timestamp_seconds``: each
  launch restarts the service;
- ``sglang_tuner_trials_total{result}``: ``feasible``, ``infeasible``, ``failed``, ``skipped``;
- ``sglang_tuner_trial_in_flight`` (the Optuna trial number, -1 between trials) and
  ``sglang_tuner_phase{phase}`` (1 for the phase in flight);
- ``sglang_tuner_best_context_capacity`` (requests), ``sglang_tuner_best_output_throughput_tok_s``
  and ``sglang_tuner_best_trial``: the best feasible trial of this run so far (highest context
  capacity of the objective's kind, ``basis``: the SLO-safe one where the study ranks by it, then
  throughput; the study's own choice, with its policy's tolerance band, is ``tuner best``), and
  ``sglang_tuner_best_slo_context_capacity``: that trial's SLO-safe context capacity (requests in
  flight at which the SLO's p99 still holds; -1 when not measured);
- ``sglang_tuner_launches_expected`` and ``sglang_tuner_budget_remaining_seconds``;
- ``sglang_tuner_running`` 1 while the run works, 0 once it stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, write_to_textfile

from tuner.errors import ConfigError

__all__ = ["PrometheusTextfile"]

_log = logging.getLogger(__name__)
_PHASES = ("render", "start", "probe", "measure", "stress", "record")
_MIN_INTERVAL_S = 1.0  # a phase's progress ticks rewrite the file at most this often


class PrometheusTextfile:
    """A progress listener that keeps ``path`` a Prometheus text exposition of the run.

    Args:
        path: The ``.prom`` file (its folder must exist and be writable).
        study: The study's name (``sglang_tuner_info``).
        host: This host's name.
        storage: The storage URL, already masked for display.
        basis: Which context capacity ranks this run's best so far: ``oom_safe`` or ``slo_safe``
            (:func:`tuner.study.best.capacity_basis`; a trial without an SLO-safe count falls
            back to its OOM-safe one).

    Raises:
        ConfigError: ``path`` cannot be written (checked once, before the run starts).
    """

    def __init__(self, path: Path, *, study: str, host: str, storage: str, basis: str = "oom_safe") -> None:
        self.path = Path(path)
        self.basis = basis
        self._lock = threading.Lock()
        self._written = 0.0
        self.registry = CollectorRegistry()
        reg = self.registry
        Gauge("sglang_tuner_info", "The tuning run (study, host, storage; the password masked).",
              ["study", "host", "storage"], registry=reg).labels(study, host, storage).set(1)
        self.restarts = Counter("sglang_tuner_restarts", "Service restarts made by the tuner (one per launch).",
                                registry=reg)
        self.last_restart = Gauge("sglang_tuner_last_restart_timestamp_seconds",
                                  "When the tuner last restarted the service (Unix time).", registry=reg)
        self.trials = Counter("sglang_tuner_trials", "Trials this run ended, by result.", ["result"], registry=reg)
        for result in ("feasible", "infeasible", "failed", "skipped"):
            self.trials.labels(result)
        self.in_flight = Gauge("sglang_tuner_trial_in_flight", "The trial under test (-1: none).", registry=reg)
        self.phase = Gauge("sglang_tuner_phase", "1 for the phase of the trial in flight.", ["phase"], registry=reg)
        self.best_capacity = Gauge("sglang_tuner_best_context_capacity",
                                   "Context capacity (requests) of this run's best feasible trial so far.",
                                   registry=reg)
        self.best_slo_capacity = Gauge("sglang_tuner_best_slo_context_capacity",
                                       "SLO-safe context capacity (sessions) of that trial (-1: not measured).",
                                       registry=reg)
        self.best_slo_capacity.set(-1)
        self.best_tput = Gauge("sglang_tuner_best_output_throughput_tok_s",
                               "Output throughput (tokens/s) of this run's best feasible trial so far.", registry=reg)
        self.best_trial = Gauge("sglang_tuner_best_trial", "Number of this run's best feasible trial (-1: none).",
                                registry=reg)
        self.expected = Gauge("sglang_tuner_launches_expected", "Launches this run expects to make in all.",
                              registry=reg)
        self.remaining = Gauge("sglang_tuner_budget_remaining_seconds", "Budget left (s).", registry=reg)
        self.running = Gauge("sglang_tuner_running", "1 while the run works, 0 once it stopped.", registry=reg)
        self.in_flight.set(-1)
        self.best_trial.set(-1)
        self.running.set(1)
        self._set_phase(None)  # every phase series exists (0) from the first write on, not only once a trial ran
        self._best: tuple[float, float] = (-1.0, -1.0)
        self._write(first=True)

    def __call__(self, event: Any) -> None:
        """Take one :class:`tuner.study.progress.Progress` event; rewrite the file."""
        with self._lock:
            tick = event.event == "phase" and event.detail is not None
            self._take(event)
            if not tick or time.monotonic() - self._written >= _MIN_INTERVAL_S:
                self._write()

    def close(self) -> None:
        """The run stopped: ``sglang_tuner_running`` 0, nothing in flight."""
        with self._lock:
            self.running.set(0)
            self.in_flight.set(-1)
            self._set_phase(None)
            self._write()

    def _take(self, event: Any) -> None:
        if event.expected is not None:
            self.expected.set(event.expected)
        if event.eta_s is not None and event.eta_s != float("inf"):
            self.remaining.set(max(0.0, event.eta_s))
        if event.event == "trial_start":
            self.restarts.inc()
            self.last_restart.set_to_current_time()
            self.in_flight.set(event.number if event.number is not None else -1)
        elif event.event == "phase" and event.number is not None and event.phase in _PHASES:
            self._set_phase(event.phase)
        elif event.event == "trial_end":
            self.in_flight.set(-1)
            self._set_phase(None)
            self._trial_end(event.number, event.result or {})
        elif event.event == "skip":
            self.trials.labels("skipped").inc()

    def _trial_end(self, number: int | None, result: dict[str, Any]) -> None:
        if result.get("outcome") == "failed":
            self.trials.labels("failed").inc()
            return
        if not result.get("feasible"):
            self.trials.labels("infeasible").inc()
            return
        self.trials.labels("feasible").inc()
        ranked = result.get("slo_context_capacity") if self.basis == "slo_safe" else None
        if ranked is None:
            ranked = result.get("context_capacity")
        score = (float(ranked or 0), float(result.get("output_throughput_tok_s") or 0.0))
        if score > self._best:
            self._best = score
            self.best_capacity.set(float(result.get("context_capacity") or 0))
            slo = result.get("slo_context_capacity")
            self.best_slo_capacity.set(float(slo) if slo is not None else -1.0)
            self.best_tput.set(score[1])
            self.best_trial.set(number if number is not None else -1)

    def _set_phase(self, current: str | None) -> None:
        for name in _PHASES:
            self.phase.labels(name).set(1 if name == current else 0)

    def _write(self, *, first: bool = False) -> None:
        """Rewrite the file; a failure is one error before the run, a warning during it (a full
        disk must not stop a run that is restarting the service)."""
        try:
            write_to_textfile(str(self.path), self.registry)
        except OSError as err:
            if first:
                raise ConfigError(f"cannot write --prometheus-textfile {self.path}: {err.strerror}",
                                  hint="pass a file in a writable folder (node_exporter's textfile directory)") from err
            _log.warning("--prometheus-textfile %s not written: %s", self.path, err.strerror)
        self._written = time.monotonic()
