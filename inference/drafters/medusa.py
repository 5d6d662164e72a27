"""Medusa drafting: heads on the last accepted hidden state propose a static tree (Cai et al. 2024).

Dimension letters: B batch, S cached slots, T prompt length, K tree nodes, H heads, R top-k ranks, V vocab,
D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from inference.engine.drafter import DecodeState, Draft
from inference.engine.tree import TreeBuffers, TreeError
from inference.engine.verify import VerifyResult
from models.medusa import MedusaHeads


class MedusaDrafter:
    """Medusa heads (Cai et al. 2024) on a static tree.

    Per step the heads run at ONE position, the last accepted one (the hidden state whose logits gave the root),
    and only the heads the tree reaches: H x (residual blocks + D x V projection) on a [B, D] input, then top-R per
    head. Node tokens are then gathered from the [B, H * R] candidate table; nothing scales with K x V. The
    projections dominate (H weight reads of D x V, about the target's own per-token cost for a small model);
    shared-lm_head heads project in one call so that weight is read once.
    """

    needs_hidden = True

    def __init__(self, heads: MedusaHeads, tree: TreeBuffers, base_lm_head: nn.Module | None = None,
                 vocab: torch.Tensor | None = None) -> None:
        """`vocab` [S] (optional): the only token ids the heads may propose, e.g. the S most frequent in their
        training data (checkpoint token_counts): the projections then read S of the V columns. Lossless: the target
        verifies as before; a token outside the shortlist is simply never drafted."""
        if tree.max_depth > len(heads.heads):
            raise ValueError(f"tree depth {tree.max_depth} exceeds the drafter's {len(heads.heads)} heads")
        if tree.topk > heads.config.out_size:  # topk over the vocabulary would fail at the first step
            which = "vocabulary" if heads.vocab_ids is None else "heads' draft vocabulary"
            raise TreeError(f"tree uses top-{tree.topk} candidates per head, but the {which} has only "
                            f"{heads.config.out_size} tokens")
        if heads.config.share_lm_head and base_lm_head is None:
            raise ValueError("these Medusa heads share the base lm_head (shared_lm_head format); pass base_lm_head")
        if vocab is not None and heads.vocab_ids is not None:
            raise ValueError(f"head vocabulary: these heads were trained with a draft vocabulary of "
                             f"{heads.config.draft_vocab_size} tokens; a serving shortlist does not apply")
        if vocab is not None:
            vocab = torch.as_tensor(vocab, dtype=torch.long).flatten()
            if not tree.topk <= len(vocab) <= heads.config.vocab_size or len(vocab.unique()) != len(vocab):
                raise ValueError(f"head vocabulary: {len(vocab)} ids (distinct?) for top-{tree.topk} trees over a "
                                 f"vocabulary of {heads.config.vocab_size}; need top-k <= S <= V, distinct ids")
            if int(vocab.min()) < 0 or int(vocab.max()) >= heads.config.vocab_size:
                raise ValueError(f"head vocabulary: ids must lie in [0, {heads.config.vocab_size})")
        self.heads = heads
        self.tree = tree
        self.base_lm_head = base_lm_head
        # [S] or None: the ids the heads' logit columns stand for. A trained draft vocabulary's own projections
        # already have S columns; a serving shortlist selects S of their V columns (`select_columns`).
        self.select_columns = vocab is not None
        self.vocab = heads.vocab_ids if heads.vocab_ids is not None else vocab
        self.stacked = StackedHeads.build(heads, tree.max_depth, vocab)  # None: per-head calls
        self._vocab_copies: dict[torch.device, torch.Tensor] = {}  # `vocab` on each device it was needed on
        self._rows: tuple[int, torch.Tensor] | None = None  # (shared lm_head data_ptr, its shortlisted rows [S, D])

    def candidates(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, D] -> top-R token ids of each head the tree uses, [B, H * R] head-major, on the heads' device
        (the lm_head's, for a target split by device_map; the hidden state is moved there)."""
        return self.scored_candidates(hidden)[0]

    def scored_candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`candidates` and each one's log-probability under its head (over the heads' vocabulary or shortlist),
        [B, H * R] float32."""
        param = next(self.heads.parameters(), None)  # absent for shared-lm_head heads without residual blocks
        h = hidden if param is None else hidden.to(param.device, param.dtype)
        used = self.heads.heads[: self.tree.max_depth]
        stacked = self._current_stack()
        head_h = stacked.blocks_forward(h) if stacked else torch.stack([head.blocks(h) for head in used])  # [H, B, D]
        if self.heads.config.share_lm_head:  # one call: the shared D x V weight is read once for all heads
            weight = self.base_lm_head.weight  # on "meta" when offloaded: its accelerate hook moves the input itself
            device = head_h.device if weight.device.type == "meta" else weight.device
            if self.vocab is not None and weight.device.type != "meta":
                logits = F.linear(head_h.to(device, weight.dtype), self._shortlisted_rows(weight))  # [H, B, S]
            else:
                logits = self.base_lm_head(head_h.to(device, weight.dtype))  # [H, B, V]
                if self.vocab is not None:
                    logits = logits.index_select(-1, self._vocab_on(logits.device))  # [H, B, S]
        elif stacked:  # one batched matmul over the heads' D x V (or D x S) weights
            logits = torch.bmm(head_h, stacked.projection)  # [H, B, D] x [H, D, V|S] -> [H, B, V|S]
        else:
            logits = torch.stack([head.lm_head(x) for head, x in zip(used, head_h)])  # [H, B, V|S]
            if self.select_columns:
                logits = logits.index_select(-1, self._vocab_on(logits.device))  # [H, B, S]
        top = logits.topk(self.tree.topk, dim=-1).indices  # [H, B, R], positions in V or in the shortlist
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, top)  # [H, B, R]
        if self.vocab is not None:
            top = self._vocab_on(top.device)[top]  # shortlist positions -> token ids
        b = hidden.shape[0]
        return top.permute(1, 0, 2).reshape(b, -1), logp.permute(1, 0, 2).reshape(b, -1)

    def _vocab_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._vocab_copies:
            self._vocab_copies[device] = self.vocab.to(device)
        return self._vocab_copies[device]

    def _shortlisted_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """The shared lm_head's rows for the shortlist, [S, D], copied once (re-taken if the weight moved)."""
        if self._rows is None or self._rows[0] != weight.data_ptr():
            self._rows = (weight.data_ptr(), weight.detach().index_select(0, self._vocab_on(weight.device)))
        return self._rows[1]

    def _current_stack(self) -> StackedHeads | None:
        """The stacks, re-built if the heads were moved or cast after this drafter was built (their parameters are
        then no longer views of the stacks)."""
        if self.stacked is not None and not self.stacked.is_current(self.heads):
            self.stacked = StackedHeads.build(self.heads, self.tree.max_depth,
                                              self.vocab if self.select_columns else None)
        return self.stacked

    def propose(self, state: DecodeState) -> Draft:
        if state.hidden is None:
            raise ValueError("MedusaDrafter needs state.hidden (the loop fills it when needs_hidden is True)")
        if self.tree.num_nodes == 1:
            return Draft(tree=self.tree, tokens=state.root[:, None])
        table, logp = self.scored_candidates(state.hidden)  # [B, H * R] each
        tokens = torch.cat([state.root[:, None], table.to(state.root.device)[:, self.tree.candidate_index]], dim=1)
        return Draft(tree=self.tree, tokens=tokens, scores=self.path_scores(logp.to(state.root.device)))

    def path_scores(self, logp: torch.Tensor) -> torch.Tensor:
        """[B, H * R] log-probabilities of the heads' candidates -> [B, K] each node's path probability: the product of
        its heads' probabilities along the path (the heads guess each position alone, so a rough estimate)."""
        node = torch.cat([logp.new_zeros(logp.shape[0], 1), logp[:, self.tree.candidate_index]], dim=1)  # [B, K]
        path = self.tree.node_path.clamp(min=0)  # [K, L]; padding -> the root, whose log-probability is 0
        return node[:, path].sum(-1).exp()

    def update(self, state: DecodeState, draft: Draft, result: VerifyResult) -> None:
        """Stateless between steps: the heads read only `state.hidden`, which the loop refreshes."""


