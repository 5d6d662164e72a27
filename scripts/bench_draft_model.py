"""Chain speculative decoding with a draft model against plain greedy and Hugging Face assisted generation, measured
in one run on the same prompts, target and draft (greedy, so every method returns the same tokens).

Prints tokens/s of: engine greedy (the baseline: the same loop, no drafter), engine chain SpS (gamma drafts per
step), HF `generate` greedy, HF `generate(assistant_model=draft)`; ratios are against the engine's greedy and against
HF assisted generation. Also the held-out acceptance estimate is what `python -m train distill` logs; here the mean
accepted drafts per step is printed.

    python scripts/bench_draft_model.py --target builtin:tiny --draft builtin:tiny-draft [--gamma 4] [--new 64]
    python scripts/bench_draft_model.py --target builtin:tiny --draft outputs/distill/tiny   # a distilled checkpoint
Built-in models are used only when already built (models.tiny.is_complete): this script never builds them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.draft_model import DraftModelDrafter, check_vocab, is_plain_model  # noqa: E402
from inference.drafters import NoDrafter  # noqa: E402
from inference.api import Engine  # noqa: E402
from models.checkpoint import draft_model_folder  # noqa: E402
from models.loading import BUILTIN_PREFIX, load_target, load_tokenizer  # noqa: E402

QUESTIONS = (
    "How do I read a file line by line?",
    "What does the os.path.join function do?",
    "Explain what a context manager is.",
    "How can I sort a dictionary by value?",
)


def require_built(name: str) -> None:
    """Exit cleanly when a builtin model is not built yet (building takes a long time; not this script's job)."""
    if name.startswith(BUILTIN_PREFIX):
        from models.tiny import cache_root, is_complete

        if not is_complete(cache_root() / "models" / name[len(BUILTIN_PREFIX):]):
            raise SystemExit(f"{name} is not built (python scripts/build_tiny_models.py); nothing measured")


def prompts(tokenizer, count: int) -> list[list[int]]:
    from data.chat import encode_prompt

    out = []
    for q in (QUESTIONS * count)[:count]:
        try:
            out.append(encode_prompt(tokenizer, [{"role": "user", "content": q}]))
        except ValueError:  # no chat template: the plain question
            out.append(tokenizer(q)["input_ids"])
    return out


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="builtin:tiny")
    parser.add_argument("--draft", default="builtin:tiny-draft", help="causal LM dir, builtin:<name>, or distill checkpoint")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    require_built(args.target)
    require_built(args.draft)
    draft_path = args.draft if is_plain_model(args.draft) else str(draft_model_folder(args.draft))
    tokenizer = load_tokenizer(args.target)
    target, draft = load_target(args.target, dtype=args.dtype), load_target(draft_path, dtype=args.dtype)
    check_vocab(draft, target)
    greedy, sps = Engine(target, NoDrafter()), Engine(target, DraftModelDrafter(draft, args.gamma))
    totals = dict.fromkeys(("engine greedy", "engine chain SpS", "HF greedy", "HF assisted"), 0.0)
    tokens, accepted = 0, []
    for prompt in prompts(tokenizer, args.prompts):
        ids = torch.tensor([prompt])
        hf = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        for _ in range(2):  # the second pass is timed: the first warms allocators and kernels
            t_greedy, base = timed(lambda: greedy.generate(prompt, args.new, ignore_eos=True))
            t_sps, spec = timed(lambda: sps.generate(prompt, args.new, ignore_eos=True))
            t_hf, _ = timed(lambda: target.generate(ids, **hf))
            t_assist, assisted = timed(lambda: target.generate(ids, assistant_model=draft, **hf))
        if spec.sequences != base.sequences:
            print(f"note: a near-tie flipped a token ({args.dtype}); outputs differ for one prompt", flush=True)
        for key, t in zip(totals, (t_greedy, t_sps, t_hf, t_assist)):
            totals[key] += t
        tokens += args.new
        accepted.append(spec.stats.mean_accepted)
    print(f"target {args.target}, draft {args.draft}, gamma {args.gamma}, {len(accepted)} prompts x {args.new} tokens")
    print(f"mean accepted drafts per step: {sum(accepted) / len(accepted):.2f} of {args.gamma}")
    for key, t in totals.items():
        print(f"  {key:18} {tokens / t:8.1f} tok/s   x{totals['engine greedy'] / t:5.2f} vs engine greedy   "
              f"x{totals['HF assisted'] / t:5.2f} vs HF assisted")


if __name__ == "__main__":
    main()
