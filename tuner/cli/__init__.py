"""The ``tuner`` command line (typer). Thin: parse, validate into a model, call one entry point, print.

Every :class:`tuner.errors.TunerError` becomes one line on stderr and exit status 1; nothing else
prints a traceback for user errors (:func:`main`). One module per command group: :mod:`.run`
(run, init), :mod:`.load`, :mod:`.results` (trials, show, best, studies, report, dashboard),
:mod:`.apply` (apply, applies), :mod:`.service` (restore, launch), :mod:`.explain`, :mod:`.sim`.
"""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

# Importing a command module registers its commands; this order is the order of `tuner --help`.
# isort: off
from tuner.cli import sim, explain, service, load, run, results, apply, fingerprint  # noqa: F401
# isort: on
from tuner.cli.common import app, console, err_console
from tuner.errors import TunerError

__all__ = ["app", "main"]


def main() -> None:
    """Entry point of the ``tuner`` script.

    Turns every user error into one line on stderr: a :class:`TunerError` exits 1, a command-line
    usage error (unknown option, bad value) exits 2 as click does, Ctrl-C exits 130. Once the
    command is over, SIGINT is ignored: the interpreter's shutdown restores SIGINT's default, and a
    Ctrl-C there killed a finished command silently (a new user's sweep: exit 130, no line, after a
    dry run had printed its whole plan).
    """
    import signal

    try:
        _run()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run() -> None:
    """:func:`main` without its exit guard."""
    try:
        rc = app(standalone_mode=False)
    except TunerError as err:
        from tuner.report.tables import terminal_safe

        err_console.print(f"[bold red]error:[/] {escape(terminal_safe(str(err)))}", highlight=False, soft_wrap=True)
        sys.exit(err.exit_code)
    except typer.TyperException as err:  # click's usage errors (typer's public base class)
        ctx = getattr(err, "ctx", None)
        if ctx is not None and err.format_message() == ctx.get_help():  # `tuner` or `tuner sim` alone
            console.print(err.format_message(), markup=False, highlight=False)
            sys.exit(0)
        command = ctx.command_path if ctx is not None else "tuner"
        err_console.print(
            f"[bold red]error:[/] {escape(err.format_message())} — see `{escape(command)} --help`",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(err.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        err_console.print("interrupted")
        sys.exit(130)
    sys.exit(rc if isinstance(rc, int) else 0)

