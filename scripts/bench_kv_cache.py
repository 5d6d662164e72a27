"""The engine's slot cache against stock transformers concatenation, per decode step, in one run.

    python scripts/bench_kv_cache.py --base smollm2 --dtype fp32                      # 1x256,32x256,32x1024,4x2048
    python scripts/bench_kv_cache.py --base smollm2 --dtype fp32 --shapes 8x512 --rounds 8

For each shape B x T (rows x cached prompt tokens) the target prefills one batch of random prompts into the engine's
cache (inference.engine.cache.SlotLayer: new keys/values written into preallocated slots), and the same keys/values
are copied into a stock DynamicCache (`torch.cat` of the whole cache every forward). Rounds then alternate between
the two, each timing --steps of the engine's own plain decode step (inference.engine.loop: forward_tree, verify,
accept; one token a row), so a busy machine slows both alike. Prints per shape the median ms a step of each and their
ratio, with the CPU it ran on. Both caches hold the same values (tests/test_cache.py): this script only times.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from data.errors import UsageError  # noqa: E402
from inference.bench.bandwidth import cpu_name  # noqa: E402
from inference.bench.run import still_running  # noqa: E402
from inference.engine.cache import new_cache  # noqa: E402
from inference.engine.devices import cuda_sync  # noqa: E402
from inference.engine.drafter import DecodeState, NoDrafter  # noqa: E402
from inference.engine.loop import DecodeConfig, accept, forward_tree, prefill, verify  # noqa: E402
from inference.kernels.attention import gqa_attention  # noqa: E402
from inference.kernels.cpu_linear import fast_linears  # noqa: E402
from inference.session import add_model_args, open_session  # noqa: E402


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"32x1024,4x2048" -> [(32, 1024), (4, 2048)]: rows x prompt tokens."""
    shapes = []
    for part in text.split(","):
        rows, _, tokens = part.strip().partition("x")
        if not (rows.isdigit() and tokens.isdigit() and int(rows) >= 1 and int(tokens) >= 1):
            raise UsageError(f"--shapes: comma-separated ROWSxTOKENS (e.g. 32x1024), got {part!r}")
        shapes.append((int(rows), int(tokens)))
    return shapes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/bench_kv_cache.py", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--shapes", default="1x256,32x256,32x1024,4x2048",
                   help="rows x prompt tokens (default: 1x256,32x256,32x1024,4x2048)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per cache per round (default 8)")
    p.add_argument("--rounds", type=int, default=6, help="slots/stock alternations (default 6)")
    return p


def stock_copy(state: DecodeState) -> DecodeState:
    """`state` with its cache's keys/values copied into a stock DynamicCache (and its own per-row tensors)."""
    cache = new_cache(slots=False)
    for index, layer in enumerate(state.cache.layers):
        cache.update(layer.keys.clone(), layer.values.clone(), index)
    return dataclasses.replace(state, cache=cache, valid=state.valid.clone(), next_pos=state.next_pos.clone(),
                               root=state.root.clone(), generated=[list(g) for g in state.generated])


def time_steps(model: torch.nn.Module, state: DecodeState, config: DecodeConfig, steps: int) -> float:
    """Median seconds of `steps` plain decode steps (draft the root, forward, verify, accept), advancing `state`
    (on a GPU, each timed to the end of its kernels)."""
    drafter, seconds, sync = NoDrafter(), [], cuda_sync(model) or (lambda: None)
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        draft = drafter.propose(state)
        logits, hidden = forward_tree(model, state, draft, needs_hidden=False)
        accept(state, verify(draft, logits, config, None), hidden)
        sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
        if args.steps < 1 or args.rounds < 1:
            raise UsageError("--steps and --rounds must be >= 1")
        if args.drafter:
            raise UsageError("--drafter: this script times the target's cache alone (pass --base)")
        session = open_session(args)  # every model option checked before a model loads; a bad base: one line
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model = session.engine.model
    device = session.engine.device
    vocab = model.get_input_embeddings().weight.shape[0]
    print(f"cpu: {cpu_name() or 'unknown'} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} "
          f"threads; {model.dtype}, device {device}; {args.steps} steps x {args.rounds} rounds a shape", flush=True)
    config = DecodeConfig(max_new_tokens=args.steps * args.rounds + 1)
    rows = []
    with torch.inference_mode(), fast_linears(model, enabled=session.engine.cpu_kernel), gqa_attention(model):
        for b, t in shapes:
            print(f"{b}x{t}: prefilling {b * t:,} tokens", flush=True)
            ids = torch.randint(1, vocab, (b, t), generator=torch.Generator().manual_seed(b * t)).to(device)
            with still_running(f"{b}x{t}: prefill", interval=5.0):
                slots = prefill(model, ids, torch.ones_like(ids, dtype=torch.bool), config, False, None)
            states = {"slots": slots, "stock": stock_copy(slots)}
            times: dict[str, list[float]] = {"slots": [], "stock": []}
            for round_ in range(args.rounds):
                for name in ("slots", "stock") if round_ % 2 == 0 else ("stock", "slots"):
                    times[name].append(time_steps(model, states[name], config, args.steps))
                print(f"{b}x{t} round {round_ + 1}/{args.rounds}: slots {times['slots'][-1] * 1e3:.1f} ms, stock "
                      f"{times['stock'][-1] * 1e3:.1f} ms a step", flush=True)
            same = sum(x == y for x, y in zip(states["slots"].generated, states["stock"].generated))
            if same < b:  # the same values (tests/test_cache.py): only a near-tie rounded apart can do this
                print(f"{b}x{t}: note: {b - same} of {b} rows decoded differently on the two caches", flush=True)
            rows.append((b, t, statistics.median(times["slots"]), statistics.median(times["stock"])))
    print("\n| rows x prompt tokens | slots ms a step | stock ms a step | stock / slots |")
    print("| --- | ---: | ---: | ---: |")
    for b, t, fast, stock in rows:
        print(f"| {b} x {t} | {fast * 1e3:.1f} | {stock * 1e3:.1f} | {stock / fast:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
