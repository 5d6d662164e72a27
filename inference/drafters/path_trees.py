"""Per-step draft trees from token paths, for drafters whose tree changes every step (lookahead, prompt lookup).

Dimension letters: B batch, K tree nodes (root included).

A training-free drafter proposes, per row, continuations of the root as token paths in priority order. A row's
paths merge into one token tree (shared prefixes share nodes) whose nodes are named by rank paths: the sibling rank
at each level, siblings ranked by first appearance, i.e. the choice format of `inference.engine.tree`, so the buffers
come from `build_tree` unchanged and `Draft` carries them like a static tree. The loop reads `draft.tree` every step, so
a new tree per step needs no change to the loop, the verification rules or the cache surgery.

A batch shares one tree shape per step: the union of the rows' rank paths, capped at `max_nodes` non-root nodes
with rows taking turns so that none starves. Where a row has no node of the union, the slot holds a filler (its
parent's token). Fillers are verified like any other draft: every exact rule in inference.engine.verify is exact for
arbitrary deterministic drafts (duplicates included), so a filler costs a tree slot, never correctness.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from inference.engine.drafter import DecodeState, Draft
from inference.engine.tree import Path_, TreeBuffers, build_tree


def rank_tree(paths: Sequence[Sequence[int]], take_turns: Sequence[Sequence[Sequence[int]]] = ()
              ) -> list[tuple[Path_, int]]:
    """Token paths after the root, in priority order -> [(rank path, token)] of their merged tree: every node once,
    parents before children, siblings ranked by first appearance. `take_turns` holds sources that come after `paths`
    and take turns a node at a time (each source's first node, then each one's second, ...), so a node cap
    (`merge_rows`) shares its nodes among them instead of giving them all to the first. A source lists its nodes as
    token paths from the root, each after its parent: a chain's are its prefixes (`chain_nodes`), a tree's come in any
    order that keeps parents first."""
    node_of: dict[tuple[Path_, int], Path_] = {}  # (parent rank path, token) -> rank path
    num_children: dict[Path_, int] = {}
    nodes: list[tuple[Path_, int]] = []

    def add(tokens: Sequence[int]) -> None:
        at: Path_ = ()
        for token in tokens:
            key = (at, token)
            if key not in node_of:
                rank = num_children.get(at, 0)
                num_children[at] = rank + 1
                node_of[key] = at + (rank,)
                nodes.append((node_of[key], token))
            at = node_of[key]

    for tokens in paths:
        add(tokens)
    for i in range(max(map(len, take_turns), default=0)):
        for source in take_turns:
            if i < len(source):
                add(source[i])
    return nodes


def chain_nodes(chain: Sequence[int]) -> list[tuple[int, ...]]:
    """A chain's nodes as token paths from the root (its prefixes), for `rank_tree`'s `take_turns`."""
    return [tuple(chain[: i + 1]) for i in range(len(chain))]


def merge_rows(rows: Sequence[Sequence[tuple[Path_, int]]], max_nodes: int) -> list[Path_]:
    """Union of the rows' rank paths, rows taking turns (each row's i-th node, then each row's (i+1)-th, ...)
    until `max_nodes` paths. Prefix-closed: a row lists a node's parent first, and once the union is full no node
    is added, so a node enters only after its parent did."""
    union: dict[Path_, None] = {}
    for i in range(max(map(len, rows), default=0)):
        for row in rows:
            if i < len(row) and len(union) < max_nodes:
                union.setdefault(row[i][0], None)
    return list(union)


def taken_nodes(sources: Sequence[Sequence[Sequence[int]]], max_nodes: int) -> list[tuple[int, ...]]:
    """The token paths of the nodes that one row's `sources`, taking turns (`rank_tree`), keep under a cap of
    `max_nodes` (`merge_rows`): what that row drafts, parents first."""
    ranked = rank_tree((), sources)
    tokens_of: dict[Path_, tuple[int, ...]] = {(): ()}
    for rank, token in ranked:
        tokens_of[rank] = tokens_of[rank[:-1]] + (token,)
    return [tokens_of[rank] for rank in merge_rows([ranked], max_nodes)]


class TreeCache:
    """Built TreeBuffers by shape, least recently used dropped first. Shapes recur across steps (a chain of a given
    length, a popular branching), and `build_tree` costs milliseconds of small tensor ops."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._trees: OrderedDict[tuple, TreeBuffers] = OrderedDict()

    def get(self, choices: Sequence[Path_], device: torch.device) -> TreeBuffers:
        ordered = tuple(sorted(choices, key=lambda p: (len(p), p)))  # build_tree's node order
        key = (ordered, str(device))
        tree = self._trees.get(key)
        if tree is None:
            depth = max(map(len, ordered), default=0)
            topk = max((r for p in ordered for r in p), default=-1) + 1
            tree = build_tree(ordered, num_heads=depth, topk=topk, device=device, source="token tree")
            self._trees[key] = tree
            if len(self._trees) > self.capacity:
                self._trees.popitem(last=False)
        else:
            self._trees.move_to_end(key)
        return tree


def paths_draft(
    root: torch.Tensor, rows: Sequence[Sequence[Sequence[int]]], max_nodes: int, trees: TreeCache,
    take_turns: bool = False,
) -> Draft:
    """root [B] and each row's continuation paths (priority order), or with `take_turns` each row's sources of
    nodes (`rank_tree`: they share the nodes a node at a time); a row may have none -> one Draft whose tree is the
    capped union of the rows' merged trees (tokens [B, K], fillers where a row lacks a node)."""
    ranked = [rank_tree((), paths) if take_turns else rank_tree(paths) for paths in rows]
    return tree_draft(root, ranked, merge_rows(ranked, max_nodes), trees)


def tree_draft(root: torch.Tensor, ranked: Sequence[Sequence[tuple[Path_, int]]], choices: Sequence[Path_],
               trees: TreeCache) -> Draft:
    """root [B], each row's merged tree (`rank_tree`) and the shared shape `choices` (prefix-closed, e.g.
    `merge_rows`) -> the Draft: tokens [B, K] in the tree's node order, fillers where a row lacks a node."""
    tree = trees.get(choices, root.device)
    table = []
    for row_root, nodes in zip(root.tolist(), ranked):
        token_of = dict(nodes)
        token_of[()] = row_root
        for path in tree.choices:  # parents first, so a filler copies a token already resolved
            token_of.setdefault(path, token_of[path[:-1]])
        table.append([row_root] + [token_of[p] for p in tree.choices])
    return Draft(tree=tree, tokens=torch.tensor(table, dtype=torch.long, device=root.device))  # [B, K]


def row_prompts(state: DecodeState) -> list[list[int]]:
    """Each row's prompt ids without left padding (the first T slots of `state.valid` are the prompt mask)."""
    t = state.prompt.shape[1]
    return [ids[mask].tolist() for ids, mask in zip(state.prompt, state.valid[:, :t])]
