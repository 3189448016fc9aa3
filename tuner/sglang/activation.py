"""The activation peak of a prefill chunk: how much runtime headroom a deployment needs after graphs.

One concept: what must stay free once the server started (after the KV pool and CUDA graphs, the
``available_gpu_mem`` of the scheduler line or the ``avail mem`` of ``Capture cuda graph end``)
for the activations of a prefill chunk. SGLang's own rule, the one its default
``mem_fraction_static`` reserves, is ``max(chunked_prefill_size, 2048) × 1.5`` MB for "activation
during large prefill" (``max_prefill_tokens`` when chunking is off), besides 512 MB of constant
attention-backend metadata, CUDA graphs (``cuda_graph_max_bs × 2`` MB) and ``tp / 8 × 1024`` MB, which
are allocated by the time the free memory after graphs is read, so they are not part of what must
still be free (0.5.5.post3 ``srt/server_args.py`` lines 801-810,
``_handle_gpu_memory_settings``; ``shared/sglang-reference.md`` §1.6). Under DP attention SGLang
itself stores the per-rank chunk (``chunked_prefill_size // dp_size``, ``_handle_data_parallelism``,
printed so by the scheduler line and the ``server_args`` echo), so the logged chunk is the one a rank
prefills. The threshold follows the deployment's chunk, not a constant; where the chunk is not known, :data:`FALLBACK_GIB` is used and said.
"""

from __future__ import annotations

__all__ = ["ACTIVATION_MB_PER_TOKEN", "MIN_CHUNK_TOKENS", "FALLBACK_GIB", "prefill_peak_gib"]

ACTIVATION_MB_PER_TOKEN = 1.5
"""MB (SGLang's ``reserved_mem`` unit, MiB in practice: it is compared with ``gpu_mem`` in MiB) of
activations per prefill token (0.5.5.post3 ``server_args.py`` line 804)."""

MIN_CHUNK_TOKENS = 2048
"""SGLang reserves for at least this chunk (``max(self.chunked_prefill_size, 2048)``)."""

FALLBACK_GIB = 1.0
"""The threshold used when the chunk size is not known (no scheduler line, no arguments)."""


def prefill_peak_gib(chunked_prefill_size: int | None, *, max_prefill_tokens: int | None = None) -> float | None:
    """The runtime headroom SGLang's own rule sets aside for one prefill chunk's activations.

    Args:
        chunked_prefill_size: The chunk one rank prefills as SGLang logs it (tokens; ``-1`` or ``0``:
            chunking off), ``None`` when not known.
        max_prefill_tokens: ``--max-prefill-tokens`` (tokens), used when chunking is off.

    Returns:
        ``max(chunk, 2048) × 1.5 / 1024`` GiB, or ``None`` when the chunk is not known.
    """
    chunk = chunked_prefill_size
    if chunk is not None and chunk <= 0:
        chunk = max_prefill_tokens
    if chunk is None:
        return None
    return max(chunk, MIN_CHUNK_TOKENS) * ACTIVATION_MB_PER_TOKEN / 1024
