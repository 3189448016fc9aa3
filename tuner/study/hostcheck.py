"""Host-memory safety before a launch: a config whose hierarchical-cache pools do not fit is skipped.

The study never restarts the service with a host pool (per rank × ranks, §7) that the host's
``MemAvailable`` or the unit's ``MemoryMax`` cannot hold with the margin of
:func:`tuner.sglang.hicache.check_host_fit`: the trial is told PRUNED with the arithmetic as its
reason, the way configs an earlier failure proves infeasible are (``shared/sglang-reference.md``
§7, case-16). The device pool a ratio multiplies comes from the newest measured trial's calibrated
memory model at the candidate's ``mem_fraction_static``; the host bytes per token are that model's
KV cell (one rank's device cell, §7).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tuner.records import TrialRecord
from tuner.sglang.flags import flag_int
from tuner.sglang.hicache import HostMemory, HostPool, check_host_fit, host_pool
from tuner.sglang.memory import KVCapacityModel

__all__ = ["ranks_of", "pool_for", "host_skip_reason"]


def ranks_of(argv: Sequence[str]) -> int:
    """Ranks a server command runs on this host: ``--tp-size`` × ``--pp-size`` (any spelling of
    each, :func:`~tuner.sglang.flags.flag_int`; 1 for one that is absent or not a positive integer)."""
    tp = flag_int(argv, "--tp-size", "--tp", "--tensor-parallel-size") or 1
    pp = flag_int(argv, "--pp-size", "--pp", "--pipeline-parallel-size") or 1
    return max(1, tp) * max(1, pp)


def _calibration(done: Sequence[tuple[int, TrialRecord]]) -> tuple[int, KVCapacityModel] | None:
    for number, record in reversed(done):
        if record.memory.capacity_model is not None:
            return number, record.memory.capacity_model
    return None


def pool_for(params: Mapping[str, Any], done: Sequence[tuple[int, TrialRecord]], *, version: str, ranks: int,
             page_size: int = 1, host_total_bytes: int | None = None) -> tuple[HostPool, int] | None:
    """The host pools ``params`` would pin and the trial whose memory model sized them, or None
    (no hierarchical cache, or no measured trial to size a ratio from)."""
    if not params.get("enable_hierarchical_cache"):
        return None
    found = _calibration(done)
    if found is None:
        return None
    number, model = found
    mfs = params.get("mem_fraction_static") or model.observed_mem_fraction_static or 0.88
    tokens = model.tokens(float(mfs), page_size=page_size, max_total_tokens=model.max_total_tokens)
    pool = host_pool(params, device_tokens=tokens, cell_bytes=model.cell_bytes, ranks=ranks, version=version,
                     page_size=page_size, host_total_bytes=host_total_bytes)
    return (pool, number) if pool is not None else None


def host_skip_reason(params: Mapping[str, Any], done: Sequence[tuple[int, TrialRecord]], host: HostMemory | None,
                     *, version: str, ranks: int, page_size: int = 1) -> tuple[str, int] | None:
    """Why ``params`` must not be launched on this host, with the proving trial, or None.

    Args:
        params: The candidate (SGLang field names).
        done: Finished trials ``(number, record)``, oldest first.
        host: The host's reading before this launch (None: no check).
        version: SGLang version (the ratio's default, 0.5.23's auto-sizing).
        ranks: Ranks on the host (:func:`ranks_of`).
        page_size: ``--page-size``.

    Returns:
        ``("host memory: host pool ... does not fit ...", calibration trial)`` or None.
    """
    if host is None:
        return None
    found = pool_for(params, done, version=version, ranks=ranks, page_size=page_size,
                     host_total_bytes=host.mem_total_bytes)
    if found is None:
        return None
    pool, number = found
    fit = check_host_fit(pool, host)
    if fit.fits:
        return None
    return f"host memory: {fit.reason} (read from {host.source})", number
