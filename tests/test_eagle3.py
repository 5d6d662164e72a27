"""EAGLE-3: the draft model's two forwards agree, the loss reads the offsets it documents, the engine drafter is
lossless (greedy identity, batched and left-padded, every tree shape), and checkpoints refuse bad maps in one line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F
from transformers import DynamicCache

from inference.bench.engine_check import lm_head_eagle3
from inference.drafters.eagle3 import (Candidates, DynamicTree, Eagle3Drafter, default_tree, eagle3_tree,
                                       plan_levels)
from inference.engine.cache import additive
from inference.engine.drafter import DecodeState
from inference.engine.loop import DecodeConfig, generate
from inference.engine.tree import TreeError, build_tree, chain_choices, walk_forwards
from inference.engine.verify import SamplingParams
from models.checkpoint import CheckpointError, DrafterMismatchError, WEIGHTS_NAME
from models.eagle3 import (Eagle3Config, Eagle3ConfigError, Eagle3Draft, check_eagle3_checkpoint, default_layers,
                           load_eagle3, save_eagle3)
from models.ttt_attention import CHUNK
from tests.conftest import build_tiny_lm, tiny_config
from tests.test_draft_model import left_pad
from tests.test_lookahead import repetitive_prompts
from train.eagle3 import ChainCounter, Eagle3TrainModule, RankCounter, eagle3_loss, record_ranks
from train.eagle3_teacher import TopkTeacher, soft_targets
from train.medusa1 import greedy_continuations

pytestmark = pytest.mark.usefixtures("single_thread")


def random_draft(arch: str = "llama", layers=(1, 2), draft_vocab: int = 64, seed: int = 0,
                 intermediate_size: int | None = None) -> Eagle3Draft:
    torch.manual_seed(seed)
    config = Eagle3Config(target=tiny_config(arch).to_dict(), layers=layers, draft_vocab_size=draft_vocab,
                          intermediate_size=intermediate_size)
    draft = Eagle3Draft(config)
    draft.set_draft_vocab(torch.randperm(config.vocab_size)[:draft_vocab])
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return draft.eval()


# --- the draft model ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,width", [("llama", None), ("qwen2", None), ("llama", 160)],
                         ids=["llama", "qwen2", "llama-wider-mlp"])
def test_unrolled_steps_equal_the_cached_step_forward(arch, width):
    """Training-time test's step j at position t equals feeding, with the stock attention and a cache, step 0's pairs
    (causal) and then the chain at t (fp64, 1e-12): the engine drafts exactly what training unrolled. Also for a draft
    layer whose MLP is wider than the target's (method.intermediate_size)."""
    draft = random_draft(arch, intermediate_size=width).double()
    if width is not None:
        assert draft.midlayer.mlp.up_proj.out_features == width
    b, t, d = 2, 8, 32
    hidden, embeds = torch.randn(b, t, d, dtype=torch.double), torch.randn(b, t, d, dtype=torch.double)
    unrolled = draft.unroll(hidden, embeds, 3)
    cache = DynamicCache()
    next_embeds = F.pad(embeds[:, 1:], (0, 0, 0, 1))  # step 0 pairs position t with the token t + 1
    causal = additive(torch.ones(t, t, dtype=torch.bool).tril()[None, None].expand(b, 1, t, t), torch.double)
    step0 = draft.step(hidden, next_embeds, torch.arange(t)[None].expand(b, t), causal, cache)
    assert (step0 - unrolled[0]).abs().max() < 1e-12
    at = 4
    seen = torch.zeros(t, dtype=torch.bool)
    seen[: at + 1] = True
    out = step0[:, at : at + 1]
    for j in (1, 2):
        visible = torch.cat([seen, torch.ones(j, dtype=torch.bool)])
        mask = additive(visible[None, None, None].expand(b, 1, 1, -1), torch.double)
        out = draft.step(out, embeds[:, at + 1 + j : at + 2 + j], torch.full((b, 1), at + j), mask, cache)
        assert (out[:, 0] - unrolled[j][:, at]).abs().max() < 1e-12



