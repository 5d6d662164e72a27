"""What would prompt lookup verify with a datastore of the target's own text, and with how many nodes? A walk over the
target's greedy answers, no tree forward.

    python scripts/lookup_walk.py --base smollm2 --datastore features/smollm2-self
    python scripts/lookup_walk.py --base smollm2 --datastore features/smollm2-self --datastore answers.jsonl \
        --datastore features/smollm2-self,sharegpt_v3 --num-draft 8,16 --questions self_instruct:16:spread
    python scripts/lookup_walk.py --base smollm2 --datastore features/smollm2-self --datastore-grow 1000000 \
        --questions gsm8k:24:spread --orders 5
    python scripts/lookup_walk.py --base smollm2 --datastore sharegpt_v3 --datastore-smoothing witten_bell,longest
    python scripts/lookup_walk.py --base smollm2 --datastore sharegpt_v3 --datastore-request-weight 0,100
    python scripts/lookup_walk.py --base smollm2 --datastore sharegpt_v3 --min-expected 0,0.5,1,1.25,1.5 \
        --forward-ms "$(python scripts/step_cost.py --base smollm2 --dtype fp32 --quiet)"

Generates each prompt's greedy answer with the target (plain decoding through the engine), then replays it as the
engine verifies a draft that depends only on the committed tokens: each step drafts from the prompt and the answer
so far (`PromptLookupDrafter.row_sources`: the request's own chain and the datastore's tree, merged into one token
tree of at most N nodes after the root, taking turns a node at a time), accepts the longest drafted path that the
answer continues, plus the target's own next token. τ = answer tokens / target forwards (the prefill included), the
engine's greedy τ for those drafters exactly.
Rows: prompt lookup alone, each datastore's tree alone, prompt lookup with each datastore, and the same with the
datastore's greedy chain in place of its tree (what the tree buys); at each N of --num-draft. With
--datastore-grow, also prompt lookup with a datastore that grows while serving (each answer joins it once replayed,
as `load(..., datastore_grow=N)` does), from nothing and from each datastore: τ in the questions' order, and the mean
and range over --orders shuffles of them (what a request gains then depends on what was served before it).
Every datastore row is walked with each of --datastore-smoothing's distributions (inference.drafters.datastore:
Witten-Bell interpolation over the matched suffixes, or the longest match's counts) and each of
--datastore-request-weight's weights of the request's own text in its counts, over one index, and prompt lookup with
each datastore at each of --min-expected's thresholds (a row drafts only when the datastore expects that many of its
nodes accepted; 0: always), and at each of --node-cost's costs (each step's nodes ranked by score and cut to as many
as pay at that cost of a drafted node in plain steps). Each row also gives the nodes drafted a step, the share of
steps that drafted, and with --forward-ms (a forward's milliseconds by drafted nodes, as scripts/step_cost.py prints
them) the speed those steps would have against plain decoding, from the forwards alone.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from data.errors import UsageError  # noqa: E402
from inference import load  # noqa: E402
from inference.bench.prompt_sets import load_questions  # noqa: E402
from inference.drafters.datastore import (  # noqa: E402
    REQUEST_WEIGHT, SMOOTHINGS, Datastore, check_request_weight, check_spec, load_datastore)
from inference.drafters.path_trees import chain_nodes, merge_rows, rank_tree, taken_nodes  # noqa: E402
from inference.drafters.prompt_lookup import NgramIndex, PromptLookupDrafter  # noqa: E402
from inference.engine.step_cost import StepCost  # noqa: E402


def accepted(sources: list[list[tuple[int, ...]]], max_nodes: int, answer: list[int]) -> int:
    """Drafts of the capped token tree of `sources` that greedy verification accepts when the target says
    `answer`."""
    nodes = rank_tree((), sources)  # as PromptLookupDrafter.propose: the sources take turns for the nodes
    kept = set(merge_rows([nodes], max_nodes))
    child = {(path[:-1], token): path for path, token in nodes if path in kept}
    at, count = (), 0
    for token in answer:
        if (at, token) not in child:
            break
        at, count = child[(at, token)], count + 1
    return count


def walk(prompt: list[int], answer: list[int], draft: "Drafts", max_nodes: int, drafted: list[int] | None = None
         ) -> tuple[int, int]:
    """(answer tokens, target forwards) replaying `answer`; `draft(index)` gives the sources of a step; `drafted`
    receives each step's number of drafted nodes."""
    index = draft.lookup.new_index()  # the drafter's own n-gram sizes
    index.extend(prompt + answer[:1])  # the prefill's forward commits the first token
    done, forwards = 1, 1
    while done < len(answer):
        sources = draft(index)
        if drafted is not None:
            drafted.append(len(taken_nodes(sources, max_nodes)))
        step = min(accepted(sources, max_nodes, answer[done:]) + 1, len(answer) - done)
        index.extend(answer[done : done + step])
        done, forwards = done + step, forwards + 1
    return len(answer), forwards


