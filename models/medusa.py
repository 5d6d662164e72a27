"""Medusa heads (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads").

Dimension letters: B batch, T time, K heads, D hidden, V vocab, S draft vocabulary.

Draft vocabulary (optional, `draft_vocab_size=S`; the idea of EAGLE-3's draft vocabulary and FR-Spec): the heads
predict over S token ids `vocab_ids` (the S most frequent training labels) instead of all V, with a map back to full
ids. On a real vocabulary (V = 32k-150k) the V x D projections cost more than the model itself; S = 4-8k keeps most
of the mass. Head logits are then [..., S]; `draft_targets` maps full-id targets into that space.

Offset convention (the only place it is stated): the base model's lm_head at position t predicts token t+1;
Medusa head k (1-based) at position t predicts token t+k+1. `head_targets` turns this into tensor shifts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    share_lm_head: bool = False  # "Medusa v2" layout: every head reuses the frozen base lm_head
    draft_vocab_size: int | None = None  # S: heads predict over S ids (MedusaHeads.vocab_ids); None: all V

    def __post_init__(self) -> None:
        for key in ("num_heads", "num_layers", "hidden_size", "vocab_size"):
            if getattr(self, key) < (0 if key == "num_layers" else 1):
                raise ValueError(f"MedusaConfig.{key} must be positive, got {getattr(self, key)}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"MedusaConfig.draft_vocab_size must be in [1, vocab_size={self.vocab_size}], "
                             f"got {self.draft_vocab_size}")

    @property
    def out_size(self) -> int:
        """Width of the heads' logits: S with a draft vocabulary, else V."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size


class ResBlock(nn.Module):
    """h + SiLU(W h + b). W starts at zero so a fresh block is the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHead(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        # A comprehension, not `[ResBlock(d)] * n`: every block owns its weights.
        self.blocks = nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)])
        self.lm_head = None if config.share_lm_head else nn.Linear(config.hidden_size, config.out_size, bias=False)


class MedusaHeads(nn.Module):
    """K heads over the base model's final (post-norm) hidden states."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList([MedusaHead(config) for _ in range(config.num_heads)])
        if config.draft_vocab_size is not None:  # set by set_draft_vocab (training) or the checkpoint (loading)
            self.register_buffer("vocab_ids", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        else:
            self.vocab_ids = None  # [S] draft index -> full token id

    @torch.no_grad()
    def set_draft_vocab(self, vocab_ids: torch.Tensor) -> None:
        """Fix the S full token ids the heads predict over (distinct, in [0, V)); index i of the logits is
        vocab_ids[i]."""
        ids = torch.as_tensor(vocab_ids, dtype=torch.long).flatten()
        if self.config.draft_vocab_size is None:
            raise ValueError("set_draft_vocab: these heads have no draft vocabulary (draft_vocab_size=None)")
        check_vocab_ids(ids, self.config.draft_vocab_size, self.config.vocab_size, "set_draft_vocab")
        self.vocab_ids.copy_(ids)

    def draft_targets(self, targets: torch.Tensor, missing: int = -100) -> torch.Tensor:
        """Full-id targets (-100 = untrained) -> indices into the heads' logits. A target outside the draft
        vocabulary becomes `missing`: -100 drops it from a loss, S counts it as a miss in accuracy. Identity
        without a draft vocabulary."""
        if self.vocab_ids is None:
            return targets
        lookup = torch.full((self.config.vocab_size,), missing, dtype=torch.long, device=targets.device)
        lookup[self.vocab_ids.to(targets.device)] = torch.arange(len(self.vocab_ids), device=targets.device)
        return torch.where(targets == -100, targets, lookup[targets.clamp(min=0)])

    @torch.no_grad()
    def init_from_base(self, base_lm_head: nn.Module) -> None:
        """Copy the base lm_head (its draft-vocabulary rows) into every head's projection, so each head starts as
        the base prediction."""
        weight = base_lm_head.weight
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"base lm_head has shape {tuple(weight.shape)}, heads expect "
                f"(vocab_size={self.config.vocab_size}, hidden_size={self.config.hidden_size})"
            )
        if self.vocab_ids is not None:
            weight = weight.index_select(0, self.vocab_ids.to(weight.device))  # [S, D]
        for head in self.heads:
            if head.lm_head is not None:
                head.lm_head.weight.copy_(weight.to(head.lm_head.weight.dtype))

    def head_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [K, ..., D]: each head's residual blocks, before the vocab projection."""
        return torch.stack([head.blocks(hidden) for head in self.heads])

    def project(self, head_hidden: torch.Tensor, base_lm_head: nn.Module | None = None) -> torch.Tensor:
        """[K, ..., D] -> [K, ..., V] (or [K, ..., S] with a draft vocabulary)."""
        if self.config.share_lm_head:
            return self._shared_projection(head_hidden, base_lm_head)
        return torch.stack([head.lm_head(h) for head, h in zip(self.heads, head_hidden)])

    def forward(self, hidden: torch.Tensor, base_lm_head: nn.Module | None = None) -> torch.Tensor:
        """hidden [B, T, D] -> logits [K, B, T, V|S]."""
        return self.project(self.head_hidden(hidden), base_lm_head)

    def head_logits(self, k: int, hidden: torch.Tensor, base_lm_head: nn.Module | None = None) -> torch.Tensor:
        """Logits of head k (0-based index into `heads`): [..., D] -> [..., V|S]. Lets training free one head's
        logits before computing the next."""
        head = self.heads[k]
        h = head.blocks(hidden)
        if head.lm_head is None:
            return self._shared_projection(h, base_lm_head)
        return head.lm_head(h)

    def base_logits(self, hidden: torch.Tensor, base_lm_head: nn.Module) -> torch.Tensor:
        """The base lm_head's logits over the heads' vocabulary: [..., D] -> [..., V|S] (the target's own next-token
        logits, columns as in head_logits)."""
        return self._shared_projection(hidden, base_lm_head)

    def _shared_projection(self, h: torch.Tensor, base_lm_head: nn.Module | None) -> torch.Tensor:
        """[..., D] through the base lm_head: all V rows, or only the draft vocabulary's S rows."""
        if base_lm_head is None:
            raise ValueError("these heads share the base lm_head (share_lm_head=True); pass base_lm_head")
        h = _as_input_of(base_lm_head, h)
        if self.vocab_ids is None:
            return base_lm_head(h)
        weight = base_lm_head.weight
        # offloaded, quantized or ZeRO-3-partitioned (`ds_id`: its module's hooks gather it): full V, then select
        if weight.device.type == "meta" or not weight.is_floating_point() or hasattr(weight, "ds_id"):
            return base_lm_head(h).index_select(-1, self.vocab_ids.to(h.device))
        return F.linear(h, weight.index_select(0, self.vocab_ids.to(weight.device)))  # [..., S]


