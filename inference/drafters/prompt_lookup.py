"""Prompt lookup decoding: draft by copying what followed the latest earlier occurrence of the current suffix.

Dimension letters: B batch, K tree nodes (root included).

Training-free (Saxena 2023, "prompt lookup decoding"; the n-gram proposer of vLLM / HF assisted generation). Per
row the context is the prompt plus every committed token, `state.root` last. The longest suffix of length n in
max_ngram..min_ngram that occurred before gives the draft: the γ tokens that followed its most recent earlier
occurrence, as a chain. Each row keeps a hash index n-gram -> end of its latest occurrence that has a next token,
updated with the committed tokens, so a lookup costs O(max_ngram) whatever the length of the context.

With a datastore (inference.drafters.datastore) a row also drafts the datastore's tree for its context (the target's
own earlier answers, where a phrase it says often is found: the most likely continuations, best first). The chain and
the tree merge into one token tree (a shared start drafted once) and take turns, a node at a time, for its
`num_draft` nodes; a step where one of them has no match gives the other all of them. A datastore that grows
(`Datastore.max_served`) gets every answer once its generation has ended (`finish`), so a later request drafts from the
answers served before it.

A drafted step costs more than a plain one: on a CPU, SmolLM2-135M's forward over 9 tokens took 2.45 times its forward
over one (`scripts/step_cost.py` measures a host). With a datastore, `min_expected` > 0 drafts a row's nodes only when the
datastore expects at least that many of them accepted: the sum of their scores (`Datastore.scored_tree`: the product
of its next-token probabilities along a node's path; a chain node gets the same product for its path, and a node both
sources draft, the larger). A row below it drafts nothing that step, so a step where no row drafts is a plain
one-token forward. A step pays when 1 + expected accepted > t(N) / t(0), the cost of an N-node forward in plain ones:
min_expected = t(N) / t(0) - 1 is the break-even point (docs/eagle3.md, "Drafting only when it pays").

`node_cost` > 0 sizes each row's draft node by node instead: the chain's and the tree's nodes ranked by score (a
parent before its children: a child's score is its parent's times a probability), cut to the k <= num_draft that
maximise (1 + the sum of their scores) / (1 + node_cost * k), with node_cost the cost of one drafted node in plain
steps (t(k) / t(0) ~ 1 + node_cost * k; `scripts/step_cost.py` fits it for a host). k = 0 makes the row's step a
plain one.

Drafts are a deterministic function of the committed tokens, so greedy verification and rejection sampling with
the one-hot rule (inference.engine.verify) keep the output exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from inference.drafters.datastore import Datastore
from inference.drafters.path_trees import TreeCache, chain_nodes, paths_draft, row_prompts, taken_nodes
from inference.drafters.suffix_index import TextCounts
from inference.engine.drafter import DecodeState, Draft
from inference.engine.verify import VerifyResult


class NgramIndex:
    """Latest occurrence of every n-gram (min_n <= n <= max_n) of one growing sequence that has a next token; with
    `counts` (a datastore's TextCounts), what followed each n-gram is counted there too."""

    def __init__(self, max_n: int, min_n: int = 1, counts: TextCounts | None = None) -> None:
        self.max_n, self.min_n, self.counts = max_n, min_n, counts
        self.tokens: list[int] = []
        self._end: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token, latest occurrence

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; each n-gram ending just before a new token becomes findable."""
        if self.counts is not None:
            self.counts.extend(tokens)
        for token in tokens:
            j = len(self.tokens) - 1  # the n-grams ending at j now have a next token
            for n in range(self.min_n, min(self.max_n, j + 1) + 1):
                self._end[tuple(self.tokens[j - n + 1 : j + 1])] = j
            self.tokens.append(token)

    def lookup(self, length: int) -> list[int]:
        """Up to `length` tokens continuing the sequence, from the longest suffix with an earlier occurrence;
        [] when no suffix of min_n..max_n tokens occurred before. Past the end of the sequence the draft repeats
        with the match's period (an occurrence d tokens back means the tail has period d), so a repetition loop
        drafts `length` tokens instead of stopping at the sequence end."""
        seq = self.tokens
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            end = self._end.get(tuple(seq[len(seq) - n :]))
            if end is not None:
                period = len(seq) - 1 - end
                draft = seq[end + 1 : end + 1 + length]
                while len(draft) < length:
                    draft.append(draft[len(draft) - period])
                return draft
        return []


@dataclass(eq=False)
class LookupRun:
    """One generation's state (kept in DecodeState.drafter_state): an index per row over prompt + committed tokens."""

    rows: list[NgramIndex]
    prompt_lens: list[int]


class PromptLookupDrafter:
    """A chain of up to `num_draft` tokens per row from an `NgramIndex` over that row's prompt and output; with a
    `datastore`, also the datastore's tree for the row (the two share `num_draft` nodes, a node at a time), and with
    `min_expected` > 0 only when the datastore expects that many of the row's nodes accepted, or with `node_cost` > 0
    the best-scored nodes, as many as pay at that cost (module docstring).
    Rows without a match contribute no nodes (fillers where other rows drafted; a root-only tree when none did)."""

    needs_hidden = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_draft: int = 8,
                 datastore: Datastore | None = None, min_expected: float = 0.0, node_cost: float = 0.0) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt_lookup: need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, "
                             f"max_ngram={max_ngram}")
        if num_draft < 1:
            raise ValueError(f"prompt_lookup: num_draft must be >= 1, got {num_draft}")
        if isinstance(min_expected, bool) or not math.isfinite(min_expected) or min_expected < 0:
            raise ValueError(f"prompt_lookup: min_expected must be a number >= 0 (accepted drafts a step), got "
                             f"{min_expected!r}")
        if isinstance(node_cost, bool) or not math.isfinite(node_cost) or node_cost < 0:
            raise ValueError(f"prompt_lookup: node_cost must be a number >= 0 (plain steps a drafted node costs), "
                             f"got {node_cost!r}")
        for name, value in (("min_expected", min_expected), ("node_cost", node_cost)):
            if value and datastore is None:
                raise ValueError(f"prompt_lookup: {name} needs a datastore (--datastore or --datastore-grow): the "
                                 f"expected acceptance comes from its next-token probabilities")
        if min_expected and node_cost:
            raise ValueError("prompt_lookup: min_expected and node_cost both decide how much a row drafts: give one")
        self.max_ngram, self.min_ngram, self.num_draft = max_ngram, min_ngram, num_draft
        self.datastore, self.min_expected, self.node_cost = datastore, float(min_expected), float(node_cost)
        self._trees = TreeCache()

    def sources(self, state: DecodeState) -> list[list[list[tuple[int, ...]]]]:
        """Each row's draft sources in priority order (`row_sources`), none for a row without a match."""
        return [self.row_sources(index) for index in self.indexes(state)]

    def scored_nodes(self, state: DecodeState) -> list[dict[tuple[int, ...], float]]:
        """Each row's chain and datastore-tree nodes (token paths from the root) -> the datastore's score of each, its
        estimate that the target accepts the path (`scores`); needs a datastore. Empty for a row without a match."""
        if self.datastore is None:
            raise ValueError("prompt_lookup: scoring nodes needs a datastore")
        scored = []
        for index in self.indexes(state):
            chain = index.lookup(self.num_draft)
            tree = self.datastore.scored_tree(index.tokens, self.num_draft, index.counts)
            scored.append(self.scores(index, chain, tree))
        return scored

    def indexes(self, state: DecodeState) -> list[NgramIndex]:
        """Each row's index of its prompt and committed tokens; built on the first step of a generation."""
        if state.drafter_state is None:
            prompts = row_prompts(state)
            state.drafter_state = LookupRun([self.new_index() for _ in prompts], [len(p) for p in prompts])
            for index, prompt, tokens in zip(state.drafter_state.rows, prompts, state.generated):
                index.extend(prompt + tokens)
        return state.drafter_state.rows

    def new_index(self) -> NgramIndex:
        """An empty index of one row's text, with this drafter's n-gram sizes (and the counts of its text a datastore
        with a `request_weight` drafts from)."""
        store = self.datastore
        counts = TextCounts(store.max_match) if store is not None and store.request_weight else None
        return NgramIndex(self.max_ngram, self.min_ngram, counts)

    def row_sources(self, index: NgramIndex) -> list[list[tuple[int, ...]]]:
        """One row's sources of nodes, each as token paths from the root, parents first (its index holds the row's
        prompt and committed tokens): its own text's chain, then the datastore's tree, best first; a source without
        a match is left out."""
        chain = index.lookup(self.num_draft)
        if self.datastore is None:
            return [chain_nodes(chain)] if chain else []
        scored = self.datastore.scored_tree(index.tokens, self.num_draft, index.counts)
        if self.node_cost:
            return self.sized(index, chain, scored)
        found = [nodes for nodes in (chain_nodes(chain), [path for path, _ in scored]) if nodes]
        if self.min_expected and self.expected(index, chain, scored, found) < self.min_expected:
            return []
        return found

    def expected(self, index: NgramIndex, chain: list[int], scored: list[tuple[tuple[int, ...], float]],
                 found: list[list[tuple[int, ...]]]) -> float:
        """Accepted drafts the datastore expects of the nodes a row drafts from `found` (its sources, taking turns for
        `num_draft` nodes): the sum of their scores, a chain node's being the datastore's score of its path. The
        chain is scored only when the tree's nodes alone fall short of `min_expected` (its scores only add)."""
        taken = taken_nodes(found, self.num_draft)
        from_tree = sum(dict(scored).get(path, 0.0) for path in taken)
        if from_tree >= self.min_expected or not chain:
            return from_tree
        score = self.scores(index, chain, scored)
        return sum(score.get(path, 0.0) for path in taken)

    def scores(self, index: NgramIndex, chain: list[int], scored: list[tuple[tuple[int, ...], float]]
               ) -> dict[tuple[int, ...], float]:
        """Each node of the chain and the tree -> its score: the tree's own, a chain node's the datastore's score of
        its path, a node both draft the larger (no datastore lookup for an empty chain)."""
        score = dict(scored)
        if chain:
            for path, value in zip(chain_nodes(chain), self.datastore.path_scores(index.tokens, chain, index.counts)):
                score[path] = max(value, score.get(path, 0.0))
        return score

    def sized(self, index: NgramIndex, chain: list[int], scored: list[tuple[tuple[int, ...], float]]
              ) -> list[list[tuple[int, ...]]]:
        """One row's nodes sized by `node_cost`: the chain's and the tree's nodes (a node both draft scored by the
        larger) ranked by score, shorter first on ties, so that every parent precedes its children; the first k <=
        num_draft of them maximising (1 + their scores' sum) / (1 + node_cost * k), as one source (none for k = 0)."""
        score = self.scores(index, chain, scored)
        ranked = sorted(score.items(), key=lambda item: (-item[1], len(item[0])))[: self.num_draft]
        best_k, best, expected = 0, 1.0, 0.0  # k = 0: a plain step, one token for one step's cost
        for k, (_, value) in enumerate(ranked, 1):
            expected += value
            gain = (1 + expected) / (1 + self.node_cost * k)  # tokens per plain step's cost
            if gain > best:
                best_k, best = k, gain
        return [[path for path, _ in ranked[:best_k]]] if best_k else []

    def propose(self, state: DecodeState) -> Draft:
        return paths_draft(state.root, self.sources(state), self.num_draft, self._trees, take_turns=True)

    def finish(self, sequences: list[list[int]]) -> None:
        """A datastore that grows (`Datastore.max_served`) indexes every answer of the generation just ended."""
        if self.datastore is not None and self.datastore.grows:
            for answer in sequences:
                self.datastore.add(answer)

    def update(self, state: DecodeState, draft: Draft, result: VerifyResult) -> None:
        """Index the tokens this step committed."""
        run: LookupRun = state.drafter_state
        for index, prompt_len, tokens in zip(run.rows, run.prompt_lens, state.generated):
            index.extend(tokens[len(index.tokens) - prompt_len :])