def test_unrolled_steps_equal_the_cached_step_forward_across_attention_chunks():
    """The same over more positions than one chunk of models/ttt_attention.py holds: row 0's chain starts at the last
    position of the first chunk, row 1's inside the second (its causal block spans both chunks)."""
    draft = random_draft("llama").double()
    b, t, d = 2, CHUNK + 45, 32
    hidden, embeds = torch.randn(b, t, d, dtype=torch.double), torch.randn(b, t, d, dtype=torch.double)
    unrolled = draft.unroll(hidden, embeds, 3)
    cache = DynamicCache()
    next_embeds = F.pad(embeds[:, 1:], (0, 0, 0, 1))
    causal = additive(torch.ones(t, t, dtype=torch.bool).tril()[None, None].expand(b, 1, t, t), torch.double)
    step0 = draft.step(hidden, next_embeds, torch.arange(t)[None].expand(b, t), causal, cache)
    assert (step0 - unrolled[0]).abs().max() < 1e-12
    at = torch.tensor([CHUNK - 1, CHUNK + 30])  # [B] where each row's chain starts
    seen = torch.arange(t)[None] <= at[:, None]  # [B, T]
    rows = torch.arange(b)
    out = step0[rows, at][:, None]  # [B, 1, D]
    for j in (1, 2):
        visible = torch.cat([seen, torch.ones(b, j, dtype=torch.bool)], 1)  # [B, T + j]
        mask = additive(visible[:, None, None], torch.double)
        out = draft.step(out, embeds[rows, at + 1 + j][:, None], (at + j)[:, None], mask, cache)
        assert (out[:, 0] - unrolled[j][rows, at]).abs().max() < 1e-12

def test_draft_vocabulary_maps():
    draft = random_draft(draft_vocab=16)
    ids = draft.vocab_ids
    assert torch.equal(ids, ids.sort().values) and len(ids.unique()) == 16
    assert torch.equal(draft.t2d.nonzero().flatten(), ids)
    assert torch.equal(draft.draft_index(ids), torch.arange(16))
    outside = int((~draft.t2d).nonzero()[0])
    assert int(draft.draft_index(torch.tensor([outside, -100]))[0]) == -1
    for bad, match in (([0] * 16, "duplicate"), (list(range(15)), r"expected 16 ids .* got shape \(15,\)"),
                       (list(range(120, 136)), r"\[0, 128\)")):
        with pytest.raises(Eagle3ConfigError, match=match):
            draft.set_draft_vocab(bad)


def test_default_layers_are_eagle3s():
    assert default_layers(30) == (2, 15, 27)
    assert default_layers(32) == (2, 16, 29)


def test_a_cache_of_other_layers_is_refused_naming_both_lists(tmp_path):
    """A feature cache extracted with SmolLM2's layers (2, 15, 27) cannot serve a draft fusing a 32-layer target's
    EAGLE-3 layers: one line naming both lists and the extraction that completes the cache."""
    from data.features import FeatureCacheError, Manifest, check_cache

    Manifest(target={}, tokenizer="t", hidden_size=32, vocab_size=128, layers=[2, 15, 27], topk=20, dtype="bf16",
             recipe={}, shards={}, complete=True).write(tmp_path)
    with pytest.raises(FeatureCacheError) as refused:
        check_cache(tmp_path, need_layers=default_layers(32))
    message = str(refused.value)
    assert "holds layers [2, 15, 27], this run needs [16, 29] too (it reads layers [2, 16, 29])" in message
    assert "method.layers=[2, 15, 16, 27, 29]" in message and "\n" not in message


# --- the loss ---------------------------------------------------------------------------------------------------------

