"""Which decode batch sizes SGLang captures as CUDA graphs, and how a batch between or above them runs.

Read from SGLang's own source (0.5.5.post3, 0.5.10 and 0.5.23 read alike,
``shared/sglang-reference.md`` §2.1):

- **The default list** (``ServerArgs._generate_cuda_graph_batch_sizes``; 0.5.23:
  ``generate_decode_cuda_graph_batch_sizes`` in ``arg_groups/cuda_graph_hook.py``):
  ``[1, 2, 4, 8, 12] + 16..256 step 8 + 272..496 step 16 + 512..max_bs step 32``; with speculative
  decoding ``1..8, 10..32 step 2, 40..64 step 4, 72..256 step 8, 272..max_bs step 16``; with
  ``--disable-cuda-graph-padding`` every size ``1..max_bs``. Cut at ``cuda_graph_max_bs``;
  ``--cuda-graph-bs`` replaces the list (and ``max_bs`` is its largest). 0.5.10 and 0.5.23 append
  ``max_bs`` itself when the list lacks it (``max_bs = 300`` captures 300; 0.5.5 stops at 288).
- **``cuda_graph_max_bs``** defaults by GPU memory and tp (§2.1's table); 0.5.23 lowers a default
  above a set ``max_running_requests`` to it.
- **The request table bounds it** (``get_batch_sizes_to_capture``, ``cuda_graph_runner.py``;
  0.5.23 ``runner/base_cuda_graph_runner.py``): when the list's largest size is above the
  req_to_token pool (``max_running_requests`` when set), the pool size is *added* to the list, then
  every size above the pool is dropped. So ``max_running_requests = 31`` under a ``max_bs`` of 256
  captures ``[1, 2, 4, 8, 12, 16, 24, 31]``: every batch it can run has a graph.
- **How a batch runs** (``CudaGraphRunner.can_run`` / ``replay_prepare``): with padding (the
  default) a batch of ``bs ≤ max(captured)`` replays the graph of the next captured size
  (``bisect_left``), the extra rows padded; above the largest captured size it runs eagerly
  (the Decode log line says ``cuda graph: False``). With ``--disable-cuda-graph-padding`` only a
  captured size replays a graph; any other batch runs eagerly.
- The log prints the captured list: ``Capture cuda graph bs [1, 2, ...]`` (0.5.5, 0.5.10, rank 0),
  ``Capture target decode CUDA graph end. bs=[...]`` (0.5.23); read there when present
  (:class:`tuner.sglang.logs.RankMemory.graph_bs`), predicted here otherwise.

So request slots above the largest captured size decode without graphs (slower per step, higher
ITL): a latency measured at one request count says nothing about a count with *better* graph
coverage of the batches in between (:meth:`GraphCoverage.covers_as_well`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["default_capture_bs", "default_cuda_graph_max_bs", "captured_bs", "GraphCoverage", "GraphFacts"]


def default_capture_bs(max_bs: int, *, speculative: bool = False, disable_padding: bool = False,
                       version: str = "0.5.5") -> tuple[int, ...]:
    """SGLang's default capture list cut at ``max_bs`` (§2.1); 0.5.10 and 0.5.23 append ``max_bs``
    when the list lacks it (0.5.5 does not: its ``max_bs = 300`` captures up to 288)."""
    if disable_padding:
        sizes = list(range(1, max_bs + 1))
    elif speculative:
        sizes = (list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4))
                 + list(range(72, 257, 8)) + list(range(272, max_bs + 1, 16)))
    else:
        sizes = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
                 + list(range(512, max_bs + 1, 32)))
    out = [s for s in sizes if s <= max_bs]
    if not version.startswith("0.5.5") and max_bs > 0 and max_bs not in out:
        out.append(max_bs)
    return tuple(out)


def default_cuda_graph_max_bs(gpu_mib: float | None, tp_size: int = 1, version: str = "0.5.5") -> int:
    """``cuda_graph_max_bs`` when unset, by the GPU's nvidia-smi MiB and tp (§2.1's table)."""
    big = tp_size >= 4
    if gpu_mib is None:
        return 160
    if gpu_mib < 20480:
        return 8
    if gpu_mib < 35840:
        return (160 if big else 48) if version.startswith("0.5.23") else (80 if big else 24)
    if gpu_mib < 61440:
        return 160 if big else 32
    if gpu_mib < 163840:
        return 512 if big else 256
    return 512


def captured_bs(sizes: Sequence[int], pool_size: int | None) -> tuple[int, ...]:
    """The sizes captured from the list ``sizes`` with a req_to_token pool of ``pool_size`` rows
    (``max_running_requests`` when set; ``None``: not bounded): the pool size added when the
    list goes above it, then every size above it dropped (§2.1, ``get_batch_sizes_to_capture``)."""
    out = [int(s) for s in sizes]
    if pool_size is not None and pool_size > 0:
        if out and max(out) > pool_size:
            out.append(int(pool_size))
        out = [s for s in out if s <= pool_size]
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class GraphCoverage:
    """The decode batches of one server that replay a CUDA graph.

    Attributes:
        captured: The captured batch sizes, ascending (empty: graphs disabled).
        padding: A batch between captured sizes replays the next one's graph (SGLang's default);
            ``False`` (``--disable-cuda-graph-padding``): it runs eagerly.
    """

    captured: tuple[int, ...]
    padding: bool = True

    @classmethod
    def predict(cls, *, max_bs: int, max_running_requests: int | None, speculative: bool = False,
                disable_padding: bool = False, version: str = "0.5.5", user_bs: Sequence[int] | None = None,
                max_bs_is_default: bool = False) -> GraphCoverage:
        """The coverage SGLang sets up for these flags (module docstring; ``max_bs_is_default``:
        0.5.23 lowers a default ``max_bs`` to a set ``max_running_requests``)."""
        if user_bs:
            sizes: tuple[int, ...] = tuple(sorted(set(int(b) for b in user_bs)))
        else:
            if (version.startswith("0.5.23") and max_bs_is_default and max_running_requests
                    and max_bs > max_running_requests):
                max_bs = int(max_running_requests)
            sizes = default_capture_bs(max_bs, speculative=speculative, disable_padding=disable_padding,
                                       version=version)
        return cls(captured=captured_bs(sizes, max_running_requests), padding=not disable_padding)

    @property
    def largest(self) -> int:
        """The largest batch that replays a graph (0: none)."""
        return self.captured[-1] if self.captured else 0

    def graph_bs(self, bs: int) -> int | None:
        """The captured size batch ``bs`` replays (padded up to it), or ``None`` when it runs eagerly."""
        if bs <= 0 or bs > self.largest:
            return None
        i = bisect.bisect_left(self.captured, bs)
        size = self.captured[i]
        return size if self.padding or size == bs else None

    def eager_above(self, running: int) -> int | None:
        """The smallest batch of ``1..running`` that runs eagerly, or ``None`` when all replay a graph."""
        if self.padding:
            return self.largest + 1 if running > self.largest else None
        return next((b for b in range(1, running + 1) if self.graph_bs(b) is None), None)

    def covers_as_well(self, other: GraphCoverage, running: int) -> bool:
        """Whether every batch of ``1..running`` that replays a graph under ``other`` also does under
        this coverage. Then this server decodes none of those batches slower than ``other`` for want
        of a graph, so a latency SLO this server broke running ``running`` requests at once is broken
        by ``other`` running at least as many (the monotone rule of :mod:`tuner.study.slo_bound`,
        which holds within equal coverage and not across a captured size)."""
        if self.padding and other.padding:  # the graphed batches are 1..largest
            return min(self.largest, running) >= min(other.largest, running)
        return all(self.graph_bs(b) is not None for b in range(1, running + 1) if other.graph_bs(b) is not None)

    def snap_down(self, count: int) -> int:
        """The largest captured size at most ``count`` (``count`` itself when no graph is captured
        below it): a request count that leaves no batch of the running set above the graphs."""
        i = bisect.bisect_right(self.captured, count)
        return self.captured[i - 1] if i else count


@dataclass(frozen=True)
class GraphFacts:
    """What a study knows of its server's decode CUDA graphs: the version's rules and the unit's
    own settings, to predict the coverage of a config the log has not shown yet.

    Attributes:
        version: The SGLang version (0.5.5 does not append ``max_bs`` to the list).
        default_max_bs: The unit's resolved ``cuda_graph_max_bs`` (``/get_server_info``), used when a
            config does not set it; ``None``: unknown (no prediction).
        speculative: The list is speculative decoding's (the log's list holds 3 and 10).
        padding: ``False`` when the unit runs ``--disable-cuda-graph-padding`` (the log's list is
            every size from 1).
    """

    version: str = "0.5.5"
    default_max_bs: int | None = None
    speculative: bool = False
    padding: bool = True

    @classmethod
    def read(cls, logged: Sequence[int] | None, default_max_bs: int | None, version: str | None) -> GraphFacts:
        """The facts of a unit whose log listed ``logged`` (``Capture cuda graph bs [...]``) and whose
        server reported ``default_max_bs``."""
        sizes = sorted(set(int(b) for b in logged or ()))
        contiguous = len(sizes) >= 13 and sizes == list(range(1, len(sizes) + 1))
        return cls(version=version or "0.5.5", default_max_bs=int(default_max_bs) if default_max_bs else None,
                   speculative=3 in sizes and not contiguous, padding=not contiguous)

    def coverage(self, max_running_requests: int, cuda_graph_max_bs: int | None = None) -> GraphCoverage | None:
        """The predicted coverage of a server with these request slots (and ``cuda_graph_max_bs``
        when a config sets it), or ``None`` when the graphs' size is not known."""
        max_bs = cuda_graph_max_bs or self.default_max_bs
        if not max_bs:
            return None
        return GraphCoverage.predict(max_bs=int(max_bs), max_running_requests=int(max_running_requests),
                                     speculative=self.speculative, disable_padding=not self.padding,
                                     version=self.version, max_bs_is_default=cuda_graph_max_bs is None)
