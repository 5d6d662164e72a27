"""The memory-bandwidth floor of a plain decoding step, and what the host is.

A plain decoding step of a small batch reads every weight of the target once, so no step can be faster than
weight bytes / memory bandwidth. The bandwidth is measured here as STREAM's "copy" does: the best of a few copies of
a large buffer into another, counting the bytes read plus the bytes written. The copy goes into a buffer allocated
and touched beforehand: a fresh `clone` would time page faults as well.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

COPY_BYTES = 256 * 2**20
COPY_REPEATS = 5


def copy_bandwidth(device: torch.device | str = "cpu", nbytes: int = COPY_BYTES, repeats: int = COPY_REPEATS) -> float:
    """Bytes per second (read + written) of the fastest of `repeats` copies of an `nbytes` buffer on `device`."""
    device = torch.device(device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


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