def test_loss_offsets_and_soft_targets():
    """Step 1 at t is scored against the target's distribution stored at t + 1 (the cache's row for token t + 2), by
    hand; gradients reach the fused projection; soft targets drop the mass outside the draft vocabulary and
    renormalise the rest."""
    draft = random_draft(draft_vocab=128)  # full vocabulary: every id inside
    b, t = 2, 10
    hidden = torch.randn(b, t, 2 * 32)
    embeds = torch.randn(b, t, 32)
    labels = torch.randint(3, 128, (b, t))
    labels[:, :3] = -100
    topk_ids = torch.randint(0, 128, (b, t, 4))
    topk_probs = torch.rand(b, t, 4).softmax(-1)
    out = eagle3_loss(draft, hidden, embeds, labels, TopkTeacher(topk_ids, topk_probs), steps=2, decay=0.8,
                      soft_weight=1.0)
    assert out.loss.requires_grad and torch.isfinite(out.loss)
    out.loss.backward()
    assert draft.fc.weight.grad is not None and draft.fc.weight.grad.abs().sum() > 0
    # step 1 by hand: output 0 at t scores the row t + 1 for label t + 2
    outputs = draft.unroll(draft.fuse(hidden), embeds, 1)
    keep = labels[:, 2:] != -100
    logits = draft.logits(outputs[0][:, : t - 2][keep])
    soft, inside = soft_targets(draft, topk_ids[:, 1 : t - 1][keep], topk_probs[:, 1 : t - 1][keep])
    assert bool(inside.all())
    expected = F.cross_entropy(logits, soft).detach()
    assert abs(float(out.metrics["step1_soft_loss"]) - float(expected)) < 1e-5
    # a small draft vocabulary: mass outside is dropped, the rest renormalised
    small = random_draft(draft_vocab=8)
    ids = torch.cat([small.vocab_ids[:2], (~small.t2d).nonzero()[:1, 0]])[None]  # two inside, one outside
    dense, inside = soft_targets(small, ids, torch.tensor([[0.5, 0.25, 0.25]]))
    assert bool(inside[0]) and torch.allclose(dense[0, :2], torch.tensor([2 / 3, 1 / 3]))


# --- the engine ---------------------------------------------------------------------------------------------------

TREES = {
    "chain": [(0,), (0, 0), (0, 0, 0)],
    "branching": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)],
}


def test_plan_levels_queries_the_nodes_with_children():
    tree = build_tree(TREES["branching"], num_heads=3, topk=3)
    levels = plan_levels(tree)
    depth = tree.depth.tolist()
    assert levels[0].queries == [0]
    assert all(depth[n] == d for d, level in enumerate(levels) for n in level.queries)
    # every non-root node is some level's child exactly once
    children = sorted(int(c) for level in levels for c in level.children)
    assert children == list(range(1, tree.num_nodes))
    # a level-2 query sees its depth-1 ancestor's slot and itself
    level2 = levels[2]
    assert level2.visible.sum(-1).tolist() == [2] * len(level2.queries)


# static trees by name, and EAGLE-2's dynamic trees by spec
TREE_SPECS = [*sorted(TREES), "dynamic", "dynamic:8:3:2", "dynamic:30:8:5", "dynamic:2:1:1"]


@pytest.mark.parametrize("tree_name", TREE_SPECS)
def test_greedy_output_is_plain_greedy(tiny_lm, tree_name):
    """Batched (3 rows of different lengths, left-padded), fp32: every row equals plain greedy decoding, for a close
    draft (drafts accepted) and a random one (almost none), with static and dynamic trees."""
    prompts = repetitive_prompts(7, 3)
    ids, mask = left_pad(prompts)
    config = DecodeConfig(max_new_tokens=20)
    plain = generate(tiny_lm, ids, None, config, attention_mask=mask).sequences
    tree = (build_tree(TREES[tree_name], num_heads=3, topk=3) if tree_name in TREES
            else eagle3_tree(tree_name, [], "cpu", draft_vocab=64))
    embed = tiny_lm.get_input_embeddings()
    close = generate(tiny_lm, ids, Eagle3Drafter(lm_head_eagle3(tiny_lm), tree, embed), config, attention_mask=mask)
    assert close.sequences == plain
    assert close.stats.mean_accepted > 0.1, close.stats.accepted
    far = generate(tiny_lm, ids, Eagle3Drafter(random_draft(), tree, embed), config, attention_mask=mask)
    assert far.sequences == plain
    wide = random_draft(intermediate_size=160)  # a draft layer wider than the target's MLP
    assert generate(tiny_lm, ids, Eagle3Drafter(wide, tree, embed), config, attention_mask=mask).sequences == plain


