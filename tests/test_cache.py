"""Tree attention on stock models and cache surgery, against brute-force recomputation."""

from __future__ import annotations

import pytest
import torch

from inference.engine.cache import (FIRST_SLOTS, additive, commit_slots, keep_nodes, new_cache, prefill_inputs,
                                    tree_inputs)
from inference.engine.tree import build_tree
from tests.model_support import save_tiny_model
from tests.script_support import load_script

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



def forward(caches, batch: int, n: int, gen: torch.Generator) -> None:
    """A forward's new keys/values [B, 2, n, 4] for two layers, the same into every cache."""
    for layer in range(2):
        keys, values = torch.randn(2, batch, 2, n, 4, generator=gen)
        for cache in caches:
            cache.update(keys, values, layer)


@pytest.mark.parametrize("reserve", [0, 3, 200, None])
@pytest.mark.parametrize("batch", [1, 3])
def test_slot_cache_equals_stock_dynamic_cache(reserve, batch):
    """Slots hold exactly what stock concatenation holds after a prompt and steps of tree forwards, surgery and
    crops. A buffer is reallocated only when full, to twice its size (amortised); a bound the cache outgrows is
    left behind the same way."""
    slots, stock = new_cache(reserve=reserve), new_cache(slots=False)
    gen = torch.Generator().manual_seed((reserve or 1) + batch)
    forward((slots, stock), batch, 7, gen)
    buffers = []
    for step in range(30):
        start, width = stock.get_seq_length(), 1 + step % 6  # a tree of `width` nodes
        forward((slots, stock), batch, width, gen)
        kept = 1 + int(torch.randint(width, (1,), generator=gen))
        keep = torch.stack([torch.randperm(width, generator=gen)[:kept] for _ in range(batch)])
        for cache in (slots, stock):
            keep_nodes(cache, start, keep)
            if step % 7 == 3:
                cache.crop(-1)
        buffers.append(slots.layers[0]._keys.data_ptr())
        assert slots.get_seq_length() == stock.get_seq_length()
        for a, b in zip(slots.layers, stock.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            assert a.keys.data_ptr() == a._keys.data_ptr()  # views of the buffer, not copies
    grown = len(set(buffers))
    assert grown == 1 if reserve in (200, None) else 1 < grown <= 6  # 7 or 10 slots doubled past ~100


def test_slot_buffers_stay_within_the_reserve_given():
    """The first buffer keeps FIRST_SLOTS free slots, or fewer when the caller's bound says fewer will come; growth
    stops at the bound: a long max_new_tokens reserves nothing it does not reach."""
    gen = torch.Generator().manual_seed(0)
    for reserve, first in ((10_000, 5 + FIRST_SLOTS), (20, 25), (None, 5 + FIRST_SLOTS)):
        cache = new_cache(reserve=reserve)
        forward((cache,), 1, 5, gen)
        assert cache.layers[0]._keys.shape[2] == first
    cache = new_cache(reserve=300)  # bound 305: 261 slots first, then the bound instead of 522
    forward((cache,), 1, 5, gen)
    forward((cache,), 1, 260, gen)
    assert cache.layers[0]._keys.shape[2] == 305 and cache.get_seq_length() == 265


def test_slot_cache_adopts_keys_replaced_from_outside():
    """A cache whose keys were replaced (transformers' batch reorder, beam search) copies them into a new buffer."""
    slots, stock = new_cache(reserve=8), new_cache(slots=False)
    gen = torch.Generator().manual_seed(0)
    forward((slots, stock), 3, 5, gen)
    for cache in (slots, stock):
        cache.batch_select_indices(torch.tensor([2, 0]))
    forward((slots, stock), 2, 2, gen)
    for a, b in zip(slots.layers, stock.layers):
        assert torch.equal(a.keys, b.keys) and a.keys.shape == (2, 2, 7, 4)


def test_the_cache_benchmark_times_both_caches_on_one_decode(tmp_path, capsys):
    """scripts/bench_kv_cache.py on a tiny target: a table row per shape with both caches' step times and their
    ratio, and both caches decoding the same tokens; a bad --shapes is one line and exit 2 before a model loads."""
    script = load_script("bench_kv_cache")
    base = save_tiny_model(tmp_path / "target")
    assert script.main(["--base", str(base), "--dtype", "fp32", "--shapes", "2x16,1x40", "--steps", "2",
                        "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    for shape in ("2 x 16", "1 x 40"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {shape} |"))
        slots, stock, ratio = (float(cell) for cell in row.strip("| ").split(" | ")[1:])
        assert slots > 0 and stock > 0  # printed to 0.1 ms, the ratio to 0.01 from the unrounded times:
        assert (stock - 0.05) / (slots + 0.05) - 0.005 <= ratio <= (stock + 0.05) / (slots - 0.05) + 0.005
    assert "decoded differently" not in out
    assert script.main(["--base", str(tmp_path / "missing"), "--shapes", "2xten"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --shapes: comma-separated ROWSxTOKENS (e.g. 32x1024), got '2xten'"
