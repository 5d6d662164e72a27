"""Verification rules: which drafted tree nodes the target accepts, and the target's own next token.

Dimension letters: B batch, K tree nodes (root included), V vocab, P leaf paths, L = max_depth + 1.

Inputs shared by every rule:
    tokens [B, K]     token at each tree node; tokens[:, 0] is the root (already committed)
    logits [B, K, V]  target logits at each node: the target's prediction for the token after that node,
                      given the prefix, the node's ancestors and the node itself
Every rule returns a `VerifyResult`; the tokens a step commits are the accepted drafts followed by `next_token`.

Rules:
    greedy     exact at temperature 0: the target's argmax chain.
    typical    LOSSY (Medusa "typical acceptance", Cai et al. 2024, sec. 3.3.1): accept x if
               p(x) > min(eps, delta * exp(-H(p))). Outputs are plausible but NOT distributed as the target.
    rejection  exact at any temperature: speculative sampling (Leviathan et al. 2023; Chen et al. 2023) over a tree of
               deterministic drafts (one-hot q), siblings tried in rank order (SpecInfer, Miao et al. 2024).
    speculative exact at any temperature for SAMPLED drafts with their draft distribution q: accept x with
               min(1, p(x)/q(x)), else resample from norm(max(0, p - q)) (Leviathan et al. 2023, Alg. 1); siblings
               drawn with replacement or without (recursive rejection sampling, Jeon et al. 2024).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from inference.engine.options import check, number, option
from inference.engine.tree import TreeBuffers

ARGMAX_CHUNK = 1024  # vocabulary slice per first-stage max in `greedy_argmax`


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] int64: `logits.argmax(-1)` exactly (the first index of the maximum; a row with a NaN goes to
    torch's own argmax), faster on the CPU, where torch's argmax is a scalar loop (~4x slower than this on 16 x
    49,152 bf16 logits, two threads: scripts/bench_cpu_kernel.py) while its max reductions are vectorised: the max of
    every ARGMAX_CHUNK-wide slice of the vocabulary, the first slice holding the row's maximum, then the argmax
    inside that slice only."""
    v = logits.shape[-1]
    if logits.device.type != "cpu" or v < 8 * ARGMAX_CHUNK:
        return logits.argmax(-1)
    n = -(-v // ARGMAX_CHUNK)
    padded = logits if n * ARGMAX_CHUNK == v else F.pad(logits, (0, n * ARGMAX_CHUNK - v), value=float("-inf"))
    slices = padded.reshape(*logits.shape[:-1], n, ARGMAX_CHUNK)  # [..., n, C]
    slice_max = slices.amax(-1)  # [..., n]
    top = slice_max.amax(-1, keepdim=True)  # [..., 1]
    if bool(top.isnan().any()):
        return logits.argmax(-1)
    first = (slice_max == top).to(torch.uint8).argmax(-1)  # [...] the first slice holding the maximum
    inside = slices.gather(-2, first[..., None, None].expand(*first.shape, 1, ARGMAX_CHUNK)).squeeze(-2)  # [..., C]
    return inside.argmax(-1) + first * ARGMAX_CHUNK


@dataclass(frozen=True)
class SamplingParams:
    """How the target's logits become a distribution; applied identically by every decoding path.
    temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = option(0.0, type=float, valid=number(0), must="a finite number >= 0",
                                help="0 = greedy; above, the target's logits are divided by it before sampling")
    top_k: int = option(0, type=int, valid=lambda v: v >= 0, must=">= 0 (0 disables it)",
                        help="sample from the k likeliest tokens only; 0 disables")
    top_p: float = option(1.0, type=float, valid=lambda v: 0 < v <= 1, must="in (0, 1]",
                          help="sample from the smallest set of tokens whose probability reaches p; 1.0 disables")

    def __post_init__(self) -> None:
        check(self, error=ValueError)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities (float64 for float64 logits) after temperature, then top-k,
    then top-p (HF order). Greedy params give the one-hot of the argmax, so every rule below reduces to greedy at
    temperature 0."""
    logits = _at_least_fp32(logits)
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, greedy_argmax(logits)[..., None], 1.0)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, mass_before >= params.top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """float32, or float64 kept as it is (the exact tests run the rules in float64)."""
    return x if x.dtype == torch.float64 else x.float()


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[..., V] probabilities -> [...] sampled ids."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """[..., V] -> [...]: the target's own token (argmax when greedy, else a sample of `target_probs`)."""
    if params.greedy:
        return greedy_argmax(logits)
    return sample(target_probs(logits, params), generator)


