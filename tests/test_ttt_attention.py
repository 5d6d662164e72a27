"""EAGLE-3's chunked training-time test attention (models/ttt_attention.py) == the explicit concatenated-mask softmax
(values and gradients of q, k, v of every step: fp64 to 1e-12 and gradcheck, bf16 within a stated bound), == the dense
block it replaced (scripts/bench_ttt_attention.py keeps it) in `eagle3_loss`, and saves O(B·H·T·Hd) for backward per
extra step where the dense block saved O(B·H·T²)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import models.eagle3
from models.ttt_attention import ttt_attention
from tests.script_support import ROOT, load_script
from tests.test_eagle3 import random_draft
from train.eagle3 import eagle3_loss
from train.eagle3_teacher import TopkTeacher

pytestmark = pytest.mark.usefixtures("single_thread")

bench = load_script("bench_ttt_attention")


def naive_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        scaling: float) -> torch.Tensor:
    """SpecForge's form: keys / values of steps 0..j concatenated along time [B, H, (j+1)T, Hd], one [T, (j+1)T] mask
    [causal | I | ... | I], one softmax. q [B, H, T, Hd] -> [B, T, H * Hd]."""
    b, h, t, hd = q.shape
    groups = h // keys[0].shape[1]
    k = torch.cat(keys, 2).repeat_interleave(groups, 1)  # [B, H, (j+1)T, Hd]
    v = torch.cat(values, 2).repeat_interleave(groups, 1)
    eye = torch.eye(t, dtype=torch.bool)
    mask = torch.cat([torch.ones(t, t, dtype=torch.bool).tril(), *[eye] * (len(keys) - 1)], 1)  # [T, (j+1)T]
    scores = (q @ k.transpose(-1, -2) * scaling).masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h * hd)


def step_inputs(b: int, h: int, kv_heads: int, t: int, hd: int, steps: int, dtype=torch.float64, seed: int = 0):
    """q [B, H, T, Hd] of the last step and keys / values [B, Hkv, T, Hd] of steps 0..steps-1, leaves with grads."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    q = leaf(b, h, t, hd)
    keys = [leaf(b, kv_heads, t, hd) for _ in range(steps)]
    values = [leaf(b, kv_heads, t, hd) for _ in range(steps)]
    return q, keys, values


def values_and_grads(attention, q, keys, values, scaling, weight):
    out = attention(q, keys, values, scaling)
    grads = torch.autograd.grad((out * weight).sum(), [q, *keys, *values])
    return out.detach(), grads


CASES = {  # (H, Hkv, T, chunk, steps)
    "gqa-ragged-chunk": (4, 2, 11, 4, 3),
    "mha": (3, 3, 9, 9, 2),
    "one-kv-head-chunk-1": (4, 1, 6, 1, 4),
    "chunk-past-the-end": (2, 1, 5, 256, 2),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_equals_the_concatenated_mask_softmax_in_fp64(case):
    h, kv_heads, t, chunk, steps = CASES[case]
    q, keys, values = step_inputs(2, h, kv_heads, t, 8, steps)
    weight = torch.randn(2, t, h * 8, dtype=torch.float64)

    def chunked(*args):
        return ttt_attention(*args, chunk=chunk)

    out, grads = values_and_grads(chunked, q, keys, values, 0.35, weight)
    ref, ref_grads = values_and_grads(naive_ttt_attention, q, keys, values, 0.35, weight)
    assert (out - ref).abs().max() < 1e-12
    assert len(grads) == 1 + 2 * steps and all(g.abs().max() > 0 for g in grads)
    assert max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)) < 1e-12


def test_gradcheck():
    q, keys, values = step_inputs(1, 4, 2, 5, 3, 3)

    def chunked(q, *kv):
        return ttt_attention(q, kv[:3], kv[3:], 0.5, chunk=2)

    assert torch.autograd.gradcheck(chunked, (q, *keys, *values))


def test_padding_rows_and_extreme_scores():
    """Right padding never reaches a real row (causal), so padded rows need no mask: zero rows (every score 0: a
    uniform softmax) and rows scaled to scores in the thousands (the shared running max) still match."""
    q, keys, values = step_inputs(2, 4, 2, 10, 8, 3)
    with torch.no_grad():
        q[1, :, 6:] = 0  # sequence 1 padded from position 6
        for k in keys:
            k[1, :, 6:] = 0
        q[0, :, 3] *= 60  # scores of order 1e3
        keys[2][0, :, 3] *= 60
    weight = torch.randn(2, 10, 32, dtype=torch.float64)
    out, grads = values_and_grads(lambda *a: ttt_attention(*a, chunk=4), q, keys, values, 0.35, weight)
    ref, ref_grads = values_and_grads(naive_ttt_attention, q, keys, values, 0.35, weight)
    assert torch.isfinite(out).all() and (out - ref).abs().max() < 1e-12
    assert max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)) < 1e-10


