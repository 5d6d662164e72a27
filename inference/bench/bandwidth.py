"""The memory-bandwidth floor of a plain decoding step, and what the host is.

A plain decoding step of a small batch reads every weight of the target once, so no step can be faster than
weight bytes / memory bandwidth. The bandwidth is measured the way a step uses memory, by reading: the best of a few
fp32 sums over a buffer far larger than any cache, allocated and touched beforehand so that no page fault is timed.
(A copy, STREAM's "copy", also counts the bytes written, whose cost depends on how the CPU allocates the lines it
writes.) On a shared host either figure moves from one minute to the next (a 2-core VM: sums' best of five 24-40 GB/s
within a minute), so a floor is measured beside the steps it judges: scripts/step_cost.py reads it before and after
every curve and prints its spread.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

READ_BYTES = 512 * 2**20
READ_REPEATS = 5


def read_bandwidth(device: torch.device | str = "cpu", nbytes: int = READ_BYTES, repeats: int = READ_REPEATS) -> float:
    """Bytes per second read by the fastest of `repeats` sums over an `nbytes` fp32 buffer on `device`."""
    device = torch.device(device)
    buffer = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        buffer.sum()
        sync()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (a tied embedding / lm_head counts once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first "model name" of /proc/cpuinfo (None where there is none, e.g. not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return None


def host_info(device: torch.device) -> dict[str, str | None]:
    """CPU model, the CPU kernels torch dispatches to (e.g. AVX2, AVX512), and the GPU's name when on one."""
    info = {"cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
