"""What every ``tuner`` command module shares: the typer app, the consoles, the study options.

The command modules (:mod:`tuner.cli.run`, :mod:`tuner.cli.load`, :mod:`tuner.cli.results`,
:mod:`tuner.cli.apply`, :mod:`tuner.cli.service`, :mod:`tuner.cli.explain`, :mod:`tuner.cli.sim`)
register their commands on :data:`app`; :func:`tuner.cli.main` runs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from tuner.results import StoredStudy, open_study, resolve_location

__all__ = ["app", "console", "err_console", "StudyOpt", "StorageOpt", "ConfigOpt", "JsonOpt", "open_stored_study"]

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
    rich_markup_mode=None,  # help texts name TOML sections like [study]: print them literally
)
console = Console()
err_console = Console(stderr=True)

StudyOpt = Annotated[str | None, typer.Option("--study", help="Study name (default: [study] of --config, or the only studies/*.db).")]
StorageOpt = Annotated[str | None, typer.Option("--storage", help="Optuna storage URL, e.g. sqlite:///studies/demo.db (must exist).")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="Config file whose [study]/[storage] name the study.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def open_stored_study(study: str | None, storage: str | None, config: Path | None) -> StoredStudy:
    """The study ``--study``/``--storage``/``--config`` name (:func:`tuner.results.resolve_location`).

    Raises:
        StudyError: See :func:`tuner.results.open_study`.
        ConfigError: The config file is invalid.
    """
    return open_study(
        resolve_location(study=study, storage=storage, config=config)
    )
