"""The ``tuner`` console script: the CLI imported under a Ctrl-C guard.

Importing the commands takes a second or more on a loaded box; a Ctrl-C in that second was a
``KeyboardInterrupt`` traceback (a new user's sweep: ``timeout -s INT 2 tuner run ...``). Nothing has
started then, so it is the same one line and exit 130 as an interrupt anywhere else before a change
(:func:`tuner.cli.main`).
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> None:
    """Entry point of the ``tuner`` script: :func:`tuner.cli.main`, its import interruptible."""
    try:
        from tuner.cli import main as cli_main
    except KeyboardInterrupt:
        sys.stderr.write("interrupted before the command started: nothing was changed\n")
        raise SystemExit(130) from None
    cli_main()
