"""Read the host memory a service's next start can pin: ``MemAvailable``, the unit's ``MemoryMax``.

Sources, in order:

* the simulator (a command running ``tuner.sim``): ``GET /sim/host_memory`` while it runs (the
  simulated host's RAM and the pools pinned now), else its command line
  (``--sim-host-memory-gib``, default 512; ``--sim-memory-max`` GiB);
* a real host: ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``).

The cgroup limit: a systemd unit's ``systemctl show -p MemoryMax,MemoryCurrent,ControlGroup``
(``infinity`` = none; when systemd sets none, the unit's own ``memory.max`` under
``/sys/fs/cgroup/<ControlGroup>``), or for a child process the tuner's own cgroup (v2
``memory.max``, v1 ``memory.limit_in_bytes``), which the child inherits. Why both: SGLang's own
check reads the host's available memory and never the cgroup (``shared/sglang-reference.md`` §7).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests

from tuner.errors import LaunchError
from tuner.sglang.flags import flag_value, runs_simulator
from tuner.sglang.hicache import GIB, HostMemory

__all__ = ["read_host_memory", "cgroup_limit", "meminfo"]

log = logging.getLogger(__name__)

_V1_UNLIMITED = 1 << 62
_SIM_DEFAULT_HOST_GIB = 512.0


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` as bytes by field (``MemTotal``, ``MemAvailable``, ...); {} when unreadable."""
    out: dict[str, int] = {}
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup",
                 group: str | None = None) -> tuple[int | None, int | None]:
    """``(limit, current)`` bytes of a cgroup: ``group`` (a path such as
    ``/system.slice/sglang.service``) or this process's own; ``None`` where unlimited or unknown."""
    entries: list[tuple[str, str, str]] = []
    if group is not None:
        entries = [("0", "", group), ("x", "memory", group)]
    else:
        try:
            for line in Path(proc_cgroup).read_text().splitlines():
                parts = line.split(":", 2)
                if len(parts) == 3:
                    entries.append((parts[0], parts[1], parts[2]))
        except OSError:
            return None, None
    for hierarchy, controllers, path in entries:
        if hierarchy == "0" and not controllers:
            base = Path(root) / path.lstrip("/")
            limit = _read_int(base / "memory.max")
            if limit is not None or (base / "memory.max").exists():
                return limit, _read_int(base / "memory.current")
    for _h, controllers, path in entries:
        if "memory" in controllers.split(","):
            base = Path(root) / "memory" / path.lstrip("/")
            limit = _read_int(base / "memory.limit_in_bytes")
            current = _read_int(base / "memory.usage_in_bytes")
            return (limit if limit is not None and limit < _V1_UNLIMITED else None), current
    return None, None


def _bytes_or_none(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    return int(value) if value.isdigit() and int(value) < _V1_UNLIMITED else None


def _unit_limit(unit: Any, root: str) -> tuple[int | None, int | None]:
    try:
        props = unit.show("MemoryMax", "MemoryCurrent", "ControlGroup")
    except LaunchError as err:
        log.warning("cannot read %s's MemoryMax (%s); checking host memory only", unit.name, err)
        return None, None
    limit, current = _bytes_or_none(props.get("MemoryMax")), _bytes_or_none(props.get("MemoryCurrent"))
    group = props.get("ControlGroup") or ""
    if limit is None and group:
        limit, own = cgroup_limit(root=root, group=group)
        current = current if current is not None else own
    return limit, current


def read_host_memory(argv: Sequence[str], *, url: str | None = None, unit: Any | None = None,
                     pinned_now_bytes: int = 0, meminfo_path: str = "/proc/meminfo",
                     cgroup_root: str = "/sys/fs/cgroup", timeout_s: float = 2.0) -> HostMemory:
    """What the host and the service's cgroup leave for the next start's host pools.

    Args:
        argv: The service's command (decides simulator or real host).
        url: The server's base URL (the simulator's ``/sim/host_memory``).
        unit: The systemd unit (:class:`tuner.launch.unit.SystemdUnit`), None for a child process.
        pinned_now_bytes: Host pools the running server pins now (a restart frees them); the
            simulator reports its own and this is then ignored.
        meminfo_path, cgroup_root: Where the kernel's files are (tests point them elsewhere).
        timeout_s: HTTP timeout for the simulator.

    Returns:
        The :class:`~tuner.sglang.hicache.HostMemory` reading.
    """
    sim = runs_simulator(argv)
    own = flag_value(argv, "--sim-memory-max") if sim else None
    if unit is not None:
        limit, current = _unit_limit(unit, cgroup_root)
        where = f"systemctl show -p MemoryMax {unit.name}"
    elif not sim or own == "auto":
        limit, current = cgroup_limit(root=cgroup_root)
        where = "the tuner's cgroup (inherited by the server)"
    else:
        limit, current, where = None, None, "no cgroup limit (--sim-memory-max none)"
    if sim and own not in (None, "none", "auto"):
        try:
            given = int(float(own) * GIB)
        except ValueError:
            given = None
        if given is not None and (limit is None or given < limit):
            limit, current, where = given, None, f"--sim-memory-max {own}"
    if sim:
        if url is not None:
            try:
                body = requests.get(url.rstrip("/") + "/sim/host_memory", timeout=timeout_s).json()
                return HostMemory(
                    mem_total_bytes=int(body["total_bytes"]), mem_available_bytes=int(body["available_bytes"]),
                    pinned_now_bytes=int(body["pinned_bytes"]), cgroup_max_bytes=limit,
                    cgroup_current_bytes=current, source=f"/sim/host_memory; {where}",
                )
            except (requests.RequestException, ValueError, KeyError, TypeError):
                pass  # not running (or not answering): its command line says what the host is
        total = int(float(flag_value(argv, "--sim-host-memory-gib") or _SIM_DEFAULT_HOST_GIB) * GIB)
        return HostMemory(mem_total_bytes=total, mem_available_bytes=total, cgroup_max_bytes=limit,
                          cgroup_current_bytes=current,
                          source=f"the simulator's --sim-host-memory-gib {total / GIB:g}; {where}")
    info = meminfo(meminfo_path)
    total = info.get("MemTotal", 0)
    return HostMemory(mem_total_bytes=total, mem_available_bytes=info.get("MemAvailable", total),
                      pinned_now_bytes=pinned_now_bytes, cgroup_max_bytes=limit, cgroup_current_bytes=current,
                      source=f"{meminfo_path}; {where}")
