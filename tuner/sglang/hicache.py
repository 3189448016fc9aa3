"""The hierarchical cache's host pool: its size per rank and across ranks, and whether it fits the host.

Facts (``shared/sglang-reference.md`` §7, §4.3):

- The host pool is sized per rank: ``--hicache-size`` GB (decimal) over the host bytes per token,
  or the device pool's tokens times ``--hicache-ratio``; rounded up to whole pages
  (``(tokens // page + 1) × page``). The host bytes per token are the device KV cell of one rank
  (MHA: ``head_dim × kv_heads_per_rank × layers × dtype × 2``; MLA: ``(kv_lora_rank +
  qk_rope_head_dim) × layers × dtype``), so tp 8 pins eight pools on the same host (case-16:
  ``--hicache-size 40`` at tp 4 pinned 160 GB).
- SGLang checks each rank's pool against ``psutil`` available − 10 GiB when it allocates it; that
  reading is the host's, so a systemd unit's ``MemoryMax=`` is not seen: pinned pages beyond it
  end in the kernel's OOM killer (the unit dies, SIGKILL), and beyond the host's RAM the host's
  other services suffer first (InferenceX#2777).
- ≤ 0.5.10 also asserts host tokens > device tokens (ratio > 1); 0.5.16+ only warns. 0.5.23's ratio
  defaults to None: the pool then shrinks so that every rank fits ``--hicache-host-memory-fraction``
  (0.8) of host memory.
- It adds a prefix tier, not active capacity: running requests still fit the device pool.

:func:`host_pool` computes one config's pools; :func:`check_host_fit` compares them with what the
host and the unit's cgroup leave (:class:`HostMemory`), with a stated margin, and words the
arithmetic; :func:`preferred_size_knob` says which sizing knob a version prefers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from tuner.sglang.versions import at_least

__all__ = [
    "SGLANG_HOST_RESERVE_BYTES",
    "HOST_MARGIN_SHARE",
    "HOST_MARGIN_MIN_BYTES",
    "HostPool",
    "HostMemory",
    "HostFit",
    "host_pool",
    "check_host_fit",
    "preferred_size_knob",
    "default_ratio",
]

GIB = 2**30
SGLANG_HOST_RESERVE_BYTES = 10 * GIB
"""SGLang keeps ``psutil`` available − 10 GiB free when it allocates a host pool (§4.3, §7)."""
HOST_MARGIN_SHARE = 0.05
"""The tuner's own margin on top: 5 % of the limit it checks against ..."""
HOST_MARGIN_MIN_BYTES = 2 * GIB
"""... and at least 2 GiB (page cache, the server's own processes growing under load)."""


def default_ratio(version: str) -> float | None:
    """``--hicache-ratio``'s default: 2.0 up to 0.5.16, None (auto-sized to host memory) in 0.5.23 (§3.2, §7)."""
    return None if at_least(version, "0.5.23") else 2.0


def preferred_size_knob(version: str) -> str:
    """The sizing knob a version prefers: ``hicache_ratio`` (a multiple of the device pool) up to
    0.5.16, ``hicache_size`` (GB per rank) from 0.5.23, whose ratio defaults to None and is
    auto-sized from host memory (§7)."""
    return "hicache_size" if at_least(version, "0.5.23") else "hicache_ratio"


@dataclass(frozen=True)
class HostPool:
    """The pinned host pools of one config.

    Attributes:
        tokens_per_rank: One rank's host pool, tokens (page-rounded).
        bytes_per_rank: One rank's host pool, bytes.
        ranks: Ranks on this host (``tp × pp``), each pinning its own pool.
        source: How it was sized, e.g. ``--hicache-ratio 2 × 159,277 device tokens``.
    """

    tokens_per_rank: int
    bytes_per_rank: int
    ranks: int
    source: str

    @property
    def total_bytes(self) -> int:
        """``bytes_per_rank × ranks``: what the host pins."""
        return self.bytes_per_rank * self.ranks