class Drafts:
    """The sources of nodes one row drafts each step. `mode`: "lookup", prompt lookup's own (its chain, and the
    datastore's tree with a datastore); "store", the datastore's tree alone; "chains", prompt lookup's chain and the
    datastore's greedy chain (`Datastore.continuation`) taking turns."""

    def __init__(self, num_draft: int, store: Datastore | None, mode: str = "lookup", min_expected: float = 0.0,
                 node_cost: float = 0.0) -> None:
        if mode not in ("lookup", "store", "chains") or (mode != "lookup" and store is None):
            raise ValueError(f"Drafts: mode {mode!r} with store {store!r}")
        self.lookup = PromptLookupDrafter(num_draft=num_draft, datastore=store, min_expected=min_expected,
                                          node_cost=node_cost)
        self.store, self.mode = store, mode

    def served(self, answer: list[int]) -> None:
        """The answer replayed joins a growing datastore, as the engine's `finish` adds it (no-op otherwise)."""
        self.lookup.finish([answer])

    def __call__(self, index: NgramIndex) -> list[list[tuple[int, ...]]]:
        if self.mode == "lookup":
            return self.lookup.row_sources(index)
        n = self.lookup.num_draft
        if self.mode == "store":
            found = [self.store.tree(index.tokens, n, index.counts)]
        else:
            found = [chain_nodes(index.lookup(n)), chain_nodes(self.store.continuation(index.tokens, n, index.counts))]
        return [nodes for nodes in found if nodes]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python scripts/lookup_walk.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the target (a conf/model name, a folder, a hub id)")
    p.add_argument("--datastore", action="append", default=[], metavar="SOURCE[,SOURCE...]",
                   help="a feature cache folder, a ShareGPT file or folder of the target's answers, or a data "
                        "recipe's name (sharegpt_v3); several joined by commas make one datastore; repeatable: a row "
                        "each")
    p.add_argument("--num-draft", default="8", help="comma list of node budgets N (default 8)")
    p.add_argument("--datastore-smoothing", default=SMOOTHINGS[0],
                   help=f"comma list of the datastore's next-token distributions ({', '.join(SMOOTHINGS)}; default "
                        f"{SMOOTHINGS[0]}): the datastore rows, once each")
    p.add_argument("--datastore-request-weight", default=str(REQUEST_WEIGHT), metavar="W[,W...]",
                   help=f"comma list of weights of the request's own text in the datastore's counts (default "
                        f"{REQUEST_WEIGHT:g}): the datastore rows, once each")
    p.add_argument("--min-expected", default="0", metavar="X[,X...]",
                   help="comma list of prompt lookup's min_expected with a datastore: a row drafts only when the "
                        "datastore expects that many of its nodes accepted (default 0: always)")
    p.add_argument("--node-cost", default="", metavar="C[,C...]",
                   help="comma list of prompt lookup's node_cost with a datastore: each step's nodes cut to as many as "
                        "pay when a drafted node costs C plain steps (default: none walked)")
    p.add_argument("--forward-ms", metavar="K:MS,...",
                   help="a target forward's milliseconds by drafted nodes K (0 is a plain step), as "
                        "scripts/step_cost.py prints them: adds each row's speed against plain decoding")
    p.add_argument("--questions", default="mt_bench:8:spread,gsm8k:4:spread,humaneval:4:spread",
                   help="bench prompt sets or a question file (first turns)")
    p.add_argument("--datastore-grow", type=int, metavar="N",
                   help="also walk with a datastore that grows with every answer (the latest N served tokens kept)")
    p.add_argument("--orders", type=int, default=5, help="question orders (shuffles) a growing datastore is walked in")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled orders")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    try:
        args.budgets = [int(n) for n in args.num_draft.split(",")]
    except ValueError:
        p.error(f"--num-draft takes a comma list of whole numbers, got {args.num_draft!r}")
    args.smoothings = args.datastore_smoothing.split(",")
    for smoothing in args.smoothings:
        if smoothing not in SMOOTHINGS:
            p.error(f"--datastore-smoothing takes a comma list of {', '.join(SMOOTHINGS)}, got {smoothing!r}")
    try:
        args.weights = [float(w) for w in args.datastore_request_weight.split(",")]
        for weight in args.weights:
            check_request_weight(weight)
    except ValueError:
        p.error(f"--datastore-request-weight takes a comma list of numbers >= 0, got {args.datastore_request_weight!r}")
    try:
        args.thresholds = [float(x) for x in args.min_expected.split(",")]
        if not all(math.isfinite(x) and x >= 0 for x in args.thresholds):
            raise ValueError
    except ValueError:
        p.error(f"--min-expected takes a comma list of numbers >= 0, got {args.min_expected!r}")
    try:
        args.node_costs = [float(x) for x in filter(None, args.node_cost.split(","))]
        if not all(math.isfinite(x) and x > 0 for x in args.node_costs):
            raise ValueError
    except ValueError:
        p.error(f"--node-cost takes a comma list of numbers > 0, got {args.node_cost!r}")
    try:
        args.costs = None if args.forward_ms is None else StepCost.parse(args.forward_ms)
    except ValueError as e:
        p.error(f"--forward-ms: {e}")
    if args.max_new_tokens < 1 or min(args.budgets) < 1:
        p.error("--max-new-tokens and --num-draft take positive numbers")
    if (args.datastore_grow is not None and args.datastore_grow < 1) or args.orders < 1:
        p.error("--datastore-grow and --orders take positive numbers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # every input is checked before the model loads
        for spec in args.datastore:
            check_spec(spec, "--datastore")
        questions, _ = load_questions(args.questions)
        engine = load(None, base=args.base, dtype=args.dtype)
        loaded = {path: load_datastore(path, engine.tokenizer, label="--datastore") for path in args.datastore}
        settings = list(itertools.product(args.smoothings, args.weights))
        stores = {row_name(path, setting, args): store.configured(*setting)
                  for path, store in loaded.items() for setting in settings}
        grow = {} if args.datastore_grow is None else {
            **{row_name("nothing", setting, args): Datastore([], max_served=args.datastore_grow, smoothing=setting[0],
                                                             request_weight=setting[1]) for setting in settings},
            **{path: store.growing(args.datastore_grow) for path, store in stores.items()}}
    except (UsageError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cases = []
    for question in tqdm(questions, desc="greedy answers"):
        prompt = engine.encode(question.turns[0])
        cases.append((prompt, engine.generate_ids(prompt, max_new_tokens=args.max_new_tokens).sequences[0]))
    rows = [("prompt lookup", None, "lookup", 0.0, 0.0)]
    rows += [(f"datastore {path}", store, "store", 0.0, 0.0) for path, store in stores.items()]
    rows += [(f"prompt lookup + {path}" + (f", drafting at ≥ {x:g} expected" if x else ""), store, "lookup", x, 0.0)
             for path, store in stores.items() for x in args.thresholds]
    rows += [(f"prompt lookup + {path}, sized at node cost {c:g}", store, "lookup", 0.0, c)
             for path, store in stores.items() for c in args.node_costs]
    rows += [(f"prompt lookup + {path}, its greedy chain", store, "chains", 0.0, 0.0) for path, store in stores.items()]
    rows += [(f"prompt lookup + {path}, growing", store, "lookup", 0.0, 0.0) for path, store in grow.items()]
    shuffles = [random.Random(args.seed + i).sample(cases, len(cases)) for i in range(args.orders)]
    total = sum(len(answer) for _, answer in cases)
    print(f"{len(cases)} prompts (--questions {args.questions}), {total} answer tokens, greedy, {args.dtype}")
    width = max(60, *(len(row[0]) + 2 for row in rows))
    speed = "" if args.costs is None else f"{'× plain':>9}"
    print(f"{'drafter':{width}}{'nodes':>7}{'walk τ':>9}{'nodes a step':>14}{'drafted':>9}{speed}   growing: mean "
          f"[min, max] over {args.orders} shuffles")
    for budget in args.budgets:
        for name, store, mode, threshold, node_cost in rows:
            draft = Drafts(budget, store, mode, threshold, node_cost)
            drafted: list[int] = []
            tau = walk_all(cases, draft, budget, drafted)
            line = (f"{name:{width}}{'≤ ' + str(budget + 1):>7}{tau:9.3f}{statistics.mean(drafted or [0]):14.2f}"
                    f"{sum(map(bool, drafted)) / max(len(drafted), 1):9.0%}")
            if args.costs is not None:
                plain = (total - len(cases)) * args.costs.ms(0)  # the tokens after each prefill, one a forward
                line += f"{plain / sum(map(args.costs.ms, drafted)):9.2f}" if drafted else f"{'-':>9}"
            if store is not None and store.grows:
                taus = [walk_all(order, draft, budget) for order in shuffles]
                line += f"   {statistics.mean(taus):.3f} [{min(taus):.3f}, {max(taus):.3f}]"
            print(line, flush=True)
    return 0


def row_name(spec: str, setting: tuple[str, float], args: argparse.Namespace) -> str:
    """A datastore row's name: its spec, and its smoothing and request weight where several are walked."""
    smoothing, weight = setting
    named = ([smoothing] if len(args.smoothings) > 1 else []) + ([f"request ×{weight:g}"] if len(args.weights) > 1
                                                                   else [])
    return f"{spec} ({', '.join(named)})" if named else spec


def walk_all(cases: list[tuple[list[int], list[int]]], draft: Drafts, budget: int, drafted: list[int] | None = None
             ) -> float:
    """τ over `cases` in their order; a growing datastore starts from its loaded corpus and takes each answer once it
    is replayed. `drafted` receives each step's number of drafted nodes."""
    if draft.store is not None and draft.store.grows:
        draft.store.forget_served()
    tokens = forwards = 0
    for prompt, answer in cases:
        t, f = walk(prompt, answer, draft, budget, drafted)
        tokens, forwards = tokens + t, forwards + f
        draft.served(answer)
    return tokens / forwards


if __name__ == "__main__":
    raise SystemExit(main())
