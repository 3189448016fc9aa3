"""Rendering of stored results: :mod:`.tables` (terminal), :mod:`.html` (the HTML report),
:mod:`.dashboard` (the optuna-dashboard process), :mod:`.explain` (``tuner explain``'s text view
of :class:`tuner.sglang.explain.Explanation`). Reads :mod:`tuner.results` and the explanation."""

__all__: list[str] = []
