"""The engine's own CPU linear for decode steps: the few-row products a decode step is, in bf16, and in fp32 on AVX2.

PyTorch's CPU bf16 `F.linear` at one to a few input rows streams the weights far below the memory bandwidth
(measured on a 2-core Sapphire Rapids, SmolLM2-135M in bf16: its 211 matmuls take ~60 ms a token, ~4.5 GB/s,
against ~16 GB/s read bandwidth). `csrc/linear.cpp` computes the same products exactly (bf16 x bf16 in fp32,
fp32 sums, one rounding to bf16): AVX-512 (else AVX2 + FMA) for up to `FMA_ROWS` rows, and where the CPU has AMX, the
tile unit for 2..`AMX_ROWS` rows (a verification tree, Jacobi block or lookahead window of up to 32 tokens);
where it has AVX-512-BF16 without AMX (Cooper Lake, AMD Zen 4/5, guests whose hypervisor hides the tiles), bf16
dot-product instructions for 2..`DP_ROWS` rows.
Only the summation order differs from stock, so outputs agree with stock ones to the last bf16 bit, the same kind
of difference a K-row forward already has from a one-row forward. More rows (longer prefills, wider trees) stay on
stock PyTorch, whose oneDNN GEMM wins there.

fp32 on AVX2 CPUs (`fp32_route_supported`; AVX-512 below): stock `F.linear` at 2 to a few rows costs up to twice its
one-row call (it leaves the BLAS's matrix-vector path; host E, a Zen 3 EPYC, SmolLM2-135M in fp32: an 8-node
verification forward took 227 ms against 99 for one token), and at 9-17 rows it runs at half the FMA rate the core
has. The kernel's fp32 blocks (`linear_fp32`: 4 weight rows x 3 input rows of 8-lane dot products, the sums of one
input row reduced and stored together) run 1..`FP32_ROWS` rows: the same products in another summation order, as
between a one-row and a K-row forward already (`scripts/step_cost.py --modes eager,stock` measures the forward).
Where the kernel cannot be built, fp32 layers of 2..`FP32_MM_ROWS` rows run as `weight @ x^T` instead, which takes
the BLAS's few-row path (`few_rows_fp32`: 146 ms for that 8-node forward). On AVX-512 CPUs the same AVX2 blocks run:
stock's one-row fp32 product there streams the weights on one thread (a Zen 4 EPYC with AVX-512-BF16, 2 cores:
~11 GB/s against ~25 through the kernel), so SmolLM2-135M's plain fp32 step took 31.9 ms against 56.9 stock and an
8-node forward 46.3 against 85.7 (`scripts/step_cost.py --dtype fp32 --modes eager,stock`). Intel AVX-512 hosts are
unmeasured; `--no-cpu-kernel` runs stock anywhere.

`fast_linears(*modules)` routes eligible `nn.Linear` layers (bf16, or fp32 where the fp32 route runs; CPU, contiguous
weight, no forward of their own set by a hook library) through the kernel (or fp32's `weight @ x^T` without it) while
its block runs, and only under no-grad/inference mode: training, Hugging Face `generate` and every baseline outside the
block stay stock. A layer is installed once (`install`: its class becomes `KernelLinear`, a plain nn.Linear
subclass); a block only switches the routing on, for its own thread. The kernel is built once per machine and torch
version with `torch.utils.cpp_extension` (ninja, a C++ compiler; ~1 min) into the draftsmith cache, and only on x86
CPUs with AVX2 + FMA or AVX-512; anywhere else, or if the build fails (one warning), stock PyTorch runs.
A failed build is remembered in the cache (`failure_marker`: one file per source, torch version, compiler and flags), so
later processes skip the attempt with a one-line notice; another compiler, other flags or a changed source build
anew, and deleting the marker retries.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from models.buildcache import cache_root

FMA_ROWS = 4  # rows the AVX-512/AVX2 FMA paths take where no wider path runs (measured before AMX and AVX-512-BF16
# were routed: 1-4 rows won, 16 lost; unmeasured since on CPUs with neither)
AMX_ROWS = 32  # input rows up to which the AMX path runs (two B tiles), for inputs whose width is a multiple of 32
DP_ROWS = 32  # input rows up to which the AVX-512-BF16 path runs where there is no AMX
FP32_ROWS = 32  # input rows up to which fp32 layers run on the kernel (host E, SmolLM2's shapes: 1-65 rows won; 32
# covers a verification tree of 31 nodes, longer prefills stay on stock GEMM)
FP32_MM_ROWS = 9  # without the kernel: rows up to which fp32 layers take `weight @ x^T` (host E: 2-9 won, 17 lost)
SOURCE = Path(__file__).with_name("csrc") / "linear.cpp"
TORCH_BATON = "lock"  # torch.utils.cpp_extension's lock file inside a build directory (a FileBaton)
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_kernel: Any = None  # the built extension module, once loaded
_failed = False  # build or load failed once: stock from then on
_amx = False  # the CPU has AMX and Linux granted the tile state
_dp = False  # the CPU has AVX-512-BF16 (the kernel's own check)


def cpu_supported() -> bool:
    """Whether this CPU and build can run the kernel: x86 with AVX2 + FMA at least, as PyTorch's own dispatch sees
    it (AVX2 or AVX512)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AVX512_BF16", "AMX")


