"""CLLM losses == naive per-row references (values and gradients); trajectory records, dataset and collator."""

import copy
import json

import pytest
import torch
from torch.nn import functional as F

from data.chat import IGNORE_INDEX
from data.jacobi import TrajectoryCollator, TrajectoryDataset, longest_run, trajectory_record, PromptSample
from train.cllm import LossSettings, ar_loss, block_logits, cllm_loss, consistency_loss

N = 4


def naive_divergence(logits: torch.Tensor, teacher: torch.Tensor, divergence: str) -> torch.Tensor:
    total = []
    for q_row, p_row in zip(logits.reshape(-1, logits.shape[-1]), teacher.reshape(-1, teacher.shape[-1])):
        p, log_q = p_row.softmax(-1), q_row.log_softmax(-1)
        ce = -(p * log_q).sum()
        total.append(ce + (p * p.log()).sum() if divergence == "kl" else ce)
    return torch.stack(total).mean()


@pytest.mark.parametrize("divergence", ["kl", "soft_ce"])
def test_consistency_loss_equals_naive(divergence):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, N, 11, generator=g, requires_grad=True)
    teacher = torch.randn(3, N, 11, generator=g)
    got = consistency_loss(logits, teacher, divergence)
    want = naive_divergence(logits, teacher, divergence)
    torch.testing.assert_close(got, want)
    (grad_got,) = torch.autograd.grad(got, logits)
    (grad_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(grad_got, grad_want)
    if divergence == "kl":
        assert float(consistency_loss(teacher, teacher, "kl")) == pytest.approx(0.0, abs=1e-6)


def make_record(rid: str, prompt: list[int], blocks: list[list[list[int]]]) -> dict:
    return trajectory_record(PromptSample(rid, tuple(prompt), tuple(prompt + [9, 9]),
                                          tuple([IGNORE_INDEX] * len(prompt) + [9, 9])), blocks, N, "random", 0)


RECORDS = [
    make_record("a", [1, 5, 7], [[[3, 3, 3, 3], [10, 11, 3, 3], [10, 11, 12, 13]], [[1, 1, 1, 1], [20, 21, 22, 23]]]),
    make_record("b", [1, 8, 9, 4, 6], [[[5, 6, 7, 8], [30, 6, 7, 9], [30, 31, 32, 33]]]),
]


def test_dataset_items_follow_the_record():
    dataset = TrajectoryDataset(RECORDS, "target_output")
    assert len(dataset) == 2 + 1 + 2  # states before each fixed point
    item = dataset[2]  # record a, block 1, state 0
    assert item["prefix"] == [1, 5, 7, 10, 11, 12, 13]
    assert item["state"] == [1, 1, 1, 1] and item["next_state"] == item["fixed_point"] == [20, 21, 22, 23]
    assert item["ar_ids"] == [1, 5, 7, 10, 11, 12, 13, 20, 21, 22, 23]
    assert item["ar_labels"] == [IGNORE_INDEX] * 3 + [10, 11, 12, 13, 20, 21, 22, 23]
    truth = TrajectoryDataset(RECORDS, "ground_truth")[0]
    assert truth["ar_ids"] == [1, 5, 7, 9, 9] and truth["ar_labels"] == [IGNORE_INDEX] * 3 + [9, 9]
    both = TrajectoryDataset(RECORDS, "both")
    assert both[2]["ar_ids"] == [1, 5, 7, 9, 9] and both[2]["ar_self_ids"] == item["ar_ids"]
    assert both[2]["ar_self_labels"] == item["ar_labels"]
    batch = TrajectoryCollator(pad_token_id=0)([both[0], both[2], both[3]])  # 3 items -> 3 reply rows + 3 own rows
    assert batch["input_ids"].shape[0] == 3 and batch["ar_input_ids"].shape[0] == 6
    assert batch["ar_labels"][3].tolist()[: len(both[0]["ar_self_labels"])] == both[0]["ar_self_labels"]


def naive_cllm(model, items, settings: LossSettings) -> torch.Tensor:
    """Per row, unpadded: teacher on prefix + target, student on prefix + state, AR on its own sequence."""
    cons, ars = [], []
    for it in items:
        p = len(it["prefix"])
        target = it["fixed_point"] if settings.consistency == "global" else it["next_state"]
        with torch.no_grad():
            teacher = model(torch.tensor([it["prefix"] + target])).logits[0, p - 1 : p + N - 1]
        student = model(torch.tensor([it["prefix"] + it["state"]])).logits[0, p - 1 : p + N - 1]
        cons.append(naive_divergence(student[None], teacher[None], settings.divergence) * N)
        logits = model(torch.tensor([it["ar_ids"]])).logits[0, :-1]
        labels = torch.tensor(it["ar_labels"][1:])
        ars.append(F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"))
        ars[-1] = (ars[-1], int((labels != IGNORE_INDEX).sum()))
    consistency = torch.stack(cons).sum() / (N * len(items))
    ar = torch.stack([a for a, _ in ars]).sum() / sum(n for _, n in ars)
    return settings.consistency_weight * consistency + settings.ar_weight * ar


@pytest.mark.parametrize("settings", [LossSettings("global", "kl", 1.0, 0.5), LossSettings("local", "soft_ce", 2.0, 1.0)])
def test_cllm_loss_equals_naive_reference(tiny_lm_factory, single_thread, settings):
    model = copy.deepcopy(tiny_lm_factory("llama")).requires_grad_(True)
    dataset = TrajectoryDataset(RECORDS, "target_output")
    items = [dataset[i] for i in (0, 2, 3)]  # different prefix lengths: right padding inside the batch
    batch = TrajectoryCollator(pad_token_id=0)(items)
    got = cllm_loss(model, batch, settings).loss
    grads_got = torch.autograd.grad(got, list(model.parameters()))
    want = naive_cllm(model, items, settings)
    grads_want = torch.autograd.grad(want, list(model.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_ar_kl_term_equals_naive_kl_to_the_reference(tiny_lm_factory, single_thread):
    """ar_loss=kl: L = L_C + w · mean over AR tokens of KL(p_ref ‖ p_model); the reference gets no gradient; the CE
    is still reported; a reference equal to the model adds exactly zero."""
    model = copy.deepcopy(tiny_lm_factory("llama")).requires_grad_(True)
    original = tiny_lm_factory("llama", seed=1)
    dataset = TrajectoryDataset(RECORDS, "target_output")
    items = [dataset[i] for i in (0, 2, 3)]
    batch = TrajectoryCollator(pad_token_id=0)(items)

    def reference_of(m):
        def reference(ids, mask, labels):
            with torch.no_grad():
                logits = m(input_ids=ids, attention_mask=mask).logits[:, :-1]  # [B, T-1, V]
                return logits[labels[:, 1:] != IGNORE_INDEX].float()
        return reference

    reference = reference_of(original)
    settings = LossSettings("global", "kl", 1.0, 0.5, "kl")
    out = cllm_loss(model, batch, settings, reference)
    kls, count = [], 0
    for it in items:
        ids, labels = torch.tensor([it["ar_ids"]]), torch.tensor(it["ar_labels"][1:])
        keep = labels != IGNORE_INDEX
        log_q = model(ids).logits[0, :-1][keep].log_softmax(-1)
        with torch.no_grad():
            log_p = original(ids).logits[0, :-1][keep].log_softmax(-1)
        kls.append((log_p.exp() * (log_p - log_q)).sum())
        count += int(keep.sum())
    want_kl = torch.stack(kls).sum() / count
    consistency = cllm_loss(model, batch, LossSettings("global", "kl", 1.0, 0.0)).loss
    torch.testing.assert_close(out.metrics["ar_kl"], want_kl.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.loss, consistency + 0.5 * want_kl, rtol=1e-4, atol=1e-5)
    assert float(out.metrics["ar_kl"]) > 1e-3  # two different random models
    grads_got = torch.autograd.grad(out.loss, list(model.parameters()))
    grads_want = torch.autograd.grad(consistency + 0.5 * want_kl, list(model.parameters()))
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    ce_run = cllm_loss(model, batch, LossSettings("global", "kl", 1.0, 0.5))
    torch.testing.assert_close(out.metrics["ar_loss"], ce_run.metrics["ar_loss"])  # the CE is still reported
    same = cllm_loss(model, batch, settings, reference_of(model))
    assert float(same.metrics["ar_kl"]) == pytest.approx(0.0, abs=1e-5)
    with pytest.raises(ValueError, match="reference"):
        cllm_loss(model, batch, settings)


def test_block_logits_and_ar_loss_pick_the_right_positions(tiny_lm_factory, single_thread):
    model = tiny_lm_factory("qwen2")
    dataset = TrajectoryDataset(RECORDS, "target_output")
    items = [dataset[i] for i in range(len(dataset))]
    batch = TrajectoryCollator(pad_token_id=0)(items)
    logits = block_logits(model, batch["input_ids"], batch["attention_mask"], batch["block_start"], N)
    for row, it in enumerate(items):
        p = len(it["prefix"])
        full = model(torch.tensor([it["prefix"] + it["state"]])).logits[0, p - 1 : p + N - 1]
        torch.testing.assert_close(logits[row], full, rtol=1e-4, atol=1e-4)
    one = ar_loss(model, batch["ar_input_ids"][:1], batch["ar_attention_mask"][:1], batch["ar_labels"][:1])
    ids, labels = torch.tensor([items[0]["ar_ids"]]), torch.tensor(items[0]["ar_labels"])
    torch.testing.assert_close(one, F.cross_entropy(model(ids).logits[0, :-1], labels[1:]), rtol=1e-4, atol=1e-5)


def test_collator_rejects_mixed_block_sizes():
    items = [TrajectoryDataset(RECORDS)[0], {**TrajectoryDataset(RECORDS)[1], "state": [1, 2]}]
    with pytest.raises(ValueError, match="block sizes"):
        TrajectoryCollator(0)(items)


def test_degenerate_generations_are_cut():
    assert longest_run([1, 2, 2, 2, 3]) == 3 and longest_run([]) == 0
    blocks = [[[5, 6, 7, 8]], [[4, 4, 4, 4]], [[1, 2, 3, 4]]]
    sample = PromptSample("x", (1,))
    kept = trajectory_record(sample, blocks, N, "pad", max_repeat=4)
    assert [b["states"][-1] for b in kept["blocks"]] == [[5, 6, 7, 8]] and kept["dropped"] is None
    dropped = trajectory_record(sample, blocks[1:], N, "pad", max_repeat=4)
    assert dropped["blocks"] == [] and "identical" in dropped["dropped"]


def test_trajectories_read_with_a_byte_order_mark_and_crlf_line_ends(tmp_path):
    from data.jacobi import read_records

    path = tmp_path / "traj.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in RECORDS).encode())
    assert read_records(path, vocab_size=1000) == [r for r in RECORDS if r["blocks"]]
