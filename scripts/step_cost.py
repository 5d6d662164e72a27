"""What a target forward costs here by the number of drafted nodes, and the acceptance a draft of each size needs.

    python scripts/step_cost.py --base smollm2 --dtype fp32
    python scripts/step_cost.py --base smollm2 --dtype fp32 --nodes 0,1,2,4,8,16,32 --context 512

The target prefills --context random tokens, then runs, as the engine's loop does (inference.engine.step_cost), one
forward over the root and a chain of k drafted nodes for each k of --nodes, --repeats times after a warm-up; the
median of each is printed with its ratio to a plain step (k = 0) and the break-even acceptance: the drafts a step of
k nodes must accept on average to beat plain decoding, t(k) / t(0) - 1. That is the value of prompt lookup's
`min_expected` option for num_draft = k on this host (inference.drafters.prompt_lookup); the least-squares cost of one
drafted node in plain steps is its `node_cost` option (each step's nodes cut to as many as pay). The last line is the
curve as K:MS items (--quiet prints only that line), for scripts that replay answers against it.

--against-stock also times the loop with its CPU kernels off (stock `F.linear`, the engine's --no-cpu-kernel): the
two curves alternate, --rounds times each, and each size's figure is the median of its rounds' medians, with the
ratio of the two beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from data.errors import UsageError  # noqa: E402
from inference.bench.bandwidth import cpu_name  # noqa: E402
from inference.engine.step_cost import NODES, StepCost, measure_step_cost  # noqa: E402
from inference.session import add_model_args, open_session  # noqa: E402


def parse_nodes(text: str) -> tuple[int, ...]:
    """"0,1,8" -> (0, 1, 8): drafted-node counts, ascending from 0; UsageError naming the flag otherwise."""
    try:
        nodes = tuple(int(part) for part in text.split(","))
    except ValueError:
        nodes = ()
    if not nodes or nodes[0] != 0 or any(b <= a for a, b in zip(nodes, nodes[1:])):
        raise UsageError(f"--nodes takes whole numbers ascending from 0 joined by commas, got {text!r}")
    return nodes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/step_cost.py", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--nodes", default=",".join(map(str, NODES)),
                   help=f"drafted nodes to time, ascending from 0 (default {','.join(map(str, NODES))})")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per size, after one warm-up (default 5)")
    p.add_argument("--context", type=int, default=256, help="prompt tokens cached before the forwards (default 256)")
    p.add_argument("--quiet", action="store_true", help="print only the K:MS line")
    p.add_argument("--against-stock", action="store_true",
                   help="also time the forwards with the engine's CPU kernels off, alternating with them on")
    p.add_argument("--rounds", type=int, default=3, help="with --against-stock: curves of each kind (default 3)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        nodes = parse_nodes(args.nodes)
        if args.repeats < 1 or args.context < 1 or args.rounds < 1:
            raise UsageError("--repeats, --context and --rounds must be >= 1")
        if args.drafter:
            raise UsageError("--drafter: this script times the target alone (pass --base)")
        session = open_session(args)  # every model option checked before a model loads; a bad base: one line
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model = session.engine.model
    say = (lambda *a, **k: None) if args.quiet else print
    say(f"cpu: {cpu_name() or 'unknown'} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} "
        f"threads; {model.dtype}, device {session.engine.device}; {args.context}-token context, median of "
        f"{args.repeats}", flush=True)

    def progress(k: int, ms: float) -> None:
        print(f"{k} drafted nodes: {ms:.1f} ms", file=sys.stderr, flush=True)

    def curve(cpu_kernel: bool) -> StepCost:
        return measure_step_cost(model, nodes, repeats=args.repeats, context=args.context, progress=progress,
                                 cpu_kernel=cpu_kernel)

    if not args.against_stock:
        cost, stock = curve(True), None
    else:
        rounds = {True: [], False: []}
        for i in range(args.rounds):
            for kernels in (True, False):
                print(f"round {i + 1}/{args.rounds}, CPU kernels {'on' if kernels else 'off'}", file=sys.stderr)
                rounds[kernels].append(curve(kernels))
        cost, stock = (StepCost(tuple((k, statistics.median(c.ms(k) for c in rounds[kernels])) for k in nodes))
                       for kernels in (True, False))
    extra = "" if stock is None else " stock ms | × stock |"
    say(f"\n| drafted nodes | ms a forward | × a plain step | break-even accepted drafts (min_expected) |{extra}")
    say("| ---: | ---: | ---: | ---: |" + ("" if stock is None else " ---: | ---: |"))
    for k, ms in cost.points:
        row = (f"| {k} | {ms:.1f} | {ms / cost.ms(0):.2f} | {cost.break_even(k):.2f} |" if k else
               f"| 0 (plain) | {ms:.1f} | 1.00 | |")
        say(row + ("" if stock is None else f" {stock.ms(k):.1f} | {ms / stock.ms(k):.2f} |"))
    node_cost = cost.node_cost()
    say(f"\none drafted node costs {node_cost:.3f} plain steps (least squares): prompt lookup's "
        f"--drafter-option node_cost={node_cost:.3f}")
    say()
    print(cost, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
