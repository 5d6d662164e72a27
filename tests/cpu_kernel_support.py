"""Helpers shared by the CPU-linear tests (tests/test_cpu_kernels.py: bf16, routing, builds;
tests/test_cpu_kernels_fp32.py: the fp32 blocks and route): the skip mark where the kernel cannot build, and the built
kernel counting the rows of each call; the skip mark where torch.compile has no C++ compiler for CPU graphs."""

from __future__ import annotations

import shutil

import pytest

from inference.kernels import cpu_linear

needs_kernel = pytest.mark.skipif(not cpu_linear.cpu_supported(), reason="the kernel needs x86 AVX2 + FMA")


def has_cpp_compiler() -> bool:
    """Whether inductor finds the C++ compiler it builds CPU graphs with (a compiled step needs one here)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return shutil.which(get_cpp_compiler()) is not None
    except Exception:  # noqa: BLE001 - no compiler found, whatever inductor raises
        return False


needs_compiler = pytest.mark.skipif(not has_cpp_compiler(), reason="no C++ compiler for torch.compile on the CPU")


class CountingKernel:
    """The built kernel, recording the input rows of each call."""

    def __init__(self) -> None:
        self.real = cpu_linear.load_kernel()
        self.rows: list[int] = []

    def linear_bf16(self, x, w, b, amx, avx512, dp):
        self.rows.append(x.numel() // x.shape[-1])
        return self.real.linear_bf16(x, w, b, amx, avx512, dp)

    def linear_bf16_routed(self, x, w, b, max_rows, amx, dp):
        y = self.real.linear_bf16_routed(x, w, b, max_rows, amx, dp)
        if y is not None:  # the kernel ran
            self.rows.append(x.numel() // x.shape[-1])
        return y

    def linear_fp32_routed(self, x, w, b, max_rows):
        y = self.real.linear_fp32_routed(x, w, b, max_rows)
        if y is not None:
            self.rows.append(x.numel() // x.shape[-1])
        return y
