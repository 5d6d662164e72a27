"""Medusa heads with a trained draft vocabulary (method.draft_vocab=S): loss, candidates, decoding and checkpoints
against the same heads over the full vocabulary restricted to the S columns."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from inference.drafters.medusa import MedusaDrafter
from inference.engine.loop import DecodeConfig, generate
from inference.engine.tree import load_tree
from models.checkpoint import CheckpointError, load_drafter, most_frequent, save_drafter
from models.interop import export_vllm
from models.medusa import MedusaConfig, MedusaHeads, head_targets
from tests.test_generate import VOCAB, normal_heads, plain_greedy, random_prompts
from train.medusa1 import medusa_loss

S = 40


def draft_copy(full: MedusaHeads, ids: torch.Tensor) -> MedusaHeads:
    """The same heads predicting over `ids` only: blocks shared by value, own projections cut to the S rows."""
    config = MedusaConfig(**{**full.config.__dict__, "draft_vocab_size": len(ids)})
    heads = MedusaHeads(config)
    heads.set_draft_vocab(ids)
    state = full.state_dict()
    for k, head in enumerate(heads.heads):
        if head.lm_head is not None:
            state[f"heads.{k}.lm_head.weight"] = state[f"heads.{k}.lm_head.weight"][ids]
    heads.load_state_dict({**state, "vocab_ids": ids})
    return heads


def vocab_ids(seed: int = 0) -> torch.Tensor:
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:S]


def test_draft_targets_map_into_the_draft_vocabulary():
    heads = draft_copy(normal_heads(False, seed=1), vocab_ids())
    ids = heads.vocab_ids
    outside = next(t for t in range(VOCAB) if t not in set(ids.tolist()))
    targets = torch.tensor([[ids[3].item(), -100, outside, ids[0].item()]])
    assert heads.draft_targets(targets).tolist() == [[3, -100, -100, 0]]
    assert heads.draft_targets(targets, missing=S).tolist() == [[3, -100, S, 0]]
    plain = normal_heads(False, seed=1)
    assert plain.draft_targets(targets) is targets


@pytest.mark.parametrize("shared", [False, True])
def test_loss_equals_full_vocabulary_heads_restricted_to_the_draft_columns(tiny_lm_factory, shared):
    """medusa_loss over S columns == CE of the full heads' logits[..., ids] on the in-vocabulary targets (values and
    gradients of the residual blocks)."""
    lm_head = tiny_lm_factory("llama").get_output_embeddings()
    full = normal_heads(shared, seed=2)
    ids = vocab_ids(1)
    draft = draft_copy(full, ids)
    hidden = torch.randn(2, 9, 32)
    labels = torch.randint(0, VOCAB, (2, 9))
    labels[0, :2] = -100
    labels[:, 4] = ids[5]  # make sure some targets are inside
    base = lm_head if shared else None
    got = medusa_loss(draft, hidden, labels, decay=0.8, lm_head=base)
    want = torch.zeros(())
    lookup = {t: i for i, t in enumerate(ids.tolist())}
    for k in range(3):
        logits = full.head_logits(k, hidden, base)[..., ids].reshape(-1, S)  # [B*T, S]
        target = head_targets(labels, k + 1).flatten().tolist()
        rows = [i for i, t in enumerate(target) if t in lookup]
        want = want + 0.8 ** (k + 1) * F.cross_entropy(logits[rows], torch.tensor([lookup[target[i]] for i in rows]))
    torch.testing.assert_close(got.loss, want)
    in_vocab = torch.stack([head_targets(labels, k) for k in (1, 2, 3)])
    assert 0 < got.metrics["draft_vocab_coverage"] < 1
    assert got.metrics["draft_vocab_coverage"] == pytest.approx(
        torch.isin(in_vocab, ids).sum().item() / (in_vocab != -100).sum().item())
    got.loss.backward()
    want_grad = torch.autograd.grad(want, full.heads[0].blocks[0].linear.weight)[0]
    torch.testing.assert_close(draft.heads[0].blocks[0].linear.weight.grad, want_grad)


@pytest.mark.parametrize("shared", [False, True])
def test_drafting_and_decoding_with_a_draft_vocabulary_are_exact(tiny_lm_factory, shared):
    """Candidates are the full heads' top-k over the S columns, as full ids; decoding equals plain greedy."""
    model = tiny_lm_factory("llama")
    lm_head = model.get_output_embeddings()
    base = lm_head if shared else None
    full = normal_heads(shared, seed=3)
    ids = vocab_ids(2)
    tree = load_tree(None, num_heads=3, topk=10)
    hidden = torch.randn(2, 32)
    got = MedusaDrafter(draft_copy(full, ids), tree, base).candidates(hidden)
    assert torch.equal(got, MedusaDrafter(full, tree, base, ids).candidates(hidden))  # == the serving shortlist
    assert torch.isin(got, ids).all()
    drafter = MedusaDrafter(draft_copy(full, ids), tree, base)
    prompts = random_prompts(41, 3)
    width = max(map(len, prompts))
    batch = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = generate(model, batch, drafter, DecodeConfig(max_new_tokens=12), attention_mask=mask)
    assert out.sequences == [plain_greedy(model, p, 12) for p in prompts]
    with pytest.raises(ValueError, match="draft vocabulary of 40"):
        MedusaDrafter(draft_copy(full, ids), tree, base, ids[:20])


