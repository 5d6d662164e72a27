"""Grouped-query attention without `repeat_kv` for masked CPU forwards of a stock transformers model.

Dimension letters: B batch, H query heads, G key/value heads (H = G·r), Q query tokens, S cached + new keys, D head dim.

Stock `sdpa` attention hands PyTorch's SDPA the G key/value heads only when no mask is given; with a mask (every
tree, Jacobi block or lookahead window the engine verifies, padded batches, packed training rows) it first copies
keys and values r times (`repeat_kv`: [B, G, S, D] -> [B, H, S, D], the whole cache, every layer, every step).
PyTorch's CPU flash kernel takes a mask and `enable_gqa=True` together and reads query head h from key/value head
h // r itself, so the copy buys nothing there: `gqa_sdpa` calls it that way (the same kernel on the same values:
outputs equal to stock bit for bit, tests/test_attention.py). On CUDA a mask with `enable_gqa` would leave the fast
kernels, so everything that is not a masked GQA forward on the CPU goes to stock `sdpa` unchanged.

One exception changes rounding, not values: a bf16 forward of one query on the CPU (a plain decoding step) runs
PyTorch's CPU flash kernel in fp32 on exact fp32 copies of q/k/v, the output rounded to bf16 once. Its bf16 kernel is
slow at one query (a Zen 4 EPYC, 9 query / 3 key-value heads of 64: 281 us over 512 keys, 1,090 over 2,048, against
74 and 215 through fp32; at 8 queries the two are level): ~6 ms of a 28 ms SmolLM2 step. The result differs from
stock's by bf16 rounding, the kind of difference a K-row forward already has from a one-row one.

`gqa_attention(*models)` switches the models whose attention is `sdpa` to this function while its block runs and
restores `sdpa` on exit, through transformers' public `set_attn_implementation` (the model's config names the
attention function each layer looks up per forward). The switch is scoped, not installed for good: Hugging Face
`generate` on the same model, outside the block, must run stock `sdpa` (its mask code branches on that name).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "draftsmith_gqa_sdpa"


def gqa_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
             is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Stock `sdpa_attention_forward`, except a masked GQA forward on the CPU: query [B, H, Q, D], key/value
    [B, G, S, D], mask [B|1, 1, Q, S] -> output [B, Q, H, D] without expanding key/value to H heads."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if one_bf16_query(query) and plain and not dropout:
        out = F.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), attn_mask=None if attention_mask is None else
            attention_mask.float(), scale=scaling, enable_gqa=groups > 1)  # [B, H, 1, D]
        return out.transpose(1, 2).to(query.dtype).contiguous(), None
    if attention_mask is None or groups == 1 or query.device.type != "cpu" or not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)  # [B, H, Q, D]
    return out.transpose(1, 2).contiguous(), None


def one_bf16_query(query: torch.Tensor) -> bool:
    """A bf16 CPU forward of one query per row (query [B, H, 1, D]): the fp32 route (module docstring)."""
    return query.device.type == "cpu" and query.dtype == torch.bfloat16 and query.shape[2] == 1


AttentionInterface.register(NAME, gqa_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # masks are built exactly as for stock sdpa


@contextmanager
def gqa_attention(*modules: torch.nn.Module | None, enabled: bool = True) -> Iterator[int]:
    """Within the block, the models among `modules` (None entries skipped) that run `sdpa` attention run `gqa_sdpa`;
    yields how many configs were switched (other attention implementations, or enabled=False: none). Restores every
    one on exit, also on error."""
    switched: dict[int, torch.nn.Module] = {}  # config id -> the model that switches it
    for module in modules if enabled else ():
        config = getattr(module, "config", None)
        if (hasattr(module, "set_attn_implementation") and id(config) not in switched
                and getattr(config, "_attn_implementation", None) == "sdpa"):
            switched[id(config)] = module
    done: list[torch.nn.Module] = []
    try:
        for model in switched.values():
            model.set_attn_implementation(NAME)
            done.append(model)
        yield len(switched)
    finally:
        for model in done:
            model.set_attn_implementation("sdpa")
