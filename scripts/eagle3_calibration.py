"""Is an EAGLE-3 draft's confidence calibrated? EAGLE-2's dynamic tree values a path by the product of the draft's
probabilities along it, which pays only when those probabilities track acceptance.

    python scripts/eagle3_calibration.py --drafter outputs/eagle3/smollm2-self
    python scripts/eagle3_calibration.py --drafter outputs/eagle3/smollm2-self --questions mt_bench:8:spread --max-new-tokens 64

Serves the prompts greedily with the drafter's dynamic tree (`--tree`, default `dynamic`) and records, each step, the
draft's top-1 probability at the root and whether the target accepted that token; and, when it did, the top-1
probability of its first child and whether that was accepted too. Prints the mean probability against the
acceptance rate, and the acceptance rate in probability bins (a calibrated draft's rates lie in their bins).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from data.errors import UsageError  # noqa: E402
from inference import load  # noqa: E402
from inference.bench.prompt_sets import load_questions  # noqa: E402
from inference.drafters.eagle3 import DynamicTree, Eagle3Drafter  # noqa: E402

BINS = ((0.0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 1.0 + 1e-9))


class Probe(Eagle3Drafter):
    """An Eagle3Drafter growing a dynamic tree for one row that records (probability, accepted) pairs: the root's
    top-1 child, and the first child of that one when it was accepted."""

    def __init__(self, inner: Eagle3Drafter) -> None:
        if not isinstance(inner.tree, DynamicTree):
            raise SystemExit("--tree: the probe reads a dynamic tree (dynamic[:<nodes>[:<depth>[:<topk>]]])")
        super().__init__(inner.draft, inner.tree, inner.embed)
        self.depth1: list[tuple[float, bool]] = []
        self.depth2: list[tuple[float, bool]] = []
        self._step: list[float] = []  # this step's top-1 probabilities: the root's query, then level 1's first

    def _top(self, outputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        logp, ids = super()._top(outputs, k)
        if len(self._step) < 2:  # the root's query, then the best depth-1 node's (the root's top-1 in practice)
            self._step.append(float(logp[0, 0, 0].exp()))
        return logp, ids

    def update(self, state, draft, result) -> None:
        accepted = int(result.num_accepted[0])
        path = [draft.tree.choices[int(n) - 1] for n in result.path[0, 1 : accepted + 1].tolist()]
        took = bool(path) and path[0] == (0,)
        self.depth1.append((self._step[0], took))
        if took and len(self._step) > 1:
            self.depth2.append((self._step[1], len(path) > 1 and path[1] == (0, 0)))
        self._step = []
        super().update(state, draft, result)


def report(name: str, pairs: list[tuple[float, bool]]) -> None:
    if not pairs:
        print(f"{name}: no steps")
        return
    mean_p = sum(p for p, _ in pairs) / len(pairs)
    rate = sum(t for _, t in pairs) / len(pairs)
    print(f"{name}: {len(pairs)} steps, mean top-1 probability {mean_p:.3f}, acceptance {rate:.3f}")
    for low, high in BINS:
        hits = [t for p, t in pairs if low <= p < high]
        if hits:
            print(f"  p in [{low:.1f}, {min(high, 1.0):.1f}): {len(hits):4d} steps, acceptance {sum(hits) / len(hits):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(prog="python scripts/eagle3_calibration.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="an eagle3 checkpoint")
    p.add_argument("--tree", default="dynamic", help="a dynamic tree spec (default: dynamic)")
    p.add_argument("--questions", default="mt_bench:8:spread,gsm8k:4:spread,humaneval:4:spread")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        questions, _ = load_questions(args.questions)  # bad sets fail here, before the model loads
        engine = load(args.drafter, dtype=args.dtype, tree=args.tree)
    except (UsageError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    if not isinstance(engine.drafter, Eagle3Drafter):
        raise SystemExit(f"--drafter {args.drafter}: not an eagle3 checkpoint")
    probe = engine.drafter = Probe(engine.drafter)
    for question in tqdm(questions, desc="questions"):
        engine.generate(question.turns[0], max_new_tokens=args.max_new_tokens)
    report("root's top-1 child (depth 1)", probe.depth1)
    report("its first child, given depth 1 accepted (depth 2)", probe.depth2)


if __name__ == "__main__":
    main()
