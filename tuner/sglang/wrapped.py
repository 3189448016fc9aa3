"""What an exception SGLang wraps says about its cause: memory, something else, or unknown.

One concept: SGLang catches *every* exception of CUDA-graph capture and re-raises it as
``Exception(f"Capture cuda graph failed: {e}\\n{CUDA_GRAPH_CAPTURE_FAILED_MSG}")``, whose advice
("set --mem-fraction-static to a smaller value", "set --cuda-graph-max-bs to a smaller value") is
about memory whatever ``e`` was (0.5.5.post3 ``srt/model_executor/cuda_graph_runner.py`` line 396,
``piecewise_cuda_graph_runner.py`` line 208, ``speculative/eagle_draft_cuda_graph_runner.py``
line 137, ``eagle_draft_extend_cuda_graph_runner.py`` line 179). The wrapper line is therefore
not evidence of memory: the wrapped text ``e`` decides (a closed gloo TCP pair is a network fault,
case-66), and where the line is cut before it, the cause is unknown.
"""

from __future__ import annotations

import re
from typing import Literal

__all__ = ["CAPTURE_FAILED", "Cause", "capture_cause", "MEMORY_WORDS"]

CAPTURE_FAILED = re.compile(r"Capture cuda graph failed:?\s*(?P<cause>.*)")
"""SGLang's wrapper line (every version since 0.3, see the module doc); ``cause`` is ``str(e)``."""

MEMORY_WORDS = re.compile(r"(?i)out of mem|OutOfMemory|\bOOM\b|cudaErrorMemoryAllocation|hipErrorOutOfMemory|Tried to allocate"
                          r"|memory allocation failed")
"""torch's and the CUDA/HIP runtimes' words for an allocation that failed (a cut ``out of mem`` included)."""

_MIN_CAUSE_CHARS = 12
"""A wrapped text shorter than this (``CUDA er``) is a line cut before the cause could be read."""

Cause = Literal["memory", "other", "unknown"]


def capture_cause(line: str) -> Cause:
    """The cause a ``Capture cuda graph failed: {e}`` line states.

    Args:
        line: The wrapper line, prefixes stripped.

    Returns:
        ``memory`` when ``e`` is an allocation failure (torch's ``CUDA out of memory. Tried to
        allocate ...``, ``CUDA error: out of memory``, a HIP OOM); ``other`` when ``e`` is any other
        readable text (a gloo/NCCL fault, a kernel error); ``unknown`` when the line holds no
        readable ``e`` (cut after the colon, or a few characters of it).
    """
    m = CAPTURE_FAILED.search(line)
    cause = m.group("cause").strip() if m else ""
    if MEMORY_WORDS.search(cause):
        return "memory"
    return "other" if len(cause) >= _MIN_CAUSE_CHARS else "unknown"
