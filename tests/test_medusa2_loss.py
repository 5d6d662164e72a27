"""Medusa-2's loss and optimizer: the loss equals a naive full-logits reference (values and gradients), the head-term
schedule, optimizer groups with the heads' learning-rate multiplier, and the self-distillation teacher (the LoRA
backbone with adapters disabled) equals the original model."""

import math

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, TrainingArguments

from models.medusa import MedusaConfig, MedusaHeads
from tests.medusa2_support import medusa2_config
from tests.model_support import tiny_config
from train.medusa2 import LossWeights, head_schedule, medusa2_loss, original_logits
from train.medusa2_backbone import BackboneOptions, prepare_backbone

B, T, D, V, K = 3, 9, 16, 23, 3


def random_heads(share: bool, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(num_heads=K, num_layers=1, hidden_size=D, vocab_size=V, share_lm_head=share))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)  # non-zero residual blocks: the test sees them
    return heads


def random_batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :3] = -100  # a prompt
    labels[1, -2:] = -100  # padding
    labels[2, 4] = -100  # a hole inside a row
    return hidden, labels


def naive_loss(heads, hidden, labels, lm_head, w: LossWeights, teacher=None):
    """Every position through lm_head and every head; shift by hand; CE with ignore_index."""
    lm_logits = lm_head(hidden)[:, :-1].reshape(-1, V)
    lm_targets = labels[:, 1:].reshape(-1)
    if teacher is None:
        lm = F.cross_entropy(lm_logits, lm_targets, ignore_index=-100)
    else:
        keep = lm_targets != -100
        p = F.softmax(teacher, -1)
        lm = (p * (p.log() - F.log_softmax(lm_logits[keep], -1))).sum(-1).mean()
    logits = heads(hidden, lm_head if heads.config.share_lm_head else None)  # [K, B, T, V]
    head_term = 0.0
    for k in range(1, K + 1):  # head k predicts token t+k+1
        ce = F.cross_entropy(logits[k - 1][:, : -(k + 1)].reshape(-1, V), labels[:, k + 1 :].reshape(-1), ignore_index=-100)
        head_term = head_term + w.decay**k * ce
    return w.lm * lm + w.heads * w.schedule * head_term


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("kl", [False, True])
def test_loss_equals_naive_reference(share, kl):
    heads = random_heads(share)
    torch.manual_seed(2)
    lm_head = torch.nn.Linear(D, V, bias=False)
    hidden, labels = random_batch()
    weights = LossWeights(lm=0.7, heads=0.2, decay=0.8, schedule=0.5)
    teacher = None
    if kl:
        keep = labels[:, 1:] != -100
        teacher = torch.randn(int(keep.sum()), V, generator=torch.Generator().manual_seed(3))  # [N, V], row order

    out = medusa2_loss(heads, hidden, labels, lm_head, weights, teacher)
    params = [hidden, *heads.parameters(), lm_head.weight]
    grads = torch.autograd.grad(out.loss, params)
    ref = naive_loss(heads, hidden, labels, lm_head, weights, teacher)
    ref_grads = torch.autograd.grad(ref, params)

    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert hidden.grad is None and grads[0].abs().sum() > 0  # the backbone gets a gradient
    assert set(out.metrics) >= {"lm_loss", "head1_loss", f"head{K}_loss", "head_term_weight"}
    assert ("lm_kl" in out.metrics) == kl