@dataclass(eq=False)
class StackedHeads:
    """The first H heads' parameters stacked so that drafting runs one batched matmul per residual layer and one for
    the vocabulary projections instead of H of each: on a small target the H weight reads and call overheads cost
    about as much as its own forward. Layouts are what a [H, B, D] x [H, D, N] bmm reads fastest on CPU (measured:
    1.1 ms for 5 projections of 256 x 4096 against 1.9 ms for the transposed view of a [H, V, D] stack). No extra
    memory: each head's parameters become views into the stacks, so training code, state_dict and the checkpoint
    see the same tensors."""

    weights: list[torch.Tensor]  # per residual layer: [H, D, D], head k's linear.weight transposed
    biases: list[torch.Tensor]  # per residual layer: [H, 1, D]
    projection: torch.Tensor | None  # [H, D, V], head k's lm_head.weight transposed; None for shared-lm_head heads
    first: int  # data_ptr of head 0's first stacked parameter: changes when the heads are moved or cast

    @staticmethod
    def build(heads: MedusaHeads, depth: int, vocab: torch.Tensor | None = None) -> StackedHeads | None:
        """None when fewer than 2 heads are used, or their parameters differ in device or dtype, or are offloaded
        (meta): the per-head path handles those. With `vocab` [S], `projection` is a contiguous [H, D, S] copy of
        the shortlisted columns (the heads' own parameters keep the full V)."""
        used = heads.heads[:depth]
        params = [p for head in used for p in head.parameters()]
        if len(used) < 2 or not params:
            return None
        ref = params[0]
        if ref.device.type == "meta" or any((p.device, p.dtype) != (ref.device, ref.dtype) for p in params):
            return None
        weights, biases = [], []
        for layer in range(heads.config.num_layers):
            linears = [head.blocks[layer].linear for head in used]
            weights.append(_stack_views(linears, "weight", lambda w: w.t(), lambda s: s.t()))  # [H, D, D]
            biases.append(_stack_views(linears, "bias", lambda b: b[None], lambda s: s[0]))  # [H, 1, D]
        projection = None
        if not heads.config.share_lm_head:
            projection = _stack_views([head.lm_head for head in used], "weight", lambda w: w.t(), lambda s: s.t())
            if vocab is not None:
                projection = projection.index_select(2, vocab.to(projection.device)).contiguous()  # [H, D, S]
        first = (weights[0] if weights else used[0].lm_head.weight).data_ptr()
        return StackedHeads(weights, biases, projection, first)

    def is_current(self, heads: MedusaHeads) -> bool:
        head = heads.heads[0]
        param = head.blocks[0].linear.weight if len(head.blocks) else head.lm_head.weight
        return param.data_ptr() == self.first

    def blocks_forward(self, h: torch.Tensor) -> torch.Tensor:
        """[B, D] -> [H, B, D]: every head's residual blocks h + SiLU(W h + b), all heads per bmm."""
        out = h[None].expand(len(self.biases[0]) if self.biases else self.projection.shape[0], -1, -1)
        for weight, bias in zip(self.weights, self.biases):
            out = out + F.silu(torch.baddbmm(bias, out, weight))  # [H, B, D]
        return out


def _stack_views(modules: list[nn.Module], name: str, into: Callable, back: Callable) -> torch.Tensor:
    """Stack `into(module.<name>)` over the modules (a copy), then make each module's parameter `back(slice)`: a
    view into the stack with its original shape."""
    params = [getattr(m, name) for m in modules]
    with torch.no_grad():
        stacked = torch.stack([into(p.detach()) for p in params])
    for k, (module, param) in enumerate(zip(modules, params)):
        setattr(module, name, nn.Parameter(back(stacked[k]), requires_grad=param.requires_grad))
    return stacked