def test_checkpoint_keeps_the_draft_vocabulary(tmp_path):
    heads = draft_copy(normal_heads(False, seed=4), vocab_ids(3))
    save_drafter(tmp_path / "ckpt", heads, "some/base")
    loaded = load_drafter(tmp_path / "ckpt")
    assert loaded.config["draft_vocab_size"] == S
    assert torch.equal(loaded.heads.vocab_ids, heads.vocab_ids)
    assert torch.equal(loaded.heads.heads[1].lm_head.weight, heads.heads[1].lm_head.weight)
    with pytest.raises(CheckpointError, match="no vLLM layout"):
        export_vllm(tmp_path / "ckpt", tmp_path / "vllm")
    assert not (tmp_path / "vllm").exists()


def rewrite_vocab_ids(checkpoint, ids: torch.Tensor) -> None:
    """Replace the stored vocab_ids of a saved checkpoint (a damaged or hand-edited file)."""
    weights = checkpoint / "drafter.safetensors"
    state = load_file(str(weights))
    save_file({**state, "vocab_ids": ids}, str(weights))


@pytest.mark.parametrize("ids, message", [
    (torch.arange(S - 1) + 5, rf"expected {S} ids \(draft_vocab_size={S}\), got shape \({S - 1},\)"),
    (torch.arange(S) + VOCAB - 10, rf"ids must lie in \[0, {VOCAB}\) \(the target's vocabulary\), got "
                                   rf"\[{VOCAB - 10}, {VOCAB + S - 11}\]"),
    (torch.arange(S) - 1, rf"ids must lie in \[0, {VOCAB}\) \(the target's vocabulary\), got \[-1, {S - 2}\]"),
    (torch.cat([torch.arange(S - 2), torch.tensor([3, 7])]), r"duplicate ids \(2 repeated, first 3\)"),
    (torch.arange(S).float(), r"expected integer token ids, got float32"),
], ids=["size", "beyond-vocab", "negative", "duplicates", "float"])
def test_bad_vocab_ids_are_refused_at_load(tmp_path, ids, message):
    """A checkpoint whose vocab_ids are not draft_vocab_size distinct ids of the vocabulary is refused by
    load_drafter, in one line naming the file, instead of failing inside the heads' index_select later."""
    path = save_drafter(tmp_path / "ckpt", draft_copy(normal_heads(False, seed=4), vocab_ids(3)), "some/base")
    rewrite_vocab_ids(path, ids)
    with pytest.raises(CheckpointError) as info:
        load_drafter(path)
    assert re.fullmatch(re.escape(f"{path / 'drafter.safetensors'}: vocab_ids: ") + message, str(info.value)), \
        str(info.value)


def test_missing_vocab_ids_are_refused_at_load(tmp_path):
    path = save_drafter(tmp_path / "ckpt", draft_copy(normal_heads(False, seed=4), vocab_ids(3)), "some/base")
    weights = path / "drafter.safetensors"
    save_file({k: v for k, v in load_file(str(weights)).items() if k != "vocab_ids"}, str(weights))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(weights))}: no vocab_ids, but config.json sets "
                                              rf"draft_vocab_size={S}$"):
        load_drafter(path)


def test_bad_draft_vocabularies_are_refused():
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, vocab_size=128\]"):
        MedusaConfig(num_heads=1, num_layers=1, hidden_size=8, vocab_size=128, draft_vocab_size=129)
    heads = MedusaHeads(MedusaConfig(num_heads=1, num_layers=1, hidden_size=8, vocab_size=128, draft_vocab_size=4))
    with pytest.raises(ValueError, match=r"^set_draft_vocab: duplicate ids \(1 repeated, first 2\)$"):
        heads.set_draft_vocab(torch.tensor([1, 2, 2, 3]))
    with pytest.raises(ValueError, match=r"^set_draft_vocab: ids must lie in \[0, 128\)"):
        heads.set_draft_vocab(torch.tensor([1, 2, 3, 128]))
    with pytest.raises(ValueError, match="expected 4 ids"):
        heads.set_draft_vocab(torch.arange(5))


def test_most_frequent_orders_by_count_then_id():
    counts = torch.tensor([3, 0, 7, 3, 1])
    assert most_frequent(counts, 4).tolist() == [2, 0, 3, 4]


def test_tree_builder_scores_draft_vocabulary_heads_in_full_ids():
    """build-tree's rank accuracy of draft-vocabulary heads == that of the full heads over the same columns: with
    every id in the draft vocabulary (any order) the counts are the full heads' own; targets outside count as misses."""
    from inference.bench.tree_fit import RankCounter, score_heads

    full = normal_heads(False, seed=5)
    hidden = torch.randn(2, 10, 32)
    labels = torch.randint(0, VOCAB, (2, 10))
    everything = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4))
    want, got = RankCounter(3, 10), RankCounter(3, 10)
    score_heads(want, full, hidden, labels, None)
    score_heads(got, draft_copy(full, everything), hidden, labels, None)
    assert torch.equal(got.hits, want.hits) and torch.equal(got.count, want.count) and want.hits.sum() > 0
    few = RankCounter(3, 10)
    score_heads(few, draft_copy(full, vocab_ids(5)), hidden, labels, None)
    assert torch.equal(few.count, want.count) and (few.hits.sum(1) <= want.hits.sum(1)).all()
