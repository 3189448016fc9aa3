"""``python -m tuner.cli``: the ``tuner`` script."""

from tuner.cli import main

main()
