"""``tuner run`` and ``tuner init``: the study, and a starter config."""

from __future__ import annotations

from datetime import UTC
from pathlib import Path
from typing import Annotated

import typer

from tuner.cli.common import app, console, err_console, non_empty_path, non_empty_text
from tuner.report.tables import terminal_safe


def _print_best_vs_baseline(summary, chosen, console=console) -> None:  # noqa: ANN001 - RunSummary, results.BestTrial, rich Console
    """The closing summary; ``chosen`` is the run's :attr:`RunSummary.best` as
    :func:`tuner.results.present_best` shows it (:func:`tuner.study.best.choose_best`, the rule
    `tuner best` applies), ``None`` when no trial is feasible."""
    from tuner.report import tables
    from tuner.study.best import max_running_requests_cut
    from tuner.study.storage import display_url, is_shared_url

    console.print(
        f"study [bold]{summary.study_name}[/] ({display_url(summary.storage_url)})"
        + (f" on host {summary.host}" if is_shared_url(summary.storage_url) and summary.host else "")
        + f": {summary.trials_run} trial(s) launched, "
        f"{summary.trials_skipped} skipped without a restart, stopped by {summary.stop_reason}"
        + (f" ({summary.stop_detail})" if summary.stop_detail else "")
        + (f"; re-enqueued interrupted trial(s) {summary.recovered}" if summary.recovered else ""),
        highlight=False, soft_wrap=True,  # one line in a pipe or the journal, not wrapped at 80 columns
    )
    skips = summary.skips_text()
    if skips is not None:
        console.print(skips, highlight=False, soft_wrap=True)
    if chosen is None:
        console.print("no feasible trial yet: nothing beats the baseline (see `tuner trials`)")
        return
    base = chosen.baseline.record if chosen.baseline else None
    best = chosen.trial
    console.print(tables.best_vs_baseline_table(chosen))
    changed = {k: v for k, v in best.record.params.items() if not base or base.params.get(k) != v}
    console.print(f"flags changed: {changed or 'none (the baseline is best)'}", highlight=False)
    console.print(f"why: {chosen.reason}", highlight=False, soft_wrap=True)
    for note in chosen.notes:
        console.print(note, highlight=False, soft_wrap=True)
    cut = max_running_requests_cut(best.record, chosen.baseline.record if chosen.baseline else None)
    if cut is not None:
        console.print(cut, highlight=False, soft_wrap=True)


def _flags_text(flags: dict) -> str:  # noqa: ANN001
    """``mem_fraction_static=0.95 max_running_requests=23`` (a trial's tuned flags, for a line)."""
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(flags.items()))


def _detail_text(detail) -> str:  # noqa: ANN001 - tuner.study.loop.PhaseProgress
    """How far a phase has come: the last SGLang line of a start, or requests done / expected."""
    if detail is None:
        return ""
    if detail.line:
        line = detail.line if len(detail.line) <= 90 else detail.line[:89] + "…"
        return f" · {line}"
    parts = []
    if detail.requests_done is not None:  # the expected count is a floor: past it, the count alone
        expected = detail.requests_expected
        of = f" of ≥{expected}" if expected and detail.requests_done < expected else ""
        parts.append(f"{detail.requests_done}{of} requests done")
    if detail.elapsed_s is not None and detail.duration_s:
        if detail.elapsed_s <= detail.duration_s:
            parts.append(f"{detail.elapsed_s:.0f}/{detail.duration_s:.0f} s")
        else:  # the window is over; the requests in flight finish before the phase ends
            parts.append(f"{detail.duration_s:.0f} s window over, finishing the requests in flight")
    return (" · " + ", ".join(parts)) if parts else ""


def progress_line(event) -> str:  # noqa: ANN001 - tuner.study.loop.Progress
    """The live line of a trial event: trial number, launch n of ~N, phase and its progress, flags."""
    of = f" of ~{event.expected}" if event.expected else ""
    flags = _flags_text(event.flags) if event.flags else ("the service's own flags" if event.kind == "baseline" else "")
    phase = event.phase or "starting"
    head = f"trial {event.number} ({event.kind or '?'}, launch {event.launch}{of}) · {phase}{_detail_text(event.detail)}"
    return head + (f"\n  flags: {flags}" if flags else "")


