"""Static draft trees: choice paths -> frozen index buffers, built once per (tree, device).

Dimension letters: K tree nodes (root included), P root-to-leaf paths, L = max_depth + 1 (path length with root),
H heads, R top-k ranks per head.

A tree is a set of choice paths in the Medusa `medusa_choices` format: the path (r1, ..., rd) is the node reached
by taking the rank-r1 candidate of head 1, then the rank-r2 candidate of head 2, and so on. Node 0 is the root: the
token already fixed for this step (the target's own next token); a node at depth d holds a candidate from head d
(1-based), i.e. the head whose prediction lands d tokens after the root. The empty path () is the root and is
implicit. A chain [(0,), (0, 0), (0, 0, 0)] is blockwise parallel decoding (Stern et al., 2018).

Nodes are numbered breadth-first with siblings in rank order, so parents precede children and a node's children
are contiguous-in-rank: the order rejection sampling tries them in.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import torch

from data.errors import UsageError

Path_ = tuple[int, ...]
TREE_DIR = "trees"


class TreeError(UsageError):
    """A tree specification is malformed or does not fit the drafter (message names the source and the path)."""


@dataclass(frozen=True, eq=False)  # identity equality: tensors have no truth value
class TreeBuffers:
    """Index buffers of one draft tree. Every tensor is int64/bool on `device`; nothing here changes per step."""

    choices: tuple[Path_, ...]  # non-root nodes in node order (node i + 1 has path choices[i])
    attn: torch.Tensor  # [K, K] bool: node i attends to node j iff j is i or an ancestor of i
    depth: torch.Tensor  # [K] depth of each node (root 0): the position offset from the root
    parent: torch.Tensor  # [K] parent node id; -1 for the root
    head: torch.Tensor  # [K] 0-based head whose candidate a node holds; -1 for the root
    rank: torch.Tensor  # [K] top-k rank of that candidate; -1 for the root
    retrieve: torch.Tensor  # [P, L] node ids from the root to each leaf, padded with -1
    node_path: torch.Tensor  # [K, L] node ids from the root to each node, padded with -1
    node_to_path: torch.Tensor  # [K] index of the first leaf path (row of `retrieve`) through each node
    child_table: torch.Tensor  # [K, C] children of each node in rank order, padded with -1 (C = most children)
    candidate_index: torch.Tensor  # [K - 1] each non-root node's (head, rank) in a head-major [H * topk] table
    max_depth: int  # deepest node = number of heads the tree uses
    topk: int  # candidates needed per head: 1 + the largest rank used (0 for a root-only tree)

    @property
    def num_nodes(self) -> int:
        return len(self.choices) + 1

    def to(self, device: torch.device | str) -> TreeBuffers:
        moved = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return TreeBuffers(**{**vars(self), **moved})


@functools.lru_cache(maxsize=16)
def tree_on(tree: TreeBuffers, device: torch.device) -> TreeBuffers:
    """`tree` on `device`, copied once per (tree, device) rather than once per decoding step: verification of a
    target split across devices runs where its logits come back, away from the state's device."""
    return tree if tree.depth.device == device else tree.to(device)


def validate_choices(choices: Sequence[Sequence[int]], num_heads: int, topk: int, source: str = "tree") -> list[Path_]:
    """Check a choice list against the drafter; return it as tuples. Raises TreeError naming the offending entry."""
    paths: list[Path_] = []
    for i, raw in enumerate(choices):
        if not isinstance(raw, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool) for r in raw):
            raise TreeError(f"{source}: entry {i} {raw!r} is not a list of integer ranks")
        paths.append(tuple(raw))
    seen: set[Path_] = set()
    for i, path in enumerate(paths):
        where = f"{source}: entry {i} {list(path)}"
        if len(path) == 0:
            raise TreeError(f"{where}: the empty path is the implicit root; remove it")
        if len(path) > num_heads:
            raise TreeError(f"{where}: depth {len(path)} exceeds the drafter's {num_heads} head(s)")
        if any(r < 0 or r >= topk for r in path):
            raise TreeError(f"{where}: ranks must be in [0, {topk}) (topk={topk})")
        if path in seen:
            raise TreeError(f"{where}: duplicate path")
        seen.add(path)
    for i, path in enumerate(paths):
        if len(path) > 1 and path[:-1] not in seen:
            raise TreeError(f"{source}: entry {i} {list(path)}: parent {list(path[:-1])} is missing")
    return paths


