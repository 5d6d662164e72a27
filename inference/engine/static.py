"""A static KV cache and fixed step shapes: what a compiled target step needs (`DecodeConfig.static_cache`, implied by
`DecodeConfig.compile`).

Dimension letters: B batch, T prompt length, C cache capacity (slots), S committed slots, K tree nodes, W nodes run
(`bucket(K)`).

The growing cache (inference.engine.cache.SlotLayer) hands the model views of its first S slots, so every step has new
shapes: a compiled graph would recompile at every token, and CUDA graphs could not be captured at all. Here:
- **The cache** is one `StaticSlotLayer` per layer: transformers' StaticLayer, buffers [B, G, C, Dh] allocated once,
  new keys/values written at the layer's own device-side length (`cumulative_length`), every forward attending over
  all C slots. Slots past the committed ones hold stale or zero entries; the mask hides them. C is the prompt plus
  max_new_tokens plus TREE_SLOTS, rounded up to a multiple of CAPACITY_STEP so that requests of similar lengths share
  a shape; `cache_slots` fixes C for every request instead (one compiled shape per bucket and batch size; a request
  that does not fit is refused before decoding, `check_slots`). A batch whose rows accept very different numbers of
  drafts leaves holes and can still outgrow C: the buffers then grow (`ensure_capacity`: one copy, a new shape).
- **Trees run in buckets**: a tree of K nodes runs as W = bucket(K) nodes (BUCKETS, at most 1.5 K; trees past 64
  nodes as they are). The W - K padding nodes repeat the root's token at the root's position, see the committed
  slots and themselves, and nothing sees them: they change no real node's output. Logits, hidden states and features are cut
  back to the K real nodes, and cache surgery (`keep_nodes`) drops the padding with the rejected nodes.
- **Masks** are [B, 1, W, C] additive masks built from the host-side `valid` [B, S] (the loop's bookkeeping, as for
  the growing cache): data, not shape.
Surgery is the growing cache's (`keep_nodes`: gather the kept nodes into place, then `crop`, which for a static layer
moves its length back). The answers equal the growing cache's up to floating point (the attention sums over C slots,
the hidden ones contributing exact zeros); tests/test_static_cache.py checks greedy equality in fp32.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import StaticLayer

from inference.engine.cache import additive, prefill_visible, tree_visible
from inference.engine.tree import TreeBuffers

# Tree sizes a step runs as, each one compiled shape per batch size: never more than 1.5x the nodes (on a CPU every
# node costs; powers of two alone ran prompt lookup's 9-node chains as 16 nodes: 34.3 ms a step against 30.5 eager,
# SmolLM2 bf16 on a Zen 4). The default trees (16 nodes; 9 for prompt lookup's 8 drafts) are buckets themselves.
BUCKETS = (1, 2, 3, 4, 6, 9, 12, 16, 24, 32, 48, 64)
CAPACITY_STEP = 256  # cache capacities are multiples of this: prompts of similar lengths share a compiled shape


def bucket(nodes: int) -> int:
    """The nodes a step of `nodes` tree nodes runs as: the smallest bucket that holds it (itself past the last)."""
    return next((b for b in BUCKETS if b >= nodes), nodes)


def check_slots(slots: int | None, prompt: int, max_new_tokens: int, tree_slots: int, name: str = "cache_slots="
                ) -> None:
    """Refuse, in one line naming cache_slots as `name` spells it, a request that does not fit a fixed capacity: the
    prompt (padded batch width), max_new_tokens and a tree's slots."""
    need = prompt + max_new_tokens + tree_slots
    if slots is not None and need > slots:
        raise ValueError(f"{name}{slots}: {prompt} prompt token(s) + max_new_tokens={max_new_tokens} + "
                         f"{tree_slots} tree slots need {need}; at most {max(slots - prompt - tree_slots, 0)} new "
                         f"tokens fit")


