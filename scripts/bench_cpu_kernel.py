"""The engine's CPU kernel against stock PyTorch linears, on one target's forward, in one run.

    python scripts/bench_cpu_kernel.py --base smollm2                  # K = 1, 2, 4, 8, 16, 24, 32 tree nodes
    python scripts/bench_cpu_kernel.py --base smollm2 --sizes 1,16 --rounds 5
    python scripts/bench_cpu_kernel.py --base smollm2 --dtype fp32     # fp32, on AVX2 CPUs without AVX-512

Times `build-tree`'s cost curve (inference.bench.tree_fit.measure_forward_cost: a K-node tree forward on a cache of
--context tokens, plus greedy verification) three ways: stock PyTorch, with the kernel (inference.kernels.cpu_linear),
and with the kernel plus the masked-GQA attention path (inference.kernels.attention) as `generate` serves; on CPUs where
the kernel takes more than 4 rows (AMX, AVX-512-BF16) also with it limited to 4 rows (the kernel for 1-4 rows, stock
above); alternating them round by round so that a busy machine slows all alike, and prints per K the median of each
and their ratios, with the CPU it ran on and the memory-bandwidth floor of a step (weight bytes / measured read
bandwidth); then torch's argmax against the engine's `greedy_argmax` on K rows of logits. The target runs in bf16, or
in fp32 where the kernel takes fp32 (`--dtype fp32`). Outputs agree with stock to bf16 (fp32) rounding
(tests/test_cpu_kernels.py, tests/test_cpu_kernels_fp32.py; the attention path and the argmax are bit-identical,
tests/test_attention.py): this script only times.

--stream times the one-row bf16 product alone, no model: for each ROWSxWIDTH matrix, copies of it filling --stream-mb
(so none stays in cache) through the kernel and through stock `F.linear`, beside a read of memory (fp32 sums over
512 MB, inference.bench.bandwidth.read_bandwidth), alternating --rounds times; medians in GB/s of weights streamed,
and the kernel's share of the read:

    python scripts/bench_cpu_kernel.py --stream 576x576,192x576,1536x576,576x1536,4096x4096,14336x4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from data.errors import UsageError  # noqa: E402
from inference.bench.bandwidth import cpu_name, read_bandwidth, weight_bytes  # noqa: E402
from inference.bench.tree_fit import measure_forward_cost  # noqa: E402
from inference.engine.verify import greedy_argmax  # noqa: E402
from inference.kernels import cpu_linear  # noqa: E402
from inference.session import add_model_args, check_model_args, open_session  # noqa: E402


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--sizes: comma-separated node counts, got {text!r}") from None
    if not sizes or min(sizes) < 1 or sizes != sorted(set(sizes)):
        raise UsageError(f"--sizes: increasing node counts >= 1, got {text!r}")
    return sizes


def parse_matrices(text: str) -> list[tuple[int, int]]:
    """"576x576,192x576" -> [(576, 576), (192, 576)] (rows x width); UsageError naming the flag otherwise."""
    try:
        matrices = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        matrices = []
    if not matrices or any(len(m) != 2 or min(m) < 1 for m in matrices):
        raise UsageError(f"--stream: comma-separated ROWSxWIDTH matrices (e.g. 576x576,4096x14336), got {text!r}")
    return matrices


STREAM_HEADER = ("| matrix (rows x width) | copies | kernel GB/s | stock GB/s | read GB/s | kernel / read |\n"
                 "| --- | ---: | ---: | ---: | ---: | ---: |")


def stream_rows(matrices: list[tuple[int, int]], total_bytes: int, rounds: int) -> Iterator[str]:
    """--stream's table rows (module docstring), one per matrix as it is measured."""
    def seconds(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for rows, width in matrices:
        copies = max(1, total_bytes // (rows * width * 2))
        weights = [torch.randn(rows, width).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, width).to(torch.bfloat16)
        nbytes = copies * rows * width * 2
        rates: dict[str, list[float]] = {"kernel": [], "stock": [], "read": []}
        for _ in range(rounds):
            rates["kernel"].append(nbytes / seconds(lambda: [cpu_linear.linear(x, w) for w in weights]))
            rates["stock"].append(nbytes / seconds(lambda: [torch.nn.functional.linear(x, w) for w in weights]))
            rates["read"].append(read_bandwidth("cpu", repeats=3))
        gb = {name: statistics.median(values) / 1e9 for name, values in rates.items()}
        yield (f"| {rows}x{width} | {copies} | {gb['kernel']:.1f} | {gb['stock']:.1f} | {gb['read']:.1f} | "
               f"{gb['kernel'] / gb['read']:.2f} |")


def timed_median(fn, reps: int) -> float:
    fn()  # warm-up
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/bench_cpu_kernel.py", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--sizes", default="1,2,4,8,16,24,32", help="tree node counts K (default: 1,2,4,8,16,24,32)")
    p.add_argument("--context", type=int, default=256, help="cached tokens before the tree (default 256)")
    p.add_argument("--reps", type=int, default=5, help="timed forwards per K per round (median; default 5)")
    p.add_argument("--rounds", type=int, default=3, help="stock/kernel alternations (default 3)")
    p.add_argument("--stream", metavar="ROWSxWIDTH,...", help="time the one-row bf16 product on these matrices alone, "
                   "against a read of memory (no model)")
    p.add_argument("--stream-mb", type=int, default=1200, help="with --stream: MB of copies of each matrix (default "
                   "1200: more than any cache)")
    return p


def stream_main(args: argparse.Namespace) -> int:
    try:
        matrices = parse_matrices(args.stream)
        if args.stream_mb < 1 or args.rounds < 1 or (args.threads is not None and args.threads < 1):
            raise UsageError("--stream-mb, --rounds and --threads must be >= 1")
        if cpu_linear.load_kernel() is None:
            raise UsageError("the kernel is not available here (it needs an x86 CPU with AVX2 + FMA and a C++ "
                             "compiler; see python scripts/cpu_report.py)")
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_name() or 'unknown'} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} "
          f"threads; one bf16 input row; medians of {args.rounds} rounds", flush=True)
    print(STREAM_HEADER, flush=True)
    for line in stream_rows(matrices, args.stream_mb * 10**6, args.rounds):
        print(line, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.stream is not None:
        return stream_main(args)
    try:
        sizes = parse_sizes(args.sizes)
        if args.context < 1 or args.reps < 1 or args.rounds < 1:
            raise UsageError("--context, --reps and --rounds must be >= 1")
        if args.drafter:
            raise UsageError("--drafter: this script times the target alone (pass --base)")
        if args.dtype not in (None, "bf16", "fp32"):
            raise UsageError(f"--dtype {args.dtype}: the kernel takes bf16, or fp32 on AVX2 CPUs")
        if args.dtype == "fp32" and not cpu_linear.fp32_route_supported():
            raise UsageError(f"--dtype fp32: the kernel takes fp32 only on AVX2 CPUs without AVX-512 (this one: "
                             f"{torch.backends.cpu.get_cpu_capability()})")
        args.dtype = args.dtype or "bf16"
        if args.device not in (None, "cpu") or args.device_map or args.quantization != "none":
            raise UsageError("the kernel is for a plain target on the CPU (no --device, --device-map or "
                             "--quantization)")
        args.device = "cpu"
        check_model_args(args)  # everything checkable before the kernel builds or a model loads
        if cpu_linear.load_kernel() is None:
            raise UsageError("the kernel is not available here (it needs an x86 CPU with AVX2 + FMA and a C++ "
                             "compiler; see python scripts/cpu_report.py)")
        session = open_session(args)  # a base that does not load: ModelLoadError, one line
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model = session.engine.model
    amx = "yes" if cpu_linear.amx_supported() else "no"
    dp = "yes" if cpu_linear.dp_supported() else "no"
    print(f"cpu: {cpu_name() or 'unknown'} ({torch.backends.cpu.get_cpu_capability()}), AMX {amx}, AVX-512-BF16 {dp}, "
          f"{torch.get_num_threads()} threads; {args.dtype}; {args.context} cached tokens; sizes {sizes}", flush=True)
    # (label, kernel linears, the most rows they take, GQA attention): stock PyTorch, the kernel alone, the engine's
    # serving setup; and where the CPU's wide paths (AMX, AVX-512-BF16) take more than the vector path's 4 rows, the
    # kernel held to those 4
    wide = model.dtype == torch.bfloat16 and cpu_linear.max_rows(model.config.hidden_size) > cpu_linear.FMA_ROWS
    variants = (("stock", False, None, False),
                *((("kernel<=4", True, cpu_linear.FMA_ROWS, False),) if wide else ()),
                ("kernel", True, None, False), ("kernel+gqa", True, None, True))
    times: dict[str, dict[int, list[float]]] = {name: {k: [] for k in sizes} for name, *_ in variants}
    for round_ in range(args.rounds):
        for name, kernel, rows, gqa in variants:
            curve = measure_forward_cost(model, args.context, sizes, args.reps, seed=round_, cpu_kernel=kernel,
                                         gqa=gqa, kernel_rows=rows)
            for k, seconds in zip(curve.sizes, curve.seconds):
                times[name][k].append(seconds)
            print(f"round {round_ + 1}/{args.rounds} {name:10}: "
                  + " ".join(f"K={k} {s * 1e3:.1f}" for k, s in zip(curve.sizes, curve.seconds)) + " ms", flush=True)
    floor_ms = weight_bytes(model) / read_bandwidth("cpu") * 1e3
    med = {name: {k: statistics.median(times[name][k]) for k in sizes} for name, *_ in variants}
    few = ["kernel <= 4 rows ms", "kernel <= 4 / kernel"] if wide else []
    head = ["K", "stock ms", *few[:1], "kernel ms", "kernel + GQA attention ms", "stock / kernel", *few[1:],
            "kernel / kernel + GQA"]
    print("\n| " + " | ".join(head) + " |")
    print("|" + " ---: |" * len(head))
    for k in sizes:
        stock, fast, served = med["stock"][k], med["kernel"][k], med["kernel+gqa"][k]
        limited = [med["kernel<=4"][k]] if wide else []
        cells = [str(k), f"{stock * 1e3:.1f}", *(f"{t * 1e3:.1f}" for t in limited), f"{fast * 1e3:.1f}",
                 f"{served * 1e3:.1f}", f"{stock / fast:.2f}", *(f"{t / fast:.2f}" for t in limited),
                 f"{fast / served:.2f}"]
        print("| " + " | ".join(cells) + " |")
    print(f"\nbandwidth floor of a step: {floor_ms:.1f} ms ({weight_bytes(model) / 1e6:.0f} MB of weights)")
    vocab = model.get_output_embeddings().weight.shape[0]
    for k in sizes:
        logits = torch.randn(1, k, vocab, generator=torch.Generator().manual_seed(k)).to(model.dtype)
        stock = timed_median(lambda: logits.argmax(-1), args.reps * args.rounds)
        fast = timed_median(lambda: greedy_argmax(logits), args.reps * args.rounds)
        print(f"argmax of {k} x {vocab} {str(model.dtype).removeprefix('torch.')} logits: torch {stock * 1e3:.2f} ms, "
              f"greedy_argmax {fast * 1e3:.2f} ms ({stock / fast:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
