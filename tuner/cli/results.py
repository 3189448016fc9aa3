"""The readers: ``tuner trials``, ``show``, ``best``, ``studies``, ``report``, ``dashboard``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tuner.cli.common import (
    ConfigOpt,
    JsonOpt,
    StorageOpt,
    StudyOpt,
    app,
    check_output_path,
    console,
    non_empty_path,
    non_empty_text,
    open_stored_study,
)


@app.command("trials", short_help='Every trial: params, capacity, throughput, p99 latency, failure.')
def trials_cmd(
    study: StudyOpt = None,
    storage: StorageOpt = None,
    config: ConfigOpt = None,
    feasible: Annotated[bool, typer.Option("--feasible", help="Only feasible trials.")] = False,
    failed: Annotated[bool, typer.Option("--failed", help="Only failed or skipped trials.")] = False,
    sort: Annotated[str | None, typer.Option("--sort", parser=non_empty_text, help="capacity, tokens, throughput, goodput, ttft, itl or number.", show_default="number")] = None,
    as_json: JsonOpt = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV (params as param.<name> columns).")] = False,
) -> None:
    """Every trial of a study: params, capacity, throughput, p99 TTFT/ITL, feasibility, failure."""
    from tuner import results
    from tuner.errors import ConfigError
    from tuner.report import tables

    if as_json and as_csv:
        raise ConfigError("--json and --csv exclude each other", hint="pass at most one of them")
    stored = open_stored_study(study, storage, config)
    views = results.select_trials(stored.trials, feasible=feasible, failed=failed, sort=sort)
    if as_json:
        print(tables.trials_json(views))
    elif as_csv:
        print(tables.trials_csv(views), end="")
    else:
        tables.print_fitted(tables.trials_table(views, title=f"study {stored.name}: {len(views)} trials"))


@app.command("show", short_help='One trial in full: memory waterfall, load phases, log, artifacts.')
def show_cmd(
    number: Annotated[int, typer.Argument(help="Trial number (see `tuner trials`).")],
    study: StudyOpt = None,
    storage: StorageOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """One trial in full: params, memory waterfall, load phases, failure evidence, log, artifacts."""
    from tuner.report import tables

    stored = open_stored_study(study, storage, config)
    view = stored.trial(number)
    if as_json:
        print(tables.trial_json(stored, view))
    else:
        tables.print_fitted(tables.trial_detail(stored, view))


@app.command("best", short_help='The feasible Pareto front and the best trial vs the baseline.')
def best_cmd(
    study: StudyOpt = None,
    storage: StorageOpt = None,
    config: ConfigOpt = None,
    policy: Annotated[str | None, typer.Option("--policy", parser=non_empty_text, help="throughput_within_capacity, max_capacity or max_throughput (default: the study's).")] = None,
    tolerance: Annotated[float | None, typer.Option("--tolerance", help="Capacity tolerance of throughput_within_capacity only (0.05 = 5%).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """The feasible Pareto front and the best trial under the policy, with deltas vs the baseline."""
    from tuner import results
    from tuner.report import tables
    from tuner.study.best import override_policy

    stored = open_stored_study(study, storage, config)
    chosen = results.best_trial(stored, override_policy(stored.info, policy, tolerance))
    if as_json:
        print(tables.json_text(chosen.summary()))
    else:
        tables.print_fitted(tables.best_panel(chosen))


@app.command("studies", short_help='The studies in a storage (default: every studies/*.db).')
def studies_cmd(
    storage: StorageOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The studies in a storage (default: every studies/*.db)."""
    from tuner import results
    from tuner.report import tables
    from tuner.study.storage import list_studies

    urls = results.storage_urls(storage=storage, config=config)
    rows = {url: list_studies(url) for url in urls}
    if as_json:
        print(tables.json_text(tables.studies_rows(rows)))
    else:
        for url, summaries in rows.items():
            tables.print_fitted(tables.studies_table(summaries, url))


