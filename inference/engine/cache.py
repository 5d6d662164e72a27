"""Tree attention inputs, the KV cache, and its surgery; the cache is a stock transformers DynamicCache whose layers
write into preallocated slots.

Dimension letters: B batch, S cached slots, T prompt length, K tree nodes, N kept nodes (1 + accepted drafts).

Conventions:
- `valid` [B, S] bool marks which cache slots hold real tokens. Left padding and the slots of rows that accepted
  fewer drafts than the longest row in a batched step are holes: never attended to again.
- Masks are ADDITIVE float masks in the model dtype (0 visible, finfo.min hidden): a bool 4-D mask is right under
  sdpa but silently wrong under eager attention. Shapes are [B, 1, Q, S + Q], which every stock decoder accepts.
- Position ids are explicit: a token's position is the number of real tokens before it in its row.

Surgery: after a tree forward the cache holds S + K slots. `keep_nodes` copies the N accepted nodes' keys/values
into slots S .. S+N-1 (a gather of N entries per layer) and crops the rest with `DynamicCache.crop`. Chosen by
per-step cost against `index_select` of the whole sequence: 12 layers x 12 heads x 64 dims bf16, N = 4 of K = 16,
in-place gather + crop ~1.1 ms at any S, whole-sequence index_select 2.2 / 12 / 31 ms at S = 256 / 1024 / 2048.
A chain-shaped accepted path (nodes 0..N-1, e.g. a chain tree) needs only the crop (~0.2 ms). Under `device_map`
every layer's keys/values stay on that layer's device; the gather index is copied to each device once per step.

Slots: a stock DynamicLayer appends by `torch.cat`, which copies the layer's whole cache every forward: noise for one
short row, but it grows with B x S. `SlotLayer` keeps a buffer of `capacity` slots per layer and hands the model views
of its first S slots: an update copies only the new keys/values, `crop` shortens the view, `keep_nodes` writes through
it. The first buffer holds the first forward plus up to FIRST_SLOTS more; a full buffer grows to twice its size (one
copy, amortised), never past the bound the caller gives (`new_cache(reserve)`: the most slots ever added after the
first forward; the loop's is max_new_tokens plus a tree's width) unless the cache outgrows it. So a short generation
reserves little, a long one copies its cache a few times, and a buffer holds at most twice its entries plus
FIRST_SLOTS.
SmolLM2-135M, fp32, 2 CPU cores (AMD EPYC, AVX2), a plain decode step (`scripts/bench_kv_cache.py`): 1 x 256 cached
tokens 58.6 ms against 59.1 stock, 32 x 256 185 against 221 (1.20x), 32 x 1024 306 against 414 (1.35x), 4 x 2048 135
against 165 (1.22x).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from inference.engine.tree import TreeBuffers


FIRST_SLOTS = 256  # free slots a layer's first buffer keeps after its first forward (at most `reserve`)


class SlotLayer(DynamicLayer):
    """A DynamicLayer whose keys/values [B, G, S, Dh] are views of the first S slots of a buffer [B, G, capacity, Dh]:
    `update` writes the new entries in place instead of concatenating. Everything else (crop, get_seq_length, the
    masks' sizes) is DynamicLayer's, reading the views. `reserve`: the most slots added after the first forward
    (None: unknown), which bounds the buffer's growth."""

    def __init__(self, reserve: int | None = None) -> None:
        super().__init__()
        self.reserve = reserve
        self.limit: int | None = None  # the first forward's length + reserve, set by the first update
        self._keys: torch.Tensor | None = None  # the buffers
        self._values: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.limit = None if self.reserve is None else key_states.shape[-2] + self.reserve
        s, n = self.get_seq_length(), key_states.shape[-2]
        if not self._holds(key_states, s + n):
            self._grow(key_states, value_states, s, self.capacity(s + n))
        self._keys[:, :, s : s + n].copy_(key_states)
        self._values[:, :, s : s + n].copy_(value_states)
        self.keys, self.values = self._keys[:, :, : s + n], self._values[:, :, : s + n]
        return self.keys, self.values

    def capacity(self, length: int) -> int:
        """Slots of the next buffer for `length` entries: the first forward's plus FIRST_SLOTS, else twice the
        current buffer; at most `limit` while `length` is within it."""
        old = 0 if self._keys is None else self._keys.shape[2]
        grown = length + FIRST_SLOTS if old == 0 else 2 * old
        if self.limit is not None and length <= self.limit:
            grown = min(grown, self.limit)
        return max(length, grown)

    def _holds(self, new: torch.Tensor, length: int) -> bool:
        """The buffer exists, still backs `keys` (nothing replaced them, e.g. a batch reorder), matches the new
        entries' rows and heads, and has `length` slots."""
        if self._keys is None or self._keys.shape[:2] != new.shape[:2] or length > self._keys.shape[2]:
            return False
        return self.keys.numel() == 0 or self.keys.data_ptr() == self._keys.data_ptr()

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, s: int, capacity: int) -> None:
        """New buffers of `capacity` slots holding the S cached entries."""
        b, g, _, dk = key_states.shape
        keys = key_states.new_empty(b, g, capacity, dk)
        values = value_states.new_empty(b, value_states.shape[1], capacity, value_states.shape[-1])
        if s:
            keys[:, :, :s].copy_(self.keys)
            values[:, :, :s].copy_(self.values)
        self._keys, self._values = keys, values

    def reset(self) -> None:
        self._keys = self._values = None
        self.limit = None
        super().reset()


