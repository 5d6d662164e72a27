"""The EAGLE-3 drafter: a one-layer draft model over the target's fused features (models/eagle3.py) drafting a tree
autoregressively in feature space; the target verifies it like any other tree. The tree is either static (fixed rank
paths, by default the ones the checkpoint's measured acceptance favours) or dynamic (EAGLE-2: grown each step from the
draft's own confidence, `DynamicTree`).

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
   A dynamic tree chooses each level's queries as it goes (`grow_dynamic`) and keeps the most probable paths.
3. After verification, this step's draft slots are dropped (`update`): the accepted tokens come back as pending pairs
   with the target's true features, as EAGLE does.
Rows accepting different counts leave holes (invalid slots), as in inference.engine.cache. The drafts are deterministic
(top-R), so greedy verification returns plain greedy decoding and rejection sampling stays exact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from inference.engine import static
from inference.engine.cache import additive, new_cache
from inference.engine.compiled import network_call
from inference.engine.drafter import DecodeState, Draft
from inference.engine.tree import TreeBuffers, TreeError, build_tree, greedy_tree_choices, load_tree
from inference.engine.verify import VerifyResult
from models.eagle3 import Eagle3Draft, token_lookup

MAX_DEPTH = 16  # deepest tree an EAGLE-3 drafter drafts
MAX_RANK = 10  # candidates per node a tree may use (ranks 0..9)
DEFAULT_NODES = 15  # non-root nodes of the default tree (16 with the root)
DEFAULT_CHAIN = 4  # depth of the fallback chain when a checkpoint records no acceptance table
DYNAMIC_SPEC = "dynamic[:<nodes>[:<depth>[:<topk>]]]"


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic draft tree (Li et al., 2024). Each step, from the root: expand the `topk` most probable
    nodes of the newest level (one draft forward), giving each its `topk` best draft tokens, for `depth` levels; then
    keep the `num_nodes` - 1 candidates of highest path probability (the product of draft probabilities from the root)
    as the tree the target verifies. A child is never more probable than its parent, so the kept set is a tree.
    In a batch the rows share one shape: a rank path's value is its probability summed over the rows (the expected
    accepted tokens of the batch), which is EAGLE-2's rule for one row. Any deterministic tree keeps verification
    lossless, so the shape may follow the draft."""

    # defaults: the best of 16:6:4, 16:8:3, 16:5:8 and 16:6:10 on smollm2 (docs/eagle3.md): as wide at the root as the
    # static tree its acceptance favours (8 children), which a narrower expansion cannot reach
    num_nodes: int = DEFAULT_NODES + 1  # verified tokens per row, the root included
    depth: int = 5  # deepest level drafted
    topk: int = 8  # nodes expanded per level and candidates per expanded node

    @classmethod
    def parse(cls, spec: str, draft_vocab: int) -> DynamicTree:
        """`dynamic`, `dynamic:<nodes>`, `dynamic:<nodes>:<depth>` or `dynamic:<nodes>:<depth>:<topk>`."""
        fields = spec.split(":")[1:]
        if len(fields) > 3 or not all(f.isdigit() for f in fields):
            raise TreeError(f"tree {spec!r}: expected {DYNAMIC_SPEC} with whole numbers")
        tree = cls(*map(int, fields))
        limits = {"nodes": (tree.num_nodes, 2, 256), "depth": (tree.depth, 1, MAX_DEPTH),
                  "topk": (tree.topk, 1, min(MAX_RANK, draft_vocab))}
        for name, (value, low, high) in limits.items():
            if not low <= value <= high:
                raise TreeError(f"tree {spec!r}: {name} must lie in [{low}, {high}], got {value}")
        return tree


@dataclass
class Candidates:
    """The nodes a dynamic tree may keep, in creation order (index i). Shared shape, per-row tokens and scores."""

    paths: list[tuple[int, ...]]  # rank path from the root
    parent: list[int]  # index of the parent candidate; -1 for the root's children
    tokens: list[torch.Tensor]  # [B] target token ids, one tensor per candidate
    logp: list[torch.Tensor]  # [B] log probability of the path under the draft (float32)

    def add(self, parent: int, tokens: torch.Tensor, logp: torch.Tensor) -> list[int]:
        """Children of `parent` (-1: the root) in rank order from [B, R] tokens and path log-probs; -> their indices."""
        first = len(self.paths)
        base = self.paths[parent] if parent >= 0 else ()
        for r in range(tokens.shape[1]):
            self.paths.append(base + (r,))
            self.parent.append(parent)
            self.tokens.append(tokens[:, r])
            self.logp.append(logp[:, r])
        return list(range(first, len(self.paths)))

    def values(self, indices: list[int]) -> list[float]:
        """Each candidate's path probability summed over the rows."""
        return torch.stack([self.logp[i] for i in indices]).exp().sum(-1).tolist()

    def best(self, indices: list[int], n: int) -> list[int]:
        """The `n` most valuable of `indices`, ties to the shallower then the older: parents before children."""
        order = sorted(zip(self.values(indices), indices), key=lambda vi: (-vi[0], len(self.paths[vi[1]]), vi[1]))
        return [i for _, i in order[:n]]


