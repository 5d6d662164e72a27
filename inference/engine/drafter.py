"""The drafter protocol: what proposes the tree of candidate tokens the target verifies each step.

Dimension letters: B batch, S cached slots, K tree nodes, V vocab, D hidden.

A drafter implements the `Drafter` protocol: `propose(state)` returns a `Draft` (a tree and the token at each node,
the root being `state.root`), and `update(state, draft, result)` lets it advance its own state after the target
accepted a path. The drafters (inference.drafters: Medusa, Jacobi, draft model, lookahead, ...) plug into
`inference.engine.loop.generate` unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from inference.engine.tree import TreeBuffers, root_only_tree
from inference.engine.verify import SamplingParams, VerifyResult


@dataclass(frozen=True, eq=False)
class Draft:
    tree: TreeBuffers
    tokens: torch.Tensor  # [B, K] token at each node; tokens[:, 0] is the root (state.root)
    # [B, K, V] q at each node: the distribution the node's children were SAMPLED from (same indexing as the
    # target logits; leaf rows unused). None: deterministic drafts, verified with the one-hot rule.
    probs: torch.Tensor | None = None
    replacement: bool = True  # sampled siblings were drawn i.i.d. from q (True) or without replacement (False)
    # [B, K] the drafter's estimate that the target accepts each node's path (root 1.0): the draft's probability of the
    # path (EAGLE-3; Medusa's heads, multiplied). None: the drafter does not score its nodes. Only a merge that ranks
    # nodes reads it (WithLookup's budget)
    scores: torch.Tensor | None = None


@dataclass(eq=False)
class DecodeState:
    """What the loop carries between steps; `inference.engine.loop.accept` advances it in place after each step."""

    cache: DynamicCache  # keys/values of every committed token except `root`
    valid: torch.Tensor  # [B, S] bool: which cache slots are real tokens (see inference.engine.cache)
    next_pos: torch.Tensor  # [B] position id of `root`
    root: torch.Tensor  # [B] the last committed token, not yet in the cache: the root of the next tree
    hidden: torch.Tensor | None  # [B, D] final-norm hidden state whose logits produced `root` (when requested)
    prompt: torch.Tensor  # [B, T] prompt ids, left-padded
    generated: list[list[int]]  # committed tokens per row, `root` included, before stop trimming
    logits: torch.Tensor | None = None  # [B, K, V] target logits of the last tree forward (None before the first)
    sampling: SamplingParams = SamplingParams()  # how the target samples; sampling drafters process logits alike
    generator: torch.Generator | None = None  # the run's random source, shared by drafters that sample
    drafter_state: Any = None  # a drafter's own per-run state (e.g. a draft model's KV cache); None before its first propose
    # [B, T | K, L*D] the hidden states a feature drafter reads (`feature_layers`), concatenated, at every position of
    # the last target forward: the prompt after prefill, then every tree node of the step; None for other drafters
    features: torch.Tensor | None = None
    compile_drafter: bool = False  # a drafter's network runs compiled (DecodeConfig.compile, compile_drafter)


class Drafter(Protocol):
    """Optionally also `feature_layers: tuple[int, ...]`: target hidden_states indices the loop keeps in
    `state.features` (a feature drafter, EAGLE-3); absent means none. And optionally `finish(sequences)`: called once
    a generation has ended, with every row's answer (stop conditions applied), for a drafter that learns from what the
    target said (a datastore that grows while serving); it must not change the drafts of a generation under way."""

    needs_hidden: bool  # whether `state.hidden` must be filled (costs nothing extra: the forward computes it)

    def propose(self, state: DecodeState) -> Draft: ...

    def update(self, state: DecodeState, draft: Draft, result: VerifyResult) -> None: ...


class NoDrafter:
    """Autoregressive baseline through the same loop: a root-only tree, one target token per forward."""

    needs_hidden = False

    def __init__(self) -> None:
        self._tree: TreeBuffers | None = None

    def propose(self, state: DecodeState) -> Draft:
        if self._tree is None or self._tree.depth.device != state.root.device:
            self._tree = root_only_tree(state.root.device)
        return Draft(tree=self._tree, tokens=state.root[:, None])

    def update(self, state: DecodeState, draft: Draft, result: VerifyResult) -> None:
        """Stateless: nothing to advance."""
