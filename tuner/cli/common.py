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
from tuner.units import non_empty

__all__ = [
    "app", "console", "err_console", "StudyOpt", "StorageOpt", "ConfigOpt", "JsonOpt", "open_stored_study",
    "check_output_path", "check_seconds", "check_state_dir", "STATE_DIR_DEFAULT", "non_empty_text", "non_empty_path",
]

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


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            shown = version("sglang-tuner")
        except PackageNotFoundError:  # pragma: no cover - run from a source tree without install
            shown = "unknown (not installed)"
        console.print(f"tuner {shown}", highlight=False, markup=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.", is_eager=True,
                                          callback=_print_version)] = False,
) -> None:
    """Auto-tune an SGLang server's memory and scheduling knobs (mem_fraction_static,
    max_running_requests, chunked prefill, hierarchical cache) with an Optuna study.

    Typical use: `tuner run --config configs/demo-sim.toml --budget 3m`, then `tuner trials`,
    `tuner best`, `tuner apply best`.
    """

def non_empty_text(value: str) -> str:
    """A string option's value (typer's ``parser=``), refused when empty or blank: the config's rule
    (:func:`tuner.units.non_empty`) for the command line, where ``--budget ''`` was read as no budget
    and ``--systemctl ''`` as the default command.

    Raises:
        typer.BadParameter: The value is empty (a usage error, exit 2; click names the option:
            ``Invalid value for '--budget'``).
    """
    try:
        return non_empty(value)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def non_empty_path(value: str | Path) -> Path:
    """A path option's value (typer's ``parser=``), refused when empty as :func:`non_empty_text`:
    ``Path("")`` is the working directory, so ``--config ''`` was read as a folder and
    ``--state-dir ''`` as the working directory. An option's default reaches the parser as the
    ``Path`` it is (``tuner init``'s ``--output tuner.toml``).

    Raises:
        typer.BadParameter: The value is empty.
    """
    return Path(non_empty_text(str(value)))


StudyOpt = Annotated[str | None, typer.Option("--study", parser=non_empty_text, help="Study name (default: [study] of --config, or the only studies/*.db).")]
StorageOpt = Annotated[str | None, typer.Option("--storage", parser=non_empty_text, help="Optuna storage URL, e.g. sqlite:///studies/demo.db (must exist).")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", parser=non_empty_path, help="Config file whose [study]/[storage] name the study.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
STATE_DIR_DEFAULT = "/var/lib/sglang-tuner as root, else ~/.local/state/sglang-tuner"
"""``--state-dir``'s default as help shows it (:func:`tuner.launch.safety.default_state_dir`)."""


def open_stored_study(study: str | None, storage: str | None, config: Path | None) -> StoredStudy:
    """The study ``--study``/``--storage``/``--config`` name (:func:`tuner.results.resolve_location`).

    Raises:
        StudyError: See :func:`tuner.results.open_study`.
        ConfigError: The config file is invalid.
    """
    return open_study(
        resolve_location(study=study, storage=storage, config=config)
    )


def check_output_path(path: Path | None, flag: str) -> None:
    """Refuse, before any work, an output file that could not be written: a folder, a file in a
    folder that does not exist (nothing is created), no write permission, or a new file on a
    virtual file system (``/proc``, ``/sys``: no blocks, where root's permission check passes).

    Raises:
        ConfigError: Naming ``flag``, the path and the problem.
    """
    import os

    from tuner.errors import ConfigError
    from tuner.launch.session import virtual_fs

    if path is None:
        return
    folder = path.parent
    if path.is_dir():
        problem = "is a folder"
    elif not folder.is_dir():
        problem = f"is in a folder that does not exist ({folder})"
    elif not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        problem = "is not writable"
    elif not path.exists() and virtual_fs(folder):  # /proc, /sys: root's W_OK, yet no new file
        problem = f"is on a virtual file system ({folder}) where no file can be created"
    else:
        return
    raise ConfigError(f"{flag} {path} {problem}", hint=f"pass a file path in an existing, writable folder to {flag}")


def check_state_dir(state_dir: Path | None, flag: str = "--state-dir") -> None:
    """Refuse, before any work, a state folder that is a file or cannot be created or written
    (its nearest existing ancestor is not a writable folder). A missing folder is fine: the
    command creates it.

    Raises:
        ConfigError: Naming ``flag``, the path and the problem.
    """
    from tuner.errors import ConfigError
    from tuner.launch.session import writable_folder

    if state_dir is None:
        return
    hint = f"pass the folder the run keeps its state file in to {flag}, or leave it out for the default"
    if state_dir.exists() and not state_dir.is_dir():
        raise ConfigError(f"{flag} {state_dir} is not a folder", hint=hint)
    blocked = writable_folder(state_dir)
    if blocked is not None:
        raise ConfigError(f"{flag} {state_dir} cannot be written ({blocked} is not a writable folder)", hint=hint)


def check_seconds(value: float, flag: str, *, allow_zero: bool = False, example: str = "900") -> None:
    """Refuse a duration that is negative (or zero, unless ``allow_zero``) or not finite (``inf``
    waited forever), before any work.

    Raises:
        ConfigError: Naming ``flag`` and the value.
    """
    import math

    from tuner.errors import ConfigError

    if math.isfinite(value) and (value > 0 or (allow_zero and value == 0)):
        return
    what = "a finite number of seconds ≥ 0" if allow_zero else "a finite, positive number of seconds"
    raise ConfigError(f"{flag} {value:g} is not {what}", hint=f"pass e.g. {flag} {example}")