def first_draft(model: torch.nn.Module, tree, rows: int = 2, sharpness: float = 1.0):
    """The first step's draft of a random EAGLE-3 draft (fp64; logits scaled by `sharpness`) over random features of
    `rows` 6-token prompts."""
    draft = random_draft(draft_vocab=64).double()
    with torch.no_grad():
        draft.lm_head.weight.mul_(sharpness)
    prompt = torch.tensor([p[:6] for p in repetitive_prompts(6, rows)])
    features = torch.randn(rows, 6, draft.fc.in_features, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64)
    state = DecodeState(cache=DynamicCache(), valid=torch.ones(rows, 6, dtype=torch.bool),
                        next_pos=torch.full((rows,), 6), root=prompt[:, -1], hidden=None, prompt=prompt,
                        generated=[[] for _ in range(rows)], features=features)
    embed = torch.nn.Embedding.from_pretrained(model.get_input_embeddings().weight.detach().double())
    return Eagle3Drafter(draft, tree, embed).propose(state)


@pytest.mark.parametrize("spec", [DynamicTree(num_nodes=13, depth=2, topk=3), DynamicTree(num_nodes=12, depth=5, topk=3)])
def test_dynamic_tree_drafts_what_the_static_tree_of_its_shape_drafts(spec):
    """Two rows: the tokens of a grown tree equal those the static drafter (tested above for greedy identity) drafts
    for the same rank paths, so growing changes the shape, never a node's token. At depth 2 with room for every
    candidate, the tree holds all k + k*k of them."""
    model = build_tiny_lm("llama")
    grown = first_draft(model, spec, sharpness=4.0)
    static = first_draft(model, build_tree(grown.tree.choices, num_heads=spec.depth, topk=spec.topk), sharpness=4.0)
    assert grown.tree.num_nodes == spec.num_nodes
    assert torch.equal(grown.tokens, static.tokens)
    if spec.depth == 2:
        every = [(r,) for r in range(3)] + [(r, c) for r in range(3) for c in range(3)]
        assert sorted(grown.tree.choices) == sorted(every)
    else:
        assert grown.tree.max_depth > 2  # a confident draft's paths go deeper than a full tree of 12 nodes would


def test_drafts_score_each_path_by_its_draft_probability():
    """Draft.scores: the root 1, a node the product of the draft's probabilities along its path (so at most its
    parent's), siblings in rank order; the static and the grown tree of one shape score each node alike."""
    model = build_tiny_lm("llama")
    spec = DynamicTree(num_nodes=10, depth=3, topk=3)
    grown = first_draft(model, spec, sharpness=4.0)
    static = first_draft(model, build_tree(grown.tree.choices, num_heads=spec.depth, topk=spec.topk), sharpness=4.0)
    for draft in (grown, static):
        scores, parent = draft.scores, draft.tree.parent
        assert scores.shape == draft.tokens.shape and torch.all(scores[:, 0] == 1)
        assert torch.all(scores[:, 1:] <= scores[:, parent[1:]] + 1e-12) and torch.all(scores > 0)
        depth1 = [k + 1 for k, path in enumerate(draft.tree.choices) if len(path) == 1]  # rank order
        assert torch.all(scores[:, depth1[:-1]] >= scores[:, depth1[1:]])
        assert scores[:, depth1].sum(-1).max() <= 1 + 1e-9  # probabilities of distinct tokens
    assert torch.allclose(grown.scores, static.scores, rtol=1e-9)


def test_dynamic_tree_of_one_level_keeps_the_best_children_in_rank_order():
    model = build_tiny_lm("llama")
    assert first_draft(model, DynamicTree(num_nodes=4, depth=1, topk=5)).tree.choices == ((0,), (1,), (2,))


def test_candidates_rank_by_batch_probability_with_parents_first():
    """A path's value is its probability summed over the rows; ties go to the shallower path, so a child whose draft
    probability is 1 never precedes its parent."""
    found = Candidates(paths=[], parent=[], tokens=[], logp=[])
    ids = torch.tensor([[5, 6], [7, 8]])
    top = found.add(-1, ids, torch.log(torch.tensor([[0.6, 0.3], [0.2, 0.7]])))  # values 0.8, 1.0
    assert found.best(top, 2) == [1, 0]
    child = found.add(1, torch.tensor([[9], [9]]), found.logp[1][:, None] + 0.0)  # probability 1: ties its parent
    assert found.best(top + child, 3) == [1, 2, 0]
    assert found.paths == [(0,), (1,), (1, 0)]
    assert found.values([2]) == pytest.approx([1.0])


