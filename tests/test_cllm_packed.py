"""Packed CLLM rows (one forward per trajectory draw) == the unpacked rows they replace: layout, logits on stock
models, loss values and gradients, the KL reference, reply rows."""

import copy

import pytest
import torch
from torch.nn import functional as F

from data.chat import IGNORE_INDEX
from data.jacobi import (
    PackedTrajectoryCollator, PackedTrajectoryDataset, PromptSample, TrajectoryCollator, TrajectoryDataset,
    trajectory_record)
from train.cllm import LossSettings, cllm_loss, packed_cllm_loss, packed_hidden, packed_reference

N = 4


def make_record(rid: str, prompt: list[int], blocks: list[list[list[int]]], reply: list[int] = (9, 9)) -> dict:
    return trajectory_record(PromptSample(rid, tuple(prompt), tuple(prompt + list(reply)),
                                          tuple([IGNORE_INDEX] * len(prompt) + list(reply))), blocks, N, "random", 0)


RECORDS = [
    make_record("a", [1, 5, 7], [[[3, 3, 3, 3], [10, 11, 3, 3], [10, 11, 12, 13]],
                                 [[1, 1, 1, 1], [20, 21, 22, 23]],
                                 [[30, 31, 32, 33]]]),  # converged at once: its only state is the fixed point
    make_record("b", [1, 8, 9, 4, 6], [[[5, 6, 7, 8], [30, 6, 7, 9], [30, 31, 32, 33]]], reply=(7, 8, 9)),
]


def test_dataset_draws_one_state_of_every_block():
    dataset = PackedTrajectoryDataset(RECORDS)
    assert len(dataset) == 2 + 2  # record a: up to 2 states before a fixed point; record b: 2
    first, second = dataset[0], dataset[1]
    assert first["answer_ids"] == [10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33]
    assert first["states"] == [[3, 3, 3, 3], [1, 1, 1, 1], [30, 31, 32, 33]]
    assert second["states"] == [[10, 11, 3, 3], [1, 1, 1, 1], [30, 31, 32, 33]]  # block 1 has one state: cycled
    assert first["ar_on_answer"] and "truth_ids" not in first
    truth = PackedTrajectoryDataset(RECORDS, "ground_truth")[0]
    assert not truth["ar_on_answer"] and truth["truth_ids"] == [1, 5, 7, 9, 9]
    assert PackedTrajectoryDataset(RECORDS, "both")[0]["ar_on_answer"]
    with pytest.raises(ValueError, match="ar_source"):
        PackedTrajectoryDataset(RECORDS, "gold")


def test_collator_layout():
    item = PackedTrajectoryDataset(RECORDS)[1]
    batch = PackedTrajectoryCollator(pad_token_id=0)([item])
    p, length = 3, 12
    head = p + length
    ids = batch["input_ids"][0].tolist()
    assert ids[:head] == [1, 5, 7] + item["answer_ids"]
    assert ids[head:] == [10, 11, 3, 1, 1, 1, 30, 31, 32]  # each state without its last token
    assert batch["position_ids"][0, head:].tolist() == [3, 4, 5, 7, 8, 9, 11, 12, 13]
    assert batch["ar_targets"][0, p - 1 : head - 1].tolist() == item["answer_ids"]
    assert (batch["ar_targets"][0, head - 1 :] == IGNORE_INDEX).all()
    visible = batch["visible"][0]
    assert visible[:head, :head].equal(torch.ones(head, head, dtype=torch.bool).tril())
    block1 = head + 3  # block 1's state rows: see prompt + block 0's fixed point (7 tokens) and their own past
    assert visible[block1 + 1].nonzero().flatten().tolist() == list(range(7)) + [block1, block1 + 1]
    assert batch["teacher_index"][0, 1].tolist() == [6, 7, 8, 9]
    assert batch["student_index"][0, 1].tolist() == [6, block1, block1 + 1, block1 + 2]
    assert batch["block_valid"].tolist() == [[True, True, True]]


