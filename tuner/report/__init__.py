"""Rendering of stored results: :mod:`.tables` (terminal), :mod:`.html` (the HTML report),
:mod:`.dashboard` (the optuna-dashboard process). Reads only :mod:`tuner.results`."""

__all__: list[str] = []
