"""What a target forward costs here by the number of drafted nodes, and the acceptance a draft of each size needs.

    python scripts/step_cost.py --base smollm2 --dtype fp32
    python scripts/step_cost.py --base smollm2 --dtype fp32 --nodes 0,1,2,4,8,16,32 --context 512
    python scripts/step_cost.py --shape llama3_1_8b --modes eager --nodes 0,8   # a random target of those shapes

The target prefills --context random tokens, then runs, as the engine's loop does (inference.engine.step_cost), one
forward over the root and a chain of k drafted nodes for each k of --nodes, --repeats times after a warm-up; the
median of each is printed with its ratio to a plain step (k = 0) and the break-even acceptance: the drafts a step of
k nodes must accept on average to beat plain decoding, t(k) / t(0) - 1. That is the value of prompt lookup's
`min_expected` option for num_draft = k on this host (inference.drafters.prompt_lookup); the least-squares cost of one
drafted node in plain steps is its `node_cost` option (each step's nodes cut to as many as pay). The last line is the
curve as K:MS items (--quiet prints only that line), for scripts that replay answers against it.

--modes times the forward in several ways, alternating, --rounds times each; each size's figure is the median of its
rounds' medians, and every mode after the first is shown beside the first with the ratio:
    eager     the engine's default: growing cache, its CPU kernels
    stock     the CPU kernels off (stock `F.linear`, the engine's --no-cpu-kernel)
    static    a static cache, trees in node buckets (the engine's --static-cache)
    compiled  the target's step compiled over a static cache (--compile; the warm-up compiles, apart from the timing)
The memory-bandwidth floor (weight bytes / read bandwidth, inference.bench.bandwidth) is printed with each mode's
plain step against it. On a shared host the bandwidth moves from one minute to the next, so it is read before and
after every curve and each curve's plain step is set against its own floor; a mode's figure is the median of those
ratios, and the floors' spread is printed.

--shape times a random Llama of a model's shapes instead of loaded weights (a name such as llama3_1_8b, a config.json,
or hidden=,layers=,heads=,kv_heads=,intermediate=,vocab=; train.memory_model.resolve_shape): the shapes decide the
time, so a machine can be judged for a target it has not downloaded.

    python scripts/step_cost.py --base smollm2 --dtype bf16 --modes compiled,eager --nodes 0,1,4,8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from data.errors import UsageError  # noqa: E402
from inference.bench.bandwidth import cpu_name, read_bandwidth, weight_bytes  # noqa: E402
from inference.engine.step_cost import NODES, StepCost, measure_step_cost  # noqa: E402
from inference.session import add_model_args, open_session  # noqa: E402
from models.builtin import DTYPES  # noqa: E402
from models.loading import check_device  # noqa: E402
from train.memory_model import MemoryModelError, Shape, resolve_shape  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse_nodes(text: str) -> tuple[int, ...]:
    """"0,1,8" -> (0, 1, 8): drafted-node counts, ascending from 0; UsageError naming the flag otherwise."""
    try:
        nodes = tuple(int(part) for part in text.split(","))
    except ValueError:
        nodes = ()
    if not nodes or nodes[0] != 0 or any(b <= a for a, b in zip(nodes, nodes[1:])):
        raise UsageError(f"--nodes takes whole numbers ascending from 0 joined by commas, got {text!r}")
    return nodes


MODES = {  # name -> measure_step_cost's settings
    "eager": {},
    "stock": {"cpu_kernel": False},
    "static": {"static_cache": True},
    "compiled": {"compile": True},
}


def parse_modes(text: str) -> tuple[str, ...]:
    """"compiled,eager" -> ("compiled", "eager"); UsageError naming the flag otherwise."""
    modes = tuple(text.split(","))
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise UsageError(f"--modes takes distinct names among {', '.join(MODES)} joined by commas, got {text!r}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/step_cost.py", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--nodes", default=",".join(map(str, NODES)),
                   help=f"drafted nodes to time, ascending from 0 (default {','.join(map(str, NODES))})")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per size, after one warm-up (default 5)")
    p.add_argument("--context", type=int, default=256, help="prompt tokens cached before the forwards (default 256)")
    p.add_argument("--quiet", action="store_true", help="print only the K:MS line")
    p.add_argument("--modes", default="eager",
                   help=f"how the forward runs, comma-separated, the first the main curve: {', '.join(MODES)} "
                        "(default eager)")
    p.add_argument("--rounds", type=int, default=3, help="with several --modes: curves of each (default 3)")
    p.add_argument("--shape", help="instead of --base: a random Llama of these shapes (a model name such as "
                   "llama3_1_8b, a config.json, or hidden=,layers=,heads=,kv_heads=,intermediate=,vocab=[,tied=1])")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        nodes = parse_nodes(args.nodes)
        modes = parse_modes(args.modes)
        if args.repeats < 1 or args.context < 1 or args.rounds < 1:
            raise UsageError("--repeats, --context and --rounds must be >= 1")
        if args.drafter:
            raise UsageError("--drafter: this script times the target alone (pass --base)")
        if args.shape is None:
            model = open_session(args).engine.model  # every model option checked before a model loads
        else:
            model = random_target(check_shape_args(args), args)
    except (UsageError, MemoryModelError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    device = model.get_input_embeddings().weight.device
    say = (lambda *a, **k: None) if args.quiet else print
    say(f"cpu: {cpu_name() or 'unknown'} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} "
        f"threads; {model.dtype}, device {device}; {args.context}-token context, median of {args.repeats}",
        flush=True)

    def progress(k: int, ms: float) -> None:
        print(f"{k} drafted nodes: {ms:.1f} ms", file=sys.stderr, flush=True)

    def curve(mode: str) -> StepCost:
        return measure_step_cost(model, nodes, repeats=args.repeats, context=args.context, progress=progress,
                                 **MODES[mode])

    nbytes = weight_bytes(model)
    rounds: dict[str, list[StepCost]] = {mode: [] for mode in modes}
    floors: dict[str, list[float]] = {mode: [] for mode in modes}  # ms: weight bytes / the reads around each curve
    for i in range(args.rounds if len(modes) > 1 else 1):
        for mode in modes:
            print(f"round {i + 1}, {mode}", file=sys.stderr, flush=True)
            before = read_bandwidth(device)
            rounds[mode].append(curve(mode))
            floors[mode].append(nbytes / ((before + read_bandwidth(device)) / 2) * 1e3)
    costs = {mode: StepCost(tuple((k, statistics.median(c.ms(k) for c in curves)) for k in nodes))
             for mode, curves in rounds.items()}
    cost, others = costs[modes[0]], modes[1:]
    extra = "".join(f" {m} ms | × {m} |" for m in others)
    say(f"\n{modes[0]}:\n| drafted nodes | ms a forward | × a plain step | break-even accepted drafts "
        f"(min_expected) |{extra}")
    say("| ---: | ---: | ---: | ---: |" + " ---: | ---: |" * len(others))
    for k, ms in cost.points:
        row = (f"| {k} | {ms:.1f} | {ms / cost.ms(0):.2f} | {cost.break_even(k):.2f} |" if k else
               f"| 0 (plain) | {ms:.1f} | 1.00 | |")
        say(row + "".join(f" {costs[m].ms(k):.1f} | {ms / costs[m].ms(k):.2f} |" for m in others))
    every = [f for mode in modes for f in floors[mode]]
    over = {m: statistics.median(c.ms(0) / f for c, f in zip(rounds[m], floors[m])) for m in modes}
    say(f"\nmemory-bandwidth floor {statistics.median(every):.2f} ms a step ({nbytes / 1e6:.0f} MB of "
        f"weights / the read bandwidth measured before and after each curve; {min(every):.2f}-{max(every):.2f} ms over "
        f"{len(every)} curves); plain step " + ", ".join(f"{m} {over[m]:.2f}x" for m in modes)
        + " the floor (each curve against its own floor, the median of its mode's)")
    node_cost = cost.node_cost()
    say(f"\none drafted node costs {node_cost:.3f} plain steps (least squares): prompt lookup's "
        f"--drafter-option node_cost={node_cost:.3f}")
    say()
    print(cost, flush=True)
    return 0


def check_shape_args(args: argparse.Namespace) -> Shape:
    """--shape's Shape, and the options a random target cannot take refused; one line, before any model is built."""
    for flag, given in (("--base", args.base), ("--quantization", args.quantization not in (None, "none")),
                        ("--device-map", args.device_map)):
        if given:
            raise UsageError(f"--shape builds a random target: drop {flag}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.device is not None:
        check_device(args.device)
    return resolve_shape(args.shape, ROOT / "conf" / "model", "--shape")


def random_target(shape: Shape, args: argparse.Namespace) -> torch.nn.Module:
    """A random Llama of `shape` in --dtype (bf16 by default) on --device, seeded by --seed."""
    from train.memory_measure import random_llama  # deferred: imports the trainers' configs, for --shape only

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype or "bf16"]
    device = check_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"building a random {shape.name} target, {shape.params() / 1e9:.2f}B params in {dtype}, on {device}",
          file=sys.stderr, flush=True)
    return random_llama(shape, dtype, device, args.seed).eval().requires_grad_(False)


if __name__ == "__main__":
    sys.exit(main())