def test_bf16_within_the_dense_blocks_error():
    """bf16 (fp32 softmax statistics): against the fp64 result, the output is within 2e-2 and every gradient within
    3e-2 of its largest entry, and neither is worse than the dense bf16 block it replaced by more than 1.5x."""
    q, keys, values = step_inputs(2, 4, 2, 40, 16, 3, seed=3)
    weight = torch.randn(2, 40, 64, dtype=torch.float64)
    exact, exact_grads = values_and_grads(naive_ttt_attention, q, keys, values, 0.25, weight)

    def errors(attention):
        low = [x.detach().bfloat16().requires_grad_() for x in (q, *keys, *values)]
        out, grads = values_and_grads(attention, low[0], low[1:4], low[4:], 0.25, weight.bfloat16())
        grad_error = max(float((g.double() - e).abs().max() / e.abs().max()) for g, e in zip(grads, exact_grads))
        return float((out.double() - exact).abs().max()), grad_error

    out_error, grad_error = errors(lambda *a: ttt_attention(*a, chunk=16))
    dense_out_error, dense_grad_error = errors(bench.dense_ttt_attention)
    assert out_error < 2e-2 and grad_error < 3e-2
    assert out_error <= 1.5 * dense_out_error and grad_error <= 1.5 * dense_grad_error


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
def test_eagle3_loss_and_gradients_equal_the_dense_blocks(dtype, tol, monkeypatch):
    """`eagle3_loss` over a tiny draft, right-padded rows (labels -100) included: the same loss, metrics and parameter
    gradients as with the dense attention `unroll` called before (pinned: scripts/bench_ttt_attention.py keeps it)."""
    draft = random_draft().to(dtype).train()
    gen = torch.Generator().manual_seed(1)
    b, t = 3, 20
    hidden = torch.randn(b, t, 2 * 32, generator=gen).to(dtype)
    embeds = torch.randn(b, t, 32, generator=gen).to(dtype)
    labels = torch.randint(3, 128, (b, t), generator=gen)
    labels[:, :2] = -100
    labels[1, 12:] = -100  # a short sequence, right-padded
    teacher = TopkTeacher(torch.randint(0, 128, (b, t, 4), generator=gen),
                          torch.rand(b, t, 4, generator=gen).softmax(-1))

    def loss_and_grads():
        draft.zero_grad(set_to_none=True)
        out = eagle3_loss(draft, hidden, embeds, labels, teacher, steps=4, decay=0.8, soft_weight=0.5)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in draft.named_parameters()}

    new, new_grads = loss_and_grads()
    monkeypatch.setattr(models.eagle3, "ttt_attention", bench.dense_ttt_attention)
    old, old_grads = loss_and_grads()
    new_loss, old_loss = float(new.loss.detach()), float(old.loss.detach())
    assert abs(new_loss - old_loss) < tol * max(1.0, abs(old_loss))
    assert new.metrics.keys() == old.metrics.keys()
    assert all(abs(float(new.metrics[k]) - float(old.metrics[k])) < tol * 10 for k in old.metrics)
    for name, grad in old_grads.items():
        assert (new_grads[name] - grad).abs().max() <= tol * max(1.0, float(grad.abs().max())), name


def saved_bytes_of_steps(attention, steps: int, b: int, h: int, kv_heads: int, t: int, hd: int) -> int:
    """Bytes saved for backward by `steps` unrolled steps of `attention` (each step's q, k, v new leaves)."""
    q, keys, values = step_inputs(b, h, kv_heads, t, hd, steps, dtype=torch.float32)
    qs = [q] + [q.detach().clone().requires_grad_() for _ in range(steps - 1)]
    with bench.SavedBytes() as saved:
        for j in range(steps):
            attention(qs[j], keys[: j + 1], values[: j + 1], 0.25)
    return saved.total


def test_saved_bytes_grow_by_q_k_v_output_and_lse_per_extra_step():
    """At T = 1024 each extra step keeps exactly q, its own k and v, the output and the fp32 log-sum-exp:
    2·B·H·T·Hd + 2·B·Hkv·T·Hd + B·H·T values (fp32), ~21x less than one fp32 [B, H, T, T] block; the dense attention
    kept more than two such blocks a step."""
    b, h, kv_heads, t, hd = 1, 4, 2, 1024, 16
    bound = 4 * (2 * b * h * t * hd + 2 * b * kv_heads * t * hd + b * h * t)
    block = 4 * b * h * t * t
    sizes = {a: [saved_bytes_of_steps(f, n, b, h, kv_heads, t, hd) for n in (1, 2, 3)]
             for a, f in (("chunked", ttt_attention), ("dense", bench.dense_ttt_attention))}
    assert sizes["dense"][0] == sizes["chunked"][0]  # step 0 is sdpa in both
    one, two, three = sizes["chunked"]
    assert two - one == three - two == bound and bound * 20 < block
    one, two, _ = sizes["dense"]
    assert two - one > 2 * block


def test_the_bench_prints_both_attentions_and_refuses_bad_input(capsys):
    argv = ["--lengths", "64,96", "--steps", "1,3", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
            "--intermediate", "64", "--repeats", "1"]
    assert bench.main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.lstrip()[:2] in ("64", "96")]
    assert [(r[0], r[1]) for r in rows] == [("64", "1"), ("64", "3"), ("96", "1"), ("96", "3")]
    three = [r for r in rows if r[1] == "3"]
    assert all(float(r[3]) > float(r[4]) for r in three)  # the chunked attention saves less
    assert bench.main([*argv[:2], "--heads", "5"]) == 2
    assert "--hidden 1024 must split into --heads 5" in capsys.readouterr().err
    run = subprocess.run([sys.executable, "scripts/bench_ttt_attention.py", "--lengths", "0"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].startswith("error: --lengths takes positive")
