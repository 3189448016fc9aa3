"""GPU memory monitor: per-GPU total/used/peak, the processes holding each GPU, release and foreign checks.

Two backends behind one :class:`GPUBackend` protocol:

* :class:`NvmlBackend` reads NVML through ``nvidia-ml-py`` (imported lazily, so hosts without it
  still import this module). Without an NVIDIA driver NVML raises ``NVMLError_LibraryNotFound``;
  that becomes one :class:`~tuner.errors.GPUError` line.
* :class:`SimBackend` reads the simulator's device-memory ledger at ``GET /sim/device_memory``
  (per GPU ``total_mib``, ``used_mib``, ``peak_used_mib``, ``free_mib``).

Why it matters (``shared/sglang-reference.md`` §1.1-1.2): SGLang sizes its KV pool from the free
memory at startup, so memory still held by the previous server (not fully exited) or by a foreign
process shrinks the pool or trips the unbalanced-memory check. Before each start a launcher calls
:meth:`GPUMonitor.wait_released` and :meth:`GPUMonitor.check_foreign`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import requests
from pydantic import BaseModel, ConfigDict

from tuner.errors import GPUError

__all__ = [
    "GPUMemory",
    "GPUProcess",
    "GPUPeak",
    "GPUBackend",
    "NvmlBackend",
    "SimBackend",
    "GPUWindow",
    "GPUMonitor",
]

log = logging.getLogger(__name__)

_MIB = 2**20


class GPUMemory(BaseModel):
    """One GPU's memory at one instant, in MiB (2^20 bytes).

    Attributes:
        index: GPU index as the backend numbers it.
        name: Product name (``NVIDIA H100 80GB HBM3``), or the simulator's preset.
        total_mib: Total memory.
        used_mib: Used memory (by every process and the driver).
        free_mib: Free memory.
        peak_used_mib: Peak used since the backend started counting, when it knows it (simulator).
    """

    model_config = ConfigDict(frozen=True)

    index: int
    name: str = ""
    total_mib: float
    used_mib: float
    free_mib: float
    peak_used_mib: float | None = None

    @property
    def used_gib(self) -> float:
        """Used memory in GiB."""
        return self.used_mib / 1024


class GPUProcess(BaseModel):
    """A process holding memory on one GPU.

    Attributes:
        gpu_index: The GPU.
        pid: PID as NVML reports it (host PID namespace).
        used_mib: Memory it holds (``None`` when the driver does not say).
        name: Process name when readable.
    """

    model_config = ConfigDict(frozen=True)

    gpu_index: int
    pid: int
    used_mib: float | None = None
    name: str | None = None


class GPUPeak(BaseModel):
    """Per-GPU figures over a sampling window (MiB).

    Attributes:
        index: GPU index.
        total_mib: Total memory.
        min_used_mib: Lowest used sample.
        peak_used_mib: Highest used sample (or the backend's own peak, if higher).
        last_used_mib: Last sample.
        samples: Number of samples taken.
    """

    model_config = ConfigDict(frozen=True)

    index: int
    total_mib: float
    min_used_mib: float
    peak_used_mib: float
    last_used_mib: float
    samples: int


class GPUBackend(Protocol):
    """Where memory figures come from (NVML or the simulator)."""

    def memory(self) -> list[GPUMemory]:
        """Every GPU's memory now. Raises GPUError when the source is unavailable."""

    def processes(self) -> list[GPUProcess]:
        """Processes holding GPU memory now."""


class NvmlBackend:
    """NVML through ``nvidia-ml-py``.

    Raises:
        GPUError: From the constructor, when ``nvidia-ml-py`` is not installed or there is no
            NVIDIA driver (``NVMLError_LibraryNotFound``) or NVML fails to initialize.
    """

    def __init__(self) -> None:
        try:
            import pynvml  # nvidia-ml-py
        except ImportError as err:
            raise GPUError("nvidia-ml-py is not installed: cannot read GPU memory",
                           hint="pip install nvidia-ml-py, or set [service] gpu_monitor = \"sim\" (the simulator) or \"none\"") from err
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound as err:
            raise GPUError(
                "no NVIDIA driver on this host (NVML library not found): cannot read GPU memory",
                hint="install the NVIDIA driver, or set [service] gpu_monitor = \"sim\" (the simulator) or \"none\"",
            ) from err
        except pynvml.NVMLError as err:
            raise GPUError(f"NVML failed to initialize: {err}",
                           hint="check the NVIDIA driver with nvidia-smi") from err

    def close(self) -> None:
        """Shut NVML down."""
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()

    def driver_version(self) -> str:
        """The NVIDIA driver version (``nvmlSystemGetDriverVersion``)."""
        version = self._nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)

    def _handles(self) -> list[Any]:
        n = self._nvml
        return [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]

    def memory(self) -> list[GPUMemory]:
        """Every GPU's memory (``nvmlDeviceGetMemoryInfo``)."""
        n = self._nvml
        out = []
        try:
            for i, h in enumerate(self._handles()):
                info = n.nvmlDeviceGetMemoryInfo(h)
                name = n.nvmlDeviceGetName(h)
                out.append(GPUMemory(
                    index=i, name=name.decode() if isinstance(name, bytes) else str(name),
                    total_mib=info.total / _MIB, used_mib=info.used / _MIB, free_mib=info.free / _MIB,
                ))
        except n.NVMLError as err:
            raise GPUError(f"NVML could not read GPU memory: {err}",
                           hint="check the NVIDIA driver with nvidia-smi") from err
        return out

    def processes(self) -> list[GPUProcess]:
        """Compute and graphics processes on every GPU, with their memory."""
        n = self._nvml
        out: dict[tuple[int, int], GPUProcess] = {}
        try:
            for i, h in enumerate(self._handles()):
                for getter in (n.nvmlDeviceGetComputeRunningProcesses, n.nvmlDeviceGetGraphicsRunningProcesses):
                    for p in getter(h):
                        used = getattr(p, "usedGpuMemory", None)
                        try:
                            name = n.nvmlSystemGetProcessName(p.pid)
                            name = name.decode() if isinstance(name, bytes) else str(name)
                        except n.NVMLError:
                            name = None
                        out[(i, p.pid)] = GPUProcess(gpu_index=i, pid=p.pid, name=name,
                                                     used_mib=used / _MIB if used else None)
        except n.NVMLError as err:
            raise GPUError(f"NVML could not list GPU processes: {err}",
                           hint="check the NVIDIA driver with nvidia-smi") from err
        return list(out.values())


