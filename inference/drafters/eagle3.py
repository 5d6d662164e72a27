"""The EAGLE-3 drafter: a one-layer draft model over the target's fused features (models/eagle3.py) drafting a static
tree autoregressively in feature space; the target verifies it like any other tree.

Dimension letters: B batch, K tree nodes, P pending pairs, Q queries of one tree level, S draft-cache slots,
F = L*D fused target features, D hidden, R candidates per expanded node.

Per step:
1. The committed pairs the draft has not read ("pending"): (the target's features at a committed token, the token
   after it), at the features' position ids (models/eagle3.py's offset convention). The first step's pending pairs
   are the whole prompt; later, the accepted path of the last tree: its nodes' features come out of the verify
   forward itself (`DecodeState.features`, `feature_layers`), so no second target pass runs. They enter the draft's
   KV cache for good; the last pair of each row (the features of the root's parent, the root) is the root's query.
2. The tree, level by level: each node with children is a query whose hidden input is its parent's output and whose
   token is its own; its children are its top-R draft tokens by rank, as the tree's rank paths say. Each level is one
   draft forward with tree attention (committed slots, the node's ancestors among this step's draft slots, itself).
3. After verification, this step's draft slots are dropped (`update`): the accepted tokens come back as pending pairs
   with the target's true features, as EAGLE does.
Rows accepting different counts leave holes (invalid slots), as in inference.engine.cache. The drafts are deterministic
(top-R), so greedy verification returns plain greedy decoding and rejection sampling stays exact.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from inference.engine.cache import additive, new_cache
from inference.engine.drafter import DecodeState, Draft
from inference.engine.tree import TreeBuffers, TreeError, build_tree, greedy_tree_choices, load_tree
from inference.engine.verify import VerifyResult
from models.eagle3 import Eagle3Draft

MAX_DEPTH = 16  # deepest tree an EAGLE-3 drafter drafts
MAX_RANK = 10  # candidates per node a tree may use (ranks 0..9)
DEFAULT_NODES = 15  # non-root nodes of the default tree (16 with the root)
DEFAULT_CHAIN = 4  # depth of the fallback chain when a checkpoint records no acceptance table


@dataclass(frozen=True)
class Level:
    """One tree level's draft forward: the nodes at depth d with children are its queries."""

    queries: list[int]  # node ids (depth d >= 1) whose outputs score their children
    parent_query: torch.Tensor  # [Q] index of each query's parent among the previous level's queries
    visible: torch.Tensor  # [Q, W + Q] bool: which of this step's earlier draft slots (W) and this level's it sees
    children: torch.Tensor  # [C] node ids at depth d + 1 (children of this level's queries)
    child_query: torch.Tensor  # [C] index of each child's parent among this level's queries
    child_rank: torch.Tensor  # [C] its rank among the parent's candidates


def plan_levels(tree: TreeBuffers) -> list[Level]:
    """The per-level forwards of a tree: level 0 is the root (queried by the pending pairs), level d >= 1 the nodes at
    depth d that have children. A query's visible slots are its expanded ancestors (every ancestor has children)."""
    parent, depth, rank = tree.parent.tolist(), tree.depth.tolist(), tree.rank.tolist()
    device = tree.depth.device
    has_children = {p for p in parent[1:]}
    levels: list[Level] = []
    slot: dict[int, int] = {}  # node -> this step's draft slot
    previous: list[int] = []
    for d in range(tree.max_depth):
        queries = [0] if d == 0 else [n for n in range(tree.num_nodes) if depth[n] == d and n in has_children]
        if not queries:
            break
        width = len(slot)
        visible = torch.zeros(len(queries), width + len(queries), dtype=torch.bool)
        for q, node in enumerate(queries):
            if d == 0:
                continue
            visible[q, width + q] = True
            ancestor = parent[node]
            while ancestor > 0:
                visible[q, slot[ancestor]] = True
                ancestor = parent[ancestor]
        if d > 0:
            slot.update({node: width + q for q, node in enumerate(queries)})
        index = {node: q for q, node in enumerate(queries)}
        children = [n for n in range(tree.num_nodes) if depth[n] == d + 1]
        as_index = functools.partial(torch.tensor, dtype=torch.long, device=device)
        levels.append(Level(
            queries=queries,
            parent_query=as_index([previous.index(parent[n]) for n in queries] if d else [0]),
            visible=visible.to(device),
            children=as_index(children),
            child_query=as_index([index[parent[n]] for n in children]),
            child_rank=as_index([rank[n] for n in children]),
        ))
        previous = queries
    return levels