class JsonProgress:
    """Writes every :class:`tuner.study.loop.Progress` event as one JSON object per line (a file,
    or standard output for ``-``), flushed at once: what a detached ``tuner-run.service`` leaves
    for a watcher (``tail -f``, ``journalctl -u tuner-run -o cat``).

    Args:
        target: A file path, or ``-`` for standard output.

    Raises:
        ConfigError: The file's folder does not exist, or it cannot be opened for writing.
    """

    def __init__(self, target: str) -> None:
        import sys
        import threading

        from tuner.cli.common import check_output_path

        self._lock = threading.Lock()
        if target == "-":
            self._stream, self._owned = sys.stdout, False
            return
        path = Path(target)
        check_output_path(path, "--json-progress")
        try:
            self._stream, self._owned = path.open("a", encoding="utf-8"), True
        except OSError as err:
            from tuner.errors import ConfigError

            raise ConfigError(f"cannot write --json-progress {path}: {err.strerror}",
                              hint="pass a writable file, or - for standard output") from err

    def __call__(self, event) -> None:  # noqa: ANN001
        data = event.model_dump(mode="json")
        if data.get("eta_s") == float("inf"):
            data["eta_s"] = None
        self._write(data)

    def summary(self, summary) -> None:  # noqa: ANN001 - tuner.study.progress.RunSummary
        """The run's last object: ``{"event": "summary", ...}`` (:meth:`RunSummary.as_json`)."""
        self._write({"event": "summary", **summary.as_json()})

    def ended(self, stop_reason: str, stop_detail: str) -> None:
        """The last object of a run that ended without its summary (Ctrl-C, SIGTERM, an error):
        ``{"event": "summary", "stop_reason": "interrupted" | "error", "stop_detail": the line said}``."""
        self._write({"event": "summary", "stop_reason": stop_reason, "stop_detail": stop_detail})

    def _write(self, data: dict) -> None:
        import json
        from datetime import datetime

        with self._lock:
            self._stream.write(json.dumps({"at": datetime.now(UTC).isoformat(timespec="milliseconds"), **data},
                                          default=str) + "\n")
            self._stream.flush()

    def close(self) -> None:
        """Close the file (standard output stays open)."""
        if self._owned:
            self._stream.close()


def _check_sinks(json_progress: str | None, prometheus_textfile: Path | None) -> None:
    """Refuse, before the dry run and the run alike, an output the run could not write: either file
    in a folder that does not exist (nothing is created); an empty one is refused by its parser.

    Raises:
        ConfigError: Naming the option, the path and the fix.
    """
    from tuner.cli.common import check_output_path

    if json_progress is not None and json_progress != "-":  # an empty one is refused by its parser
        check_output_path(Path(json_progress), "--json-progress")
    check_output_path(prometheus_textfile, "--prometheus-textfile")


def _prometheus_textfile(path: Path | None, cfg, storage: str | None):  # noqa: ANN001, ANN202 - TunerConfig, PrometheusTextfile
    """The ``--prometheus-textfile`` sink (written once now: a bad path is refused before the run)."""
    if path is None:
        return None
    from tuner.cli.common import check_output_path
    from tuner.load.search import context_slo
    from tuner.report.prometheus import PrometheusTextfile
    from tuner.study.hosts import host_name
    from tuner.study.storage import display_url, study_storage_url

    check_output_path(path, "--prometheus-textfile")
    basis = cfg.objective.capacity if cfg.objective.capacity != "auto" else (
        "slo_safe" if context_slo(cfg.slo) is not None else "oom_safe")  # as the study's choice ranks
    return PrometheusTextfile(path, study=cfg.study.name, host=host_name(),
                              storage=display_url(storage or study_storage_url(cfg)), basis=basis)


class _RunProgress:
    """Renders :class:`tuner.study.loop.Progress` events: one line per trial, a live phase line.

    The live line names the Optuna trial number (as the result lines do), the kind, the launch
    count against the run's stable estimate, the phase and how far it has come (the last SGLang
    line of a start, requests done in a load phase), the flags under test, and counts the budget
    left down every second from the last event's ``eta_s``. Events may come from a reader thread.
    """

    def __init__(self, also=(), out=console) -> None:  # noqa: ANN001 - extra event sinks (JsonProgress, PrometheusTextfile), a rich Console
        import threading
        import time

        from rich.progress import Progress, ProgressColumn, SpinnerColumn, TextColumn
        from rich.text import Text

        from tuner.units import format_duration

        class TimeLeft(ProgressColumn):
            def render(self, task) -> Text:  # noqa: ANN001 - rich Task
                deadline = task.fields.get("deadline")
                if deadline is None:
                    return Text("")
                return Text(f"· {format_duration(max(0.0, deadline - time.monotonic()))} left")

        self._monotonic = time.monotonic
        self._lock = threading.Lock()
        self.also = also
        self.out = out
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), TimeLeft(),
                                 console=out, transient=True, refresh_per_second=2)
        self.task = self.progress.add_task("starting", total=None, deadline=None)
        self.in_flight: int | None = None

    def __enter__(self) -> _RunProgress:
        """Start the live line on a terminal only: rich's Progress ends with an empty line on any
        other output, which would sit above an error line."""
        if self.out.is_interactive:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress.live.is_started:
            self.progress.stop()

    def __call__(self, event) -> None:  # noqa: ANN001
        for sink in self.also:
            sink(event)
        deadline = None if event.eta_s is None or event.eta_s == float("inf") else self._monotonic() + event.eta_s
        with self._lock:
            if event.event == "phase" and event.number is None:  # about the study, not this host's trial
                self.progress.console.print(f"  {terminal_safe(event.message)}", highlight=False, markup=False,
                                            soft_wrap=True)
            elif event.event in ("trial_end", "skip", "stop", "note"):
                self.in_flight = None
                self.progress.console.print(f"  {terminal_safe(event.message)}", highlight=False, markup=False,
                                            soft_wrap=True)
            elif event.event in ("trial_start", "phase"):
                self.in_flight = event.number
                self.progress.update(self.task, description=terminal_safe(progress_line(event)), deadline=deadline,
                                     refresh=self.progress.live.is_started)


