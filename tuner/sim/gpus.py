"""Simulated GPU presets: memory as nvidia-smi reports it, bandwidths and peak compute.

Memory sizes are what ``nvidia-smi --query-gpu=memory.total`` prints in MiB, the number SGLang
uses for its defaults (``shared/sglang-reference.md`` §0 Units, §2.1). Bandwidths are the vendors'
datasheet figures in decimal GB/s, ``bf16_tflops`` the dense (no sparsity) bf16 tensor peak.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from tuner.sim.errors import SimError

__all__ = ["GpuSpec", "GPUS", "get_gpu", "MIB"]

MIB = 1 << 20
"""Bytes per MiB."""


@dataclass(frozen=True)
class GpuSpec:
    """One simulated GPU model.

    Attributes:
        name: Preset key, e.g. ``"H100-80GB"``.
        memory_mib: Total memory as nvidia-smi reports it, MiB (H100-80GB: 81559; the reference
            RTX PRO 6000: 97887, §1.8).
        hbm_gb_s: Device memory bandwidth, decimal GB/s.
        bf16_tflops: Dense bf16 tensor-core peak, TFLOP/s.
        pcie_gb_s: Host<->device bandwidth per direction, decimal GB/s.
        context_mib: Memory in use at SGLang's baseline measurement (§1.1) with tp > 1: the CUDA
            context plus NCCL / custom-all-reduce buffers. §1.8 derives ~1.56 GiB at tp 8 on the
            RTX PRO 6000 (1,626 MiB reproduces its 159,277 tokens exactly).
        comm_buffers_mib: The part of ``context_mib`` that torch.distributed / NCCL /
            custom-all-reduce allocate; absent at tp 1 (reported by the
            ``Init torch distributed ends. mem usage=`` line, §4.2).
        compute_capability: ``torch.cuda.get_device_capability()`` (``(9, 0)`` Hopper, ``(10, 0)``
            B200, ``(12, 0)`` RTX PRO 6000): SGLang picks DeepSeek DSA's KV dtype and attention
            backends by it (0.5.23 ``arg_groups/overrides.py``, :mod:`tuner.sim.dsa`).
    """

    name: str
    memory_mib: int
    hbm_gb_s: float
    bf16_tflops: float
    pcie_gb_s: float
    context_mib: int = 1626
    comm_buffers_mib: int = 1024
    compute_capability: tuple[int, int] = (9, 0)

    @property
    def memory_bytes(self) -> int:
        """Total device memory in bytes."""
        return self.memory_mib * MIB

    def context_bytes(self, tp_size: int) -> int:
        """Bytes in use on each GPU at the baseline (before weights), for a tp group of ``tp_size``."""
        mib = self.context_mib if tp_size > 1 else self.context_mib - self.comm_buffers_mib
        return mib * MIB

    def comm_bytes(self, tp_size: int) -> int:
        """Bytes allocated by the distributed init (0 at tp 1)."""
        return self.comm_buffers_mib * MIB if tp_size > 1 else 0


GPUS: Mapping[str, GpuSpec] = MappingProxyType(
    {
        g.name: g
        for g in (
            GpuSpec("H100-80GB", memory_mib=81559, hbm_gb_s=3350.0, bf16_tflops=989.0, pcie_gb_s=64.0),
            GpuSpec("H200-141GB", memory_mib=143771, hbm_gb_s=4800.0, bf16_tflops=989.0, pcie_gb_s=64.0),
            GpuSpec("A100-80GB", memory_mib=81920, hbm_gb_s=2039.0, bf16_tflops=312.0, pcie_gb_s=32.0,
                    compute_capability=(8, 0)),
            GpuSpec("L40S-48GB", memory_mib=46068, hbm_gb_s=864.0, bf16_tflops=362.0, pcie_gb_s=32.0,
                    compute_capability=(8, 9)),
            GpuSpec("L4-24GB", memory_mib=23034, hbm_gb_s=300.0, bf16_tflops=121.0, pcie_gb_s=32.0,
                    compute_capability=(8, 9)),
            GpuSpec(
                "RTX-PRO-6000-96GB", memory_mib=97887, hbm_gb_s=1792.0, bf16_tflops=503.8, pcie_gb_s=64.0,
                compute_capability=(12, 0),
            ),
            # HGX B200 datasheet: 180 GB HBM3e at 8 TB/s, 2.25 PFLOP/s dense bf16; nvidia-smi prints 183359 MiB.
            GpuSpec("B200-180GB", memory_mib=183359, hbm_gb_s=8000.0, bf16_tflops=2250.0, pcie_gb_s=64.0,
                    compute_capability=(10, 0)),
        )
    }
)
"""Every preset by name."""


def get_gpu(name: str) -> GpuSpec:
    """Return the preset called ``name`` (case-insensitive).

    Raises:
        SimError: Unknown name; the message lists the presets.
    """
    for key, spec in GPUS.items():
        if key.lower() == name.strip().lower():
            return spec
    raise SimError(
        f"Unknown --sim-gpu {name!r}. Choose one of: {', '.join(GPUS)}."
    )