def _as_input_of(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x` in the dtype of `module`'s floating-point weight: fp32 heads trained on a bf16 backbone feed its shared
    lm_head in bf16 (the cast is differentiable). Quantized or offloaded (meta) weights take the input as it is."""
    weight = getattr(module, "weight", None)
    if weight is None or not weight.is_floating_point() or weight.device.type == "meta" or weight.dtype == x.dtype:
        return x
    return x.to(weight.dtype)


def head_targets(labels: torch.Tensor, k: int) -> torch.Tensor:
    """Targets aligned with head k (1-based) logits.

    labels [B, T] are unshifted token ids (-100 where not trained), as in HF causal-LM labels. Head k at position t
    predicts token t+k+1, so the returned [B, T] tensor holds labels[:, t+k+1] and -100 for the last k+1 positions.
    """
    shift = k + 1
    out = torch.full_like(labels, -100)
    if shift < labels.shape[1]:
        out[:, :-shift] = labels[:, shift:]
    return out


def check_vocab_ids(ids: torch.Tensor, size: int, vocab_size: int, where: str = "draft vocabulary",
                    error: type[ValueError] = ValueError) -> None:
    """`error` (one line starting with `where`) unless `ids` [S] are `size` distinct integer token ids in
    [0, vocab_size): the one check of a draft vocabulary (Medusa heads' vocab_ids, EAGLE-3's d2t), at training and
    at load, so a bad list fails here instead of inside an embedding or index_select."""
    if ids.dim() != 1 or ids.numel() != size:
        raise error(f"{where}: expected {size} ids (draft_vocab_size={size}), got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise error(f"{where}: expected integer token ids, got {str(ids.dtype).removeprefix('torch.')}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise error(f"{where}: ids must lie in [0, {vocab_size}) (the target's vocabulary), got [{low}, {high}]")
    values, counts = ids.unique(return_counts=True)
    if bool((counts > 1).any()):
        repeated = values[counts > 1]
        raise error(f"{where}: duplicate ids ({repeated.numel()} repeated, first {int(repeated[0])})")
