"""inference.kernels.attention (masked GQA sdpa without repeat_kv) and verify.greedy_argmax: both must equal stock
exactly (a one-query bf16 forward: within rounding, computed in fp32)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from inference.drafters.jacobi import JacobiDrafter
from inference.engine.loop import DecodeConfig, generate
from inference.engine.verify import ARGMAX_CHUNK, greedy_argmax
from inference.kernels.attention import NAME, gqa_attention, gqa_sdpa
from tests.conftest import build_tiny_lm


def tree_logits(model, ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_gqa_forward_is_bit_identical_to_stock(arch, dtype):
    """A 4-D additive mask (a tree over a prefix, two rows, one of them left-padded) through gqa_sdpa gives the
    stock sdpa logits bit for bit: the same kernel, only the key/value copy is gone."""
    model = build_tiny_lm(arch, seed=1).to(dtype)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the tiny models are GQA
    gen = torch.Generator().manual_seed(0)
    b, t = 2, 12
    ids = torch.randint(3, 128, (b, t), generator=gen)
    visible = torch.ones(t, t, dtype=torch.bool).tril()
    visible[8:, 8:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    visible = visible.expand(b, t, t).clone()
    visible[1, :, :3] = False  # row 1: three padding columns
    visible[1, :3, :3] = torch.eye(3, dtype=torch.bool)  # padded queries see themselves (no all-masked rows)
    mask = torch.zeros(b, 1, t, t, dtype=dtype).masked_fill(~visible[:, None], torch.finfo(dtype).min)
    position_ids = torch.cat([torch.arange(8), torch.tensor([8, 9, 9, 10])]).expand(b, t)
    stock = tree_logits(model, ids, mask, position_ids)
    with gqa_attention(model) as switched:
        assert switched == 1 and model.config._attn_implementation == NAME
        fast = tree_logits(model, ids, mask, position_ids)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(fast, stock)


def test_generate_with_and_without_the_gqa_path_agree_token_for_token():
    """Jacobi steps are masked forwards; the engine's output and acceptance are the same either way."""
    model = build_tiny_lm("llama", seed=2)
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    runs = [generate(model, ids, JacobiDrafter(), DecodeConfig(max_new_tokens=12, gqa_attention=on))
            for on in (True, False)]
    assert runs[0].sequences == runs[1].sequences and len(runs[0].sequences[0]) == 12
    assert runs[0].stats.accepted == runs[1].stats.accepted


def test_gqa_attention_switches_only_sdpa_models_and_restores_on_error():
    sdpa, eager = build_tiny_lm("llama", seed=0), build_tiny_lm("llama", seed=0, attn_implementation="eager")
    with gqa_attention(sdpa, eager, sdpa.model, None) as switched:  # sdpa.model shares sdpa's config: once
        assert switched == 1 and eager.config._attn_implementation == "eager"
    with gqa_attention(sdpa, enabled=False) as switched:
        assert switched == 0 and sdpa.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"):
        with gqa_attention(sdpa):
            raise RuntimeError("boom")
    assert sdpa.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [8 * ARGMAX_CHUNK, 49_152, 32_001, 100])
def test_greedy_argmax_equals_torch_argmax(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    cases = [
        torch.randn(2, 5, vocab, generator=gen),
        torch.randint(0, 3, (3, vocab), generator=gen).float(),  # many ties: the first index must win
        torch.full((2, vocab), float("-inf")),  # all -inf: index 0, as torch
    ]
    spread = torch.randn(4, vocab, generator=gen)
    spread[0, -1] = 50.0  # the maximum in the last (possibly partial) slice
    spread[1, min(ARGMAX_CHUNK - 1, vocab // 3)] = spread[1, min(2 * ARGMAX_CHUNK, vocab - 1)] = 50.0  # a tie across slices
    spread[2, vocab // 2] = float("nan")  # NaN: torch's argmax picks it
    spread[3, 0] = float("inf")
    cases.append(spread)
    for logits in cases:
        logits = logits.to(dtype)
        assert torch.equal(greedy_argmax(logits), logits.argmax(-1))
        assert greedy_argmax(logits).dtype == torch.int64


def test_one_bf16_query_runs_the_flash_kernel_in_fp32():
    """A bf16 decode step's attention (one query, GQA, with and without a mask) is fp32 flash attention over exact
    fp32 copies, rounded to bf16 once: within bf16 rounding of stock, and at least as close to fp64."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 16, generator=gen).bfloat16() for h, n in ((4, 1), (2, 40), (2, 40)))
    module = SimpleNamespace(num_key_value_groups=2)
    mask = torch.zeros(2, 1, 1, 40, dtype=torch.bfloat16)
    mask[1, ..., :7] = torch.finfo(torch.bfloat16).min  # a left-padded row
    for m in (None, mask):
        ours, _ = gqa_sdpa(module, q, k, v, m, scaling=0.25)  # [B, 1, H, D]
        fp32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=None if m is None else
                                              m.float(), scale=0.25, enable_gqa=True)
        assert torch.equal(ours, fp32.transpose(1, 2).bfloat16())
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=None if m is None else
                                               m.double(), scale=0.25, enable_gqa=True).transpose(1, 2)
        stock = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.25, enable_gqa=True).transpose(1, 2)
        assert (ours.double() - exact).abs().max() <= (stock.double() - exact).abs().max()
        assert torch.allclose(ours.float(), stock.float(), atol=2e-2)