def build_tree(
    choices: Sequence[Sequence[int]],
    num_heads: int,
    topk: int,
    device: torch.device | str = "cpu",
    source: str = "tree",
) -> TreeBuffers:
    """Validate `choices` and build its buffers (node order: breadth-first, siblings by rank)."""
    ordered = sorted(validate_choices(choices, num_heads, topk, source), key=lambda p: (len(p), p))
    node_of = {(): 0} | {p: i + 1 for i, p in enumerate(ordered)}
    all_paths = [()] + ordered
    k = len(all_paths)
    length = max((len(p) for p in all_paths), default=0) + 1

    # Index lists first, one tensor each at the end: per-step trees (drafters.path_trees) build here every step.
    parent = [-1] + [node_of[p[:-1]] for p in ordered]
    ancestors = [[node_of[p[:j]] for j in range(len(p) + 1)] for p in all_paths]  # root .. node itself
    node_path = torch.tensor([a + [-1] * (length - len(a)) for a in ancestors], dtype=torch.long)
    # padding -1 -> 0 marks the root, an ancestor of every node anyway
    attn = torch.zeros(k, k, dtype=torch.bool).scatter_(1, node_path.clamp(min=0), True)

    children = [[] for _ in range(k)]
    for i in range(1, k):
        children[parent[i]].append(i)  # breadth-first numbering already sorts siblings by rank
    width = max(map(len, children))
    child_table = torch.tensor([kids + [-1] * (width - len(kids)) for kids in children], dtype=torch.long)
    leaves = [i for i in range(k) if not children[i]]
    retrieve = node_path[leaves]
    first_path: dict[int, int] = {}  # node -> the first leaf path listing it
    for row, leaf in enumerate(leaves):
        for node in ancestors[leaf]:
            first_path.setdefault(node, row)
    node_to_path = torch.tensor([first_path[i] for i in range(k)], dtype=torch.long)

    topk_used = max((r for p in ordered for r in p), default=-1) + 1
    head = torch.tensor([len(p) - 1 for p in all_paths])
    rank = torch.tensor([p[-1] if p else -1 for p in all_paths])
    return TreeBuffers(
        choices=tuple(ordered),
        attn=attn.to(device),
        depth=torch.tensor([len(p) for p in all_paths], device=device),
        parent=torch.tensor(parent, device=device),
        head=head.to(device),
        rank=rank.to(device),
        retrieve=retrieve.to(device),
        node_path=node_path.to(device),
        node_to_path=node_to_path.to(device),
        child_table=child_table.to(device),
        candidate_index=(head[1:] * topk_used + rank[1:]).to(device),
        max_depth=length - 1,
        topk=topk_used,
    )


def chain_choices(depth: int) -> list[Path_]:
    """Blockwise parallel decoding: the top-1 candidate of each of `depth` heads."""
    return [(0,) * d for d in range(1, depth + 1)]


def greedy_tree_choices(accuracy: Sequence[Sequence[float]], num_nodes: int) -> list[Path_]:
    """The `num_nodes`-node tree maximising expected accepted length (Medusa paper, sec. 3.3.1).

    accuracy[h][r] is the probability that head h's rank-r candidate is the right token; a path's acceptance
    probability is the product along it (independence assumption). Because each child's probability is at most
    its parent's, adding nodes by largest path probability keeps the tree prefix-closed and is optimal.
    """
    frontier: dict[Path_, float] = {(r,): accuracy[0][r] for r in range(len(accuracy[0]))}
    chosen: list[Path_] = []
    while frontier and len(chosen) < num_nodes:
        best = max(frontier, key=lambda p: (frontier[p], -len(p)))
        prob = frontier.pop(best)
        chosen.append(best)
        if len(best) < len(accuracy):
            for r, acc in enumerate(accuracy[len(best)]):
                frontier[best + (r,)] = prob * acc
    return sorted(chosen, key=lambda p: (len(p), p))


def best_tree_choices(
    accuracy: Sequence[Sequence[float]], step_cost: Callable[[int, int], float], max_nodes: int = 64
) -> list[Path_]:
    """The greedy tree with the most expected tokens per unit of step cost, over sizes 1..max_nodes and depth
    limits 1..len(accuracy). step_cost(num_nodes including the root, depth) is the relative cost of one step: the
    tree forward plus drafting `depth` heads (each a D x V projection, a large share of a small model's forward)."""
    best: tuple[float, list[Path_]] = (-math.inf, [])
    for depth in range(1, len(accuracy) + 1):
        for size in range(1, max_nodes):
            choices = greedy_tree_choices(accuracy[:depth], size)
            used = max(len(p) for p in choices)
            score = expected_accept_length(choices, accuracy) / step_cost(len(choices) + 1, used)
            if score > best[0]:
                best = (score, choices)
    return best[1]


