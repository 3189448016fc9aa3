"""The simulator's one error type: a startup or argument error in SGLang's one-line style.

``tuner.sim`` imports nothing from the rest of ``tuner`` (it stands in for SGLang), so it has its
own error class instead of ``tuner.errors``.
"""

from __future__ import annotations

__all__ = ["SimError"]


class SimError(Exception):
    """Bad simulator input (unknown preset, config.json missing a field, bad value).

    The message is one line, in SGLang's style: it names the flag, file or field, the bad value
    and the fix. ``python -m tuner.sim`` prints it and exits with status 2 (argparse's status),
    like SGLang's own server-args checks.
    """