def test_dynamic_tree_specs_are_checked():
    assert eagle3_tree("dynamic:12:5:3", [], "cpu", 64) == DynamicTree(num_nodes=12, depth=5, topk=3)
    assert eagle3_tree("dynamic", [], "cpu", 64) == DynamicTree()
    for spec, needle in [("dynamic:1", "nodes must lie in"), ("dynamic:16:17", "depth must lie in"),
                         ("dynamic:16:4:11", r"topk must lie in \[1, 10\]"), ("dynamic:x", "whole numbers"),
                         ("dynamic:", "whole numbers"), ("dynamic:1:2:3:4", "whole numbers")]:
        with pytest.raises(TreeError, match=needle):
            eagle3_tree(spec, [], "cpu", 64)
    with pytest.raises(TreeError, match=r"topk must lie in \[1, 4\]"):
        eagle3_tree("dynamic:16:4:5", [], "cpu", draft_vocab=4)
    table = [[0.6, 0.2, 0.1], [0.5, 0.2], [0.4]]
    assert eagle3_tree("default:6", table, "cpu").choices == tuple(default_tree(table, 5))
    assert eagle3_tree("default:6", table, "cpu").num_nodes == 6
    for spec in ("default:1", "default:x", "default:"):
        with pytest.raises(TreeError, match="expected default:<nodes>"):
            eagle3_tree(spec, table, "cpu")


def test_sampled_decoding_runs_batched():
    """Sampling at temperature 0.8 through rejection sampling (deterministic drafts: the enumerated one-hot rule of
    tests/test_lossless_exact.py covers their law), left-padded, one generator: the same seed, the same tokens."""
    model = build_tiny_lm("llama")
    ids, mask = left_pad(repetitive_prompts(5, 2))
    drafter = lambda: Eagle3Drafter(lm_head_eagle3(model), build_tree(TREES["branching"], 3, 3),  # noqa: E731
                                    model.get_input_embeddings())
    config = DecodeConfig(max_new_tokens=12, sampling=SamplingParams(temperature=0.8))
    runs = [generate(model, ids, drafter(), config, attention_mask=mask, generator=torch.Generator().manual_seed(3))
            for _ in range(2)]
    assert runs[0].sequences == runs[1].sequences and all(len(s) == 12 for s in runs[0].sequences)


def test_default_tree_follows_the_measured_acceptance():
    acceptance = [[0.6, 0.2, 0.05], [0.5, 0.1, 0.0], [0.4, 0.1, 0.0]]
    choices = default_tree(acceptance, num_nodes=6)
    assert choices[0] == (0,) and (0, 0) in choices and len(choices) == 6
    assert default_tree([]) == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    with pytest.raises(TreeError, match="chain:<depth>"):
        eagle3_tree("chain", acceptance, "cpu")
    assert eagle3_tree("chain:5", acceptance, "cpu").max_depth == 5


# --- checkpoints ----------------------------------------------------------------------------------------------------

def test_checkpoint_round_trip_and_refusals(tmp_path):
    draft = random_draft(draft_vocab=32)
    save_eagle3(tmp_path / "ok", draft, "builtin:tiny")
    loaded = load_eagle3(tmp_path / "ok", target_vocab_size=128)
    hidden, embeds = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    assert torch.equal(loaded.unroll(hidden, embeds, 2)[1], draft.unroll(hidden, embeds, 2)[1])
    assert torch.equal(loaded.vocab_ids, draft.vocab_ids)
    with pytest.raises(DrafterMismatchError, match="vocabulary of 128 tokens, the target has 100"):
        check_eagle3_checkpoint(tmp_path / "ok", target_vocab_size=100)

    def corrupted(name: str, **tensors: torch.Tensor):
        from safetensors.torch import load_file, save_file
        folder = tmp_path / name
        save_eagle3(folder, draft, "builtin:tiny")
        state = load_file(str(folder / WEIGHTS_NAME))
        state.update(tensors)
        save_file(state, str(folder / WEIGHTS_NAME))
        return folder

    d2t = draft.d2t.clone()
    d2t[-1] = 500
    with pytest.raises(CheckpointError, match=r"d2t: ids must lie in \[0, 128\)"):
        check_eagle3_checkpoint(corrupted("range", d2t=d2t))
    dup = draft.d2t.clone()
    dup[1] = dup[0] - 1  # draft id 1 -> the same target id as draft id 0
    with pytest.raises(CheckpointError, match="duplicate ids"):
        check_eagle3_checkpoint(corrupted("dup", d2t=dup))
    with pytest.raises(CheckpointError, match=r"t2d has shape \(100,\)"):
        check_eagle3_checkpoint(corrupted("t2d", t2d=torch.zeros(100, dtype=torch.bool)))
    with pytest.raises(CheckpointError, match=r"d2t has shape \(31,\)"):
        check_eagle3_checkpoint(corrupted("size", d2t=draft.d2t[:31].clone()))
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    config["eagle3"]["layers"] = [7]
    (tmp_path / "ok" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"layers \[7\]"):
        check_eagle3_checkpoint(tmp_path / "ok")