@app.command("copy-study")
def copy_study_cmd(
    from_url: Annotated[str, typer.Option("--from", parser=non_empty_text, help="Source storage URL, e.g. sqlite:///studies/demo.db.")],
    to_url: Annotated[str, typer.Option("--to", parser=non_empty_text, help="Target storage URL, e.g. postgresql+psycopg://user:pw@db/tuner.")],
    study: Annotated[str, typer.Option("--study", parser=non_empty_text, help="The study to copy.")],
    to_study: Annotated[str | None, typer.Option("--to-study", parser=non_empty_text, help="Its name in the target (default: the same).")] = None,
) -> None:
    """Copy a study between storages (SQLite <-> PostgreSQL)."""
    from tuner.study.storage import copy_study, display_url

    count = copy_study(from_url, to_url, study, to_study)
    console.print(f"copied study {study} ({count} trials) from {display_url(from_url)} to "
                  f"{display_url(to_url)} as {to_study or study}; artifact files stay where they are",
                  highlight=False, soft_wrap=True)


@app.command("report", short_help='One self-contained HTML report with figures (opens offline).')
def report_cmd(
    study: StudyOpt = None,
    storage: StorageOpt = None,
    config: ConfigOpt = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", parser=non_empty_path, help="HTML file (default studies/<study>-report.html).")] = None,
) -> None:
    """Write one self-contained HTML report (plots inlined; opens offline)."""
    from tuner.report import html

    check_output_path(output, "--output")  # before the study is read or a figure built
    stored = open_stored_study(study, storage, config)
    path = html.write_study_report(stored, output, slo_ms=_slo_ms(config, stored))
    console.print(f"report written to {path}")


def _slo_ms(config: Path | None, stored) -> dict[str, float | None] | None:  # noqa: ANN001 - StoredStudy
    """The p99 TTFT/ITL limits (ms) of the study's ``[slo]``: from ``--config``, else the config file
    the study recorded when it still exists (``None`` when neither can be read)."""
    from tuner.config import load_config
    from tuner.errors import ConfigError

    recorded = stored.info.config_path if stored.info else None
    path = config or (Path(recorded) if recorded and Path(recorded).is_file() else None)
    if path is None:
        return None
    try:
        slo = load_config(path).slo
    except ConfigError:
        return None
    if slo is None:
        return None
    return {"ttft": slo.ttft_ms.get("p99"), "itl": slo.itl_ms.get("p99")}


@app.command("dashboard", short_help="optuna-dashboard on the study's storage (it can write).")
def dashboard_cmd(
    study: StudyOpt = None,
    storage: StorageOpt = None,
    config: ConfigOpt = None,
    host: Annotated[str, typer.Option("--host", parser=non_empty_text, help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8080,
) -> None:
    """Run optuna-dashboard on the study's storage (Ctrl-C stops it).

    The dashboard can write: optuna-dashboard 0.21 has no read-only mode, and its pages can
    create, rename and delete studies and add notes in this storage. To look without that risk,
    copy the .db file and pass the copy with --storage. Before it starts, the tuner names the
    objectives of its studies (context capacity, output throughput) where they have no names.
    """
    from tuner import results
    from tuner.report import dashboard
    from tuner.study.storage import check_storage, display_url

    location = results.resolve_location(study=study, storage=storage, config=config)
    check_storage(location.storage_url)
    dashboard.check_listen_address(host, port)
    dashboard.name_objectives_in(location.storage_url)
    console.print(f"optuna-dashboard on http://{host}:{port}/  (storage {display_url(location.storage_url)}; Ctrl-C stops it)",
                  highlight=False, soft_wrap=True)  # fmt: skip
    status = dashboard.serve_dashboard(location.storage_url, host=host, port=port)
    if status is None:
        console.print("dashboard stopped", highlight=False)
    raise typer.Exit(status or 0)
