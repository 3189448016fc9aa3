"""An SGLang-compatible simulated server for machines without GPUs.

It imports nothing from the rest of ``tuner``: its behaviour is re-derived from SGLang's source
(``shared/sglang-reference.md``), so tests never check the product against itself.
"""