@app.command("run", short_help='Run or resume the study: relaunch, load, measure, learn, restore.')
def run_cmd(
    config: Annotated[Path, typer.Option("--config", "-c", parser=non_empty_path, help="The tuning config (TOML).")],
    budget: Annotated[str | None, typer.Option("--budget", "-b", parser=non_empty_text, help="Wall-clock budget with a unit: 4h, 90m, 1h30m, 3m, 90s (a bare number is an error). At least one trial's estimated cost.")] = None,
    trials: Annotated[int | None, typer.Option("--trials", "-n", metavar="N", help="Cap on trials launched in this run (restarts; skipped proposals do not count), at least 1.", show_default="the config's [budget] trials, else none")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and the first launch; change nothing.")] = False,
    storage: Annotated[str | None, typer.Option("--storage", parser=non_empty_text, help="Override the config's storage url.")] = None,
    allow_mixed_environment: Annotated[bool, typer.Option(
        "--allow-mixed-environment", help="Add trials to a study recorded with another SGLang/GPU/driver/model.")] = False,
    apply_best: Annotated[bool, typer.Option(
        "--apply-best", help="After the run, persist the best trial like `tuner apply best --yes` (verify, roll back on failure).")] = False,
    json_progress: Annotated[str | None, typer.Option(
        "--json-progress", metavar="FILE|-", parser=non_empty_text,
        help="Also write every progress event (trial start/end, phase and its progress, flags, launch n of ~N, "
             "budget left) as one JSON object per line to FILE (appended), or to standard output with -.")] = None,
    prometheus_textfile: Annotated[Path | None, typer.Option(
        "--prometheus-textfile", metavar="FILE", parser=non_empty_path,
        help="Keep FILE a Prometheus text exposition of the run (restarts, trials by result, the phase in "
             "flight, best so far, budget left), rewritten at every step: point it into node_exporter's "
             "textfile directory (e.g. /var/lib/node_exporter/textfile/sglang-tuner.prom).")] = None,
) -> None:
    """Run (or resume) the Optuna study: relaunch the service per trial, measure, learn; restore it at the end.

    Exit status: 0 the run ended (budget, --trials, or nothing left to try; the service restored);
    1 a refusal before anything changed, or a failure during the run (one line; the service
    restored); 2 a usage error; 130 Ctrl-C or SIGTERM (the trial in flight stored as failed, the
    service restored). With --json-progress the last object is the run's summary (event
    "summary": counts, stop reason, baseline and best with their figures).
    """
    from tuner.config import load_config
    from tuner.errors import ConfigError
    from tuner.units import parse_duration_s

    if trials is not None and trials < 1:
        raise ConfigError(f"--trials {trials} is not a number of trials", hint="pass --trials 1 or more, or leave it out")
    try:  # a Ctrl-C before the run holds the service: nothing changed, and the line says so
        _check_sinks(json_progress, prometheus_textfile)
        cfg = load_config(config)
        text = budget or cfg.budget.total
        budget_s = parse_duration_s(text) if text else None
        max_trials = trials or cfg.budget.trials
        if budget_s is None and max_trials is None and not dry_run:
            raise ConfigError("no budget: neither --budget nor --trials nor [budget] total/trials is set",
                              hint="pass e.g. --budget 4h")
        from tuner import entrypoints

        if dry_run:
            console.print(entrypoints.dry_run(cfg, budget_s=budget_s, max_trials=max_trials, storage_url=storage),
                          highlight=False, markup=False, soft_wrap=True)
            entrypoints.dry_run_checks(cfg, budget_s=budget_s, max_trials=max_trials, storage_url=storage,
                                       allow_mixed_environment=allow_mixed_environment)
            console.print("checks: every check a run makes before it changes anything passes", highlight=False)
            return
        sink = JsonProgress(json_progress) if json_progress else None
        metrics = _prometheus_textfile(prometheus_textfile, cfg, storage)
    except KeyboardInterrupt:
        err_console.print("interrupted before the run started: nothing was changed", highlight=False, markup=False)
        raise typer.Exit(130) from None
    out = err_console if json_progress == "-" else console  # `-`: standard output carries JSON only
    renderer = _RunProgress(also=[s for s in (sink, metrics) if s is not None], out=out)
    try:
        with renderer:
            summary = entrypoints.tune(cfg, budget_s=budget_s, max_trials=max_trials,
                                     allow_mixed_environment=allow_mixed_environment, storage_url=storage,
                                     on_progress=renderer)
    except KeyboardInterrupt as stop:  # tune() restored the service (when it had changed it) before re-raising
        from tuner.study.storage import display_url

        what = (f"trial {renderer.in_flight} recorded as failed (interrupted)" if renderer.in_flight is not None
                else "no trial was in flight")
        again = (f"tuner run --config {config}" + (f" --budget {budget}" if budget else "")
                 + (f" --storage {display_url(storage)}" if storage else ""))
        # No `service`: tune() stopped before it held the service (its checks), so nothing changed.
        service = getattr(stop, "service", entrypoints.UNCHANGED_SERVICE)
        said = f"interrupted: {what}, service {service}; resume with `{again}`"
        err_console.print(said, highlight=False, markup=False, soft_wrap=True)
        if sink is not None:
            sink.ended("interrupted", said)
            sink.close()
        if metrics is not None:
            metrics.close()
        raise typer.Exit(130) from None
    except BaseException as err:
        if sink is not None:
            sink.ended("error", " ".join(str(err).split()) or type(err).__name__)
            sink.close()
        if metrics is not None:
            metrics.close()
        raise
    if sink is not None:
        sink.summary(summary)
        sink.close()
    if metrics is not None:
        metrics.close()
    out.print(f"service {summary.service}", highlight=False, soft_wrap=True)
    from tuner import results

    stored = results.open_study(results.StudyLocation(storage_url=summary.storage_url, study_name=summary.study_name))
    # The run's own choice (RunSummary.best, the config's [objective]), shown with the stored views.
    chosen = results.present_best(stored, summary.best, cfg.objective) if summary.best is not None else None
    _print_best_vs_baseline(summary, chosen, out)
    if apply_best and chosen is not None:
        from tuner.cli.apply import apply_cmd

        apply_cmd(target="best", undo=False, dry_run=False, yes=True, study=None, storage=storage, config=config,
                  state_dir=None, verify_s=20.0, timeout_s=cfg.service.start_timeout_s, write=None)


@app.command("init", short_help='Write a starter config from a running unit or for the simulator.')
def init_cmd(
    output: Annotated[Path, typer.Option("--output", "-o", parser=non_empty_path, help="Where to write the config.")] = Path("tuner.toml"),
    unit: Annotated[str | None, typer.Option("--unit", parser=non_empty_text, help="Read a running systemd unit (ExecStart, model, GPU, version).")] = None,
    sim: Annotated[bool, typer.Option("--sim", help="Write a config for the simulated server instead.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a starter config from a running unit (--unit sglang.service) or for the simulator (--sim)."""
    from tuner.errors import ConfigError
    from tuner.starter import starter_config

    if output.is_dir():  # --force cannot overwrite a folder (review N19)
        raise ConfigError(f"--output {output} is a folder", hint=f"pass a file path, e.g. --output {output / 'tuner.toml'}")
    if output.exists() and not force:
        raise ConfigError(f"{output} already exists", hint="pass --force to overwrite it, or --output another file")
    if not unit and not sim:
        raise ConfigError("tell init what to tune", hint="pass --unit sglang.service or --sim")
    if unit and sim:
        raise ConfigError(f"--sim and --unit {unit} exclude each other (a simulator config reads no unit)",
                          hint="pass --sim for the simulator, or --unit UNIT to read a running unit")
    text = starter_config(unit=unit, sim=sim)
    if not output.parent.is_dir():
        raise ConfigError(f"--output {output}: folder {output.parent} does not exist",
                          hint="create it first, or pass --output in an existing folder")
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot write --output {output}: {err.strerror}", hint="pass a writable path") from err
    console.print(f"wrote {output}; check [workload] and [slo], then `tuner run --config {output} --dry-run` "
                  f"and `tuner run --config {output} --budget {'3m' if sim else '4h'}`",
                  highlight=False, markup=False, soft_wrap=True)
