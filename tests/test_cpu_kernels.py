"""The engine's CPU linear (inference.kernels.cpu_linear) in bf16: the same products as F.linear, routed only where it
should be, restored afterwards, and stock PyTorch wherever it is unsupported or fails to build; the engine's use of it
and its benchmark script. The fp32 blocks and route (AVX2) are in tests/test_cpu_kernels_fp32.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inference.api import Engine
from inference.engine.drafter import NoDrafter
from inference.engine.loop import DecodeConfig, generate
from inference.kernels import cpu_linear
from inference.kernels.cpu_linear import KernelLinear, fast_linears, max_rows
from tests.conftest import build_tiny_lm
from tests.cpu_kernel_support import CountingKernel, needs_kernel
from tests.script_support import exit_code, load_script

ROOT = Path(__file__).resolve().parents[1]
# (avx512, dp): the vector path a product takes where AMX does not
VECTOR = [pytest.param((True, False), id="avx512", marks=pytest.mark.skipif(
              not cpu_linear.avx512_supported(), reason="no AVX-512 on this CPU")),
          pytest.param((True, True), id="avx512bf16", marks=pytest.mark.skipif(
              not (cpu_linear.cpu_supported() and cpu_linear.dp_supported()), reason="no AVX-512-BF16 here")),
          pytest.param((False, False), id="avx2")]
AMX = [False, pytest.param(True, marks=pytest.mark.skipif(
    not (cpu_linear.cpu_supported() and cpu_linear.amx_supported()), reason="no AMX on this CPU"))]


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The exact fp64 result of the bf16 inputs."""
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


@needs_kernel
@pytest.mark.parametrize("vector", VECTOR)
@pytest.mark.parametrize("amx", AMX)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 12, 16, 17, 32])
@pytest.mark.parametrize("k,n", [(16, 8), (37, 19), (100, 37), (64, 48), (576, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_is_the_exact_product_rounded_once(vector, amx, rows, k, n, bias):
    """Every path (AVX-512 or AVX2 at any row count; AVX-512-BF16 dot products for 2.. rows, whole blocks of 4 rows
    and each remainder, a K that is not a multiple of 32; AMX for 2..32 rows of widths divisible by 32, with the
    vector path finishing the N % 16 rows) against the exact product."""
    avx512, dp = vector
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(2, rows, k, generator=gen).bfloat16()  # 3-D input: leading dims are flattened and restored
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    out = cpu_linear.linear(x, w, b, amx=amx, avx512=avx512, dp=dp)
    assert out.shape == (2, rows, n) and out.dtype == torch.bfloat16
    ref = _reference(x, w, b)
    # fp32 sums of exact products, rounded to bf16 once: within one bf16 unit (2^-8 relative) plus the fp32
    # summation error, which is tiny next to it at these sizes
    err = (out.double() - ref).abs()
    assert bool((err <= ref.abs() * 2.0 ** -8 + 1e-3).all()), float(err.max())
    stock = F.linear(x, w, b)
    assert (out.float() - stock.float()).abs().max() <= ref.abs().max() * 2.0 ** -7


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2])  # 2 rows: AMX or AVX-512-BF16 where the CPU has them
def test_kernel_keeps_special_values(rows):
    x = torch.tensor([[1.0, 2.0, 0.0, 0.0]] * rows).bfloat16()
    w = torch.tensor([[1.0, 1.0, 0.0, 0.0], [float("inf"), 0.0, 0.0, 0.0], [float("nan"), 0.0, 0.0, 0.0]]).bfloat16()
    for out in cpu_linear.linear(x, w).float():
        assert out[0] == 3.0 and out[1] == float("inf") and torch.isnan(out[2])


@needs_kernel
def test_rows_routed_follow_the_cpus_paths():
    """Up to 32 rows where AMX (inputs whose width is a multiple of 32) or, on CPUs without AMX, AVX-512-BF16 runs
    them; else up to 4."""
    widths = {576: cpu_linear.max_rows(576), 100: cpu_linear.max_rows(100)}
    if cpu_linear.amx_supported():
        assert widths == {576: cpu_linear.AMX_ROWS, 100: cpu_linear.FMA_ROWS}
    elif cpu_linear.dp_supported():
        assert widths == {576: cpu_linear.DP_ROWS, 100: cpu_linear.DP_ROWS}
    else:
        assert widths == {576: cpu_linear.FMA_ROWS, 100: cpu_linear.FMA_ROWS}


@needs_kernel
def test_routed_entry_runs_only_where_the_kernel_applies():
    """The one C++ call each routed layer makes: the kernel's product where it applies, None (stock runs) for grad
    mode, more rows than allowed, no rows, another dtype, a non-contiguous weight or a bias of another dtype."""
    kernel = cpu_linear.load_kernel()
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=gen).bfloat16()
    b = torch.randn(40, generator=gen).bfloat16()
    x = torch.randn(64, 3, generator=gen).bfloat16().T  # [3, 64], not contiguous: read through a contiguous copy
    with torch.no_grad():
        y = kernel.linear_bf16_routed(x, w, b, 4, False, False)
        assert y is not None and torch.equal(y, cpu_linear.linear(x.contiguous(), w, b, amx=False, dp=False))
        assert kernel.linear_bf16_routed(x, w, b, 2, False, False) is None  # 3 rows > 2
        assert kernel.linear_bf16_routed(x[:0], w, b, 4, False, False) is None
        assert kernel.linear_bf16_routed(x.float(), w, b, 4, False, False) is None
        assert kernel.linear_bf16_routed(x, w.T.contiguous().T, b, 4, False, False) is None
        assert kernel.linear_bf16_routed(x, w, b.float(), 4, False, False) is None
    assert kernel.linear_bf16_routed(x, w, b, 4, False, False) is None  # grad mode on
    with torch.inference_mode():
        assert kernel.linear_bf16_routed(x, w, None, 4, False, False) is not None