def test_loss_terms_are_separable():
    """λ0 = 0 leaves the head term alone, c = 0 the LM term alone (each equal to its own naive value)."""
    heads, (hidden, labels) = random_heads(False), random_batch()
    lm_head = torch.nn.Linear(D, V, bias=False)
    lm_only = medusa2_loss(heads, hidden, labels, lm_head, LossWeights(lm=1.0, heads=0.0, decay=0.8, schedule=1.0))
    ce = F.cross_entropy(lm_head(hidden)[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(lm_only.loss, ce)
    heads_only = medusa2_loss(heads, hidden, labels, lm_head, LossWeights(lm=0.0, heads=1.0, decay=1.0, schedule=1.0))
    torch.testing.assert_close(heads_only.loss, sum(heads_only.metrics[f"head{k}_loss"] for k in range(1, K + 1)))


def test_head_schedule():
    assert head_schedule("constant", 0.0) == 1.0 and head_schedule("constant", 0.7) == 1.0
    assert head_schedule("linear", 0.25) == pytest.approx(0.25)
    assert head_schedule("sine", 0.0) == 0.0 and head_schedule("sine", 1.0) == pytest.approx(1.0)
    assert head_schedule("sine", 1 / 3) == pytest.approx(math.sin(math.pi / 6))
    assert head_schedule("linear", 0.1, fraction=0.2) == pytest.approx(0.5)  # the ramp ends at 20% of the phase
    assert head_schedule("sine", 0.5, fraction=0.2) == 1.0
    assert head_schedule("linear", -0.5) == 0.0  # before the joint phase
    with pytest.raises(ValueError, match="cosine"):
        head_schedule("cosine", 0.5)


def fresh_lm(seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=64), dtype=torch.float32)
    return model.eval().requires_grad_(False)


def test_teacher_with_adapters_disabled_equals_original():
    original = fresh_lm()
    backbone = prepare_backbone(fresh_lm(), BackboneOptions(kind="lora", quantized=False, lora_r=4, lora_dropout=0.0))
    with torch.no_grad():  # train the adapter a little: non-zero B, so the adapted model differs from the original
        for name, p in backbone.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 64, (2, 7), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0  # left padding
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != -100

    teacher = original_logits(backbone, input_ids, attention_mask, labels)  # [N, V]
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        want = original(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits[keep]
        adapted = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits[keep]
    torch.testing.assert_close(teacher, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(adapted, want, atol=1e-3)  # the adapters are back on afterwards
    assert backbone.training  # and the backbone's mode is restored


def test_optimizer_groups_and_multiplier(tmp_path):
    from train.trainer import DraftTrainer, LossModule
    from train.medusa2 import Method

    cfg = medusa2_config("method.heads_lr_multiplier=4", "training.weight_decay=0.1", "method.lora_r=4")
    method = Method(cfg)
    model = method.build(fresh_lm(), tokenizer=None)
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-3, weight_decay=0.1, use_cpu=True, report_to=[])
    trainer = DraftTrainer(model=LossModule(model, method), args=args, method=method, prompts=[], extra={})
    optimizer = trainer.create_optimizer()

    groups = {g["name"]: g for g in optimizer.param_groups}
    assert groups["backbone"]["lr"] == pytest.approx(1e-3) and groups["heads"]["lr"] == pytest.approx(4e-3)
    assert groups["heads_no_decay"]["lr"] == pytest.approx(4e-3) and groups["heads_no_decay"]["weight_decay"] == 0.0
    assert groups["backbone"]["weight_decay"] == 0.1 and groups["heads"]["weight_decay"] == 0.1
    in_groups = [id(p) for g in optimizer.param_groups for p in g["params"]]
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert sorted(in_groups) == sorted(trainable) and len(set(in_groups)) == len(in_groups)
    head_ids = {id(p) for p in model.heads.parameters()}
    assert {id(p) for p in groups["heads"]["params"]} | {id(p) for p in groups["heads_no_decay"]["params"]} == head_ids
    assert all("lora_" in n for n, p in model.target.named_parameters() if p.requires_grad)
    assert method in trainer.callback_handler.callbacks  # the step reaches the loss schedule


def test_full_backbone_trains_every_weight():
    from train.medusa2 import Method

    method = Method(medusa2_config("method.backbone=full"))
    model = method.build(fresh_lm(), tokenizer=None)
    assert all(p.requires_grad for p in model.parameters())
    groups = method.param_groups(model, 1e-5)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


@pytest.mark.parametrize("override, message", [
    ("method.backbone=adapter", "method.backbone=adapter: choose one of lora, full"),
    ("method.lm_loss=mse", "method.lm_loss=mse: choose one of ce, kl"),
    ("method.head_schedule=cosine", "method.head_schedule=cosine: choose one of constant, linear, sine"),
])
def test_bad_choices_are_refused_at_composition(override, message):
    from train.cli import UsageError, parse
    from train.config import register_configs

    register_configs()

    with pytest.raises(UsageError) as info:
        parse(["medusa2", "+model=tiny", override])
    assert str(info.value) == message


def test_bad_settings_are_one_line_errors():
    from train.cli import UsageError
    from train.medusa2 import Method

    with pytest.raises(UsageError, match="method.heads_warmup_steps"):
        Method(medusa2_config("method.heads_warmup_steps=10", "training.max_steps=5"))
    with pytest.raises(UsageError, match="QLoRA"):
        Method(medusa2_config("method.backbone=full", "model.quantization=nf4"))
    with pytest.raises(UsageError, match="adapters disabled"):
        Method(medusa2_config("method.backbone=full", "method.lm_loss=kl"))