def avx512_supported() -> bool:
    """Whether the AVX-512 path runs here (F/BW/VL); else the AVX2 path does."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")


def fp32_route_supported() -> bool:
    """Whether fp32 layers are routed here (the kernel's fp32 blocks, or `weight @ x^T` without the kernel): x86 with
    AVX2 + FMA, where both were measured to win (module docstring; AVX-512 hosts run the same AVX2 blocks)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AVX512_BF16", "AMX")


def few_rows_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, limit: int) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]^T (+ bias) as (weight @ x^T)^T for 2..`limit` rows of an fp32 CPU input under no
    grad; None where that does not apply (the caller runs stock `F.linear`). fp32's route where the kernel is not
    built."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if not 2 <= rows <= limit or torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    # [N, rows] -> [rows, N], copied contiguous: a transposed view would slow what reads it (the verify step's
    # argmax over the LM head's logits took 3.5 ms a step instead of 0.8)
    y = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def amx_supported() -> bool:
    """Whether the CPU reports AMX tiles with bf16 (Linux /proc/cpuinfo; False elsewhere)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        return False
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags


def max_rows(width: int) -> int:
    """Input rows up to which an input of `width` features runs on the kernel (0: no kernel on this machine)."""
    if load_kernel() is None:
        return 0
    if _amx:  # AMX hosts: stock oneDNN runs its own AMX kernels for the widths the tile path does not take
        return AMX_ROWS if width % 32 == 0 else FMA_ROWS
    return DP_ROWS if _dp else FMA_ROWS


def dp_supported() -> bool:
    """Whether the AVX-512-BF16 path runs here (builds the kernel if it is not built yet)."""
    return load_kernel() is not None and _dp


def _extension_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    return f"draftsmith_linear_{digest}"


def compiler_identity() -> str:
    """What a build depends on besides the source and torch: the C++ compiler torch's extension builder runs ($CXX,
    else c++: its resolved path and first `--version` line) and ninja's path; "missing" for a tool not found."""
    compiler = os.environ.get("CXX", "c++")
    path = shutil.which(compiler)
    version = "missing"
    if path is not None:
        try:
            run = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
            version = (run.stdout.strip().splitlines() or ["?"])[0]
        except (OSError, subprocess.SubprocessError):
            version = "unrunnable"
    return f"{compiler}={path or 'missing'} ({version}); ninja={shutil.which('ninja') or 'missing'}"


def failure_marker(name: str) -> Path:
    """The file that records a failed build of extension `name` (source and torch version) with this compiler and
    these flags: its presence makes later processes skip the build."""
    key = hashlib.sha256(f"{compiler_identity()}|{' '.join(CFLAGS)}|{' '.join(LDFLAGS)}".encode()).hexdigest()[:12]
    return cache_root() / "kernels" / f"{name}.failed-{key}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"


def load_kernel() -> Any:
    """The compiled extension, building it on first use; None where it is unsupported or failed to build (now, or
    in an earlier process with the same compiler and flags: `failure_marker`)."""
    global _kernel, _failed, _amx, _dp
    if _kernel is not None or _failed:
        return _kernel
    if not cpu_supported():
        _failed = True
        return None
    name = _extension_name()
    build_dir = cache_root() / "kernels" / name
    marker = None if any(build_dir.glob(f"{name}*.so")) else failure_marker(name)
    if marker is not None and marker.is_file():
        _failed = True
        warnings.warn(f"the engine's CPU kernel failed to build before with this compiler and flags ({marker}; "
                      f"delete it to retry), stock PyTorch linear runs instead", stacklevel=2)
        return None
    try:
        _kernel = _build(name, build_dir)
        _amx = amx_supported() and bool(_kernel.amx_init())
        _dp = bool(_kernel.has_avx512_bf16())
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: fall back to stock, say so once
        _failed = True
        _kernel = None
        if marker is not None:  # a build was attempted: later processes skip it
            _remember_failure(marker, exc)
        warnings.warn(f"the engine's CPU kernel is unavailable, stock PyTorch linear runs instead: "
                      f"{_first_line(exc)}", stacklevel=2)
        return None
    return _kernel