@dataclass(frozen=True, eq=False)
class VerifyResult:
    """Outcome of one verification step. Row b commits tokens[b, : num_accepted[b] + 1]."""

    node: torch.Tensor  # [B] deepest accepted tree node (0: only the root, no draft accepted)
    path_index: torch.Tensor  # [B] a row of tree.retrieve passing through `node`
    num_accepted: torch.Tensor  # [B] accepted draft tokens (= depth of `node`)
    path: torch.Tensor  # [B, L] node ids root .. node, padded with -1: the cache entries to keep
    tokens: torch.Tensor  # [B, L] accepted drafts then next_token, padded with -1
    next_token: torch.Tensor  # [B] the target's token after the accepted drafts (correction or bonus)

    def to(self, device: torch.device | str) -> VerifyResult:
        """The same result on `device` (itself when already there)."""
        if self.node.device == torch.device(device):
            return self
        return VerifyResult(**{k: v.to(device) for k, v in vars(self).items()})


def make_result(tree: TreeBuffers, tokens: torch.Tensor, node: torch.Tensor, next_tok: torch.Tensor) -> VerifyResult:
    """Assemble a VerifyResult from the accepted node [B] and the next token [B]."""
    path = tree.node_path[node]  # [B, L]
    n = tree.depth[node]  # [B]
    drafts = tokens.gather(1, path[:, 1:].clamp(min=0))  # [B, L-1] tokens along the path, root excluded
    committed = torch.cat([drafts, torch.full_like(n[:, None], -1)], dim=1)  # [B, L]
    committed.scatter_(1, n[:, None], next_tok[:, None])
    col = torch.arange(committed.shape[1], device=committed.device)
    committed = committed.masked_fill(col[None, :] > n[:, None], -1)
    return VerifyResult(
        node=node, path_index=tree.node_to_path[node], num_accepted=n, path=path, tokens=committed, next_token=next_tok
    )


def path_matches(tree: TreeBuffers, accept: torch.Tensor) -> torch.Tensor:
    """[B, K] per-node acceptance (node judged against its parent's distribution) -> [B, P] accepted prefix length
    of every leaf path (consecutive accepted nodes from depth 1)."""
    ret = tree.retrieve  # [P, L]
    ok = accept[:, ret[:, 1:].clamp(min=0)] & (ret[:, 1:] >= 0)  # [B, P, L-1]
    return ok.long().cumprod(-1).sum(-1)


def verify_greedy(tokens: torch.Tensor, logits: torch.Tensor, tree: TreeBuffers) -> VerifyResult:
    """Exact greedy: the longest path whose every token equals the target argmax at its parent (the first such leaf
    path in `tree.retrieve` order on ties; every longest path carries the same tokens, the target's argmax chain).

    One argmax on the logits' device, then a walk over the [B, K] argmax ids on the host: the tree is small, and a
    dozen indexing kernels cost more than the walk (about 0.5 ms per step on CPU, as much as the drafting itself)."""
    pred = greedy_argmax(logits)  # [B, K]
    host = host_tree(tree)
    nodes, accepted, next_ids = [], [], []
    drafted_rows = tokens.tolist()
    for drafted, argmax in zip(drafted_rows, pred.tolist()):
        best_len, best = -1, 0
        for path in host.paths:  # root .. leaf
            n = 1
            while n < len(path) and drafted[path[n]] == argmax[path[n - 1]]:
                n += 1
            if n - 1 > best_len:
                best_len, best = n - 1, path[n - 1]
        nodes.append(best)
        accepted.append(best_len)
        next_ids.append(argmax[best])
    width = tree.node_path.shape[1]
    committed = [[drafted[x] for x in host.node_path[node][1 : n + 1]] + [nxt] + [-1] * (width - n - 1)
                 for drafted, node, n, nxt in zip(drafted_rows, nodes, accepted, next_ids)]
    as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=tokens.device)
    return VerifyResult(
        node=as_tensor(nodes),
        path_index=as_tensor([host.node_to_path[x] for x in nodes]),
        num_accepted=as_tensor(accepted),
        path=as_tensor([host.node_path[x] for x in nodes]),
        tokens=as_tensor(committed),
        next_token=as_tensor(next_ids),
    )


@dataclass(frozen=True)
class HostTree:
    """Python copies of a tree's index buffers, for host-side walks."""

    paths: tuple[tuple[int, ...], ...]  # root .. leaf node ids of each row of `retrieve`, unpadded
    node_path: tuple[tuple[int, ...], ...]  # [K][L] root .. node, padded with -1 (as TreeBuffers.node_path)
    node_to_path: tuple[int, ...]  # [K]