def default_tree(acceptance: list[list[float]], num_nodes: int = DEFAULT_NODES) -> list[tuple[int, ...]]:
    """The tree maximising expected accepted length under the checkpoint's measured [depth][rank] hit rates (the
    Medusa paper's greedy construction; EAGLE's acceptances are conditional on the parent, which is what it assumes);
    a chain of DEFAULT_CHAIN without a table."""
    table = [row[:MAX_RANK] for row in acceptance[:MAX_DEPTH]]
    if not table or not any(any(row) for row in table):
        return [(0,) * d for d in range(1, DEFAULT_CHAIN + 1)]
    return greedy_tree_choices(table, num_nodes)


def eagle3_tree(spec: object, acceptance: list[list[float]], device: torch.device | str) -> TreeBuffers:
    """None / "default": `default_tree`; otherwise any `load_tree` spec (a JSON file, "chain:<n>", a choice list),
    ranks < MAX_RANK and depth <= MAX_DEPTH."""
    if spec is None or spec == "default":
        return build_tree(default_tree(acceptance), MAX_DEPTH, MAX_RANK, device, source="eagle3 default tree")
    if spec == "chain":
        raise TreeError("tree 'chain': an EAGLE-3 drafter has no fixed head count; say 'chain:<depth>'")
    return load_tree(spec, num_heads=MAX_DEPTH, topk=MAX_RANK, device=device)


@dataclass(eq=False)
class Pending:
    """Committed pairs the draft has not read yet, right-padded with holes."""

    features: torch.Tensor  # [B, P, F] the target's features at each committed token
    tokens: torch.Tensor  # [B, P] the token after it
    positions: torch.Tensor  # [B, P] the features' position ids
    valid: torch.Tensor  # [B, P] bool; each row's last valid pair queries the root's children


@dataclass(eq=False)
class DraftRun:
    """The drafter's per-run state (DecodeState.drafter_state)."""

    cache: DynamicCache  # the draft layer's keys / values: committed pairs, then this step's draft slots
    valid: torch.Tensor  # [B, S] bool
    pending: Pending
    drafted: int = 0  # draft slots the last propose appended (dropped by update)