def _build(name: str, build_dir: Path) -> Any:
    """Build (or load the build of) the extension in `build_dir`, one process at a time."""
    from filelock import FileLock  # deferred: only a machine that builds the kernel needs the lock
    from torch.utils import cpp_extension  # deferred: imports setuptools, ~0.3 s, only when the kernel is needed

    build_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(build_dir) + ".lock"):  # an OS lock: released when its holder dies, however it dies
        # torch's own build baton is a plain file that a process killed mid-build or mid-load leaves behind, and
        # every later load would wait on it forever; under our lock nobody else holds it
        (build_dir / TORCH_BATON).unlink(missing_ok=True)
        if not any(build_dir.glob(f"{name}*.so")):
            print(f"building the engine's CPU kernel in {build_dir} (once, ~1 min)", file=sys.stderr, flush=True)
        return cpp_extension.load(name=name, sources=[str(SOURCE)], build_directory=str(build_dir),
                                  extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), verbose=False)


def _remember_failure(marker: Path, exc: BaseException) -> None:
    """Write `marker` (the compiler, the flags and the error, for a reader); a cache that cannot be written only
    means the next process tries again."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{compiler_identity()}\nflags: {' '.join(CFLAGS)} / {' '.join(LDFLAGS)}\n"
                          f"{_first_line(exc)}\n")
    except OSError:
        pass


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           amx: bool | None = None, avx512: bool = True, dp: bool | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N], all bf16 on the CPU, through the kernel; `amx` (default:
    where available) lets 2..32 rows run on the tile unit, `dp` (default: where available) lets 2.. rows that AMX does
    not take run on AVX-512-BF16 dot products; `avx512=False` takes the AVX2 path even where AVX-512 exists (for
    tests). Any number of rows is computed correctly; `max_rows` says up to how many it is faster than stock."""
    kernel = _require_kernel()
    if amx and not _amx:
        raise RuntimeError("AMX is not available on this machine (see amx_supported())")
    if dp and not _dp:
        raise RuntimeError("AVX-512-BF16 is not available on this machine (see dp_supported())")
    return kernel.linear_bf16(x, weight, bias, _amx if amx is None else amx, avx512, _dp if dp is None else dp)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N], all fp32 on the CPU, through the kernel's AVX2 + FMA
    blocks. Any number of rows is computed correctly; up to `FP32_ROWS` it is faster than stock on AVX2 CPUs."""
    return _require_kernel().linear_fp32(x, weight, bias)


def _require_kernel() -> Any:
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("the engine's CPU kernel is not available on this machine (see cpu_supported())")
    return kernel


def eligible(module: nn.Module) -> bool:
    """A plain bf16 CPU nn.Linear (bias bf16 or none), or an fp32 one where `fp32_route_supported`, whose forward
    nobody else replaced (accelerate's offload hooks do)."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if not isinstance(module, nn.Linear) or not isinstance(weight, torch.Tensor):
        return False
    dtype = weight.dtype
    return ((dtype == torch.bfloat16 or (dtype == torch.float32 and fp32_route_supported()))
            and weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
            and (bias is None or (bias.dtype == dtype and bias.device.type == "cpu"))
            and "forward" not in vars(module))


class KernelLinear(nn.Linear):
    """A plain `nn.Linear` whose few-row no-grad calls run through the kernel while a `fast_linears` block is active
    (stock `F.linear` otherwise: training, Hugging Face `generate`, every baseline). `install` turns an eligible layer
    into one by changing its class, once: the same parameters, state_dict, deepcopy and pickling as before."""

    kernel_rows: int  # rows up to which this layer runs on the kernel (bf16: max_rows; fp32: FP32_ROWS, or
    # FP32_MM_ROWS through `weight @ x^T` where the kernel is not built)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._traced(x)
        routing = _routing.get()
        if routing is not None and self.weight.dtype == torch.float32:
            kernel, limit = routing
            limit = min(limit, self.kernel_rows)
            y = (few_rows_fp32(x, self.weight, self.bias, limit) if kernel is None
                 else kernel.linear_fp32_routed(x, self.weight, self.bias, limit))
            if y is not None:
                return y
        elif routing is not None and routing[0] is not None:
            kernel, limit = routing
            # the kernel checks that it applies (no grad mode, bf16 CPU input of 1..rows rows, weight as eligible()
            # found it) in one C++ call and answers None where it does not
            y = kernel.linear_bf16_routed(x, self.weight, self.bias, min(limit, self.kernel_rows), _amx, _dp)
            if y is not None:
                return y
        return F.linear(x, self.weight, self.bias)

    def _traced(self, x: torch.Tensor) -> torch.Tensor:
        """The forward inside a compiled graph (inference.engine.compiled), where the routing's context variable
        cannot be read: an installed layer routes every call its kernel takes (shapes are fixed when the graph is
        traced) through the kernel's custom ops, which the graph calls like any other op; stock F.linear elsewhere."""
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        if (torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != self.weight.dtype
                or not 1 <= rows <= self.kernel_rows or load_kernel() is None):
            return F.linear(x, self.weight, self.bias)
        if x.dtype == torch.float32:
            return torch.ops.draftsmith.linear_fp32(x, self.weight, self.bias)
        return torch.ops.draftsmith.linear_bf16(x, self.weight, self.bias, _amx, _dp)


@torch.library.custom_op("draftsmith::linear_fp32", mutates_args=(), schema="(Tensor x, Tensor w, Tensor? b) -> Tensor")
def _linear_fp32_op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return _require_kernel().linear_fp32(x, w, b)


@torch.library.custom_op("draftsmith::linear_bf16", mutates_args=(),
                         schema="(Tensor x, Tensor w, Tensor? b, bool amx, bool dp) -> Tensor")
def _linear_bf16_op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, amx: bool, dp: bool) -> torch.Tensor:
    return _require_kernel().linear_bf16(x, w, b, amx, True, dp)


