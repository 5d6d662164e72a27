"""Draft-model speculative decoding against plain greedy and Hugging Face assisted generation, measured in one run
on the same prompts, target and draft (greedy, so every method returns the same tokens).

Prints tokens/s of: engine greedy (the baseline: the same loop, no drafter), each engine drafting configuration
(`--configs`: chain or multi-candidate tree, with a stop policy), HF `generate` greedy and HF
`generate(assistant_model=draft)` (its default dynamic draft length); ratios are against the engine's greedy and
against HF assisted generation, plus mean draft tokens and accepted drafts per step. Methods alternate prompt by
prompt, after one warm-up pass of each.

    python scripts/bench_draft_model.py --target builtin:tiny --draft builtin:tiny-draft [--new 64]
    python scripts/bench_draft_model.py --draft outputs/stopper/tiny --configs chain:4 chain:8@learned branches:2x8@learned
A config is TREE[@STOP]: TREE as `inference.load(tree=)` (chain:<n>, branches:<k>x<n>), STOP as `draft_stop=`
(fixed, confidence:<t>, learned[:<t>]; learned needs a checkpoint from `python -m train stopper`).
Prompts: MT-bench first turns from ../shared/data/mt_bench/question.jsonl when present, else built-in questions.
Built-in models are used only when already built (models.tiny.is_built): this script never builds them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.chat import encode_prompt  # noqa: E402
from inference.api import Engine  # noqa: E402
from inference.drafters.draft_model import DraftModelDrafter, draft_shape  # noqa: E402
from inference.drafters.draft_stop import parse_stop  # noqa: E402
from inference.engine.drafter import NoDrafter  # noqa: E402
from models.draft_model import checkpoint_stopper, load_draft_model  # noqa: E402
from models.loading import load_target, load_tokenizer  # noqa: E402
from models.refs import BuiltinRef, parse_model  # noqa: E402
from models.tiny import is_built  # noqa: E402

QUESTIONS = (
    "How do I read a file line by line?",
    "What does the os.path.join function do?",
    "Explain what a context manager is.",
    "How can I sort a dictionary by value?",
)


def require_built(name: str) -> None:
    """Exit cleanly when a builtin model is not built yet (building takes a long time; not this script's job)."""
    ref = parse_model(name)
    if isinstance(ref, BuiltinRef):
        if not is_built(ref.name):
            raise SystemExit(f"{name} is not built (python scripts/build_tiny_models.py); nothing measured")


MT_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench" / "question.jsonl"


def questions(count: int) -> list[str]:
    import json

    if MT_BENCH.is_file():
        found = [json.loads(line)["turns"][0] for line in MT_BENCH.read_text().splitlines() if line.strip()]
    else:
        found = list(QUESTIONS)
    return (found * count)[:count]


def prompts(tokenizer, count: int) -> list[list[int]]:
    out = []
    for q in questions(count):
        try:
            out.append(encode_prompt(tokenizer, [{"role": "user", "content": q}]))
        except ValueError:  # no chat template: the plain question
            out.append(tokenizer(q)["input_ids"])
    return out


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def drafter(draft, spec: str, stopper, threshold) -> DraftModelDrafter:
    tree, _, stop = spec.partition("@")
    gamma, branches = draft_shape(tree)
    return DraftModelDrafter(draft, gamma, branches, stop=parse_stop(stop or "fixed", stopper, threshold))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="builtin:tiny")
    parser.add_argument("--draft", default="builtin:tiny-draft",
                        help="causal LM dir, builtin:<name>, or a distill / stopper checkpoint")
    parser.add_argument("--configs", nargs="+", default=["chain:4"], help="TREE[@STOP] per engine configuration")
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    require_built(args.target)
    require_built(args.draft)
    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target, dtype=args.dtype)
    draft = load_draft_model(args.draft, target, target.device)  # vocabulary checked, shared tensors attached
    stopper, entry = checkpoint_stopper(args.draft)
    threshold = entry.get("threshold")
    engines = {"engine greedy": Engine(target, NoDrafter())}
    engines.update({f"engine {c}": Engine(target, drafter(draft, c, stopper, threshold)) for c in args.configs})
    names = [*engines, "HF greedy", "HF assisted"]
    totals, accepted, steps = dict.fromkeys(names, 0.0), {}, {}
    tokens, mismatches = 0, 0
    all_prompts = prompts(tokenizer, args.prompts)
    for i, prompt in enumerate(all_prompts):
        ids = torch.tensor([prompt])
        hf = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        runs = {name: (lambda e=engine: e.generate(prompt, args.new, ignore_eos=True)) for name, engine in engines.items()}
        runs["HF greedy"] = lambda: target.generate(ids, **hf)
        runs["HF assisted"] = lambda: target.generate(ids, assistant_model=draft, **hf)
        for name, run in runs.items():
            if i == 0:
                run()  # warm-up: allocators, kernels, caches
            t, out = timed(run)
            totals[name] += t
            if name == "engine greedy":
                reference = out.sequences
            elif name.startswith("engine"):
                mismatches += out.sequences != reference
            if name.startswith("engine"):
                steps[name] = steps.get(name, 0) + out.stats.steps
                accepted[name] = accepted.get(name, 0) + sum(a for s in out.stats.accepted for a in s if a >= 0)
        tokens += args.new
    print(f"target {args.target}, draft {args.draft} ({args.dtype}), {len(all_prompts)} prompts x {args.new} tokens"
          f"{' (MT-bench first turns)' if MT_BENCH.is_file() else ''}; outputs differing from engine greedy: {mismatches}")
    print(f"  {'method':28} {'tok/s':>8} {'vs engine greedy':>17} {'vs HF assisted':>15} {'accepted/step':>14}")
    for name, t in totals.items():
        per_step = f"{accepted[name] / steps[name]:14.2f}" if name in steps and name != "engine greedy" else " " * 14
        print(f"  {name:28} {tokens / t:8.1f} {totals['engine greedy'] / t:17.2f} {totals['HF assisted'] / t:15.2f} {per_step}")


if __name__ == "__main__":
    main()