def test_chain_acceptance_counts_only_positions_whose_shallower_drafts_were_right():
    """One row of 6 tokens: step 1 right at t = 0, 2, 3; step 2 (scored at t <= 2) right at 0, 1; step 3 (t <= 1)
    right at 1 only. Conditional acceptances 3/4, 1/2 (t = 0 of 0, 2), 0/1 (t = 0), so tau = 1 + .75 + .375."""
    chain = ChainCounter(3)
    chain.add(0, torch.tensor([[True] * 4]), torch.tensor([True, False, True, True]))
    chain.add(1, torch.tensor([[True] * 3]), torch.tensor([True, True, False]))
    chain.add(2, torch.tensor([[True] * 2]), torch.tensor([False, True]))
    assert chain.accept() == [0.75, 0.5, 0.0]
    assert chain.metrics()["tau_chain"] == pytest.approx(2.125)


@pytest.mark.parametrize("choices", [chain_choices(3), [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]],
                         ids=["chain3", "branching"])
def test_walk_estimate_equals_the_engines_forwards(tiny_lm, choices):
    """The training evaluation's ranks of the target's greedy continuations, replayed step by step through a static
    tree (`walk_forwards`), give exactly the target forwards the engine takes to decode the same prompts with the
    same draft and tree (fp32, greedy): the estimate is the engine's τ, not an approximation of it."""
    draft = lm_head_eagle3(tiny_lm)
    module = Eagle3TrainModule(tiny_lm, draft)
    prompts, new = repetitive_prompts(11, 4), 24
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
    counter = RankCounter(depth=5)
    for prompt in prompts:  # one at a time: greedy_continuations batches by length, so its order is not the prompts'
        for ids, mask, labels in greedy_continuations(tiny_lm, [prompt], new, tokenizer, batch_size=1):
            record_ranks(module, draft.config.layers, ids, mask, labels, 5, counter)
    assert len(counter.walk.texts) == len(prompts)
    tree = build_tree(choices, num_heads=max(map(len, choices)), topk=2)
    forwards = 0
    for prompt, (ranks, made) in zip(prompts, counter.walk.texts):
        out = generate(tiny_lm, torch.tensor([prompt]), Eagle3Drafter(draft, tree, tiny_lm.get_input_embeddings()),
                       DecodeConfig(max_new_tokens=new))
        assert out.stats.new_tokens == made
        assert walk_forwards(choices, ranks, made) == out.stats.target_forwards
        forwards += out.stats.target_forwards
    assert forwards < new * len(prompts)  # drafts were accepted: the equality is not the trivial one
    assert counter.walk.tau(choices) == pytest.approx(new * len(prompts) / forwards)


def test_build_tree_times_eagle3_drafting_per_depth(tiny_lm):
    """build-tree's drafting cost for an EAGLE-3 drafter: one positive figure per depth (each timed step drops the
    pairs and drafts it appended, or later depths would time a growing cache)."""
    from inference.bench.tree_fit import measure_eagle3_cost

    drafter = Eagle3Drafter(lm_head_eagle3(tiny_lm), build_tree(TREES["chain"], 3, 1), tiny_lm.get_input_embeddings())
    costs = measure_eagle3_cost(drafter, tiny_lm, context=12, topk=3, reps=2, max_depth=3)
    assert len(costs) == 3 and all(c > 0 for c in costs)