@_linear_fp32_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


@_linear_bf16_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, amx: bool, dp: bool) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


# (the kernel, a row limit) inside a fast_linears block of this thread / task; None: KernelLinear runs stock
_routing: ContextVar[tuple[Any, int] | None] = ContextVar("draftsmith_kernel_routing", default=None)
ALL_ROWS = max(FMA_ROWS, AMX_ROWS, DP_ROWS, FP32_ROWS)  # no limit beyond each layer's own kernel_rows


def install(*modules: nn.Module | None) -> list[KernelLinear]:
    """Turn the eligible linears of `modules` (None entries skipped) into KernelLinear, once (layers installed before
    are kept); -> every KernelLinear among them. The kernel is built when some layer is eligible; bf16 layers are
    installed only where it is available, fp32 layers also without it (`few_rows_fp32`)."""
    found: dict[int, nn.Module] = {}
    for root in modules:
        for module in root.modules() if root is not None else ():
            if isinstance(module, KernelLinear) or (type(module) is nn.Linear and eligible(module)):
                found.setdefault(id(module), module)
    kernel = load_kernel() if found else None
    if kernel is None:
        found = {key: layer for key, layer in found.items() if layer.weight.dtype != torch.bfloat16}
    fp32_rows = FP32_MM_ROWS if kernel is None else FP32_ROWS
    for layer in found.values():
        if not isinstance(layer, KernelLinear):
            fp32 = layer.weight.dtype == torch.float32
            layer.__class__ = KernelLinear
            layer.kernel_rows = fp32_rows if fp32 else max_rows(layer.in_features)
    return list(found.values())


@contextmanager
def fast_linears(*modules: nn.Module | None, enabled: bool = True, row_limit: int | None = None) -> Iterator[int]:
    """Within the block, eligible linears of `modules` (None entries skipped; installed on first use, `install`) run
    their few-row no-grad calls through the kernel: up to `max_rows` rows, or at most `row_limit` (for benchmarks: 4
    is the routing of CPUs without AMX or AVX-512-BF16). Yields how many layers are routed (0 where nothing is
    eligible, the kernel is unavailable or enabled=False). Outside the block, also on error, every layer runs stock."""
    layers = install(*modules) if enabled else []
    kernel = load_kernel() if layers else None  # None: fp32 layers take few_rows_fp32
    routing = (kernel, ALL_ROWS if row_limit is None else row_limit) if layers else None
    token = _routing.set(routing)
    try:
        yield len(layers)
    finally:
        _routing.reset(token)
