"""A tree drafter's tree with prompt lookup's chain grafted on: both verified in the same target forward.

Dimension letters: B batch, K tree nodes (root included).

A trained drafter (EAGLE-3, Medusa) guesses the next few tokens from the target's state; prompt lookup
(inference.drafters.prompt_lookup) copies what followed the latest earlier occurrence of the current suffix of the
prompt and output. They fail in different places: a trained drafter rarely guesses five tokens in a row, and a copy
(a variable name, a quoted sentence, a repeated line of code) is either right for many tokens or absent. `WithLookup`
verifies both each step: per row, the inner tree's token paths first, then the lookup chain, merged into one token tree
(`path_trees.rank_tree`: a chain that starts with tokens the inner tree already drafted continues below its nodes
instead of repeating them). With a datastore of the target's own text (inference.drafters.datastore) the lookup also
drafts the datastore's tree, best first, after the request's own chain: it gets the lookup's nodes the own chain
leaves (all of them in a step where the request's own text has no match). A trained drafter and a datastore both
predict the target's habitual phrasing, a copy from the request is what neither can guess, so here the copy comes
first (on smollm2, with EAGLE-3's 8-node tree: τ 2.37 in this order, 2.33 with the two taking turns as prompt lookup
alone has them). A step without a match verifies the inner tree alone; the lookup adds at most `num_draft` nodes. Rows
of a batch share one tree shape (`path_trees.merge_rows`, fillers where a row lacks a node).

With a `budget` the order is by estimate instead: each node of the inner tree carries the drafter's probability of its
path (`Draft.scores`: EAGLE-3's draft probabilities, Medusa's heads'), each of the lookup's the datastore's score (its
chain's and tree's nodes, `PromptLookupDrafter.scored_nodes`), a node both draft the larger, and the `budget`
likeliest nodes of the pool are verified: EAGLE-2's rule for one tree, over both sources, so a step where the datastore
is sure gives it more nodes and one where the drafter is sure gives the drafter more, within one node count. Each
source's estimates fall along a path (a child's at most its parent's), so the likeliest nodes form a tree.

Drafts of both are deterministic, so greedy verification still returns plain greedy decoding and rejection sampling
with the one-hot rule stays exact (inference.engine.verify: exact for any deterministic tree). The inner drafter
advances from the merged tree's accepted path (EAGLE-3 reads the target's features at its nodes, Medusa the final
hidden state): both work for any tree the target verified.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from inference.drafters.datastore import Datastore
from inference.drafters.path_trees import TreeCache, merge_rows, rank_tree, tree_draft
from inference.drafters.prompt_lookup import PromptLookupDrafter
from inference.engine.drafter import DecodeState, Draft, Drafter
from inference.engine.verify import VerifyResult


@dataclass(eq=False)
class WithLookupRun:
    """Each part's own per-run state (DecodeState.drafter_state holds this between steps)."""

    inner: Any = None
    lookup: Any = None


@contextmanager
def part_state(state: DecodeState, run: WithLookupRun, part: str) -> Iterator[None]:
    """Within the block `state.drafter_state` is `run.<part>`, the state that part (`inner` or `lookup`) keeps; on
    exit, also on error, what the part left there is stored back and `run` is the drafter state again."""
    state.drafter_state = getattr(run, part)
    try:
        yield
    finally:
        setattr(run, part, state.drafter_state)
        state.drafter_state = run


def node_paths(draft: Draft) -> list[list[list[int]]]:
    """Each row's token path from the root (root excluded) to every non-root node of `draft`, in node order."""
    parent = draft.tree.parent.tolist()
    rows = []
    for tokens in draft.tokens.tolist():
        paths: list[list[int]] = [[]]
        for k in range(1, len(parent)):
            paths.append(paths[parent[k]] + [tokens[k]])
        rows.append(paths[1:])
    return rows


class WithLookup:
    """`inner`'s tree plus a prompt-lookup chain of up to `num_draft` tokens per row (n-grams of `min_ngram` to
    `max_ngram` tokens, as `PromptLookupDrafter`), and the `datastore`'s tree when given, `num_draft` nodes
    for both."""

    def __init__(self, inner: Drafter, num_draft: int = 8, max_ngram: int = 3, min_ngram: int = 1,
                 datastore: Datastore | None = None, budget: int | None = None) -> None:
        if budget is not None and (datastore is None or isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 1):
            raise ValueError(f"WithLookup: budget ranks the datastore's scores, so it needs a datastore, and is a "
                             f"whole number of nodes >= 1, got {budget!r}")
        self.inner, self.datastore, self.budget = inner, datastore, budget
        self.lookup = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram, num_draft=num_draft,
                                          datastore=datastore)
        self.needs_hidden = inner.needs_hidden
        self.feature_layers: tuple[int, ...] = tuple(getattr(inner, "feature_layers", ()))
        self.tree = getattr(inner, "tree", None)  # the inner drafter's own tree, before any chain (Engine.tree)
        self._trees = TreeCache()

    def propose(self, state: DecodeState) -> Draft:
        run = state.drafter_state if isinstance(state.drafter_state, WithLookupRun) else WithLookupRun()
        with part_state(state, run, "inner"):
            draft = self.inner.propose(state)
        if draft.probs is not None:
            raise ValueError("WithLookup: the inner drafter sampled its draft; only deterministic drafts merge")
        if self.budget is not None:
            return self.pooled(state, run, draft)
        with part_state(state, run, "lookup"):
            sources = self.lookup.sources(state)  # [B] lists of sources: the row's chain, the datastore's tree
        if not any(sources):
            return draft
        rows = [rank_tree(paths + [node for nodes in found for node in nodes])  # priority order
                for paths, found in zip(node_paths(draft), sources)]
        choices = merge_rows(rows, draft.tree.num_nodes - 1 + self.lookup.num_draft)
        return tree_draft(draft.tokens[:, 0], rows, choices, self._trees)

    def pooled(self, state: DecodeState, run: WithLookupRun, draft: Draft) -> Draft:
        """The `budget` likeliest nodes of the inner tree and the lookup's, by their scores (module docstring)."""
        if draft.scores is None:
            raise ValueError("WithLookup: a budget ranks nodes by score, and the inner drafter does not score its "
                             "nodes")
        with part_state(state, run, "lookup"):
            scored = self.lookup.scored_nodes(state)  # [B] dicts: token path -> the datastore's score
        rows = []
        for paths, inner_scores, pool in zip(node_paths(draft), draft.scores[:, 1:].tolist(), scored):
            for path, value in zip(map(tuple, paths), inner_scores):
                pool[path] = max(value, pool.get(path, 0.0))
            ranked = sorted(pool, key=lambda path: (-pool[path], len(path)))  # ties: parents first
            rows.append(rank_tree(ranked))
        return tree_draft(draft.tokens[:, 0], rows, merge_rows(rows, self.budget), self._trees)

    def finish(self, sequences: list[list[int]]) -> None:
        """The generation's answers to both parts that learn from them (a growing datastore; Drafter.finish)."""
        for part in (self.inner, self.lookup):
            finish = getattr(part, "finish", None)
            if finish is not None:
                finish(sequences)

    def update(self, state: DecodeState, draft: Draft, result: VerifyResult) -> None:
        run: WithLookupRun = state.drafter_state
        with part_state(state, run, "inner"):
            self.inner.update(state, draft, result)
        with part_state(state, run, "lookup"):
            self.lookup.update(state, draft, result)
