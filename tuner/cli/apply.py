"""``tuner apply`` and ``tuner applies``: persist a trial's flags (verify, roll back), and their log."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from tuner.cli.common import (
    STATE_DIR_DEFAULT,
    ConfigOpt,
    JsonOpt,
    StorageOpt,
    StudyOpt,
    app,
    check_output_path,
    check_seconds,
    check_state_dir,
    console,
    non_empty_path,
    non_empty_text,
    open_stored_study,
)


@app.command("apply", short_help="Persist a trial's flags, restart, verify; roll back on failure.")
def apply_cmd(
    target: Annotated[str | None, typer.Argument(parser=non_empty_text, help="`best` or a trial number.")] = None,
    undo: Annotated[bool, typer.Option("--undo", help="Return to the state before the last verified apply.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the drop-in and the command-line diff; change nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    study: StudyOpt = None,
    storage: StorageOpt = None,
    config: ConfigOpt = None,
    state_dir: Annotated[Path | None, typer.Option("--state-dir", parser=non_empty_path, help="Folder of the run's state files.", show_default=STATE_DIR_DEFAULT)] = None,
    verify_s: Annotated[float, typer.Option("--verify-s", help="Seconds of the verifying load check (0: none).")] = 20.0,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Seconds the server may take to be ready.")] = 900.0,
    write: Annotated[Path | None, typer.Option("--write", parser=non_empty_path, help="Process launcher: write the command line to this file.")] = None,
    keep_admission: Annotated[bool, typer.Option(
        "--keep-admission",
        help="Keep the trial's own max_running_requests where its memory admits more longest contexts than the "
             "sessions that held the SLO (by default the apply sets --max-running-requests to that count).")] = False,
) -> None:
    """Persist a trial's flags (systemd drop-in 80-tuner.conf), restart, verify; roll back on failure.

    Where the trial admits more longest contexts at once than the sessions its steady windows held
    the SLO at, the applied config carries --max-running-requests set to that count (the SLO-safe
    capacity), so that it holds what the study measured; --keep-admission keeps the trial's own.
    """
    from tuner import apply as applying
    from tuner import results
    from tuner.errors import ConfigError
    from tuner.report import tables
    from tuner.study.best import admission_limit, admission_line, max_running_requests_cut

    check_seconds(timeout_s, "--timeout-s")
    check_seconds(verify_s, "--verify-s", allow_zero=True, example="20")
    check_output_path(write, "--write")  # before the plan is printed, with --dry-run too (review N14)
    check_state_dir(state_dir)
    if undo == (target is not None):
        raise ConfigError("pass either a target (`best` or a trial number) or --undo", hint="e.g. `tuner apply best`")
    if target not in (None, "best") and not target.isdigit():
        raise ConfigError(f"apply target {target!r} is neither `best` nor a trial number", hint="e.g. `tuner apply 7`")
    stored = open_stored_study(study, storage, config)
    view = None
    if target is not None:  # not undo (checked above)
        view = results.best_trial(stored).trial if target == "best" else stored.trial(int(target))
    cfg = applying.study_config(stored, config)
    log = applying.ApplyLog(stored.location.storage_url)
    if view is None:
        plan = applying.plan_undo(stored, cfg, log, state_dir=state_dir)
    else:
        limit = None if keep_admission else admission_limit(view.record)
        load = applying.load_check_for(cfg, view, duration_s=verify_s, admission_limit=limit) if verify_s > 0 else None
        plan = applying.plan_apply(stored, view, cfg, state_dir=state_dir, load=load, admission_limit=limit)
    # soft_wrap: a command line or drop-in is printed whole, never cut at the terminal width,
    # so it can be pasted and piped
    console.print(plan.render(timeout_s=timeout_s), markup=False, highlight=False, soft_wrap=True)
    cut = max_running_requests_cut(view.record, baseline.record if (baseline := stored.baseline()) else None,
                                   applied=not keep_admission) if view is not None else None
    if cut is not None:
        console.print(cut, markup=False, highlight=False, soft_wrap=True)
    admits = admission_line(view.record, applied=not keep_admission) if view is not None else None
    if admits is not None:
        console.print(admits, markup=False, highlight=False, soft_wrap=True)
    if dry_run:
        return
    log.check_writable()  # before the confirmation and any change: an apply is never left unrecorded
    if plan.launcher == "systemd" and not yes:
        if not sys.stdin.isatty():
            raise ConfigError("tuner apply restarts the service and needs a confirmation", hint="pass --yes")
        typer.confirm(f"restart {plan.target} with this config?", abort=True)
    gpu = applying.gpu_monitor(cfg) if plan.launcher == "systemd" else None
    record = applying.execute(plan, log, timeout_s=timeout_s, write=write, gpu=gpu)
    tables.print_fitted(tables.apply_result(record))


@app.command("applies", short_help="Every apply, undo and rollback of a study's storage.")
def applies_cmd(
    study: StudyOpt = None,
    storage: StorageOpt = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Every apply, undo and rollback recorded in the study's storage."""
    from tuner import apply as applying
    from tuner import results
    from tuner.report import tables

    location = results.resolve_location(study=study, storage=storage, config=config)
    if location.study_name:  # a study the storage lacks (a typo) was "no apply recorded" (exit 0)
        results.open_study(location)
    records = applying.ApplyLog(location.storage_url).records()
    if as_json:
        print(tables.json_text([r.model_dump(mode="json") for r in records]))
    elif not records:
        name = location.study_name or location.storage_url
        console.print(f"no apply recorded in {name} yet (`tuner apply best` makes one)", highlight=False, soft_wrap=True)
    else:
        tables.print_fitted(tables.applies_table(records))