@needs_kernel
def test_fast_linears_routes_few_row_no_grad_calls_inside_its_block_only(monkeypatch):
    """Installed once (the layers become KernelLinear, same parameters and state_dict), routed only inside a block:
    a second block installs nothing new, and after it the layers run stock, bit for bit."""
    model = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 8)).bfloat16()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    kernel = CountingKernel()
    monkeypatch.setattr(cpu_linear, "load_kernel", lambda: kernel)
    rows = max_rows(32)  # 32 with AMX or AVX-512-BF16, else 4
    few, many = torch.randn(rows, 32).bfloat16(), torch.randn(rows + 1, 32).bfloat16()
    with torch.no_grad():
        stock_few, stock_many = model(few), model(many)
    with fast_linears(model) as routed:
        assert routed == 2 and all(type(layer) is KernelLinear for layer in (model[0], model[2]))
        with torch.no_grad():
            fast_few, fast_many = model(few), model(many)
        with_grad = model(few)  # grad mode: stock, so training through these layers is unaffected
    assert kernel.rows == [rows, rows]  # only the few-row no-grad calls, both layers
    installed = model[0]
    with fast_linears(model) as routed:
        assert routed == 2 and model[0] is installed
    with torch.no_grad():
        after = model(few)
    assert kernel.rows == [rows, rows]  # outside a block: stock
    assert torch.equal(after, stock_few)
    assert model.state_dict().keys() == state.keys() and all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    torch.testing.assert_close(fast_few.float(), stock_few.float(), rtol=2 ** -6, atol=2 ** -6)
    assert torch.equal(fast_many, stock_many)  # more rows: stock, bit for bit
    assert torch.equal(with_grad.detach(), stock_few) and with_grad.requires_grad
    copy = __import__("copy").deepcopy(model)
    assert type(copy[0]) is KernelLinear and copy[0].weight is not model[0].weight


@needs_kernel
def test_fast_linears_row_limit_caps_the_routed_rows(monkeypatch):
    """`row_limit` (benchmarks: the vector path's 4 rows on a CPU whose wide paths take 32) lowers, never raises,
    the rows a layer routes."""
    model = nn.Sequential(nn.Linear(32, 16)).bfloat16()
    kernel = CountingKernel()
    monkeypatch.setattr(cpu_linear, "load_kernel", lambda: kernel)
    with torch.no_grad():
        for limit in (2, 10_000):
            with fast_linears(model, row_limit=limit):
                for rows in (1, 2, 3, max_rows(32), max_rows(32) + 1):
                    model(torch.randn(rows, 32).bfloat16())
            routed = [r for r in (1, 2, 3, max_rows(32), max_rows(32) + 1) if r <= min(limit, max_rows(32))]
            assert kernel.rows == routed, (limit, kernel.rows)
            kernel.rows.clear()


@needs_kernel
def test_fast_linears_stops_routing_on_error(monkeypatch):
    layer = nn.Linear(16, 16).bfloat16()
    kernel = CountingKernel()
    monkeypatch.setattr(cpu_linear, "load_kernel", lambda: kernel)
    with pytest.raises(RuntimeError, match="boom"):
        with fast_linears(layer):
            raise RuntimeError("boom")
    with torch.no_grad():
        layer(torch.randn(1, 16).bfloat16())
    assert kernel.rows == []


