"""Training-time test (TTT) attention for EAGLE-3's unrolled steps (models/eagle3.py `Eagle3Draft.unroll`) without a
[B, H, T, T] score block kept for backward.

Dimension letters: B batch, T time, H query heads, Hkv key/value heads, G = H / Hkv query heads per key head, Hd head
width, C query positions per chunk, R = G * C score rows of one chunk (a key head's G query heads stacked), j the step.

Step j's query at t attends to step 0's keys at s <= t (causal) and to the keys of steps 1..j at t itself (its own
chain: what the chain it stands for sees at inference; SpecForge's and speculators' TTT mask, a causal block and one
diagonal per extra step):
    o_t = (Σ_{s<=t} e^{a_ts} v0_s + Σ_{i=1..j} e^{c_ti} vi_t) / Z_t,   a_ts = scaling q_t·k0_s,  c_ti = scaling q_t·ki_t
Step 0 is torch's scaled_dot_product_attention (its fused kernels keep O(B·H·T) for backward). A later step runs
`ChainAttention`, flash attention's recipe (Dao et al. 2022, alg. 1-2) in plain torch: over chunks of C query
positions it scores the causal block [B, Hkv, R, <= T] and the j chain terms [B, Hkv, R, j] under one running max,
keeps the output and the per-row log-sum-exp log Z_t, and in backward recomputes the chunk's probabilities P:
    dS = P ∘ (dP - rowsum(dO ∘ O)),   dP = dO · Vᵀ   (the chain terms likewise, per diagonal).
Saved for backward per extra step: q, the step's inputs k0, v0, k1..kj, v1..vj (the caller's own tensors: no copies;
k_i and v_i for i < j are already held by earlier steps), the output [B, H, T, Hd] and the log-sum-exp [B, H, T] (fp32,
fp64 for fp64 inputs): O(B·H·T·Hd) new bytes per step. The transient peak is one chunk's scores, O(B·H·C·T).

Grouped-query heads are never repeated: q is viewed [B, Hkv, G, T, Hd] and a chunk's G query heads share one matmul
against their key head. Scores and products run in the inputs' dtype; the softmax statistics, the chain terms and the
gradient sums over chunks in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

CHUNK = 256  # query positions per chunk: a chunk's scores are [B, H, C, <= T]


def ttt_attention(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], scaling: float,
                  chunk: int = CHUNK) -> torch.Tensor:
    """Step j = len(keys) - 1 of training-time test: q [B, H, T, Hd], keys / values [B, Hkv, T, Hd] of steps 0..j
    -> attention output [B, T, H * Hd] (query t sees keys[0] at <= t and keys[1..j] at t)."""
    b, h, t, hd = q.shape
    if len(keys) != len(values) or not keys or h % keys[0].shape[1]:
        raise ValueError(f"ttt_attention: {len(keys)} keys, {len(values)} values over {h} query heads "
                         f"(need as many keys as values, at least one, and whole query groups per key head)")
    if chunk < 1:
        raise ValueError(f"ttt_attention: chunk {chunk} must be a positive number of query positions")
    if len(keys) == 1:
        out = F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, scale=scaling,
                                             enable_gqa=h != keys[0].shape[1])  # [B, H, T, Hd]
    else:
        out = ChainAttention.apply(scaling, chunk, q, *keys, *values)  # [B, H, T, Hd]
    return out.transpose(1, 2).reshape(b, t, h * hd)


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax statistics accumulate in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def grouped(x: torch.Tensor, kv_heads: int, start: int, stop: int) -> torch.Tensor:
    """Query-head tensor [B, H, T, ...] -> its positions start..stop grouped by key head [B, Hkv, R, ...]."""
    return x.unflatten(1, (kv_heads, -1))[:, :, :, start:stop].flatten(2, 3)


def write_grouped(x: torch.Tensor, kv_heads: int, start: int, stop: int, rows: torch.Tensor) -> None:
    """The inverse of `grouped`: rows [B, Hkv, R, ...] into x [B, H, T, ...] at positions start..stop (cast to x's
    dtype)."""
    x.unflatten(1, (kv_heads, -1))[:, :, :, start:stop] = rows.unflatten(2, (-1, stop - start))


def chain_dot(rows: torch.Tensor, others: Sequence[torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """rows [B, Hkv, R, Hd] (positions start..stop) · others[i] [B, Hkv, T, Hd] at the same positions -> [B, Hkv, R, j]
    in the statistics dtype (each query head of a group against its key head). Elementwise: a batched matmul of
    [G, Hd] x [Hd, j] blocks runs many times slower on CPU."""
    st = stat_dtype(rows.dtype)
    rows = rows.unflatten(2, (-1, stop - start)).to(st)  # [B, Hkv, G, C, Hd]
    dots = [(rows * o[:, :, None, start:stop].to(st)).sum(-1) for o in others]  # [B, Hkv, G, C] each
    return torch.stack(dots, -1).flatten(2, 3)


def chain_sum(weights: torch.Tensor, others: Sequence[torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """Σ_i weights[..., i] · others[i] at the same positions: weights [B, Hkv, R, j], others [B, Hkv, T, Hd] each
    -> [B, Hkv, R, Hd] in the weights' dtype."""
    w = weights.unflatten(2, (-1, stop - start))[..., None]  # [B, Hkv, G, C, j, 1]
    total = sum(w[..., i, :] * o[:, :, None, start:stop].to(weights.dtype) for i, o in enumerate(others))
    return total.flatten(2, 3)  # [B, Hkv, R, Hd]


