"""sglang-tuner: auto-tune SGLang's memory and scheduling knobs with an Optuna study.

The layers, left to right (a module imports only from layers to its left, plus ``errors``):
config -> sglang/ (the facts) -> launch/ and load/ -> trial -> study -> apply / report -> cli.
``tuner.sim`` is apart: it imports nothing from ``tuner`` and re-derives SGLang's behaviour from
SGLang's own source, so tests never check the product against itself.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
