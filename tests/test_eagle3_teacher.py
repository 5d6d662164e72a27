"""EAGLE-3's full teacher (method.teacher=full, train/eagle3_teacher.py): the same loss as the top-k teacher when k = V
(values, gradients, metrics; any chunking), the distribution recomputed from a cache the writer made equal to the
online forward's (and to the target's own softmax over the draft ids), and a bad value refused in one line."""

from __future__ import annotations


import pytest
import torch
from hydra import compose, initialize_config_module

from data.features import FeatureCollator, FeatureDataset
from models.loading import load_target
from tests.conftest import build_tiny_lm
from tests.data_support import random_chats, write_sharegpt
from tests.features_support import extract
from tests.model_support import save_tiny_model
from tests.test_eagle3 import random_draft
from train.cli import UsageError, parse
from train.config import Eagle3Teacher, register_configs
from train.eagle3 import Eagle3TrainModule, Method, eagle3_loss
from train.eagle3_teacher import TEACHERS, TopkTeacher, full_teacher

pytestmark = pytest.mark.usefixtures("single_thread")
register_configs()


def perturbed(draft, seed: int = 1):
    torch.manual_seed(seed)
    for p in draft.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    return draft


@pytest.mark.parametrize("draft_vocab", [128, 48], ids=["S=V", "S<V"])
def test_full_teacher_is_the_topk_teacher_at_k_equal_v(draft_vocab):
    """The top-k teacher with k = V (every id, the target's softmax) and the full teacher give one loss (1e-6), the
    same gradients and metrics, over the whole vocabulary and over a draft vocabulary that drops some of the mass;
    the full teacher's chunking changes nothing."""
    target = build_tiny_lm()
    draft = random_draft(layers=(1, 2), draft_vocab=draft_vocab)
    model = Eagle3TrainModule(target, draft)
    b, t = 3, 12
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (b, t))
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0
    labels = ids.clone()
    labels[:, :3] = -100
    labels[mask == 0] = -100
    feats = model.target_features(ids, mask, (1, 2), teacher="full")
    logits = target(input_ids=ids, attention_mask=mask).logits  # [B, T, V]
    top = logits.float().softmax(-1).topk(128, dim=-1)
    hidden = torch.cat([feats["layer_1"], feats["layer_2"]], dim=-1)
    embeds = model.embed(ids)
    lm_head = target.get_output_embeddings()
    teachers = {"topk": TopkTeacher(top.indices, top.values),
                "full": full_teacher(draft, lm_head, feats["hidden"], labels),
                "full-chunked": full_teacher(draft, lm_head, feats["hidden"], labels, chunk=5)}
    outs, grads = {}, {}
    for name, teacher in teachers.items():
        outs[name] = eagle3_loss(draft, hidden, embeds, labels, teacher, steps=3, decay=0.8, soft_weight=1.0)
        grads[name] = torch.autograd.grad(outs[name].loss, [p for p in draft.parameters() if p.requires_grad])
    for name in ("full", "full-chunked"):
        assert abs(float(outs[name].loss.detach()) - float(outs["topk"].loss.detach())) < 1e-6
        assert outs[name].metrics.keys() == outs["topk"].metrics.keys()
        for key, value in outs["topk"].metrics.items():
            assert abs(float(outs[name].metrics[key]) - float(value)) < 1e-6, key
        for a, b_ in zip(grads[name], grads["topk"]):
            torch.testing.assert_close(a, b_, rtol=0, atol=1e-6)
    # the row of position t is the target's softmax over the draft ids at t, renormalised there
    full = teachers["full"]
    b0, t0 = 1, 6
    expected = logits[b0, t0].softmax(-1)[draft.vocab_ids]
    torch.testing.assert_close(full.probs[full.row[b0, t0]], expected / expected.sum(), rtol=0, atol=1e-6)
    assert int(full.row[0, 1]) == -1 and int(full.row[2, 8]) == -1  # token t + 1 untrained (prompt, padding)


@pytest.fixture(scope="module")
def cache_run(tmp_path_factory):
    """A tiny random target, a chat file, and a feature cache of it made by `python -m train features` with no soft
    labels (method.topk=0: the full teacher reads the stored last hidden state)."""
    root = tmp_path_factory.mktemp("teacher")
    model_dir = save_tiny_model(root / "llama", initializer_range=0.2)
    data = write_sharegpt(root / "chats.json", random_chats(8, user=lambda i: 3 + i % 4, reply=lambda i: 5 + i % 7))
    cache = root / "cache"
    extract(model_dir, data, cache, "method.topk=0", "method.layers=[1,2]")
    return model_dir, cache


def test_cached_full_teacher_equals_the_online_one(cache_run):
    """The trainer's loss from the cache (lm_head over the stored last hidden state) equals its online loss (the
    target's forward each step): the same teacher rows (1e-6), loss (1e-5) and metrics."""
    model_dir, cache = cache_run
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["method=eagle3", "+model=tiny", f"model.path={model_dir}",
                                                      "method.teacher=full", "method.layers=[1,2]",
                                                      "method.draft_vocab=60", "method.ttt_steps=3"])
    method = Method(cfg)
    assert method.feature_needs() == ([1, 2], False)  # no top-k soft labels needed from the cache
    target = load_target(str(model_dir), dtype="fp32")
    model = method.build(target, tokenizer=None)
    torch.manual_seed(0)
    model.draft.set_draft_vocab(torch.randperm(model.draft.config.vocab_size)[:60])  # some mass outside
    perturbed(model.draft)
    dataset = FeatureDataset(cache, "train", layers=[1, 2])
    batch = FeatureCollator(pad_token_id=0)([dataset[i] for i in range(4)])
    online = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    feats = model.target_features(online["input_ids"], online["attention_mask"], (1, 2), teacher="full")
    lm_head = target.get_output_embeddings()
    from_cache = full_teacher(model.draft, lm_head, batch["hidden"], batch["labels"])
    from_forward = full_teacher(model.draft, lm_head, feats["hidden"], batch["labels"])
    assert torch.equal(from_cache.row, from_forward.row) and torch.equal(from_cache.argmax, from_forward.argmax)
    torch.testing.assert_close(from_cache.probs, from_forward.probs, rtol=0, atol=1e-6)
    assert len(from_cache.probs) == int((batch["labels"][:, 1:] != -100).sum())
    cached, live = method._loss(model, batch, 3), method._loss(model, online, 3)
    assert abs(float(cached.loss.detach()) - float(live.loss.detach())) < 1e-5 and float(live.loss.detach()) > 0
    for key, value in live.metrics.items():
        assert abs(float(cached.metrics[key]) - float(value)) < 1e-5, key


def test_the_teacher_choices_and_a_bad_value():
    assert [str(c) for c in Eagle3Teacher] == list(TEACHERS)
    with pytest.raises(UsageError) as info:
        parse(["eagle3", "+model=tiny", "method.teacher=all"])
    assert str(info.value) == "method.teacher=all: choose one of topk, full"
