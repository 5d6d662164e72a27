"""Near-tie classification of greedy mismatches (inference.bench.greedy_ties): where outputs part, the stated tolerance
on high-precision logits at the parting and at every later token of the tested output, the two drivers (in-place cast,
float64 copy) agreeing, and an injected engine bug in bf16 caught as a mismatch."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from inference.api import Engine
from inference.bench.greedy_ties import (TIE_ULPS, UNIT_ROUNDOFF, Divergence, Fp64Judge, classify, first_divergence,
                                         tolerance, verdict)
from inference.bench.stats import Answer, TurnResult, format_table, summarize
from inference.drafters.prompt_lookup import PromptLookupDrafter
from inference.engine.drafter import NoDrafter
from inference.engine.loop import DecodeConfig, generate

pytestmark = pytest.mark.usefixtures("single_thread")
BF16 = torch.bfloat16


def test_first_divergence_positions_and_ended_outputs():
    assert first_divergence([1, 2], [5, 6, 7], [5, 6, 7]) is None
    d = first_divergence([1, 2], [5, 6, 7, 8], [5, 6, 9, 8])
    assert (d.index, d.left, d.right, d.context, d.rest) == (2, 7, 9, (1, 2, 5, 6), (8,))
    d = first_divergence([1], [5, 6], [5, 6, 4, 3])  # the left output ended (EOS) where the right went on
    assert (d.index, d.left, d.right, d.context, d.rest) == (2, None, 4, (1, 5, 6), (3,))


def test_tolerance_is_the_stated_bound():
    hi = torch.tensor([[1.0, -20.0, 3.0], [0.5, 0.25, -0.5]], dtype=torch.float64)
    expected = (TIE_ULPS[BF16] * 2.0 ** -8 + TIE_ULPS[torch.float64] * 2.0 ** -53) * torch.tensor([20.0, 0.5])
    assert torch.allclose(tolerance(hi, BF16, torch.float64), expected.double())
    assert UNIT_ROUNDOFF[torch.float32] == 2.0 ** -24
    with pytest.raises(ValueError, match="int8"):
        tolerance(hi, torch.int8, torch.float64)


def scored(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)  # [N, V]


def test_verdict_checks_both_tokens_at_the_parting_and_every_later_token():
    """max|hi| = 10: the bf16 tolerance is 16 x 2^-8 x 10 = 0.625 (plus a float64 term of ~1e-13)."""
    tol = TIE_ULPS[BF16] * 2.0 ** -8 * 10
    d = Divergence((1, 2), 0, left=0, right=1, rest=(2, 0))
    ties = scored([[10.0, 10.0 - tol / 2, 0.0], [9.0, 0.0, 10.0], [10.0, 0.0, 0.0]])  # every token the argmax or near
    v = verdict(d, ties, BF16, torch.float64)
    assert v.near_tie and v.checked == 3 and v.failed_at is None and v.hi_argmax == 0
    assert v.gap == pytest.approx(tol / 2) and v.tolerance == pytest.approx(tol)
    fork = verdict(d, scored([[10.0, 10.0 - 2 * tol, 0.0], *ties[1:].tolist()]), BF16, torch.float64)
    assert not fork.near_tie and fork.failed_at == 0 and fork.failed_by == pytest.approx(2 * tol)
    # Both sides tied with each other but far below a third token: both decoders are wrong.
    both = verdict(d, scored([[5.0, 5.0, 10.0], *ties[1:].tolist()]), BF16, torch.float64)
    assert not both.near_tie and both.gap == 0.0 and both.hi_argmax == 2 and both.failed_by == pytest.approx(5.0)
    # A tie at the parting, then the tested output takes a token 3 below the argmax two tokens later.
    later = verdict(Divergence((1, 2), 0, 0, 1, rest=(2, 2)), scored([*ties[:2].tolist(), [10.0, 0.0, 7.0]]),
                    BF16, torch.float64)
    assert not later.near_tie and later.failed_at == 2 and later.failed_by == pytest.approx(3.0)
    assert later.gap == pytest.approx(tol / 2)  # the parting itself was a tie
    ended = verdict(Divergence((1,), 4, None, 2), ties, BF16, torch.float64)
    assert not ended.near_tie and ended.margin is None and ended.failed_at == 4


def test_classify_reruns_in_high_precision_and_names_the_true_greedy_token(tiny_lm_factory):
    """A fabricated mismatch against the model's true greedy output: a token far below the argmax is a real
    mismatch, and the high-precision rerun names the greedy side. The model is left in the high dtype; Fp64Judge,
    which reruns a float64 copy instead, rules the same to the bit and leaves its model as it was."""
    model = tiny_lm_factory("llama", seed=3)
    prompt = [5, 9, 17, 33]
    greedy = generate(model, torch.tensor([prompt]), config=DecodeConfig(max_new_tokens=4)).sequences[0]
    copy_ = type(model)(model.config).eval().requires_grad_(False)  # the fixture model stays fp32 for other tests
    copy_.load_state_dict(model.state_dict())
    logits = copy_(input_ids=torch.tensor([prompt + greedy[:2]])).logits[0, -1]
    worst = int(logits.argmin())
    wrong = greedy[:2] + [worst] + greedy[3:]
    d = first_divergence(prompt, greedy, wrong)
    [v] = classify(copy_, [d], torch.float64)
    assert (d.index, d.left, d.right, v.hi_argmax, v.failed_at) == (2, greedy[2], worst, greedy[2], 2)
    assert not v.near_tie and v.margin > 1.0 and v.tolerance < 1e-4 and v.checked == 2
    assert copy_.lm_head.weight.dtype == torch.float64
    judge = Fp64Judge(model)
    assert judge(d) == v and judge.reruns == 1 and model.lm_head.weight.dtype == torch.float32


# --- an injected engine bug, in bf16

def shift_positions_by_one(monkeypatch) -> None:
    """The bug: every tree forward of the engine places its nodes one position too far (the prefill is right)."""
    loop = importlib.import_module("inference.engine.loop")
    real = loop.tree_inputs

    def shifted(tree, valid, next_pos, dtype):
        mask, positions = real(tree, valid, next_pos, dtype)
        return mask, positions + 1

    monkeypatch.setattr(loop, "tree_inputs", shifted)


def bug_prompts(n: int) -> list[list[int]]:
    """Prompts that repeat a 6-token stretch, so prompt lookup drafts from the first step."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        stretch = torch.randint(3, 128, (6,), generator=g).tolist()
        out.append(stretch + torch.randint(3, 128, (4,), generator=g).tolist() + stretch)
    return out


