"""Tree attention inputs and KV-cache surgery on a stock transformers DynamicCache.

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
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import DynamicCache

from inference.engine.tree import TreeBuffers


def new_cache() -> DynamicCache:
    """An empty full-attention cache. Built without the model config on purpose: sliding-window layers would drop
    slots and break the slot indexing used here (callers reject sequences longer than a model's window)."""
    return DynamicCache()


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
    t = pad_mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=pad_mask.device).tril()
    visible = causal[None] & pad_mask[:, None, :]  # [B, T, T]
    visible |= torch.eye(t, dtype=torch.bool, device=pad_mask.device)[None]
    return additive(visible[:, None], dtype), positions


def tree_inputs(
    tree: TreeBuffers, valid: torch.Tensor, next_pos: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Mask [B, 1, K, S + K] and position ids [B, K] for one tree forward.

    Node i sees every valid cached slot, its ancestors and itself; its position is the root's position plus its
    depth. The mask is None when it would hide nothing (a single node over a hole-free cache)."""
    positions = next_pos[:, None] + tree.depth[None, :]  # [B, K]
    b, k = valid.shape[0], tree.num_nodes
    if k == 1 and bool(valid.all()):
        return None, positions
    visible = torch.cat([valid[:, None, :].expand(b, k, -1), tree.attn[None].expand(b, k, k)], dim=-1)  # [B, K, S+K]
    return additive(visible[:, None], dtype), positions


def keep_nodes(cache: DynamicCache, start: int, keep: torch.Tensor) -> None:
    """Keep tree nodes `keep` [B, N] (node ids; entries past a row's accepted path may name any node, their slots
    become holes) at slots start .. start+N-1 and drop the other tree slots. Slots before `start` are untouched."""
    b, n = keep.shape
    tree_len = cache.get_seq_length() - start
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
