"""Where a failure happened, as far as the log shows it: the phase, or ``unknown`` and the line that would settle it.

One concept: a failure's phase is asserted only from evidence. SGLang prints a line at each step
of a start (``shared/sglang-reference.md`` §4.2: ``Init torch distributed``, ``Load weight
begin/end``, ``KV Cache is allocated``, ``Memory pool end``, ``Capture cuda graph begin/end``, the
scheduler's ``max_total_num_tokens=`` line, ``The server is fired up and ready to roll!``) and,
while serving, ``Prefill batch`` / ``Decode batch`` lines (§4.5, ``scheduler_metrics_mixin.py``
``log_prefill_stats`` / ``log_decode_stats``, 0.5.5.post3) and request lines. An excerpt that holds
none of them (a traceback alone, a cut report) does not say whether the server was starting or
serving: the phase is :data:`UNKNOWN`, never ``init``, and the report names the line that would
settle it (:func:`settling_line`).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["UNKNOWN", "SERVING", "STARTUP", "failure_phase", "settling_line", "FORWARD_FRAMES", "startup_frame"]

UNKNOWN = "unknown"
"""The phase of a failure whose log shows no startup line and nothing of serving."""

SERVING = "serving"
"""The phase of a failure after a ready line, a batch line, a request line or a benchmark client."""

STARTUP = "startup"
"""The phase of a failure whose traceback runs through the server's construction (``Scheduler.__init__
→ init_model_worker``, ``ModelRunner.__init__``) while the log shows no startup line: starting, at a
step the log does not show."""

_STARTUP_FILES = ("managers/scheduler.py", "managers/tp_worker.py", "managers/tp_worker_overlap_thread.py", "model_executor/model_runner.py")
_STARTUP_FUNCS = frozenset({"init_model_worker", "init_tp_model_worker", "init_memory_pool", "init_cuda_graphs", "init_device_graphs",
                            "init_torch_distributed", "load_model", "init_attention_backend", "initialize"})


def startup_frame(file: str, func: str) -> bool:
    """Whether a traceback frame belongs to the server's construction (0.5.5.post3
    ``managers/scheduler.py`` ``Scheduler.__init__`` → ``init_model_worker``, ``managers/tp_worker.py``
    ``TpModelWorker.__init__``, ``model_executor/model_runner.py`` ``ModelRunner.__init__`` →
    ``initialize`` / ``load_model`` / ``init_memory_pool`` / ``init_cuda_graphs``)."""
    return func in _STARTUP_FUNCS or (func == "__init__" and file.replace("\\", "/").endswith(_STARTUP_FILES))

FORWARD_FRAMES = (r"^(?:forward_extend|forward_decode|forward_idle|forward_split_prefill|_forward_raw|forward_batch_generation|run_batch"
                  r"|init_forward_metadata|update_single_wrapper|call_begin_forward|begin_forward|(?:\w+_)?plan(?:_\w+)?)$")
"""Traceback functions that run a forward pass of a batch (the model's ``forward_extend`` /
``forward_decode``, an attention backend's ``init_forward_metadata`` and its prefill/decode
``call_begin_forward`` / ``plan``, e.g. flashinfer's ``BatchPrefillWithPagedKVCacheWrapper.plan``; ``model_runner.py`` and
``layers/attention/*_backend.py``, 0.5.5.post3): a batch was running (the warm-up request or a
served one), whatever phase lines the excerpt lacks. Graph capture calls the same forward functions,
so a capture frame anywhere in the traceback wins over these."""


def failure_phase(reached: str, *, startup_seen: bool, serving: bool, in_construction: bool = False) -> str:
    """The phase to state for a failure.

    Args:
        reached: The last startup phase a phase line set (:attr:`tuner.sglang.logs.LogWatcher.phase`;
            ``init`` before any).
        startup_seen: Whether any startup line was seen (a server_args echo, the launch command,
            distributed init, weight loading, ...): only then is ``init`` a fact.
        serving: Whether anything of serving was seen (ready, batch, request or benchmark lines).
        in_construction: Whether the traceback runs through the server's construction (:func:`startup_frame`).

    Returns:
        ``serving`` once serving was seen, else ``reached`` when a startup line was seen, else
        :data:`STARTUP` when the traceback shows the construction, else :data:`UNKNOWN`.
    """
    if serving:
        return SERVING
    if startup_seen:
        return reached
    return STARTUP if in_construction else UNKNOWN


def settling_line(kind: Literal["phase", "step", "cause"] = "phase") -> str:
    """What line would settle what the log cannot say, in the report's words.

    Args:
        kind: ``phase``: where the failure happened; ``step``: which startup step (the traceback
            shows the construction); ``cause``: what a wrapped exception was.

    Returns:
        One sentence naming SGLang's lines (§4.2, §4.5) that would decide it.
    """
    if kind == "step":
        return ("a startup line before it ('Load weight begin', 'KV Cache is allocated', 'Capture cuda graph begin') would settle which "
                "startup step it was")
    if kind == "cause":
        return ("the wrapped exception's own text (the line after 'Capture cuda graph failed:', e.g. torch's 'CUDA out of memory. "
                "Tried to allocate ...') would settle whether memory was the cause")
    return ("a startup line before it ('Load weight begin', 'KV Cache is allocated', 'Capture cuda graph begin') or a 'Prefill batch' / "
            "'Decode batch' line would settle whether the server was starting or serving")
