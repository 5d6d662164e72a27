"""Lookahead drafting: multi-branch retrieval from a global trie of token n-grams, verified as one token tree.

Dimension letters: B batch, K tree nodes (root included).

Training-free (Zhao et al. 2024, "Lookahead: An Inference Acceleration Framework for Large Language Model with
Lossless Generation Accuracy", KDD). One `TokenTrie` holds every n-gram of up to `max_prefix + branch_length`
tokens seen so far: the prompts of the current request (weight `prompt_weight`) and every committed output (weight
1), across requests. Per step and row, the suffix of the context (prompt + committed tokens, root last) is matched
with the longest prefix first; the matched node's most frequent continuations are taken best-first, and when the
longest prefix yields fewer than `draft_nodes` nodes, shorter prefixes fill the rest (the prefix length adapts to
the number of matches). The branches merge into one token tree per step (inference.drafters.path_trees) that the target
verifies with tree attention in one forward.

Memory is bounded: the trie never holds more than `max_nodes` nodes; when full it prunes to PRUNE_TO of that,
dropping the least frequent n-grams first and, among equally frequent ones, the least recently seen. A request's
prompt n-grams are eliminated (their prompt weight subtracted) when the next request starts; outputs stay.

Drafts are a deterministic function of the committed tokens, so greedy verification and rejection sampling with
the one-hot rule (inference.engine.verify) keep the output exact.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterator, Sequence

from inference.drafters.path_trees import TreeCache, paths_draft, row_prompts
from inference.engine.drafter import DecodeState, Draft
from inference.engine.verify import VerifyResult

PRUNE_TO = 0.75  # prune to this share of max_nodes, so a prune (a sort of all nodes) is paid once per many inserts
EMPTY = 1e-9  # an n-gram whose count falls to this after elimination is gone


class _Node:
    __slots__ = ("token", "parent", "children", "count", "last", "depth", "alive")

    def __init__(self, token: int, parent: _Node | None, depth: int) -> None:
        self.token, self.parent, self.depth = token, parent, depth
        self.children: dict[int, _Node] = {}
        self.count = 0.0  # weighted occurrences of the n-gram root .. this node
        self.last = 0  # trie clock when last counted
        self.alive = True


class TokenTrie:
    """Every n-gram (1..max_depth tokens) of the sequences fed in, with weighted occurrence counts.

    Counts: `insert(seq, w)` adds w per occurrence of each n-gram inside seq; `extend(seq, start, w)` adds the
    occurrences that end at positions >= start (seq[:start] was fed before), so insert(a) then extend(a + b, len(a))
    counts exactly like insert(a + b). `eliminate(seq, w)` subtracts what insert(seq, w) added. At most `max_nodes`
    nodes (root excluded) exist at any time.

    Invariant: along every path count and recency (`last`) never increase, so the (count, recency) order used for
    retrieval and pruning always ranks a node below its parent; pruning therefore removes leaves, and a subtree is
    never lost while a weaker n-gram survives."""

    def __init__(self, max_nodes: int = 65536, max_depth: int = 12) -> None:
        if max_depth < 1:
            raise ValueError(f"lookahead: trie depth must be >= 1, got {max_depth}")
        if max_nodes < 4 * max_depth:  # a prune must free room while sparing the path being inserted
            raise ValueError(f"lookahead: max_nodes must be >= 4 x trie depth = {4 * max_depth}, got {max_nodes}")
        self.max_nodes, self.max_depth = max_nodes, max_depth
        self.root = _Node(-1, None, 0)
        self.size = 0  # nodes, root excluded
        self.clock = 0

    def __len__(self) -> int:
        return self.size

    def insert(self, tokens: Sequence[int], weight: float = 1.0) -> None:
        """Count every n-gram of `tokens` (each start, up to max_depth tokens) with `weight`."""
        self.clock += 1
        for i in range(len(tokens)):
            node = self.root
            for token in tokens[i : i + self.max_depth]:
                node = self._child(node, token)
                node.count += weight
                node.last = self.clock

    def extend(self, tokens: Sequence[int], start: int, weight: float = 1.0) -> None:
        """Count the n-grams of `tokens` that end at positions >= start (streaming: one call per step)."""
        self.clock += 1
        for j in range(start, len(tokens)):
            for i in range(max(0, j + 1 - self.max_depth), j + 1):
                walked, node = [], self.root
                for token in tokens[i : j + 1]:  # the prefix was counted at position j - 1; recreated if pruned
                    node = self._child(node, token)
                    walked.append(node)
                node.count += weight
                for prefix in walked:  # keep count and recency monotone along paths (see the class docstring)
                    prefix.count = max(prefix.count, node.count)
                    prefix.last = self.clock

    def eliminate(self, tokens: Sequence[int], weight: float = 1.0) -> None:
        """Undo insert(tokens, weight). An n-gram left with count zero and no continuations goes; one that still
        has continuations (counted from other sequences, e.g. an output running past this prompt's end) keeps the
        count of its most frequent continuation."""
        for i in range(len(tokens)):
            walked, node = [], self.root
            for token in tokens[i : i + self.max_depth]:
                node = node.children.get(token)
                if node is None:  # pruned since: nothing left to subtract below
                    break
                node.count -= weight
                walked.append(node)
            for node in reversed(walked):  # deepest first: a node sees its children's final counts
                floor = max((child.count for child in node.children.values()), default=0.0)
                if node.count <= EMPTY and floor <= EMPTY:
                    self._remove(node)
                else:
                    node.count = max(node.count, floor)

    def match(self, prefix: Sequence[int]) -> _Node | None:
        """The node of the n-gram `prefix`, or None when it is not stored."""
        node = self.root
        for token in prefix:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def continuations(self, prefix: Sequence[int], budget: int, depth: int) -> list[tuple[int, ...]]:
        """Up to `budget` token paths (at most `depth` long) that followed `prefix`, most frequent first: a
        best-first walk of the prefix's subtree by (count, recency), so every path comes after its own prefix."""
        start = self.match(prefix)
        if start is None or budget < 1:
            return []
        order = 0  # heap tie-break: nodes never get compared
        heap: list[tuple[float, int, int, _Node, tuple[int, ...]]] = []
        paths: list[tuple[int, ...]] = []
        node, path = start, ()
        while True:
            if len(path) < depth:
                for child in heapq.nlargest(budget - len(paths), node.children.values(), key=_rank):
                    order += 1
                    heapq.heappush(heap, (-child.count, -child.last, order, child, path + (child.token,)))
            if not heap or len(paths) == budget:
                return paths
            _, _, _, node, path = heapq.heappop(heap)
            paths.append(path)

    def prune(self, target: int, keep: _Node | None = None) -> None:
        """Remove the lowest-(count, recency) n-grams, each with its subtree, until at most `target` nodes remain.
        `keep` and its ancestors survive (the path an insert is extending)."""
        spared = set()
        while keep is not None:
            spared.add(id(keep))
            keep = keep.parent
        victims = sorted((n for n in self.nodes() if id(n) not in spared), key=lambda n: (n.count, n.last, -n.depth))
        for node in victims:
            if self.size <= target:
                return
            if node.alive:
                self._remove(node)

    def nodes(self) -> Iterator[_Node]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def ngrams(self) -> dict[tuple[int, ...], float]:
        """n-gram -> count for every stored node (for inspection and tests)."""
        out: dict[tuple[int, ...], float] = {}
        stack = [(child, (child.token,)) for child in self.root.children.values()]
        while stack:
            node, gram = stack.pop()
            out[gram] = node.count
            stack.extend((child, gram + (child.token,)) for child in node.children.values())
        return out

    def _child(self, node: _Node, token: int) -> _Node:
        """node's child for `token`, created (count 0) when absent, pruning first when full."""
        child = node.children.get(token)
        if child is None:
            if self.size >= self.max_nodes:
                self.prune(min(int(self.max_nodes * PRUNE_TO), self.max_nodes - 1), keep=node)
            child = node.children[token] = _Node(token, node, node.depth + 1)
            child.last = self.clock
            self.size += 1
        return child

    def _remove(self, node: _Node) -> None:
        del node.parent.children[node.token]
        stack = [node]
        while stack:
            gone = stack.pop()
            gone.alive = False
            self.size -= 1
            stack.extend(gone.children.values())


def _rank(node: _Node) -> tuple[float, int]:
    return node.count, node.last


@dataclass(eq=False)
class LookaheadRun:
    """One generation's state (kept in DecodeState.drafter_state)."""

    contexts: list[list[int]]  # per row: prompt + committed tokens fed to the trie so far
    prompt_lens: list[int]


class LookaheadDrafter:
    """Multi-branch trie retrieval (see the module docstring). Per step and row: up to `draft_nodes` tree nodes, at
    most `branch_length` deep, from suffix matches of `max_prefix` down to 1 tokens. The trie persists across
    generations (`self.trie`); construct a new drafter to start from an empty one."""

    needs_hidden = False

    def __init__(
        self,
        max_nodes: int = 65536,
        draft_nodes: int = 15,
        branch_length: int = 8,
        max_prefix: int = 4,
        prompt_weight: float = 2.0,
    ) -> None:
        for name, value in (("draft_nodes", draft_nodes), ("branch_length", branch_length), ("max_prefix", max_prefix)):
            if value < 1:
                raise ValueError(f"lookahead: {name} must be >= 1, got {value}")
        if not prompt_weight > 0:
            raise ValueError(f"lookahead: prompt_weight must be > 0, got {prompt_weight}")
        self.trie = TokenTrie(max_nodes, max_depth=max_prefix + branch_length)
        self.draft_nodes, self.branch_length, self.max_prefix = draft_nodes, branch_length, max_prefix
        self.prompt_weight = prompt_weight
        self.counted_prompts: list[list[int]] = []  # prompts now in the trie at prompt weight (the latest generation)
        self._trees = TreeCache()

    def retrieve(self, context: Sequence[int]) -> list[tuple[int, ...]]:
        """Continuation paths for `context` (its last token is the root), priority order, at most draft_nodes
        distinct paths: the longest matching prefix first, shorter prefixes only while the budget is not full."""
        paths: dict[tuple[int, ...], None] = {}
        for n in range(min(self.max_prefix, len(context)), 0, -1):
            # a full budget from each prefix: paths a longer prefix already gave must not crowd out new ones
            for path in self.trie.continuations(context[len(context) - n :], self.draft_nodes, self.branch_length):
                if len(paths) == self.draft_nodes:
                    return list(paths)
                paths.setdefault(path, None)
        return list(paths)

    def propose(self, state: DecodeState) -> Draft:
        if state.drafter_state is None:  # first step of a generation
            state.drafter_state = self._start(state)
        rows = [self.retrieve(context) for context in state.drafter_state.contexts]
        return paths_draft(state.root, rows, self.draft_nodes, self._trees)

    def update(self, state: DecodeState, draft: Draft, result: VerifyResult) -> None:
        """Feed each row's newly committed tokens to the trie."""
        run: LookaheadRun = state.drafter_state
        for context, prompt_len, tokens in zip(run.contexts, run.prompt_lens, state.generated):
            start = len(context)
            context.extend(tokens[start - prompt_len :])
            self.trie.extend(context, start)

    def _start(self, state: DecodeState) -> LookaheadRun:
        """Swap the previous generation's prompts for this one's in the trie, and feed the first tokens."""
        for prompt in self.counted_prompts:
            self.trie.eliminate(prompt, self.prompt_weight)
        self.counted_prompts = row_prompts(state)
        run = LookaheadRun([p + g for p, g in zip(self.counted_prompts, state.generated)],
                           [len(p) for p in self.counted_prompts])
        for prompt, context in zip(self.counted_prompts, run.contexts):
            self.trie.insert(prompt, self.prompt_weight)
            self.trie.extend(context, len(prompt))
        return run
