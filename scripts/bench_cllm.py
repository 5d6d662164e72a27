"""Jacobi decoding before/after CLLM training: tokens per target forward, speedup over greedy, greedy identity.

    python -m data.jacobi --model tiny --output traj.jsonl --block-size 16 --max-prompts 512 --max-new-tokens 64
    python -m train cllm +model=tiny method.trajectories=traj.jsonl training.max_steps=200 training.learning_rate=2e-4
    python scripts/bench_cllm.py --base builtin:tiny --cllm outputs/cllm/tiny --prompts 16

Prompts are the first user turns of a `data` config's validation split. Speedups are wall-clock ratios against the
greedy baseline of the same model in the same run (the training report prints validation perplexity vs original).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.config import load_data_config  # noqa: E402
from data.jacobi import prompt_samples  # noqa: E402
from inference import Engine, NoDrafter, load  # noqa: E402
from models.loading import load_tokenizer  # noqa: E402


def run(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], int, int, float]:
    """(sequences, new tokens, decoding steps, seconds) over the prompts, one at a time."""
    sequences, tokens, steps, seconds = [], 0, 0, 0.0
    for prompt in prompts:
        start = time.perf_counter()
        out = engine.generate(prompt, max_new_tokens=max_new_tokens)
        seconds += time.perf_counter() - start
        sequences += out.sequences
        tokens += len(out.sequences[0])
        steps += out.stats.steps
    return sequences, tokens, steps, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--cllm", required=True, type=Path, help="a checkpoint written by `python -m train cllm`")
    parser.add_argument("--data", default="default")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="fp32")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.base)
    samples = prompt_samples(load_data_config(args.data), tokenizer, "validation", args.prompts)
    prompts = [list(s.prompt_ids) for s in samples]
    tuned = load(args.cllm, dtype=args.dtype)
    n = tuned.drafter.options.block_size
    base_jacobi = load(f"jacobi:n={n},init={tuned.drafter.options.init}", base=args.base, dtype=args.dtype)
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, block size {n}")
    print(f"{'model':<10}{'greedy tok/s':>14}{'jacobi tok/step':>17}{'jacobi tok/s':>14}{'speedup':>9}  == greedy")
    for name, jacobi in (("original", base_jacobi), ("cllm", tuned)):
        greedy_out, g_tokens, _, g_seconds = run(Engine(jacobi.model, NoDrafter()), prompts, args.max_new_tokens)
        jacobi_out, j_tokens, j_steps, j_seconds = run(jacobi, prompts, args.max_new_tokens)
        per_step = (j_tokens - len(prompts)) / max(j_steps, 1)  # each row's first token comes from the prefill
        print(f"{name:<10}{g_tokens / g_seconds:>14.1f}{per_step:>17.2f}"
              f"{j_tokens / j_seconds:>14.1f}{g_seconds / g_tokens * j_tokens / j_seconds:>8.2f}x  "
              f"{jacobi_out == greedy_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