def expected_accept_length(choices: Sequence[Path_], accuracy: Sequence[Sequence[float]]) -> float:
    """Expected tokens per step under the independence model: 1 (root) + sum of path acceptance probabilities."""
    return 1.0 + sum(math.prod(accuracy[d][r] for d, r in enumerate(p)) for p in choices)


def accepted_drafts(choices: Sequence[Path_], ranks: Sequence[int]) -> int:
    """Drafts a static tree gets accepted in greedy decoding at a root where the target's next tokens ranked
    `ranks[d]` among depth d+1's candidates (-1: not among them, or no such token): the depth of the longest prefix
    of `ranks` that is a path of the tree."""
    paths = choices if isinstance(choices, frozenset) else frozenset(map(tuple, choices))
    depth = 0
    while depth < len(ranks) and ranks[depth] >= 0 and tuple(ranks[: depth + 1]) in paths:
        depth += 1
    return depth


def walk_forwards(choices: Sequence[Path_], ranks: Sequence[Sequence[int]], new_tokens: int) -> int:
    """Target forwards a greedy decode of `new_tokens` tokens takes with a static tree and deterministic drafts, the
    prefill included, as the engine counts them. ranks[c - 1] are the ranks (see `accepted_drafts`) at the root
    reached after c committed tokens, for c = 1 .. new_tokens - 1.

    Each step starts where the last one ended, so the steps land more often in the hard stretches of a text than a
    mean over every position assumes: the walk, not that mean, is the τ = tokens / forwards an engine measures."""
    paths = frozenset(map(tuple, choices))
    committed, forwards = min(1, new_tokens), 1  # the prefill's forward makes the first token
    while committed < new_tokens:
        committed = min(committed + accepted_drafts(paths, ranks[committed - 1]) + 1, new_tokens)
        forwards += 1
    return forwards


def default_tree_path(num_heads: int) -> Path:
    """The shipped default tree for a drafter with `num_heads` heads (1-5; more heads use the 5-head tree)."""
    return Path(str(resources.files("inference.engine") / TREE_DIR / f"medusa_{min(max(num_heads, 1), 5)}heads.json"))


def read_tree_file(path: str | Path) -> list[Path_]:
    """Choices from a JSON file: either a list of paths or {"choices": [...], ...}."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except OSError as e:
        raise TreeError(f"{path}: cannot read tree file ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise TreeError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    choices = data.get("choices") if isinstance(data, dict) else data
    if not isinstance(choices, list):
        raise TreeError(f"{path}: expected a list of paths or an object with a 'choices' list")
    return choices


def load_tree(
    spec_or_path: str | Path | Sequence[Sequence[int]] | None,
    num_heads: int,
    topk: int,
    device: torch.device | str = "cpu",
) -> TreeBuffers:
    """Build a tree from None/"default" (shipped tree for `num_heads`), "chain" (one candidate per head),
    "chain:<n>", a JSON file path, or a choice list. Depths beyond `num_heads` or ranks >= `topk` raise TreeError.
    A default tree deeper than `num_heads` is cut to `num_heads` levels; its ranks must still fit `topk`."""
    if spec_or_path is None or spec_or_path == "default":
        path = default_tree_path(num_heads)
        choices = [c for c in read_tree_file(path) if len(c) <= num_heads]
        return build_tree(choices, num_heads, topk, device, source=str(path))
    if isinstance(spec_or_path, str) and (spec_or_path == "chain" or spec_or_path.startswith("chain:")):
        depth_text = spec_or_path.partition(":")[2] or str(num_heads)
        if not depth_text.isdigit():
            raise TreeError(f"tree {spec_or_path!r}: expected 'chain' or 'chain:<depth>'")
        return build_tree(chain_choices(int(depth_text)), num_heads, topk, device, source=spec_or_path)
    if isinstance(spec_or_path, (str, Path)):
        return build_tree(read_tree_file(spec_or_path), num_heads, topk, device, source=str(spec_or_path))
    return build_tree(spec_or_path, num_heads, topk, device)


def root_only_tree(device: torch.device | str = "cpu") -> TreeBuffers:
    """The one-node tree: plain autoregressive decoding through the speculative loop."""
    return build_tree([], num_heads=0, topk=0, device=device)