def test_fast_linears_leaves_ineligible_layers_alone(monkeypatch):
    """fp32 weights where the fp32 route does not run, a forward someone else set (accelerate's hooks), or
    enabled=False: nothing routed, nothing built."""
    monkeypatch.setattr(cpu_linear, "load_kernel", lambda: pytest.fail("no layer is eligible: nothing to build"))
    monkeypatch.setattr(cpu_linear, "fp32_route_supported", lambda: False)
    hooked = nn.Linear(8, 8).bfloat16()
    hooked.forward = lambda x: x
    mixed = nn.Linear(8, 8).bfloat16()
    mixed.bias = nn.Parameter(mixed.bias.float())  # an fp32 bias next to a bf16 weight: stock handles the promotion
    with fast_linears(nn.Linear(8, 8), hooked, mixed, None) as routed:
        assert routed == 0
    with fast_linears(nn.Linear(8, 8).bfloat16(), enabled=False) as routed:
        assert routed == 0
    assert hooked.forward(torch.ones(1)).item() == 1.0  # its own forward kept


def test_unsupported_cpu_or_failed_build_falls_back_to_stock(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_linear, "_kernel", None)
    monkeypatch.setattr(cpu_linear, "_failed", False)
    monkeypatch.setattr(cpu_linear, "cpu_supported", lambda: False)
    layer = nn.Linear(8, 8).bfloat16()
    with fast_linears(layer) as routed:
        assert routed == 0 and type(layer) is nn.Linear
    with pytest.raises(RuntimeError, match="not available"):
        cpu_linear.linear(torch.ones(1, 8).bfloat16(), layer.weight)

    # a source that does not compile: one warning, stock from then on
    monkeypatch.setattr(cpu_linear, "_failed", False)
    monkeypatch.setattr(cpu_linear, "cpu_supported", lambda: True)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_linear, "SOURCE", bad)
    with pytest.warns(UserWarning, match="stock PyTorch linear runs instead"):
        assert cpu_linear.load_kernel() is None
    with fast_linears(layer) as routed:
        assert routed == 0


def test_a_stale_torch_build_baton_does_not_hang_the_next_load(monkeypatch, tmp_path):
    """A process killed while torch built or loaded the kernel leaves torch's baton file in the build directory; the
    next load removes it under draftsmith's own lock (which died with its holder) instead of waiting forever."""
    from torch.utils import cpp_extension

    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append(
        (Path(kw["build_directory"]) / cpu_linear.TORCH_BATON).exists()) or "built")
    build_dir = tmp_path / "kernels" / "k"
    build_dir.mkdir(parents=True)
    (build_dir / cpu_linear.TORCH_BATON).touch()  # left by a killed process
    assert cpu_linear._build("k", build_dir) == "built" and seen == [False]


class FailingBuild:
    """torch's extension builder, failing every build and counting the attempts."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, **kwargs):
        self.calls += 1
        raise RuntimeError("Error building extension 'draftsmith_linear_bf16'")


def fresh_process(monkeypatch) -> None:
    """The module's state as a new process starts with it."""
    monkeypatch.setattr(cpu_linear, "_kernel", None)
    monkeypatch.setattr(cpu_linear, "_failed", False)