class Eagle3Drafter:
    """Drafts `tree` with an Eagle3Draft; `embed` is the target's input embedding (the draft's token inputs)."""

    needs_hidden = False

    def __init__(self, draft: Eagle3Draft, tree: TreeBuffers, embed: nn.Module) -> None:
        if tree.max_depth > MAX_DEPTH or tree.topk > min(MAX_RANK, draft.config.draft_vocab_size):
            raise TreeError(f"an EAGLE-3 tree may be {MAX_DEPTH} deep with ranks below "
                            f"{min(MAX_RANK, draft.config.draft_vocab_size)}; this one is {tree.max_depth} deep, "
                            f"rank {tree.topk - 1}")
        self.draft = draft
        self.tree = tree
        self.embed = embed
        self.feature_layers = tuple(draft.config.layers)
        self.levels = plan_levels(tree)
        self.vocab = draft.vocab_ids.to(tree.depth.device)  # [S] draft id -> target id

    def propose(self, state: DecodeState) -> Draft:
        if state.features is None:
            raise ValueError("Eagle3Drafter needs state.features (the loop fills them from feature_layers)")
        run = state.drafter_state if isinstance(state.drafter_state, DraftRun) else self._start(state)
        state.drafter_state = run
        b = state.root.shape[0]
        rows = torch.arange(b, device=state.root.device)
        out = self._feed(run, run.pending)  # [B, P, D]
        last = run.pending.valid.long().cumsum(-1).argmax(-1)  # [B] each row's last valid pair
        outputs = out[rows, last][:, None]  # [B, 1, D]: level 0's one query, the root
        tokens = state.root.new_zeros(b, self.tree.num_nodes)
        tokens[:, 0] = state.root
        run.drafted = 0
        for d, level in enumerate(self.levels):
            if d > 0:
                hidden = outputs[:, level.parent_query]  # [B, Q, D] each query's parent's output
                positions = (state.next_pos + d - 1)[:, None].expand(b, len(level.queries))
                outputs = self._level(run, hidden, tokens[:, level.queries], positions, level.visible)
            top = self.draft.logits(outputs).topk(self.tree.topk, dim=-1).indices  # [B, Q, R]
            picked = top[:, level.child_query, level.child_rank]  # [B, C]
            tokens[:, level.children] = self.vocab[picked]
        return Draft(tree=self.tree, tokens=tokens)

    def update(self, state: DecodeState, draft: Draft, result: VerifyResult) -> None:
        """Drop this step's draft slots; the accepted path (root .. deepest accepted node) with the target's own
        features becomes the pending pairs, each paired with the token committed after it."""
        run: DraftRun = state.drafter_state
        if run.drafted:
            run.cache.crop(-run.drafted)
            run.valid = run.valid[:, : run.valid.shape[1] - run.drafted]
            run.drafted = 0
        n = result.num_accepted  # [B]
        width = int(n.max()) + 1
        col = torch.arange(width, device=n.device)
        path = result.path[:, :width].clamp(min=0)  # [B, W] node ids; padding -> root (a hole below)
        features = state.features.gather(1, path[:, :, None].expand(-1, -1, state.features.shape[-1]))
        run.pending = Pending(
            features=features,  # [B, W, F]
            tokens=result.tokens[:, :width].clamp(min=0),  # accepted drafts then the next token
            positions=(state.next_pos - n - 1)[:, None] + col,  # the old root's position onwards
            valid=col[None, :] <= n[:, None],
        )

    def _start(self, state: DecodeState) -> DraftRun:
        """The first propose: every prompt position's features paired with the token after it (the root last)."""
        t = state.prompt.shape[1]
        pad_mask = state.valid[:, :t]  # before any step, state.valid is the prompt's pad mask
        return DraftRun(
            cache=new_cache(),
            valid=pad_mask[:, :0],
            pending=Pending(
                features=state.features,  # [B, T, F]
                tokens=torch.cat([state.prompt[:, 1:], state.root[:, None]], dim=1),
                positions=(pad_mask.long().cumsum(-1) - 1).clamp(min=0),
                valid=pad_mask,
            ),
        )

    def _feed(self, run: DraftRun, pending: Pending) -> torch.Tensor:
        """Read the pending pairs into the cache (causal among themselves, holes seen by no one) -> [B, P, D]."""
        b, p = pending.tokens.shape
        causal = torch.ones(p, p, dtype=torch.bool, device=pending.valid.device).tril()
        own = (causal[None] & pending.valid[:, None, :]) | torch.eye(p, dtype=torch.bool, device=causal.device)[None]
        visible = torch.cat([run.valid[:, None, :].expand(b, p, -1), own], dim=-1)  # [B, P, S + P]
        hidden = self.draft.fuse(pending.features)
        out = self._forward(run, hidden, pending.tokens, pending.positions, visible)
        run.valid = torch.cat([run.valid, pending.valid], dim=1)
        return out

    def _level(self, run: DraftRun, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
               cols: torch.Tensor) -> torch.Tensor:
        """One tree level: Q queries seeing the committed slots and `cols` [Q, W + Q] of this step's -> [B, Q, D]."""
        b, q = tokens.shape
        committed = run.valid[:, : run.valid.shape[1] - run.drafted]
        visible = torch.cat([committed[:, None, :].expand(b, q, -1), cols[None].expand(b, -1, -1)], dim=-1)
        out = self._forward(run, hidden, tokens, positions, visible)
        run.valid = torch.cat([run.valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1)
        run.drafted += q
        return out

    def _forward(self, run: DraftRun, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                 visible: torch.Tensor) -> torch.Tensor:
        dtype = self.draft.fc.weight.dtype
        embeds = self.embed(tokens)
        return self.draft.step(hidden.to(dtype), embeds.to(dtype), positions, additive(visible[:, None], dtype),
                               run.cache)