def new_cache(reserve: int | None = None, slots: bool = True) -> DynamicCache:
    """An empty full-attention cache whose layers write into preallocated slots (`SlotLayer`; `reserve`: the most
    slots added after the first forward, None when unknown); slots=False: stock DynamicLayers (concatenation). Built
    without the model config on purpose: sliding-window layers would drop slots and break the slot indexing used here
    (callers reject sequences longer than a model's window)."""
    cache = DynamicCache()
    if slots:
        cache.layer_class_to_replicate = partial(SlotLayer, reserve=reserve)
    return cache


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask -> additive float mask (0 where visible, finfo(dtype).min elsewhere)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)


def prefill_inputs(pad_mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Mask [B, 1, T, T] (or None when nothing is padded) and position ids [B, T] for a left-padded prompt.
    pad_mask [B, T] is True at real tokens. Padded queries see only themselves so no softmax row is empty."""
    positions = (pad_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
    if bool(pad_mask.all()):
        return None, positions
    return additive(prefill_visible(pad_mask)[:, None], dtype), positions


def prefill_visible(pad_mask: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool: causal over a left-padded prompt (pad_mask [B, T]); padded queries see only themselves."""
    t = pad_mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=pad_mask.device).tril()
    visible = causal[None] & pad_mask[:, None, :]  # [B, T, T]
    return visible | torch.eye(t, dtype=torch.bool, device=pad_mask.device)[None]


def tree_inputs(
    tree: TreeBuffers, valid: torch.Tensor, next_pos: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Mask [B, 1, K, S + K] and position ids [B, K] for one tree forward.

    Node i sees every valid cached slot, its ancestors and itself; its position is the root's position plus its
    depth. The mask is None when it would hide nothing (a single node over a hole-free cache)."""
    positions = next_pos[:, None] + tree.depth[None, :]  # [B, K]
    if tree.num_nodes == 1 and bool(valid.all()):
        return None, positions
    return additive(tree_visible(tree, valid)[:, None], dtype), positions


def tree_visible(tree: TreeBuffers, valid: torch.Tensor) -> torch.Tensor:
    """[B, K, S + K] bool: node i sees every valid cached slot (`valid` [B, S]), its ancestors and itself."""
    b, k = valid.shape[0], tree.num_nodes
    return torch.cat([valid[:, None, :].expand(b, k, -1), tree.attn[None].expand(b, k, k)], dim=-1)


def keep_nodes(cache: DynamicCache, start: int, keep: torch.Tensor, tree_len: int | None = None) -> None:
    """Keep tree nodes `keep` [B, N] (node ids; entries past a row's accepted path may name any node, their slots
    become holes) at slots start .. start+N-1 and drop the other tree slots. Slots before `start` are untouched.
    `tree_len`: the slots the tree appended (default: the cache's length past `start`; a static cache, whose length
    lives on the device, passes it)."""
    b, n = keep.shape
    tree_len = cache.get_seq_length() - start if tree_len is None else tree_len
    in_place = list(range(n))
    if any(row != in_place for row in keep.tolist()):  # on the host: [B, N] is tiny, a kernel costs more
        on_device = _per_device(keep)
        for layer in cache.layers:
            for kv in (layer.keys, layer.values):  # [B, H, S + K, Dh]; each layer on its own device under device_map
                here = on_device(kv.device)
                if b == 1:
                    picked = kv.index_select(2, here[0] + start)
                else:
                    index = here[:, None, :, None].expand(b, kv.shape[1], n, kv.shape[3])
                    picked = kv.narrow(2, start, tree_len).gather(2, index)  # [B, H, N, Dh]
                kv.narrow(2, start, n).copy_(picked)  # `picked` is a copy, so overlapping slots are safe
    if tree_len > n:
        cache.crop(-(tree_len - n))


def _per_device(index: torch.Tensor) -> Callable[[torch.device], torch.Tensor]:
    """`index` on a given device, copied once per device (a target split by device_map keeps each layer's cache on
    that layer's device)."""
    copies = {index.device: index}

    def on(device: torch.device) -> torch.Tensor:
        if device not in copies:
            copies[device] = index.to(device)
        return copies[device]

    return on


def commit_slots(valid: torch.Tensor, num_accepted: torch.Tensor, width: int) -> torch.Tensor:
    """Append `width` slots to `valid` [B, S]: row b's first 1 + num_accepted[b] new slots are real, the rest holes."""
    new = torch.arange(width, device=valid.device)[None, :] <= num_accepted[:, None]  # [B, N]
    return torch.cat([valid, new], dim=1)