@dataclass(frozen=True)
class Level:
    """One tree level's draft forward: the nodes at depth d with children are its queries."""

    queries: list[int]  # node ids (depth d >= 1) whose outputs score their children
    parent_query: torch.Tensor  # [Q] index of each query's parent among the previous level's queries
    visible: torch.Tensor  # [Q, W + Q] bool: which of this step's earlier draft slots (W) and this level's it sees
    children: torch.Tensor  # [C] node ids at depth d + 1 (children of this level's queries)
    child_query: torch.Tensor  # [C] index of each child's parent among this level's queries
    child_rank: torch.Tensor  # [C] its rank among the parent's candidates


def level_visibility(queries: list[int], parent: list[int], slot: dict[int, int]) -> torch.Tensor:
    """[Q, W + Q] bool: the draft slots each query of a level sees this step: its expanded ancestors (`slot`, W of
    them: every ancestor below the root was expanded) and itself."""
    width = len(slot)
    visible = torch.zeros(len(queries), width + len(queries), dtype=torch.bool)
    for q, node in enumerate(queries):
        visible[q, width + q] = True
        ancestor = parent[node]
        while ancestor in slot:
            visible[q, slot[ancestor]] = True
            ancestor = parent[ancestor]
    return visible


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
        visible = level_visibility(queries, parent, slot) if d else torch.zeros(1, 1, dtype=torch.bool)
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


def eagle3_tree(spec: object, acceptance: list[list[float]], device: torch.device | str,
                draft_vocab: int = MAX_RANK) -> TreeBuffers | DynamicTree:
    """None / "default": `default_tree`; "default:<nodes>": the same for <nodes> verified tokens (root included);
    "dynamic[:...]": a `DynamicTree`; otherwise any `load_tree` spec (a JSON file, "chain:<n>", a choice list), ranks
    < MAX_RANK and depth <= MAX_DEPTH."""
    if spec is None or spec == "default":
        return build_tree(default_tree(acceptance), MAX_DEPTH, MAX_RANK, device, source="eagle3 default tree")
    if isinstance(spec, str) and spec.startswith("default:"):
        nodes = spec.partition(":")[2]
        if not nodes.isdigit() or not 2 <= int(nodes) <= 256:
            raise TreeError(f"tree {spec!r}: expected default:<nodes> with 2 <= nodes <= 256 (the root included)")
        return build_tree(default_tree(acceptance, int(nodes) - 1), MAX_DEPTH, MAX_RANK, device,
                          source=f"eagle3 default tree of {nodes} nodes")
    if isinstance(spec, str) and (spec == "dynamic" or spec.startswith("dynamic:")):
        return DynamicTree.parse(spec, draft_vocab)
    if spec == "chain":
        raise TreeError("tree 'chain': an EAGLE-3 drafter has no fixed head count; say 'chain:<depth>'")
    return load_tree(spec, num_heads=MAX_DEPTH, topk=MAX_RANK, device=device)