def capacity_for(length: int) -> int:
    """Cache slots for `length` entries: rounded up to a multiple of CAPACITY_STEP."""
    return -(-length // CAPACITY_STEP) * CAPACITY_STEP


class StaticSlotLayer(StaticLayer):
    """transformers' StaticLayer (fixed buffers [B, G, C, Dh], writes at a device-side length, returns all C slots)
    that can grow: `grow` reallocates for more slots, keeping the entries (a new shape: a compiled step recompiles)."""

    def grow(self, capacity: int) -> None:
        if not self.is_initialized or capacity <= self.max_cache_len:
            self.max_cache_len = max(self.max_cache_len, capacity)
            return
        keys = self.keys.new_zeros(*self.keys.shape[:2], capacity, self.keys.shape[-1])
        values = self.values.new_zeros(*self.values.shape[:2], capacity, self.values.shape[-1])
        keys[:, :, : self.max_cache_len].copy_(self.keys)
        values[:, :, : self.max_cache_len].copy_(self.values)
        self.keys, self.values, self.max_cache_len = keys, values, capacity
        torch._dynamo.mark_static_address(self.keys)  # as StaticLayer does: CUDA graphs need fixed addresses
        torch._dynamo.mark_static_address(self.values)


def new_static_cache(capacity: int) -> DynamicCache:
    """An empty cache whose layers are StaticSlotLayers of `capacity` slots (built without the model config: the
    loop refuses lengths past a sliding window, see inference.engine.loop.check_window)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = partial(StaticSlotLayer, max_cache_len=capacity)
    return cache


def capacity(cache: DynamicCache) -> int:
    """The slots every layer of a static cache holds."""
    return cache.layers[0].max_cache_len if cache.layers else cache.layer_class_to_replicate.keywords["max_cache_len"]


def ensure_capacity(cache: DynamicCache, length: int) -> None:
    """Grow every layer to hold `length` slots when it holds fewer."""
    if length > capacity(cache):
        for layer in cache.layers:
            layer.grow(capacity_for(length))


def over_capacity(cache: DynamicCache, visible: torch.Tensor) -> torch.Tensor:
    """What Q new entries see of a static cache once written, [B, Q, S + Q] bool -> [B, Q, C]: the cache grown first
    when S + Q exceeds its capacity, its free slots hidden (a drafter's own static cache, as the loop's masks do)."""
    ensure_capacity(cache, visible.shape[-1])
    return torch.nn.functional.pad(visible, (0, capacity(cache) - visible.shape[-1]))


def prefill_mask(pad_mask: torch.Tensor, dtype: torch.dtype, slots: int) -> torch.Tensor:
    """[B, 1, T, C] causal mask over a static cache of C = `slots` for a left-padded prompt (pad_mask [B, T] True at
    real tokens); padded queries see only themselves so no softmax row is empty."""
    b, t = pad_mask.shape
    visible = torch.zeros(b, t, slots, dtype=torch.bool, device=pad_mask.device)
    visible[:, :, :t] = prefill_visible(pad_mask)
    return additive(visible[:, None], dtype)


def tree_inputs(
    tree: TreeBuffers, valid: torch.Tensor, next_pos: torch.Tensor, dtype: torch.dtype, slots: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask [B, 1, W, C] and position ids [B, W] for a tree of K nodes run as W = `width` nodes over a static cache
    of C = `slots` whose first S = valid.shape[1] slots are committed (`valid` [B, S]); the tree's keys land at
    slots S .. S+W-1. Node i < K sees the valid slots, its ancestors and itself (as
    inference.engine.cache.tree_inputs); a padding node sees the valid slots and itself, at the root's position."""
    b, s = valid.shape
    k = tree.num_nodes
    visible = torch.zeros(b, width, slots, dtype=torch.bool, device=valid.device)
    visible[:, :k, : s + k] = tree_visible(tree, valid)
    pad = torch.arange(k, width, device=valid.device)
    visible[:, k:, :s] = valid[:, None, :]
    visible[:, pad, s + pad] = True
    depth = torch.cat([tree.depth, tree.depth.new_zeros(width - k)])  # [W]
    return additive(visible[:, None], dtype), next_pos[:, None] + depth[None, :]


def pad_tokens(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """[B, K] drafted tokens -> [B, W]: the padding nodes repeat the root's token."""
    return torch.cat([tokens, tokens[:, :1].expand(-1, width - tokens.shape[1])], dim=1)


def tree_slots(cache: Any, nodes: int) -> int:
    """The slots a tree forward of `nodes` nodes appends: its bucket over a static cache, else the nodes."""
    return bucket(nodes) if static_layers(cache) else nodes


def static_layers(cache: Any) -> bool:
    """Whether `cache` is a static cache (its layers StaticSlotLayers, made or to be made)."""
    factory = getattr(cache, "layer_class_to_replicate", None)
    return getattr(factory, "func", None) is StaticSlotLayer