def host_pool(params: Mapping[str, Any], *, device_tokens: int, cell_bytes: int, ranks: int, version: str,
              page_size: int = 1, host_total_bytes: int | None = None) -> HostPool | None:
    """The host pools ``params`` would pin (§7), or None without the hierarchical cache.

    Args:
        params: SGLang field names → values (``enable_hierarchical_cache``, ``hicache_size`` in
            decimal GB per rank, ``hicache_ratio``, ``hicache_host_memory_fraction``).
        device_tokens: The device pool's ``max_total_num_tokens`` at this config (the ratio's base).
        cell_bytes: KV bytes per token of one rank (the device cell, §1.3).
        ranks: Ranks on the host.
        version: SGLang version (the ratio's default).
        page_size: ``--page-size``.
        host_total_bytes: Host RAM, for 0.5.23's auto-sized ratio; None = not auto-sized.

    Returns:
        The :class:`HostPool`, or None.
    """
    if not params.get("enable_hierarchical_cache"):
        return None
    page = max(1, int(page_size or 1))
    cell = max(1, int(cell_bytes))
    size = float(params.get("hicache_size") or 0)
    ratio = params.get("hicache_ratio")
    if size > 0:
        tokens = int(size * 1e9 // cell)
        source = f"--hicache-size {size:g} GB per rank"
    else:
        auto = ratio is None and default_ratio(version) is None
        r = float(ratio if ratio is not None else (default_ratio(version) or 2.0))
        tokens = int(device_tokens * r)
        source = f"--hicache-ratio {r:g} × {device_tokens:,} device tokens"
        if auto and host_total_bytes:
            fraction = float(params.get("hicache_host_memory_fraction") or 0.8)
            fit = int(fraction * host_total_bytes / (max(1, ranks) * cell))
            if fit < tokens:
                tokens = fit
                source = f"auto-sized to {fraction:g} of host memory over {ranks} ranks"
    tokens = (tokens // page + 1) * page
    return HostPool(tokens_per_rank=tokens, bytes_per_rank=tokens * cell, ranks=max(1, ranks), source=source)


class HostMemory(BaseModel):
    """What the host and the service's cgroup leave for host pools, read before a launch.

    Attributes:
        mem_total_bytes: Host RAM (``MemTotal``, or the simulator's ``--sim-host-memory-gib``).
        mem_available_bytes: ``MemAvailable`` now (what ``psutil`` calls available).
        pinned_now_bytes: Host pools the running server pins now; a restart frees them, so they
            count as available to the next config.
        cgroup_max_bytes: The unit's ``MemoryMax`` (systemd) or cgroup ``memory.max``; None = none.
        cgroup_current_bytes: The unit's memory use now (``memory.current``), when known.
        source: Where the numbers came from (``/proc/meminfo + systemctl show``, ``/sim/host_memory``).
    """

    model_config = ConfigDict(frozen=True)

    mem_total_bytes: int
    mem_available_bytes: int
    pinned_now_bytes: int = 0
    cgroup_max_bytes: int | None = None
    cgroup_current_bytes: int | None = None
    source: str = ""


@dataclass(frozen=True)
class HostFit:
    """The verdict of :func:`check_host_fit`.

    Attributes:
        fits: Whether the pools fit both limits with the margin.
        reason: The arithmetic in one sentence (GB decimal as SGLang prints them, GiB for limits).
        limit: ``host`` or ``cgroup``: the limit that decided (the tighter one when it fits).
        headroom_bytes: What is left under the tighter limit after the pools and the margin
            (negative when it does not fit).
    """

    fits: bool
    reason: str
    limit: str
    headroom_bytes: int


def _margin(limit_bytes: int) -> int:
    return max(HOST_MARGIN_MIN_BYTES, int(HOST_MARGIN_SHARE * limit_bytes))


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def check_host_fit(pool: HostPool, host: HostMemory) -> HostFit:
    """Whether ``pool`` fits the host and the unit's cgroup, with the margin, and why.

    Host: ``pools ≤ MemAvailable + pinned now − 10 GiB (SGLang's reserve) − margin``. Cgroup:
    ``pools ≤ MemoryMax − (memory.current − pinned now) − margin``. The margin is
    :data:`HOST_MARGIN_SHARE` of the limit, at least :data:`HOST_MARGIN_MIN_BYTES`.

    Args:
        pool: The config's pools (:func:`host_pool`).
        host: The host's reading.

    Returns:
        The :class:`HostFit`; its ``reason`` names every number, e.g. ``host pool 40 GB per rank ×
        8 ranks = 320 GB (343.6 GiB pinned) does not fit the host: MemAvailable 251.3 GiB + 0.0 GiB
        pinned now − 10 GiB SGLang reserve − 12.6 GiB margin = 228.7 GiB``.
    """
    want = pool.total_bytes
    head = (f"host pool {pool.bytes_per_rank / 1e9:.2f} GB per rank × {pool.ranks} rank"
            f"{'s' if pool.ranks != 1 else ''} = {want / 1e9:.2f} GB ({_gib(want)} pinned; {pool.source})")
    room_host = host.mem_available_bytes + host.pinned_now_bytes - SGLANG_HOST_RESERVE_BYTES
    m_host = _margin(host.mem_total_bytes or room_host)
    left_host = room_host - m_host
    host_text = (f"MemAvailable {_gib(host.mem_available_bytes)} + {_gib(host.pinned_now_bytes)} pinned now "
                 f"− 10.0 GiB SGLang reserve − {_gib(m_host)} margin = {_gib(left_host)}")
    checks = [("host", left_host - want, f"the host: {host_text}")]
    if host.cgroup_max_bytes is not None:
        other = max(0, (host.cgroup_current_bytes or 0) - host.pinned_now_bytes)
        m_cg = _margin(host.cgroup_max_bytes)
        left_cg = host.cgroup_max_bytes - other - m_cg
        checks.append(("cgroup", left_cg - want,
                       f"the unit's MemoryMax: {_gib(host.cgroup_max_bytes)} − {_gib(other)} other use "
                       f"− {_gib(m_cg)} margin = {_gib(left_cg)}"))
    limit, headroom, text = min(checks, key=lambda c: c[1])
    if headroom < 0:
        return HostFit(False, f"{head} does not fit {text}", limit, headroom)
    return HostFit(True, f"{head} fits {text}", limit, headroom)