def pad_pending(pending: Pending, width: int) -> Pending:
    """`pending` right-padded to `width` pairs with holes (repeating the last pair's inputs; valid False)."""
    pad = width - pending.tokens.shape[1]

    def extend(x: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
        last = x[:, -1:] if fill is None else fill
        return torch.cat([x, last.expand(x.shape[0], pad, *x.shape[2:])], dim=1)

    return Pending(features=extend(pending.features), tokens=extend(pending.tokens),
                   positions=extend(pending.positions), valid=extend(pending.valid, pending.valid.new_zeros(1, 1)))


def check_fits(tree: TreeBuffers | DynamicTree, draft_vocab: int) -> None:
    """TreeError when `tree` is deeper than MAX_DEPTH or asks for ranks the draft cannot rank (MAX_RANK, or a draft
    vocabulary of fewer tokens)."""
    ranks = min(MAX_RANK, draft_vocab)
    if isinstance(tree, DynamicTree):
        if tree.depth > MAX_DEPTH or tree.topk > ranks:
            raise TreeError(f"an EAGLE-3 dynamic tree may be {MAX_DEPTH} deep with topk <= {ranks}; "
                            f"this one is {tree.depth} deep, topk {tree.topk}")
    elif tree.max_depth > MAX_DEPTH or tree.topk > ranks:
        raise TreeError(f"an EAGLE-3 tree may be {MAX_DEPTH} deep with ranks below {ranks}; this one is "
                        f"{tree.max_depth} deep, rank {tree.topk - 1}")


@dataclass(eq=False)
class Pending:
    """Committed pairs the draft has not read yet, right-padded with holes."""

    features: torch.Tensor  # [B, P, F] the target's features at each committed token
    tokens: torch.Tensor  # [B, P] the token after it
    positions: torch.Tensor  # [B, P] the features' position ids
    valid: torch.Tensor  # [B, P] bool; each row's last valid pair queries the root's children


@dataclass(eq=False)
class DraftRun:
    """The drafter's per-run state (DecodeState.drafter_state). Over a static target cache (fixed step shapes) the
    draft's cache is static too, of the target's capacity C, and every draft forward attends over all C slots."""

    cache: DynamicCache  # the draft layer's keys / values: committed pairs, then this step's draft slots
    valid: torch.Tensor  # [B, S] bool
    pending: Pending
    step: Callable[..., torch.Tensor]  # Eagle3Draft.step, compiled when DecodeState.compile_drafter
    logits: Callable[[torch.Tensor], torch.Tensor]  # Eagle3Draft.logits, the same
    drafted: int = 0  # draft slots the last propose appended (dropped by update)


class Eagle3Drafter:
    """Drafts `tree` (static buffers or a DynamicTree) with an Eagle3Draft; `embed` is the target's input embedding
    module, read through `token_lookup` (its table's rows: the draft's token inputs)."""

    needs_hidden = False

    def __init__(self, draft: Eagle3Draft, tree: TreeBuffers | DynamicTree, embed: nn.Module) -> None:
        check_fits(tree, draft.config.draft_vocab_size)
        self.draft = draft
        self.tree = tree
        self.embed = token_lookup(embed)
        self.feature_layers = tuple(draft.config.layers)
        self.levels = [] if isinstance(tree, DynamicTree) else plan_levels(tree)
        self.vocab = draft.vocab_ids.to(draft.fc.weight.device)  # [S] draft id -> target id

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
        run.drafted = 0
        if isinstance(self.tree, DynamicTree):
            return self.grow_dynamic(state, run, outputs)
        tokens = state.root.new_zeros(b, self.tree.num_nodes)
        tokens[:, 0] = state.root
        path_logp = outputs.new_zeros(b, self.tree.num_nodes, dtype=torch.float32)  # [B, K] log q of each node's path
        for d, level in enumerate(self.levels):
            if d > 0:
                hidden = outputs[:, level.parent_query]  # [B, Q, D] each query's parent's output
                positions = (state.next_pos + d - 1)[:, None].expand(b, len(level.queries))
                outputs = self._level(run, hidden, tokens[:, level.queries], positions, level.visible)
            logits = run.logits(outputs)  # [B, Q, S]
            top = logits.topk(self.tree.topk, dim=-1).indices  # [B, Q, R]
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, top)  # [B, Q, R]
            picked = top[:, level.child_query, level.child_rank]  # [B, C]
            tokens[:, level.children] = self.vocab[picked]
            parents = self.tree.parent[level.children]  # [C], filled at the level before
            path_logp[:, level.children] = path_logp[:, parents] + logp[:, level.child_query, level.child_rank]
        return Draft(tree=self.tree, tokens=tokens, scores=path_logp.exp())

    def grow_dynamic(self, state: DecodeState, run: DraftRun, root: torch.Tensor) -> Draft:
        """EAGLE-2's tree from the root's draft output `root` [B, 1, D]: expand the best `topk` of the newest level
        for `depth` levels, then keep the best `num_nodes` - 1 candidates (`DynamicTree`)."""
        spec: DynamicTree = self.tree
        b = root.shape[0]
        top = self._top(run, root, spec.topk)  # ([B, 1, R] log-probs, [B, 1, R] target ids)
        found = Candidates(paths=[], parent=[], tokens=[], logp=[])
        newest = found.add(-1, top[1][:, 0], top[0][:, 0])
        slot: dict[int, int] = {}  # expanded candidate -> its draft slot this step
        outputs = root
        query_of: dict[int, int] = {i: 0 for i in newest}  # candidate -> index of its parent among the last queries
        for d in range(1, spec.depth):
            queries = found.best(newest, spec.topk)
            width = len(slot)
            visible = level_visibility(queries, found.parent, slot)
            slot.update({node: width + q for q, node in enumerate(queries)})
            hidden = outputs[:, [query_of[n] for n in queries]]  # [B, Q, D] each query's parent's output
            tokens = torch.stack([found.tokens[n] for n in queries], dim=1)  # [B, Q]
            positions = (state.next_pos + d - 1)[:, None].expand(b, len(queries))
            outputs = self._level(run, hidden, tokens, positions, visible.to(root.device))
            logp, ids = self._top(run, outputs, spec.topk)  # [B, Q, R]
            newest, query_of = [], {}
            for q, node in enumerate(queries):
                children = found.add(node, ids[:, q], found.logp[node][:, None] + logp[:, q])
                newest += children
                query_of.update({c: q for c in children})
        kept = found.best(list(range(len(found.paths))), spec.num_nodes - 1)
        tree = build_tree([found.paths[i] for i in kept], MAX_DEPTH, MAX_RANK, root.device, source="eagle3 dynamic")
        index = {found.paths[i]: i for i in kept}
        drafted = [found.tokens[index[path]] for path in tree.choices]  # node order
        logp = [found.logp[index[path]] for path in tree.choices]
        scores = torch.stack([torch.zeros_like(logp[0]), *logp], dim=1).exp() if logp else None  # [B, K]
        return Draft(tree=tree, tokens=torch.stack([state.root.to(root.device), *drafted], dim=1), scores=scores)

    def _top(self, run: DraftRun, outputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best draft tokens of each output [B, Q, D]: (log-probabilities [B, Q, k] float32, target ids)."""
        logp, ids = torch.log_softmax(run.logits(outputs).float(), dim=-1).topk(k, dim=-1)
        return logp, self.vocab[ids]

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
        """The first propose: every prompt position's features paired with the token after it (the root last). The
        draft's cache is static when the target's is (of the same capacity), its step and logits compiled when the
        run compiles its drafter (DecodeState.compile_drafter)."""
        t = state.prompt.shape[1]
        pad_mask = state.valid[:, :t]  # before any step, state.valid is the prompt's pad mask
        fixed = static.static_layers(state.cache)
        return DraftRun(
            cache=static.new_static_cache(static.capacity(state.cache)) if fixed else new_cache(),
            step=network_call(self.draft, "step") if state.compile_drafter else self.draft.step,
            logits=network_call(self.draft, "logits") if state.compile_drafter else self.draft.logits,
            valid=pad_mask[:, :0],
            pending=Pending(
                features=state.features,  # [B, T, F]
                tokens=torch.cat([state.prompt[:, 1:], state.root[:, None]], dim=1),
                positions=(pad_mask.long().cumsum(-1) - 1).clamp(min=0),
                valid=pad_mask,
            ),
        )

    def _feed(self, run: DraftRun, pending: Pending) -> torch.Tensor:
        """Read the pending pairs into the cache (causal among themselves, holes seen by no one) -> [B, P, D]. Over a
        static cache the pairs of a decoding step run as static.bucket(P) (padding pairs are holes, cropped after)."""
        p = pending.tokens.shape[1]
        width = static.bucket(p) if static.static_layers(run.cache) and run.valid.shape[1] else p
        if width > p:
            out = self._feed(run, pad_pending(pending, width))[:, :p]
            run.cache.crop(p - width)
            run.valid = run.valid[:, : run.valid.shape[1] - (width - p)]
            return out
        b = pending.tokens.shape[0]
        causal = torch.ones(p, p, dtype=torch.bool, device=pending.valid.device).tril()
        own = (causal[None] & pending.valid[:, None, :]) | torch.eye(p, dtype=torch.bool, device=causal.device)[None]
        visible = torch.cat([run.valid[:, None, :].expand(b, p, -1), own], dim=-1)  # [B, P, S + P]
        hidden = self.draft.fuse(pending.features)
        prompt = run.valid.shape[1] == 0  # the prompt's pairs: a new length each request, so never compiled
        out = self._forward(run, hidden, pending.tokens, pending.positions, visible,
                            step=self.draft.step if prompt else run.step)
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
                 visible: torch.Tensor, step: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """One draft forward of Q pairs seeing `visible` [B, Q, S + Q] (the cache after they are written) ->
        [B, Q, D], through `step` (default: the run's)."""
        dtype = self.draft.fc.weight.dtype
        embeds = self.embed(tokens)
        if static.static_layers(run.cache):
            visible = static.over_capacity(run.cache, visible)  # [B, Q, C]
        step = step or run.step
        return step(hidden.to(dtype), embeds.to(dtype), positions, additive(visible[:, None], dtype), run.cache)
