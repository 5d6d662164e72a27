"""The engine's CPU linear (inference.kernels.cpu_linear) in fp32 (AVX2): the kernel's fp32 blocks against the exact
product, the fp32 route (on the kernel, or as weight @ x^T without it) for few-row no-grad calls inside a block, and
greedy tree decoding through it equal to plain decoding. The bf16 kernel, routing and builds: tests/test_cpu_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inference.engine.drafter import NoDrafter
from inference.engine.loop import DecodeConfig, generate
from inference.kernels import cpu_linear
from inference.kernels.cpu_linear import KernelLinear, fast_linears
from tests.conftest import build_tiny_lm
from tests.cpu_kernel_support import CountingKernel, needs_kernel


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 12, 16, 17, 32])
@pytest.mark.parametrize("k,n", [(8, 4), (16, 8), (37, 19), (100, 37), (64, 48), (576, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_kernel_is_the_product(rows, k, n, bias):
    """The fp32 blocks at every row count (one row; whole blocks of 3 rows and each remainder), widths that are not a
    multiple of 8 (the scalar tail) and weight counts that are not a multiple of 4 (a partial block), against the
    exact product: only the fp32 summation order differs from stock."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(2, rows, k, generator=gen)  # 3-D: leading dims flattened and restored
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    out = cpu_linear.linear_fp32(x, w, b)
    assert out.shape == (2, rows, n) and out.dtype == torch.float32 and out.is_contiguous()
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    scale = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0)  # the sum of |terms|
    err = (out.double() - ref).abs()
    assert bool((err <= scale * k * 2.0 ** -24 + 1e-7).all()), float(err.max())  # fp32 summation error bound
    transposed = cpu_linear.linear_fp32(x.transpose(0, 1), w, b)  # a non-contiguous input is read contiguous
    torch.testing.assert_close(transposed, out.transpose(0, 1), rtol=0, atol=0)


def test_fp32_kernel_refuses_what_it_does_not_compute():
    kernel = cpu_linear.load_kernel()
    if kernel is None:
        pytest.skip("the kernel is not available here")
    w = torch.randn(8, 16)
    with torch.no_grad():
        assert kernel.linear_fp32_routed(torch.randn(5, 16), w, None, 4) is None  # more rows than allowed
        assert kernel.linear_fp32_routed(torch.randn(5, 16).double(), w, None, 32) is None
        assert kernel.linear_fp32_routed(torch.randn(5, 16), w.t().contiguous().t(), None, 32) is None
        assert kernel.linear_fp32_routed(torch.randn(5, 16), w, torch.randn(7), 32) is None
        assert kernel.linear_fp32_routed(torch.randn(5, 16), w, None, 5).shape == (5, 8)
    assert kernel.linear_fp32_routed(torch.randn(5, 16), w, None, 32) is None  # grad mode
    with pytest.raises(RuntimeError, match="fp32 only"):
        kernel.linear_fp32(torch.randn(2, 16).bfloat16(), w, None)


def _fp32_layer_outputs(layer: nn.Linear, rows_list: list[int]):
    """(stock outputs, outputs inside a fast_linears block, one grad-mode output inside it) for inputs of each row
    count."""
    inputs = {rows: torch.randn(1, rows, layer.in_features) for rows in rows_list}
    with torch.no_grad():
        stock = {rows: F.linear(x, layer.weight, layer.bias) for rows, x in inputs.items()}
    with fast_linears(layer) as routed:
        assert routed == 1 and type(layer) is KernelLinear
        with torch.no_grad():
            fast = {rows: layer(x) for rows, x in inputs.items()}
        with_grad = layer(inputs[2])
    assert torch.equal(with_grad.detach(), stock[2]) and with_grad.requires_grad  # grad mode: stock
    with torch.no_grad():
        assert torch.equal(layer(inputs[2]), stock[2])  # outside the block: stock
    return stock, fast


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_layers_run_on_the_kernel(monkeypatch, bias):
    """fp32 layers where the fp32 route runs (forced here on any AVX2 CPU): 1..FP32_ROWS no-grad rows run on the
    kernel, the same products to fp32 rounding; more rows, grad mode and outside the block run stock, bit for bit."""
    monkeypatch.setattr(cpu_linear, "fp32_route_supported", lambda: True)
    kernel = CountingKernel()
    monkeypatch.setattr(cpu_linear, "load_kernel", lambda: kernel)
    torch.manual_seed(0)
    layer = nn.Linear(37, 19, bias=bias)
    limit = cpu_linear.FP32_ROWS
    stock, fast = _fp32_layer_outputs(layer, [1, 2, 17, limit, limit + 1])
    assert layer.kernel_rows == limit and kernel.rows == [1, 2, 17, limit]
    for rows, y in fast.items():
        assert y.shape == stock[rows].shape and y.dtype == torch.float32 and y.is_contiguous()
        if rows <= limit:
            torch.testing.assert_close(y, stock[rows], rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(y, stock[rows]), rows


@pytest.mark.parametrize("bias", [False, True])
def test_fp32_layers_take_the_few_row_route_without_the_kernel(monkeypatch, bias):
    """Where the kernel is not built, fp32 layers (where the route runs; forced here on any CPU) still route: 2..
    FP32_MM_ROWS no-grad rows run as weight @ x^T, the same products to fp32 rounding; one row, more rows, grad mode
    and outside the block run stock, bit for bit."""
    monkeypatch.setattr(cpu_linear, "fp32_route_supported", lambda: True)
    monkeypatch.setattr(cpu_linear, "load_kernel", lambda: None)
    torch.manual_seed(0)
    layer = nn.Linear(37, 19, bias=bias)
    limit = cpu_linear.FP32_MM_ROWS
    stock, fast = _fp32_layer_outputs(layer, [1, 2, limit, limit + 1])
    assert layer.kernel_rows == limit
    for rows, y in fast.items():
        assert y.shape == stock[rows].shape and y.dtype == torch.float32 and y.is_contiguous()
        if 2 <= rows <= limit:
            torch.testing.assert_close(y, stock[rows], rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(y, stock[rows]), rows


@pytest.mark.parametrize("kernel", [pytest.param(True, id="kernel", marks=needs_kernel),
                                    pytest.param(False, id="weight@x^T")])
def test_fp32_route_keeps_greedy_tree_decoding_equal_to_plain(monkeypatch, kernel):
    """Through the engine's loop with the fp32 route on (forced on any CPU), on the kernel or, without it, through
    weight @ x^T: a tree drafter's greedy output equals plain greedy decoding with the CPU kernels off."""
    from inference.drafters.prompt_lookup import PromptLookupDrafter  # deferred: one test drafts

    monkeypatch.setattr(cpu_linear, "fp32_route_supported", lambda: True)
    if not kernel:
        monkeypatch.setattr(cpu_linear, "load_kernel", lambda: None)
    model = build_tiny_lm("llama", seed=5)
    ids = torch.tensor([[5, 9, 12, 7, 30, 5, 9, 12, 7, 30, 5, 9]])
    plain = generate(model, ids, NoDrafter(), DecodeConfig(max_new_tokens=24, cpu_kernel=False))
    drafted = generate(model, ids, PromptLookupDrafter(num_draft=6), DecodeConfig(max_new_tokens=24))
    assert drafted.sequences == plain.sequences
    routed = [m for m in model.modules() if type(m) is KernelLinear]
    assert len(routed) == 15  # 2 layers x 7 + lm_head
    assert {m.kernel_rows for m in routed} == {cpu_linear.FP32_ROWS if kernel else cpu_linear.FP32_MM_ROWS}