class SimBackend:
    """The simulator's device-memory ledger (``GET {url}/sim/device_memory``).

    The simulated GPUs exist only while the simulator runs: when it does not answer, there is no
    GPU memory held (``memory()`` is empty), which is what "released" means for it.

    Args:
        url: Base URL of the simulator.
        timeout_s: HTTP timeout per request.
    """

    def __init__(self, url: str, *, timeout_s: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _payload(self) -> Any | None:
        try:
            resp = requests.get(f"{self.url}/sim/device_memory", timeout=self.timeout_s)
        except requests.RequestException:
            return None
        if resp.status_code != 200:
            return None
        try:
            return resp.json()
        except ValueError as err:
            raise GPUError(f"{self.url}/sim/device_memory did not answer JSON",
                           hint="point gpu.url at a tuner.sim server") from err

    @staticmethod
    def _gpus(payload: Any) -> list[dict[str, Any]]:
        if isinstance(payload, dict):
            for key in ("gpus", "devices"):
                if isinstance(payload.get(key), list):
                    return payload[key]
            return [payload] if "total_mib" in payload else []
        return payload if isinstance(payload, list) else []

    def memory(self) -> list[GPUMemory]:
        """Every simulated GPU; empty when the simulator is not running."""
        payload = self._payload()
        out = []
        for i, g in enumerate(self._gpus(payload)):
            try:
                total, used = float(g["total_mib"]), float(g["used_mib"])
            except (KeyError, TypeError, ValueError) as err:
                raise GPUError(f"{self.url}/sim/device_memory lacks total_mib/used_mib",
                               hint="upgrade the simulator") from err
            peak = g.get("peak_used_mib")
            out.append(GPUMemory(
                index=int(g.get("index", g.get("gpu", i))), name=str(g.get("name", "sim")),
                total_mib=total, used_mib=used, free_mib=float(g.get("free_mib", total - used)),
                peak_used_mib=float(peak) if peak is not None else None,
            ))
        return out

    def processes(self) -> list[GPUProcess]:
        """Holders the simulator reports (its own server and simulated foreign processes)."""
        out = []
        for i, g in enumerate(self._gpus(self._payload())):
            for p in g.get("processes", []) if isinstance(g, dict) else []:
                out.append(GPUProcess(gpu_index=int(g.get("index", i)), pid=int(p.get("pid", 0)),
                                      used_mib=p.get("used_mib"), name=p.get("name")))
            foreign = g.get("foreign_mib") if isinstance(g, dict) else None
            if foreign and not any(p.name == "foreign" for p in out if p.gpu_index == i):
                out.append(GPUProcess(gpu_index=i, pid=0, used_mib=float(foreign), name="foreign"))
        return out


class GPUWindow:
    """Samples taken in a background thread while the ``with`` block runs; see :attr:`peaks`."""

    def __init__(self, backend: GPUBackend, poll_s: float) -> None:
        self._backend = backend
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._acc: dict[int, dict[str, float]] = {}
        self._errors = 0
        self._thread = threading.Thread(target=self._run, name="gpu-window", daemon=True)
        self.started_at = time.monotonic()
        self.duration_s = 0.0

    def _sample(self) -> None:
        try:
            mem = self._backend.memory()
        except GPUError as err:
            self._errors += 1
            log.debug("GPU sample failed: %s", err)
            return
        with self._lock:
            for g in mem:
                a = self._acc.setdefault(g.index, {"total": g.total_mib, "min": g.used_mib,
                                                   "peak": g.used_mib, "n": 0})
                a["min"] = min(a["min"], g.used_mib)
                a["peak"] = max(a["peak"], g.used_mib, g.peak_used_mib or 0.0)
                a["last"] = g.used_mib
                a["n"] += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._poll_s)

    def start(self) -> None:
        """Start sampling."""
        self.started_at = time.monotonic()
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop sampling (one last sample is taken)."""
        self._stop.set()
        self._thread.join(timeout_s)
        self._sample()
        self.duration_s = time.monotonic() - self.started_at

    @property
    def peaks(self) -> list[GPUPeak]:
        """Per-GPU total, min, peak and last used memory over the window so far (MiB)."""
        with self._lock:
            return [GPUPeak(index=i, total_mib=a["total"], min_used_mib=a["min"], peak_used_mib=a["peak"],
                            last_used_mib=a.get("last", a["min"]), samples=int(a["n"]))
                    for i, a in sorted(self._acc.items())]


class GPUMonitor:
    """Per-GPU memory, holders, sampling windows, and the checks made before each server start.

    Args:
        backend: :class:`NvmlBackend` or :class:`SimBackend` (or any :class:`GPUBackend`).
        poll_s: Sampling interval of windows and waits.
        idle_used_mib: Used memory per GPU that still counts as "free" (driver, display).
    """

    def __init__(self, backend: GPUBackend, *, poll_s: float = 0.5, idle_used_mib: float = 1024.0) -> None:
        self.backend = backend
        self.poll_s = poll_s
        self.idle_used_mib = idle_used_mib

    @classmethod
    def for_target(cls, kind: str, url: str | None = None, **kwargs: Any) -> GPUMonitor:
        """Build a monitor: ``kind`` is ``"nvml"`` or ``"sim"`` (then ``url`` is the simulator).

        Raises:
            GPUError: NVML is unavailable, or ``kind`` is unknown.
        """
        if kind == "nvml":
            return cls(NvmlBackend(), **kwargs)
        if kind == "sim" and url:
            return cls(SimBackend(url), **kwargs)
        raise GPUError(f"unknown GPU monitor {kind!r}", hint="set [service] gpu_monitor = \"nvml\", \"sim\" (with [service] url) or \"none\"")

    def snapshot(self) -> list[GPUMemory]:
        """Every GPU's memory now. Raises GPUError when the backend cannot be read."""
        return self.backend.memory()

    def processes(self) -> dict[int, list[GPUProcess]]:
        """Processes holding memory, by GPU index."""
        out: dict[int, list[GPUProcess]] = {}
        for p in self.backend.processes():
            out.setdefault(p.gpu_index, []).append(p)
        return out

    @contextlib.contextmanager
    def window(self) -> Iterator[GPUWindow]:
        """Sample every GPU in a thread while the block runs; read ``window.peaks`` after it."""
        w = GPUWindow(self.backend, self.poll_s)
        w.start()
        try:
            yield w
        finally:
            w.stop()

    def _held(self) -> list[str]:
        held = [f"GPU{g.index} {g.used_mib:.0f} MiB used" for g in self.snapshot()
                if g.used_mib > self.idle_used_mib]
        held += [f"GPU{p.gpu_index} PID {p.pid} ({p.name or '?'}, {p.used_mib or 0:.0f} MiB)"
                 for p in self.backend.processes()]
        return held

    def wait_released(self, timeout_s: float, *, allow_foreign: bool = False) -> list[GPUMemory]:
        """Wait until the previous server's GPU memory is freed.

        Call after stopping a server and before starting the next (§1.2: memory still held
        lowers the next server's baseline and so its KV pool). Normally that means no process
        holds GPU memory and used memory is back to idle on every GPU. With ``allow_foreign``
        (a foreign process may keep its share) it means used memory stopped falling: two
        samples in a row within 64 MiB on every GPU.

        Args:
            timeout_s: Limit.
            allow_foreign: See above.

        Returns:
            The final snapshot.

        Raises:
            GPUError: Memory is still held after ``timeout_s`` (the message names the holders).
        """
        deadline = time.monotonic() + timeout_s
        previous: dict[int, float] | None = None
        while True:
            if allow_foreign:
                now = {g.index: g.used_mib for g in self.snapshot()}
                if previous is not None and now.keys() == previous.keys() and all(
                    abs(now[i] - previous[i]) <= 64 for i in now
                ):
                    return self.snapshot()
                previous = now
                held = [f"GPU{i} {u:.0f} MiB used and still changing" for i, u in now.items()]
            else:
                held = self._held()
                if not held:
                    return self.snapshot()
            if time.monotonic() >= deadline:
                raise GPUError(
                    f"GPU memory not released after {timeout_s:.0f} s: {'; '.join(held)}",
                    hint="stop the process holding it (a previous server that did not exit?), "
                    "or set allow_foreign = true to start anyway",
                )
            time.sleep(self.poll_s)

    def check_foreign(self, *, allow_foreign: bool = False) -> list[GPUProcess]:
        """Refuse to start while a foreign process holds GPU memory.

        Args:
            allow_foreign: Log the holders and go on instead of refusing.

        Returns:
            The holders found (empty normally).

        Raises:
            GPUError: A process holds GPU memory and ``allow_foreign`` is false.
        """
        procs = self.backend.processes()
        if procs and not allow_foreign:
            names = ", ".join(f"GPU{p.gpu_index} PID {p.pid} ({p.name or '?'}, {p.used_mib or 0:.0f} MiB)"
                              for p in procs)
            raise GPUError(
                f"another process holds GPU memory: {names}",
                hint="stop it (it would shrink SGLang's KV pool, §1.2), or set allow_foreign = true",
            )
        if procs:
            log.warning("starting although foreign processes hold GPU memory: %s", procs)
        return procs
