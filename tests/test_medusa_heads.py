"""Medusa heads: init equals the base prediction, blocks are distinct, the weighted loss equals a naive loop."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from models.medusa import MedusaConfig, MedusaHeads, head_targets
from train.medusa1 import medusa_loss

D, V = 16, 37


def make_heads(num_heads=3, num_layers=2, share=False, seed=0) -> tuple[MedusaHeads, nn.Linear]:
    torch.manual_seed(seed)
    base = nn.Linear(D, V, bias=False)
    heads = MedusaHeads(MedusaConfig(num_heads, num_layers, D, V, share_lm_head=share))
    if not share:
        heads.init_from_base(base)
    return heads, base


@pytest.mark.parametrize("share", [False, True])
def test_heads_equal_base_prediction_at_init(share):
    heads, base = make_heads(share=share)
    hidden = torch.randn(2, 5, D)
    logits = heads(hidden, base if share else None)  # [K, B, T, V]
    assert logits.shape == (3, 2, 5, V)
    for k in range(3):
        torch.testing.assert_close(logits[k], base(hidden))


def test_blocks_and_heads_are_distinct_modules():
    heads, _ = make_heads(num_heads=3, num_layers=2)
    params = [p for p in heads.parameters()]
    assert len({id(p) for p in params}) == len(params)
    blocks = [b for h in heads.heads for b in h.blocks]
    assert len({id(b) for b in blocks}) == 6
    with torch.no_grad():
        heads.heads[0].blocks[0].linear.weight.add_(1.0)
    assert heads.heads[1].blocks[0].linear.weight.abs().sum() == 0
    assert heads.heads[0].blocks[1].linear.weight.abs().sum() == 0


def test_head_targets_offsets():
    labels = torch.tensor([[10, 11, 12, 13, 14]])
    # head k at position t predicts token t+k+1
    assert head_targets(labels, 1).tolist() == [[12, 13, 14, -100, -100]]
    assert head_targets(labels, 3).tolist() == [[14, -100, -100, -100, -100]]
    assert head_targets(labels, 5).tolist() == [[-100] * 5]


@pytest.mark.parametrize("decay", [0.8, 1.0])
def test_weighted_loss_equals_naive_per_head_loop(decay):
    heads, _ = make_heads(num_heads=3, num_layers=1, seed=1)
    for p in heads.parameters():  # move away from the identity init so heads differ
        nn.init.normal_(p, std=0.3)
    B, T = 3, 9
    hidden = torch.randn(B, T, D)
    labels = torch.randint(0, V, (B, T))
    labels[0, :4] = -100  # prompt
    labels[2, 6:] = -100  # padding
    out = medusa_loss(heads, hidden, labels, decay)

    naive = torch.zeros(())
    for k in range(1, 4):
        logits = heads.head_logits(k - 1, hidden)  # [B, T, V]
        total, count = torch.zeros(()), 0
        for b in range(B):
            for t in range(T):
                if t + k + 1 < T and labels[b, t + k + 1] != -100:
                    total = total + F.cross_entropy(logits[b, t][None], labels[b, t + k + 1][None], reduction="sum")
                    count += 1
        naive = naive + decay**k * total / count
    torch.testing.assert_close(out.loss, naive)

    grads = torch.autograd.grad(out.loss, list(heads.parameters()))
    naive_grads = torch.autograd.grad(naive, list(heads.parameters()))
    for g, n in zip(grads, naive_grads):
        torch.testing.assert_close(g, n)
    assert set(out.metrics) >= {"head1_top1", "head1_top5", "head3_loss"}


def test_fp32_heads_sharing_a_bf16_lm_head_train():
    # Medusa-1 keeps heads in fp32 over a bf16 backbone; shared-lm_head heads must feed that lm_head in bf16.
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=16, vocab_size=40, share_lm_head=True))
    for p in heads.parameters():
        nn.init.normal_(p, std=0.1)
    lm_head = nn.Linear(16, 40, bias=False).to(torch.bfloat16).requires_grad_(False)
    hidden = torch.randn(2, 5, 16)
    logits = heads.head_logits(0, hidden, lm_head)  # [B, T, V]
    assert logits.dtype == torch.bfloat16 and logits.shape == (2, 5, 40)
    assert heads(hidden, lm_head).shape == (2, 2, 5, 40)
    medusa_loss(heads, hidden, torch.randint(0, 40, (2, 5)), 0.8, lm_head).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads.parameters())


@pytest.mark.parametrize("weight", [0.5, 1.0])
@pytest.mark.parametrize("draft_vocab", [False, True])
def test_soft_label_loss_equals_naive_per_position_loop(weight, draft_vocab):
    """(1 - w) · CE(x_{t+k+1}) + w · CE(softmax(lm_head(h_{t+k}))): the target's own distribution one step before the
    head's token, over the heads' vocabulary (renormalised over the draft ids), values and gradients."""
    heads, base = make_heads(num_heads=3, num_layers=1, seed=2)
    if draft_vocab:
        ids = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:20]
        config = MedusaConfig(**{**heads.config.__dict__, "draft_vocab_size": 20})
        heads = MedusaHeads(config)
        heads.set_draft_vocab(ids)
        heads.init_from_base(base)
    for p in heads.parameters():
        nn.init.normal_(p, std=0.3)
    B, T, decay = 2, 10, 0.8
    hidden = torch.randn(B, T, D)
    labels = torch.randint(0, V, (B, T))
    labels[0, :3] = -100
    out = medusa_loss(heads, hidden, labels, decay, soft_weight=weight, base_lm_head=base)

    naive = torch.zeros(())
    for k in range(1, 4):
        logits = heads.head_logits(k - 1, hidden)  # [B, T, V|S]
        targets = heads.draft_targets(head_targets(labels, k))
        total, count = torch.zeros(()), 0
        for b in range(B):
            for t in range(T):
                if targets[b, t] == -100:
                    continue
                teacher = base(hidden[b, t + k])  # [V]: the target's prediction of x_{t+k+1}
                if draft_vocab:
                    teacher = teacher[heads.vocab_ids]
                log_q = logits[b, t].log_softmax(-1)
                hard = -log_q[targets[b, t]]
                soft = -(teacher.softmax(-1).detach() * log_q).sum()
                total = total + (1 - weight) * hard + weight * soft
                count += 1
        naive = naive + decay**k * total / count
    torch.testing.assert_close(out.loss, naive)
    grads = torch.autograd.grad(out.loss, list(heads.parameters()), allow_unused=True)
    naive_grads = torch.autograd.grad(naive, list(heads.parameters()), allow_unused=True)
    for g, n in zip(grads, naive_grads):
        if n is None:
            assert g is None or g.abs().sum() == 0
        else:
            torch.testing.assert_close(g, n)
    assert {"head1_soft_loss", "head3_soft_loss"} <= set(out.metrics)
    out = medusa_loss(heads, hidden, labels, decay, soft_weight=weight, base_lm_head=base)
    assert torch.autograd.grad(out.loss, [base.weight], allow_unused=True) == (None,)  # the teacher is a constant


def test_soft_labels_without_the_target_lm_head_are_refused():
    heads, _ = make_heads()
    with pytest.raises(ValueError, match="base_lm_head"):
        medusa_loss(heads, torch.randn(1, 6, D), torch.randint(0, V, (1, 6)), 0.8, soft_weight=0.5)


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("tree", ["chain", "default"])
def test_walk_estimate_equals_the_engines_tau(tiny_lm_factory, tree):
    """medusa1's evaluation on the target's greedy continuations replays them through the engine's chain and default
    tree (`ContinuationWalk`): its τ equals the engine's tokens / target forwards on the same prompts, with the same
    heads (fp32, greedy), and drafts were accepted, so the equality is not the trivial one."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from inference.bench.engine_check import lm_head_heads
    from inference.drafters.medusa import MedusaDrafter
    from inference.engine.loop import DecodeConfig, generate
    from inference.engine.tree import load_tree
    from tests.test_lookahead import repetitive_prompts
    from train.medusa1 import MedusaTrainModule, Method

    model = tiny_lm_factory("llama")
    heads = lm_head_heads(model, 3)
    prompts, new = repetitive_prompts(5, 4), 24
    cfg = OmegaConf.create({"method": {"num_heads": 3}, "eval": {"greedy_new_tokens": new, "max_batches": None},
                            "training": {"per_device_eval_batch_size": 1}})
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
    metrics = Method(cfg).evaluate(MedusaTrainModule(model, heads), [], tokenizer, prompts)
    drafter = MedusaDrafter(heads, load_tree(tree, num_heads=3, topk=10), model.get_output_embeddings())
    tokens = forwards = 0
    for prompt in prompts:
        stats = generate(model, torch.tensor([prompt]), drafter, DecodeConfig(max_new_tokens=new)).stats
        tokens, forwards = tokens + stats.new_tokens, forwards + stats.target_forwards
    assert forwards < tokens
    assert metrics[f"greedy_tau_walk_{'tree' if tree == 'default' else tree}"] == pytest.approx(tokens / forwards)