def test_collator_pads_rows_and_appends_reply_rows():
    dataset = PackedTrajectoryDataset(RECORDS, "both")
    batch = PackedTrajectoryCollator(pad_token_id=0)([dataset[0], dataset[2]])
    assert batch["input_ids"].shape[0] == 4  # 2 packed rows, then the 2 replies
    assert batch["block_valid"].tolist() == [[True, True, True], [True, False, False], [False] * 3, [False] * 3]
    reply = batch["input_ids"][2, :5].tolist()
    assert reply == [1, 5, 7, 9, 9] and batch["ar_targets"][2, :5].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 9, 9,
                                                                                  IGNORE_INDEX]
    short = len(dataset[2]["prompt_ids"]) + 4 + 3  # record b's packed row; padding after it sees only itself
    assert batch["visible"][1, short:, :].equal(torch.eye(batch["visible"].shape[-1], dtype=torch.bool)[short:])
    with pytest.raises(ValueError, match="block sizes"):
        PackedTrajectoryCollator(0)([dataset[0], {**dataset[2], "states": [[1, 2]]}])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_packed_logits_equal_separate_forwards(tiny_lm_factory, single_thread, arch):
    """On stock models: every block's student logits == a forward on prefix + state, the teacher's == a forward on
    prompt + answer (the 4-D mask and position ids give exact logits)."""
    model = tiny_lm_factory(arch)
    dataset = PackedTrajectoryDataset(RECORDS)
    items = [dataset[1], dataset[2]]
    batch = PackedTrajectoryCollator(pad_token_id=0)(items)
    with torch.no_grad():
        hidden = packed_hidden(model, batch)
        logits = model.get_output_embeddings()(hidden)  # [R, T, V]
        for row, item in enumerate(items):
            prompt, answer = item["prompt_ids"], item["answer_ids"]
            full = model(torch.tensor([prompt + answer])).logits[0]
            for j, state in enumerate(item["states"]):
                start = len(prompt) + j * N
                alone = model(torch.tensor([prompt + answer[: start - len(prompt)] + state])).logits[0]
                torch.testing.assert_close(logits[row, batch["student_index"][row, j]], alone[start - 1 : start + N - 1],
                                           rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(logits[row, batch["teacher_index"][row, j]], full[start - 1 : start + N - 1],
                                           rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("settings", [LossSettings("global", "kl", 1.0, 0.5), LossSettings("global", "soft_ce", 2.0, 1.0),
                                      LossSettings("global", "kl", 1.0, 0.0)])
def test_packed_loss_equals_the_unpacked_items_it_replaces(tiny_lm_factory, single_thread, settings):
    """One packed draw of a record == the unpacked batch of its blocks' states (same means: every block token for
    the consistency, the same answer for the AR term), values and gradients."""
    model = copy.deepcopy(tiny_lm_factory("llama")).requires_grad_(True)
    packed = PackedTrajectoryDataset(RECORDS[:1])[0]
    unpacked = TrajectoryDataset(RECORDS[:1])
    items = [unpacked[0], unpacked[2], unpacked[3]]  # block 0 state 0, block 1 state 0, block 2's fixed point
    assert [it["state"] for it in items] == packed["states"]
    got = packed_cllm_loss(model, PackedTrajectoryCollator(0)([packed]), settings)
    want = cllm_loss(model, TrajectoryCollator(0)(items), settings)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-5)
    for key in want.metrics:
        torch.testing.assert_close(got.metrics[key], want.metrics[key], rtol=1e-4, atol=1e-5)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(got.loss, params), torch.autograd.grad(want.loss, params)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_packed_ar_kl_and_reply_rows_equal_naive(tiny_lm_factory, single_thread):
    """ar_source=both with ar_loss=kl: the AR term pools the answers inside the packed rows and the reply rows; the
    KL reference runs only the columns up to the last AR target; a reference equal to the model adds zero."""
    model = copy.deepcopy(tiny_lm_factory("llama")).requires_grad_(True)
    original = tiny_lm_factory("llama", seed=1)
    dataset = PackedTrajectoryDataset(RECORDS, "both")
    items = [dataset[0], dataset[2]]
    batch = PackedTrajectoryCollator(0)(items)
    out = packed_cllm_loss(model, batch, LossSettings("global", "kl", 1.0, 0.5, "kl"), packed_reference(original))
    rows = [(it["prompt_ids"] + it["answer_ids"], [IGNORE_INDEX] * len(it["prompt_ids"]) + it["answer_ids"])
            for it in items] + [(it["truth_ids"], it["truth_labels"]) for it in items]
    ces, kls, count = [], [], 0
    for ids, labels in rows:
        ids, labels = torch.tensor([ids]), torch.tensor(labels[1:])
        keep = labels != IGNORE_INDEX
        log_q = model(ids).logits[0, :-1][keep].log_softmax(-1)
        with torch.no_grad():
            log_p = original(ids).logits[0, :-1][keep].log_softmax(-1)
        ces.append(F.nll_loss(log_q, labels[keep], reduction="sum"))
        kls.append((log_p.exp() * (log_p - log_q)).sum())
        count += int(keep.sum())
    torch.testing.assert_close(out.metrics["ar_loss"], (torch.stack(ces).sum() / count).detach(), rtol=1e-4, atol=1e-5)
    want_kl = torch.stack(kls).sum() / count
    torch.testing.assert_close(out.metrics["ar_kl"], want_kl.detach(), rtol=1e-4, atol=1e-6)
    consistency = packed_cllm_loss(model, batch, LossSettings("global", "kl", 1.0, 0.0)).loss
    torch.testing.assert_close(out.loss, consistency + 0.5 * want_kl, rtol=1e-4, atol=1e-5)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(out.loss, params),
                    torch.autograd.grad(consistency + 0.5 * want_kl, params)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    same = packed_cllm_loss(model, batch, LossSettings("global", "kl", 1.0, 0.5, "kl"), packed_reference(model))
    assert float(same.metrics["ar_kl"]) == pytest.approx(0.0, abs=1e-5)


def test_packed_loss_refuses_local_consistency_and_a_missing_reference(tiny_lm_factory):
    model = tiny_lm_factory("llama")
    batch = PackedTrajectoryCollator(0)([PackedTrajectoryDataset(RECORDS)[0]])
    with pytest.raises(ValueError, match="global consistency only"):
        packed_cllm_loss(model, batch, LossSettings("local", "kl", 1.0, 1.0))
    with pytest.raises(ValueError, match="reference"):
        packed_cllm_loss(model, batch, LossSettings("global", "kl", 1.0, 1.0, "kl"))


def test_packed_batch_without_ar_targets_adds_zero_not_nan(tiny_lm_factory, single_thread):
    """No AR target in the batch (ground-truth rows whose labels are all masked): CE and KL are zero, as unpacked."""
    model = tiny_lm_factory("llama")
    item = {**PackedTrajectoryDataset(RECORDS)[0], "ar_on_answer": False}
    batch = PackedTrajectoryCollator(0)([item])
    out = packed_cllm_loss(model, batch, LossSettings("global", "kl", 1.0, 1.0, "kl"), packed_reference(model))
    assert float(out.metrics["ar_loss"]) == 0.0 and float(out.metrics["ar_kl"]) == 0.0
    assert torch.isfinite(out.loss) and float(out.loss) == pytest.approx(float(out.metrics["consistency_loss"]))
