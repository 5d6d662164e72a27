"""Does an EAGLE-3 checkpoint's training-time τ estimate say what the engine will measure? And on which prompts?

    python scripts/eagle3_walk.py --drafter outputs/eagle3/smollm2-self
    python scripts/eagle3_walk.py --drafter outputs/eagle3/smollm2-self --features features/smollm2-self --count 16
    python scripts/eagle3_walk.py --drafter outputs/eagle3/smollm2-self --tree chain:3 --also chain:6,default

Serves each prompt greedily through the engine with the drafter and `--tree` (τ = new tokens / target forwards,
prefill included), then scores the same continuations as training evaluates them (`train.eagle3.record_ranks`: the
draft unrolled over the target's teacher-forced features) and prints, beside the engine's τ:
    walk    the continuations replayed step by step through the tree (`ContinuationWalk`): each step starts where the
            last one ended, as in the engine, so it should equal the engine's τ (up to near-ties that fp32 rounding
            can flip between a tree forward and a teacher-forced one)
    mean    1 + the mean accepted length of a chain over every position, the estimate training logged before the
            walk: too high where easy and hard stretches alternate, because steps land more often in the hard ones
`--also` scores further static trees by the walk alone (no engine run). Prompts: `--questions` (the bench's sets or a
question file, first turns) or `--features DIR`, the held-out prompts a feature cache keeps for training's evaluation,
so the two can be told apart: estimate against engine on one set of prompts, one set of prompts against another.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from data.chat import IGNORE_INDEX  # noqa: E402
from data.errors import UsageError  # noqa: E402
from data.features import read_prompts  # noqa: E402
from inference import load  # noqa: E402
from inference.bench.prompt_sets import load_questions  # noqa: E402
from inference.drafters.eagle3 import DynamicTree, Eagle3Drafter, eagle3_tree  # noqa: E402
from inference.engine.tree import chain_choices  # noqa: E402
from models.eagle3 import check_eagle3_checkpoint  # noqa: E402
from train.eagle3 import Eagle3TrainModule, RankCounter, chain_tau, record_ranks  # noqa: E402


def tree_choices(spec: str, acceptance: list[list[float]]) -> list[tuple[int, ...]]:
    """A static tree's paths, read as the engine reads `--tree` for an eagle3 checkpoint (`eagle3_tree`)."""
    tree = eagle3_tree(spec, acceptance, "cpu")
    if isinstance(tree, DynamicTree):
        raise UsageError(f"--tree {spec}: the walk replays static trees (default, chain:<n>, a tree file)")
    return list(tree.choices)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python scripts/eagle3_walk.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="an eagle3 checkpoint")
    p.add_argument("--tree", default="default", help="the static tree the engine serves with (default: the "
                   "checkpoint's; chain:<n>; a tree file)")
    p.add_argument("--also", default="", help="comma list of further static trees scored by the walk alone")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--questions", default="mt_bench:8:spread,gsm8k:4:spread,humaneval:4:spread",
                        help="bench prompt sets or a question file (first turns)")
    source.add_argument("--features", help="a feature cache folder: its held-out prompts (training's evaluation)")
    p.add_argument("--count", type=int, default=None, help="at most this many prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or (args.count is not None and args.count < 1):
        p.error("--max-new-tokens and --count take a positive number")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # every input is checked before the model loads
        config = check_eagle3_checkpoint(args.drafter)  # an eagle3 checkpoint with sound maps
        acceptance = config.acceptance or []  # the table the engine builds its default tree from
        trees = {spec: tree_choices(spec, acceptance) for spec in [args.tree, *args.also.split(",")] if spec}
        if args.features:
            prompts = read_prompts(args.features)
            if not prompts:
                raise UsageError(f"--features {args.features}: no held-out prompts there (a feature cache keeps them "
                                 f"in its folder)")
        else:
            prompts = None
            questions, _ = load_questions(args.questions)
        engine = load(args.drafter, dtype=args.dtype, tree=args.tree)
    except (UsageError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    assert isinstance(engine.drafter, Eagle3Drafter) and not isinstance(engine.drafter.tree, DynamicTree)
    if prompts is None:
        prompts = [engine.encode(q.turns[0]) for q in questions]
    prompts = prompts[: args.count]
    draft = engine.drafter.draft
    module = Eagle3TrainModule(engine.model, draft)
    depth = max(max(map(len, choices)) for choices in trees.values())  # unrolled steps the trees need
    counter = RankCounter(depth)
    tokens = forwards = 0
    for ids in tqdm(prompts, desc="prompts (engine, then the draft's ranks)"):
        out = engine.generate_ids(ids, max_new_tokens=args.max_new_tokens)
        new = out.sequences[0]
        tokens, forwards = tokens + out.stats.new_tokens, forwards + out.stats.target_forwards
        text = torch.tensor([list(ids) + list(new)])
        labels = torch.cat([torch.full((len(ids),), IGNORE_INDEX), torch.tensor(new, dtype=torch.long)])[None]
        record_ranks(module, tuple(draft.config.layers), text, torch.ones_like(text), labels, depth, counter)
    source = f"--features {args.features}" if args.features else f"--questions {args.questions}"
    print(f"{len(prompts)} prompts ({source}), {tokens} new tokens, greedy, {args.dtype}")
    print(f"{'tree':28}{'nodes':>6}{'engine τ':>10}{'walk τ':>9}{'mean τ':>9}")
    for spec, choices in trees.items():
        engine_tau = f"{tokens / forwards:10.3f}" if spec == args.tree else f"{'':10}"
        chain = choices == chain_choices(len(choices))
        rates = [row[0] for row in counter.table()[: len(choices)]]
        mean = f"{chain_tau(rates):9.3f}" if chain else f"{'':9}"
        print(f"{spec:28}{len(choices) + 1:6d}{engine_tau}{counter.walk.tau(choices):9.3f}{mean}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
