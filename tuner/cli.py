"""The ``tuner`` command line (typer). Thin: parse, validate into a model, call one entry point, print.

Every :class:`tuner.errors.TunerError` becomes one line on stderr and exit status 1; nothing else
prints a traceback for user errors. Each issue's commands live in their own section below.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from tuner.errors import TunerError

app = typer.Typer(
    name="tuner",
    help=(
        "Auto-tune an SGLang server's memory and scheduling knobs (mem_fraction_static, "
        "max_running_requests, chunked prefill, hierarchical cache) with an Optuna study.\n\n"
        "Typical use: `tuner run --config configs/demo-sim.toml --budget 3m`, then "
        "`tuner trials`, `tuner best`, `tuner apply best`."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

# ---- sim (issue: simulated SGLang server) -------------------------------------------------

# ---- explain (issue: SGLang knowledge) ------------------------------------------------------

# ---- restore / launch (issue: service control) ----------------------------------------------

# ---- load (issue: load generator) -----------------------------------------------------------

# ---- run / init (issue: tuner run) ----------------------------------------------------------

# ---- trials / show / best / studies / report / dashboard / apply / applies (issue: history) -

from pathlib import Path as _Path  # noqa: E402
from typing import Annotated as _Ann  # noqa: E402

_StudyOpt = _Ann[str | None, typer.Option("--study", help="Study name (default: [study] of --config, or the only studies/*.db).")]
_StorageOpt = _Ann[str | None, typer.Option("--storage", help="Optuna storage URL, e.g. sqlite:///studies/demo.db (must exist).")]
_ConfigOpt = _Ann[_Path | None, typer.Option("--config", "-c", help="Config file whose [study]/[storage] name the study.")]
_JsonOpt = _Ann[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _history_study(study: str | None, storage: str | None, config: _Path | None):  # noqa: ANN202
    from tuner import history

    return history.open_study(
        history.resolve_location(study=study, storage=storage, config=config)
    )


@app.command("trials")
def trials_cmd(
    study: _StudyOpt = None,
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    feasible: _Ann[bool, typer.Option("--feasible", help="Only feasible trials.")] = False,
    failed: _Ann[bool, typer.Option("--failed", help="Only failed or skipped trials.")] = False,
    sort: _Ann[str | None, typer.Option("--sort", help="capacity, tokens, throughput, goodput, ttft, itl or number.")] = None,
    as_json: _JsonOpt = False,
    as_csv: _Ann[bool, typer.Option("--csv", help="Print CSV (params as param.<name> columns).")] = False,
) -> None:
    """Every trial of a study: params, capacity, throughput, p99 TTFT/ITL, feasibility, failure."""
    from tuner import history, report

    stored = _history_study(study, storage, config)
    views = history.select_trials(stored.trials, feasible=feasible, failed=failed, sort=sort)
    if as_json:
        print(report.trials_json(views))
    elif as_csv:
        print(report.trials_csv(views), end="")
    else:
        console.print(report.trials_table(views, title=f"study {stored.name}: {len(views)} trials"))


@app.command("show")
def show_cmd(
    number: _Ann[int, typer.Argument(help="Trial number (see `tuner trials`).")],
    study: _StudyOpt = None,
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    as_json: _JsonOpt = False,
) -> None:
    """One trial in full: params, memory waterfall, load phases, failure evidence, log, artifacts."""
    from tuner import report

    stored = _history_study(study, storage, config)
    view = stored.trial(number)
    if as_json:
        print(report.trial_json(stored, view))
    else:
        console.print(report.trial_detail(stored, view))


@app.command("best")
def best_cmd(
    study: _StudyOpt = None,
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    policy: _Ann[str | None, typer.Option("--policy", help="throughput_within_capacity, max_capacity or max_throughput (default: the study's).")] = None,
    tolerance: _Ann[float | None, typer.Option("--tolerance", help="Capacity tolerance of throughput_within_capacity (0.05 = 5%).")] = None,
    as_json: _JsonOpt = False,
) -> None:
    """The feasible Pareto front and the best trial under the policy, with deltas vs the baseline."""
    from tuner import history, report

    stored = _history_study(study, storage, config)
    chosen = history.choose_best(stored, history.override_policy(stored, policy, tolerance))
    if as_json:
        print(report.json_text(chosen.summary()))
    else:
        console.print(report.best_panel(chosen))


@app.command("studies")
def studies_cmd(
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    as_json: _JsonOpt = False,
) -> None:
    """The studies in a storage (default: every studies/*.db)."""
    from tuner import history, report

    urls = history.storage_urls(storage=storage, config=config)
    rows = {url: history.list_studies(url) for url in urls}
    if as_json:
        print(report.json_text(report.studies_rows(rows)))
    else:
        for url, summaries in rows.items():
            console.print(report.studies_table(summaries, url))


@app.command("report")
def report_cmd(
    study: _StudyOpt = None,
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    output: _Ann[_Path | None, typer.Option("--output", "-o", help="HTML file (default studies/<study>-report.html).")] = None,
) -> None:
    """Write one self-contained HTML report (plots inlined; opens offline)."""
    from tuner import report

    stored = _history_study(study, storage, config)
    path = report.write_study_report(stored, output)
    console.print(f"report written to {path}")


@app.command("dashboard")
def dashboard_cmd(
    study: _StudyOpt = None,
    storage: _StorageOpt = None,
    config: _ConfigOpt = None,
    host: _Ann[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: _Ann[int, typer.Option("--port", help="Port to listen on.")] = 8080,
) -> None:
    """Run optuna-dashboard on the study's storage (Ctrl-C stops it)."""
    import subprocess

    from tuner import history, report

    location = history.resolve_location(study=study, storage=storage, config=config)
    history.check_storage(location.storage_url)
    argv = report.dashboard_argv(location.storage_url, host=host, port=port)
    console.print(f"optuna-dashboard on http://{host}:{port}/  (storage {location.storage_url})")
    raise typer.Exit(subprocess.call(argv))


def main() -> None:
    """Entry point of the ``tuner`` script: run the app, turn TunerError into one line."""
    try:
        app()
    except TunerError as err:
        err_console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