def turns(engine: Engine, prompts: list[list[int]], n: int) -> list[Answer]:
    out = []
    for i, prompt in enumerate(prompts):
        tokens = tuple(engine.generate(prompt, max_new_tokens=n, temperature=0.0, seed=0).sequences[0])
        out.append(Answer(i, "bug", (TurnResult(tokens, "", 1.0, len(tokens), (), None, tuple(prompt)),)))
    return out


def test_off_by_one_positions_in_bf16_are_mismatches_not_near_ties(tiny_lm_factory, monkeypatch):
    """The plain loop in bf16 is the reference; prompt lookup (3 drafts) runs the same bf16 weights. Clean, it is
    lossless. With every tree forward's positions shifted by one it parts from the reference on every prompt, often
    at a token the bug moved by less than bf16 rounding (a tie, as far as that position can tell): the old rule,
    which judged only that first token against twice the rounding noise measured there, called such turns near
    ties. The later tokens, each scored against the float64 greedy choice given the method's own prefix, give the
    bug away on every turn."""
    model = copy.deepcopy(tiny_lm_factory("llama", seed=0)).to(BF16)
    prompts = bug_prompts(6)
    reference = turns(Engine(model, NoDrafter()), prompts, 40)
    clean = turns(Engine(model, PromptLookupDrafter(num_draft=3)), prompts, 40)
    shift_positions_by_one(monkeypatch)
    buggy = turns(Engine(model, PromptLookupDrafter(num_draft=3)), prompts, 40)
    judge = Fp64Judge(model)
    summary = summarize({"drafter": clean, "bug": buggy, "ar": reference}, "drafter", greedy=True, judge=judge)
    check = summary["greedy_check"]
    ok, bad = check["methods"]["drafter"], check["methods"]["bug"]
    assert ok["mismatch"] == 0 and ok["near_tie"] + ok["identical"] == len(prompts)
    assert (bad["identical"], bad["near_tie"], bad["mismatch"]) == (0, 0, len(prompts)), bad["divergences"]
    assert check["lossless"] is False and judge.reruns >= len(prompts)
    for d in bad["divergences"]:
        assert d["failed_at"] >= d["position"] and d["failed_by"] > d["failed_tolerance"] > 0
    report = format_table(summary)
    assert "NOT lossless" in report and "bug 0 identical / 0 verified near-tie / 6 mismatch" in report
    assert report.count("MISMATCH bug, question ") == len(prompts) and "likely an engine bug" in report
