"""Tree attention on stock models and cache surgery, against brute-force recomputation."""

from __future__ import annotations

import pytest
import torch

from inference.engine.cache import additive, commit_slots, keep_nodes, new_cache, prefill_inputs, tree_inputs
from inference.engine.tree import build_tree

pytestmark = pytest.mark.usefixtures("single_thread")
CHOICES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]


def path_tokens(tree, tokens: torch.Tensor, node: int) -> torch.Tensor:
    """Tokens from the root to `node` (inclusive) in one row."""
    chain = tree.node_path[node]
    return tokens[chain[chain >= 0]]


def prefill(model, prompt: torch.Tensor, pad_mask: torch.Tensor):
    cache = new_cache()
    mask, pos = prefill_inputs(pad_mask, torch.float32)
    model(input_ids=prompt, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    return cache


def test_additive_mask_values():
    mask = additive(torch.tensor([[True, False]]), torch.bfloat16)
    assert mask.dtype == torch.bfloat16
    assert mask.tolist() == [[0.0, torch.finfo(torch.bfloat16).min]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_logits_equal_per_path_causal_logits(tiny_lm_factory, attn):
    for arch in ("llama", "qwen2", "mistral"):
        model = tiny_lm_factory(arch, attn_implementation=attn)
        gen = torch.Generator().manual_seed(0)
        tree = build_tree(CHOICES, num_heads=3, topk=3)
        prompt = torch.randint(3, 128, (1, 9), generator=gen)
        tokens = torch.randint(3, 128, (tree.num_nodes,), generator=gen)
        cache = prefill(model, prompt, torch.ones_like(prompt, dtype=torch.bool))
        valid = torch.ones(1, prompt.shape[1], dtype=torch.bool)
        mask, pos = tree_inputs(tree, valid, torch.tensor([prompt.shape[1]]), torch.float32)
        logits = model(input_ids=tokens[None], attention_mask=mask, position_ids=pos, cache=cache).logits[0]
        for node in range(tree.num_nodes):
            seq = torch.cat([prompt[0], path_tokens(tree, tokens, node)])
            expected = model(input_ids=seq[None]).logits[0, -1]
            torch.testing.assert_close(logits[node], expected, atol=1e-5, rtol=1e-5, msg=f"{arch} node {node}")


def test_left_padded_prefill_matches_unpadded(tiny_lm):
    prompts = [torch.tensor([5, 9, 33, 71, 12]), torch.tensor([40, 41])]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    pad_mask = torch.stack([torch.arange(width) >= width - len(p) for p in prompts])
    mask, pos = prefill_inputs(pad_mask, torch.float32)
    logits = tiny_lm(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], tiny_lm(input_ids=prompt[None]).logits[0, -1], atol=1e-5, rtol=1e-5)


CHAIN = [(0,), (0, 0), (0, 0, 0)]


@pytest.mark.parametrize(
    "choices, ends",
    [
        (CHOICES, [7]), (CHOICES, [6]), (CHOICES, [0]), (CHOICES, [8, 3]), (CHOICES, [0, 5]),
        (CHAIN, [2]), (CHAIN, [3, 1]),
    ],
    ids=["deep", "second-branch", "root-only", "batch-holes", "batch-root", "chain-crop", "chain-batch"],
)
def test_cache_surgery_equals_recompute(tiny_lm, choices, ends):
    """After a tree forward, keeping each row's accepted path (root .. ends[row]) must leave the cache that a fresh
    forward over prompt + path builds, and the next forward must give the recomputed logits."""
    tree = build_tree(choices, num_heads=3, topk=3)
    batch = len(ends)
    gen = torch.Generator().manual_seed(sum(ends))
    prompt = torch.randint(3, 128, (batch, 6), generator=gen)
    tokens = torch.randint(3, 128, (batch, tree.num_nodes), generator=gen)
    pad_mask = torch.ones_like(prompt, dtype=torch.bool)
    cache = prefill(tiny_lm, prompt, pad_mask)
    mask, pos = tree_inputs(tree, pad_mask, torch.full((batch,), 6), torch.float32)
    tiny_lm(input_ids=tokens, attention_mask=mask, position_ids=pos, cache=cache)

    accepted_nodes = [tree.node_path[end][tree.node_path[end] >= 0].tolist() for end in ends]
    width = max(map(len, accepted_nodes))
    keep = torch.tensor([path + [path[-1]] * (width - len(path)) for path in accepted_nodes])
    keep_nodes(cache, 6, keep)
    valid = commit_slots(pad_mask, torch.tensor([len(p) - 1 for p in accepted_nodes]), width)
    assert cache.get_seq_length() == 6 + width and valid.shape == (batch, 6 + width)

    nxt = torch.randint(3, 128, (batch, 1), generator=gen)
    next_pos = valid.sum(-1)
    mask, pos = tree_inputs(build_tree([], 0, 0), valid, next_pos, torch.float32)
    logits = tiny_lm(input_ids=nxt, attention_mask=mask, position_ids=pos, cache=cache).logits[:, 0]
    for row, path in enumerate(accepted_nodes):
        seq = torch.cat([prompt[row], tokens[row, path], nxt[row]])
        fresh = new_cache()
        expected = tiny_lm(input_ids=seq[None], cache=fresh).logits[0, -1]
        torch.testing.assert_close(logits[row], expected, atol=1e-5, rtol=1e-5)
        n = len(path)
        for layer, ref in zip(cache.layers, fresh.layers):  # kept slots equal the recomputed keys/values
            torch.testing.assert_close(layer.keys[row, :, : 6 + n], ref.keys[0, :, : 6 + n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(layer.values[row, :, : 6 + n], ref.values[0, :, : 6 + n], atol=1e-5, rtol=1e-5)