def per_key_head(weights: torch.Tensor, rows: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Σ over a group's query heads of weights [B, Hkv, R] · rows [B, Hkv, R, Hd] -> [B, Hkv, C, Hd] (a chain key's or
    value's gradient at positions start..stop)."""
    products = weights[..., None] * rows.to(weights.dtype)  # [B, Hkv, R, Hd]
    return products.unflatten(2, (-1, stop - start)).sum(2)


def chunk_scores(q: torch.Tensor, keys: Sequence[torch.Tensor], start: int, stop: int,
                 scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of query positions start..stop, q [B, Hkv, R, Hd] from `grouped` -> (causal block [B, Hkv, R, stop]
    over keys[0] at 0..stop, -inf above the diagonal; chain [B, Hkv, R, j] against keys[1..j] at the same positions),
    both in the statistics dtype."""
    block = torch.matmul(q, keys[0][:, :, :stop].transpose(-1, -2)).to(stat_dtype(q.dtype)).mul_(scaling)
    position = torch.arange(start, stop, device=q.device)
    future = position[None] > position[:, None]  # [C, C]: keys before `start` are all visible
    block.unflatten(2, (-1, stop - start))[..., start:].masked_fill_(future, float("-inf"))
    return block, chain_dot(q, keys[1:], start, stop) * scaling  # [B, Hkv, R, stop], [B, Hkv, R, j]


class ChainAttention(torch.autograd.Function):
    """Steps j >= 1 (the module docstring's formulas): apply(scaling, chunk, q, k0..kj, v0..vj) -> [B, H, T, Hd].
    Gradients flow to q and every key and value; not twice differentiable."""

    @staticmethod
    def forward(ctx: Any, scaling: float, chunk: int, q: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        keys, values = kv[: len(kv) // 2], kv[len(kv) // 2 :]
        b, h, t, hd = q.shape
        kv_heads, st = keys[0].shape[1], stat_dtype(q.dtype)
        out = q.new_empty(b, h, t, hd)
        lse = torch.empty(b, h, t, dtype=st, device=q.device)
        for start in range(0, t, chunk):
            stop = min(start + chunk, t)
            block, chain = chunk_scores(grouped(q, kv_heads, start, stop), keys, start, stop, scaling)
            top = torch.maximum(block.amax(-1), chain.amax(-1))[..., None]  # [B, Hkv, R, 1] one max for both
            p, pc = block.sub_(top).exp_(), torch.exp(chain - top)  # [B, Hkv, R, stop], [B, Hkv, R, j]
            total = p.sum(-1, keepdim=True) + pc.sum(-1, keepdim=True)  # [B, Hkv, R, 1]
            o = torch.matmul(p.to(q.dtype), values[0][:, :, :stop]).to(st) + chain_sum(pc, values[1:], start, stop)
            write_grouped(out, kv_heads, start, stop, o / total)
            write_grouped(lse, kv_heads, start, stop, (top + total.log())[..., 0])
        ctx.save_for_backward(q, *keys, *values, out, lse)
        ctx.scaling, ctx.chunk = scaling, chunk
        return out

    @staticmethod
    @once_differentiable  # the backward is written out, not itself differentiated
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, *kv, out, lse = ctx.saved_tensors
        keys, values = kv[: len(kv) // 2], kv[len(kv) // 2 :]
        scaling, t, kv_heads, st = ctx.scaling, q.shape[2], keys[0].shape[1], stat_dtype(q.dtype)
        dq = torch.empty_like(q)
        dk0 = torch.zeros(keys[0].shape, dtype=st, device=q.device)  # summed over chunks
        dv0 = torch.zeros(values[0].shape, dtype=st, device=q.device)
        dks = [torch.empty_like(k) for k in keys[1:]]  # a position's chain terms lie in one chunk: written once
        dvs = [torch.empty_like(v) for v in values[1:]]
        for start in range(0, t, ctx.chunk):
            stop = min(start + ctx.chunk, t)
            qc = grouped(q, kv_heads, start, stop)  # [B, Hkv, R, Hd]
            block, chain = chunk_scores(qc, keys, start, stop, scaling)
            norm = grouped(lse, kv_heads, start, stop)[..., None]  # [B, Hkv, R, 1]
            p, pc = block.sub_(norm).exp_(), torch.exp(chain - norm)  # the forward's probabilities
            do = grouped(grad_out, kv_heads, start, stop)  # [B, Hkv, R, Hd]
            delta = (do.to(st) * grouped(out, kv_heads, start, stop).to(st)).sum(-1, keepdim=True)  # rowsum(dO∘O)
            dp = torch.matmul(do, values[0][:, :, :stop].transpose(-1, -2)).to(st)  # [B, Hkv, R, stop]
            ds = dp.sub_(delta).mul_(p).to(q.dtype)  # [B, Hkv, R, stop]
            dv0[:, :, :stop] += torch.matmul(p.to(q.dtype).transpose(-1, -2), do).to(st)
            dk0[:, :, :stop] += torch.matmul(ds.transpose(-1, -2), qc).to(st) * scaling
            dsc = pc * (chain_dot(do, values[1:], start, stop) - delta)  # [B, Hkv, R, j]
            dqc = torch.matmul(ds, keys[0][:, :, :stop]).to(st) + chain_sum(dsc, keys[1:], start, stop)
            write_grouped(dq, kv_heads, start, stop, dqc * scaling)
            for i, (dk, dv) in enumerate(zip(dks, dvs)):
                dk[:, :, start:stop] = per_key_head(dsc[..., i], qc, start, stop) * scaling
                dv[:, :, start:stop] = per_key_head(pc[..., i], do, start, stop)
        return None, None, dq, dk0.to(keys[0].dtype), *dks, dv0.to(values[0].dtype), *dvs
