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

The two sources' scores are not on one scale (a product of the drafter's softmax probabilities beside the datastore's
smoothed counts), so the pool ranks calibrated estimates, learned while serving (`Calibration`): per source and score
band, the share of the nodes verified that the target accepted, starting from the raw score (a prior of
`Calibration.prior` nodes) and kept across generations, as a growing datastore keeps what it served.

Drafts of both are deterministic, so greedy verification still returns plain greedy decoding and rejection sampling
with the one-hot rule stays exact (inference.engine.verify: exact for any deterministic tree). The inner drafter
advances from the merged tree's accepted path (EAGLE-3 reads the target's features at its nodes, Medusa the final
hidden state): both work for any tree the target verified.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from inference.drafters.datastore import Datastore
from inference.drafters.path_trees import TreeCache, merge_rows, rank_tree, tree_draft
from inference.drafters.prompt_lookup import PromptLookupDrafter
from inference.engine.drafter import DecodeState, Draft, Drafter
from inference.engine.verify import VerifyResult


Scores = dict[str, float]  # source ("inner", "lookup") -> that source's score of a node


@dataclass(eq=False)
class WithLookupRun:
    """Each part's own per-run state (DecodeState.drafter_state holds this between steps)."""

    inner: Any = None
    lookup: Any = None
    # with a budget: per row, the token paths ranked within it this step and their sources' scores (for `update`)
    ranked: list[list[tuple[tuple[int, ...], Scores]]] | None = None


@dataclass(eq=False)
class Calibration:
    """How often the target accepts a node a source scored x: per source and band of x (`bands_per_halving` bands
    each time x halves, down to 2**-(bands / bands_per_halving)), the nodes verified and the nodes accepted. The
    estimate is their ratio with `prior` pseudo-nodes at x itself, so before any evidence it is x."""

    prior: float = 8.0
    bands: int = 24
    bands_per_halving: int = 2
    counts: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (source, band) -> [verified, accepted]

    def band(self, score: float) -> int:
        return min(self.bands - 1, int(-math.log2(min(max(score, 1e-12), 1.0)) * self.bands_per_halving))

    def estimate(self, source: str, score: float) -> float:
        verified, accepted = self.counts.get((source, self.band(score)), (0.0, 0.0))
        return (accepted + self.prior * score) / (verified + self.prior)

    def observe(self, source: str, score: float, accepted: bool) -> None:
        seen = self.counts.setdefault((source, self.band(score)), [0.0, 0.0])
        seen[0] += 1.0
        seen[1] += float(accepted)


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
        self.calibration = Calibration()  # with a budget: learned from every step verified, kept across generations
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
        rows, run.ranked = [], []
        for paths, inner_scores, found in zip(node_paths(draft), draft.scores[:, 1:].tolist(), scored):
            pool: dict[tuple[int, ...], Scores] = {path: {"lookup": value} for path, value in found.items()}
            for path, value in zip(map(tuple, paths), inner_scores):
                pool.setdefault(path, {})["inner"] = value
            estimate = self.estimates(pool)
            ranked = sorted(estimate, key=lambda path: (-estimate[path], len(path)))  # ties: parents first
            rows.append(rank_tree(ranked))
            run.ranked.append([(path, pool[path]) for path in ranked[: self.budget]])
        return tree_draft(draft.tokens[:, 0], rows, merge_rows(rows, self.budget), self._trees)

    def estimates(self, pool: dict[tuple[int, ...], Scores]) -> dict[tuple[int, ...], float]:
        """Each node's calibrated chance of acceptance: the larger of its sources' (`Calibration.estimate`), and
        never above its parent's, so the likeliest nodes still form a tree."""
        estimate = {path: max(self.calibration.estimate(source, score) for source, score in scores.items())
                    for path, scores in pool.items()}
        for path in sorted(estimate, key=len):  # parents first
            parent = path[:-1]
            if parent in estimate:
                estimate[path] = min(estimate[path], estimate[parent])
        return estimate

    def calibrate(self, ranked: list[list[tuple[tuple[int, ...], Scores]]], result: VerifyResult) -> None:
        """Count each row's nodes ranked within the budget as verified, and those on its accepted path as accepted,
        under each source that scored them."""
        for row, tokens, n in zip(ranked, result.tokens.tolist(), result.num_accepted.tolist()):
            accepted = tuple(tokens[:n])
            for path, scores in row:
                hit = accepted[: len(path)] == path
                for source, score in scores.items():
                    self.calibration.observe(source, score, hit)

    def finish(self, sequences: list[list[int]]) -> None:
        """The generation's answers to both parts that learn from them (a growing datastore; Drafter.finish)."""
        for part in (self.inner, self.lookup):
            finish = getattr(part, "finish", None)
            if finish is not None:
                finish(sequences)

    def update(self, state: DecodeState, draft: Draft, result: VerifyResult) -> None:
        run: WithLookupRun = state.drafter_state
        if run.ranked is not None:
            self.calibrate(run.ranked, result)
            run.ranked = None
        with part_state(state, run, "inner"):
            self.inner.update(state, draft, result)
        with part_state(state, run, "lookup"):
            self.lookup.update(state, draft, result)
