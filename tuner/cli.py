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