@functools.lru_cache(maxsize=64)
def host_tree(tree: TreeBuffers) -> HostTree:
    return HostTree(
        paths=tuple(tuple(n for n in row if n >= 0) for row in tree.retrieve.tolist()),
        node_path=tuple(map(tuple, tree.node_path.tolist())),
        node_to_path=tuple(tree.node_to_path.tolist()),
    )


def typical_threshold(probs: torch.Tensor, epsilon: float, delta: float) -> torch.Tensor:
    """[..., V] -> [...]: min(epsilon, delta * exp(-H(p))), entropy in nats."""
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1)
    return torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))


def verify_typical(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    tree: TreeBuffers,
    params: SamplingParams,
    epsilon: float = 0.09,
    delta: float = 0.3,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """LOSSY typical acceptance: accept node x iff p_parent(x) > min(epsilon, delta * exp(-H(p_parent))), p being
    `target_probs`. Longest accepted path wins; ties go to the higher path likelihood. The next token is sampled
    from p at the accepted node."""
    probs = target_probs(logits, params)  # [B, K, V]
    parent = tree.parent.clamp(min=0)
    p_tok = probs[:, parent].gather(2, tokens[:, :, None])[:, :, 0]  # [B, K] p_parent(token)
    accept = p_tok > typical_threshold(probs, epsilon, delta)[:, parent]  # [B, K]
    lengths = path_matches(tree, accept)  # [B, P]
    ret = tree.retrieve
    logp = p_tok.clamp(min=1e-30).log()[:, ret[:, 1:].clamp(min=0)]  # [B, P, L-1]
    depth_idx = torch.arange(ret.shape[1] - 1, device=ret.device)
    likelihood = logp.masked_fill(depth_idx >= lengths[:, :, None], 0.0).sum(-1)  # [B, P]
    score = torch.where(lengths == lengths.max(-1, keepdim=True).values, likelihood, -math.inf)
    best = score.argmax(-1)
    node = ret[best, lengths.gather(1, best[:, None])[:, 0]]
    next_tok = sample(probs.gather(1, node[:, None, None].expand(-1, 1, probs.shape[-1]))[:, 0], generator)
    return make_result(tree, tokens, node, next_tok)


class Draws(Protocol):
    """The random decisions of the exact rules, injectable: tests integrate over them exactly (tests/lossless_exact.py)
    instead of sampling them. `TorchDraws` is the engine's."""

    def accept(self, num: torch.Tensor, den: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """[B] float, [B] float (>= 0), [B] bool -> [B] bool: active & (u * den < num) with u ~ U[0, 1) per row, i.e.
        True with probability min(1, num / den) where den > 0 (and iff num > 0 where den = 0)."""
        ...

    def pick(self, weights: torch.Tensor) -> torch.Tensor:
        """[B, V] non-negative weights (each row with positive sum) -> [B] ids drawn in proportion to them."""
        ...


@dataclass(frozen=True)
class TorchDraws:
    """Draws from torch's generator (the global one when None): one U[0, 1) per row per `accept` call, active or not,
    so a seed gives the same stream whatever the rows do."""

    generator: torch.Generator | None = None

    def accept(self, num: torch.Tensor, den: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        u = torch.rand(num.shape, generator=self.generator, device=num.device)
        return active & (u * den < num)

    def pick(self, weights: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(weights, 1, generator=self.generator)[:, 0]


def verify_rejection(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    tree: TreeBuffers,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    draws: Draws | None = None,
) -> VerifyResult:
    """Exact tree speculative sampling with deterministic drafts: the committed tokens are distributed exactly as
    sampling the target autoregressively with `params`.

    At a node with target distribution p, children x1, x2, ... (rank order) are tried in turn. A draft is a
    point mass q = 1{x}, so the acceptance test min(1, r(x)/q(x)) is "accept with probability r(x)", r starting as
    p; on rejection the residual norm(max(r - q, 0)) is r with x zeroed and renormalised, and the next sibling is
    tried against it. An accepted child becomes the current node; when no child is accepted (or at a leaf: the
    whole path was accepted) the next token is sampled from the current residual. A sibling repeating a rejected
    token has residual mass 0 and is never accepted, so duplicate drafts stay exact. This is `verify_speculative`'s
    walk with q the one-hot of each child (see `_walk`). `draws` (default: TorchDraws(generator)) makes the random
    decisions.
    """
    draws = draws if draws is not None else TorchDraws(generator)
    return _walk(tokens, target_probs(logits, params), None, tree, draws, replacement=True)


def verify_speculative(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    draft_probs: torch.Tensor,
    tree: TreeBuffers,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    replacement: bool = True,
    *,
    draws: Draws | None = None,
) -> VerifyResult:
    """Exact speculative sampling of sampled drafts: the committed tokens are distributed exactly as sampling the
    target autoregressively with `params`, whatever the draft distribution.

    draft_probs [B, K, V]: q at each node, the distribution its children were drawn from (independently, or without
    replacement when `replacement` is False). At a node, r starts as the target's p; children are tried in order:
    child x is accepted with probability min(1, r(x)/q(x)); on rejection r <- norm(max(0, r - q)) and, without
    replacement, q <- q with x removed, renormalised. An accepted child becomes the current node (r = p, q = its
    draft_probs row); otherwise, or at a leaf, the next token is sampled from r (the bonus token after a fully
    accepted path). A chain (one child per node) is Leviathan et al.'s Algorithm 1. A child with q(x) = 0 (a filler
    once q's support is exhausted) is never accepted and leaves r and q unchanged, as if it were not proposed.
    `draws` (default: TorchDraws(generator)) makes the random decisions.
    """
    draws = draws if draws is not None else TorchDraws(generator)
    return _walk(tokens, target_probs(logits, params), _at_least_fp32(draft_probs), tree, draws, replacement)


def _walk(
    tokens: torch.Tensor, probs: torch.Tensor, q_all: torch.Tensor | None, tree: TreeBuffers, draws: Draws,
    replacement: bool,
) -> VerifyResult:
    """The one tree walk of the exact sampling rules. probs [B, K, V]: the target's p at each node. q_all [B, K, V]:
    the draft distribution at each node, or None for deterministic drafts (q = the one-hot of each child's token).
    Vectorised over rows: the loop runs over tree depth and sibling slots only."""
    batch, rows = tokens.shape[0], torch.arange(tokens.shape[0], device=tokens.device)
    node = torch.zeros(batch, dtype=torch.long, device=tokens.device)  # current node per row
    walking = torch.ones(batch, dtype=torch.bool, device=tokens.device)
    residual = probs[:, 0].clone()  # [B, V] r, normalised
    q = None if q_all is None else q_all[:, 0].clone()  # [B, V]; None: one-hot drafts
    for _ in range(tree.max_depth):
        kids = tree.child_table[node]  # [B, C]
        moved = torch.zeros_like(walking)
        for j in range(kids.shape[1]):
            child = kids[:, j]
            trying = walking & ~moved & (child >= 0)
            x = tokens.gather(1, child.clamp(min=0)[:, None])  # [B, 1]
            r_x = residual.gather(1, x)[:, 0]
            q_x = torch.ones_like(r_x) if q is None else q.gather(1, x)[:, 0]
            # u < r(x) / q(x); a q(x) = 0 filler is never accepted
            take = draws.accept(r_x, q_x, trying & (q_x > 0))
            rejected = trying & ~take
            residual = torch.where(rejected[:, None], _after_rejection(residual, q, x), residual)
            if q is not None and not replacement:
                q = torch.where(rejected[:, None], _without(q, x), q)
            node = torch.where(take, child, node)
            residual = torch.where(take[:, None], probs[rows, child.clamp(min=0)], residual)
            if q is not None:
                q = torch.where(take[:, None], q_all[rows, child.clamp(min=0)], q)
            moved |= take
        walking &= moved
        if not bool(walking.any()):
            break
    # rounding can only empty a residual whose every remaining token had mass ~0; fall back to p at the node
    empty = ~(residual.sum(-1) > 0)
    residual = torch.where(empty[:, None], probs[rows, node], residual)
    return make_result(tree, tokens, node, draws.pick(residual))


def _after_rejection(residual: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """[B, V] r, [B, V] q (None: the one-hot of x [B, 1]) -> norm(max(0, r - q)), the law of the token given that x
    was rejected. r = q exactly (mass 0) cannot reject; the guard is for rounding."""
    leftover = residual.scatter(1, x, 0.0) if q is None else (residual - q).clamp(min=0)
    mass = leftover.sum(-1, keepdim=True)
    return torch.where(mass > 0, leftover / mass.clamp(min=1e-30), residual)


def _without(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[B, V] q with the token x [B, 1] removed and renormalised: the law of the next sibling drawn without
    replacement."""
    dropped = q.scatter(1, x, 0.0)
    return dropped / dropped.sum(-1, keepdim=True).clamp(min=1e-30)