def test_failed_build_is_remembered_per_compiler_and_flags(monkeypatch, tmp_path):
    """A failed build leaves a marker in the cache: the next process skips the attempt with a one-line notice and
    runs stock; another compiler or other flags try again."""
    from torch.utils import cpp_extension

    build = FailingBuild()
    monkeypatch.setattr(cpp_extension, "load", build)
    monkeypatch.setattr(cpu_linear, "cpu_supported", lambda: True)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    fresh_process(monkeypatch)
    with pytest.warns(UserWarning, match="stock PyTorch linear runs instead: RuntimeError: Error building"):
        assert cpu_linear.load_kernel() is None
    markers = list((tmp_path / "cache" / "kernels").glob("*.failed-*"))
    assert build.calls == 1 and len(markers) == 1
    assert "Error building extension" in markers[0].read_text()

    fresh_process(monkeypatch)  # a later process: no second attempt, one line saying why
    with pytest.warns(UserWarning) as notices:
        assert cpu_linear.load_kernel() is None
    assert build.calls == 1
    [notice] = [str(w.message) for w in notices]
    assert "\n" not in notice and "failed to build before with this compiler and flags" in notice
    assert str(markers[0]) in notice and "stock PyTorch" in notice
    layer = nn.Linear(8, 8).bfloat16()
    with fast_linears(layer) as routed:
        assert routed == 0 and type(layer) is nn.Linear

    fresh_process(monkeypatch)  # other flags: a new attempt
    monkeypatch.setattr(cpu_linear, "CFLAGS", ("-O2", "-fopenmp"))
    with pytest.warns(UserWarning, match="unavailable"):
        cpu_linear.load_kernel()
    assert build.calls == 2

    fresh_process(monkeypatch)  # another compiler: a new attempt
    monkeypatch.setenv("CXX", sys.executable)  # any runnable program: the identity is its path and --version line
    with pytest.warns(UserWarning, match="unavailable"):
        cpu_linear.load_kernel()
    assert build.calls == 3
    assert len(list((tmp_path / "cache" / "kernels").glob("*.failed-*"))) == 3

    fresh_process(monkeypatch)  # a changed source: a new attempt
    source = tmp_path / "linear_bf16.cpp"
    source.write_text(cpu_linear.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(cpu_linear, "SOURCE", source)
    with pytest.warns(UserWarning, match="unavailable"):
        cpu_linear.load_kernel()
    assert build.calls == 4


@needs_kernel
def test_generate_uses_the_kernel_unless_disabled(monkeypatch):
    """The engine's loop routes the target's decode steps through the kernel by default; cpu_kernel=False (the
    CLI's --no-cpu-kernel) keeps it stock. Each step's logits agree with stock to bf16 rounding."""
    model = build_tiny_lm("llama", seed=3).bfloat16()
    kernel = CountingKernel()
    monkeypatch.setattr(cpu_linear, "load_kernel", lambda: kernel)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    generate(model, ids, NoDrafter(), DecodeConfig(max_new_tokens=4))
    # the prefill's layers see 40 rows (more than the kernel takes: stock), its lm_head only the last position; then
    # 3 one-row decode steps through every linear (2 layers x 7 + lm_head)
    assert kernel.rows == [1] * (1 + 3 * 15)
    kernel.rows.clear()
    generate(model, ids, NoDrafter(), DecodeConfig(max_new_tokens=4, cpu_kernel=False))
    assert kernel.rows == []
    assert sum(type(m) is KernelLinear for m in model.modules()) == 15  # installed by the first call, idle since
    with torch.no_grad():
        stock = model(ids[:, :1]).logits
        with fast_linears(model):
            fast = model(ids[:, :1]).logits
    torch.testing.assert_close(fast.float(), stock.float(), rtol=0.05, atol=0.05)


def test_engine_passes_its_kernel_setting(monkeypatch):
    seen = []
    monkeypatch.setattr("inference.api.generate", lambda model, ids, drafter, config, *rest: seen.append(config))
    model = build_tiny_lm("llama")
    engine = Engine(model, NoDrafter())
    engine.generate([5, 6, 7], max_new_tokens=2)
    engine.cpu_kernel = False
    engine.generate([5, 6, 7], max_new_tokens=2)
    assert [c.cpu_kernel for c in seen] == [True, False]


@pytest.mark.parametrize("flags,needle", [
    (["--sizes", "4,2"], "--sizes: increasing node counts"),
    (["--sizes", "1,x"], "--sizes: comma-separated"),
    (["--dtype", "fp16"], "--dtype fp16: the kernel takes bf16, or fp32 on AVX2 CPUs"),
    (["--drafter", "prompt_lookup"], "--drafter: this script times the target alone"),
    (["--rounds", "0"], "must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    ([], "no complete snapshot of no/such-model"),  # models.refs' hub policy, offline in the tests
])
def test_kernel_benchmark_refuses_bad_flags_before_loading(capsys, flags, needle):
    """scripts/bench_cpu_kernel.py, in the test process: one line, exit 2 (the base named does not exist: flags are
    refused before it is looked at, and then it is refused itself in one line, not a traceback)."""
    code = exit_code(load_script("bench_cpu_kernel"), ["--base", "no/such-model", *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [err.strip()] and needle in err


def test_kernel_benchmark_refuses_a_bad_flag_from_the_command_line():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_cpu_kernel.py"), "--base",
                             "no/such-model", "--sizes", "4,2"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "--sizes: increasing" in result.stderr


@needs_kernel
def test_the_stream_table_gives_each_matrix_its_rates_and_refuses_bad_matrices(capsys):
    """--stream: a row per matrix, in the order given, with its copies (filling --stream-mb) and finite rates, the
    kernel's share of the read being kernel / read; a malformed list is one line and exit 2 before anything runs."""
    script = load_script("bench_cpu_kernel")
    assert exit_code(script, ["--stream", "64x128,96x64", "--stream-mb", "1", "--rounds", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\| \d+x\d+ \|", line)]
    assert [r.split(" | ")[0] for r in rows] == ["| 64x128", "| 96x64"]
    for row, (n, k) in zip(rows, ((64, 128), (96, 64))):
        _, copies, kernel, stock, read, share = [cell.strip() for cell in row.strip("|").split("|")]
        assert int(copies) == 10**6 // (n * k * 2) and min(float(kernel), float(stock), float(read)) > 0
        assert float(share) == pytest.approx(float(kernel) / float(read), abs=0.01 + 0.1 / float(read))  # of rounded cells
    for flags in (["--stream", "64x"], ["--stream", "64x0"], ["--stream", "64x64", "--stream-mb", "0"]):
        assert exit_code(script, flags) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --stream") and err.count("\n") == 1, err
