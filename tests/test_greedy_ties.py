"""Near-tie classification of greedy mismatches (inference.greedy_ties): where outputs part, whether the parting is
within the run dtype's rounding at that position, and the two drivers (in-place cast, float64 copy) agreeing."""

from __future__ import annotations

import pytest
import torch

from inference.greedy_ties import Divergence, Fp64Judge, classify, first_divergence, verdict
from inference.generate import DecodeConfig, generate

pytestmark = pytest.mark.usefixtures("single_thread")


def test_first_divergence_positions_and_ended_outputs():
    assert first_divergence([1, 2], [5, 6, 7], [5, 6, 7]) is None
    d = first_divergence([1, 2], [5, 6, 7, 8], [5, 6, 9, 8])
    assert (d.index, d.left, d.right, d.context) == (2, 7, 9, (1, 2, 5, 6))
    d = first_divergence([1], [5, 6], [5, 6, 4])  # the left output ended (EOS) where the right went on
    assert (d.index, d.left, d.right, d.context) == (2, None, 4, (1, 5, 6))


def test_verdict_compares_the_gap_with_the_rounding_noise():
    g = torch.Generator().manual_seed(0)
    hi = torch.randn(50, generator=g, dtype=torch.float64)
    a, b = int(hi.argmax()), int(hi.topk(2).indices[1])
    lo = hi + 0.05 * torch.randn(50, generator=g, dtype=torch.float64)  # the run dtype's error at this position
    d = Divergence((1, 2), 0, a, b)
    close = hi.clone()
    close[b] = close[a] - 0.01  # 0.01 apart: well inside the ~0.05 noise
    tie = verdict(d, lo + (close - hi), close)
    assert tie.near_tie and tie.margin == pytest.approx(0.01) and tie.noise > 0.02 and tie.hi_argmax == a
    far = hi.clone()
    far[b] = far[a] - 3.0
    real = verdict(d, lo + (far - hi), far)
    assert not real.near_tie and real.margin == pytest.approx(3.0) and real.gap == pytest.approx(3.0)
    swapped = verdict(Divergence((1, 2), 0, b, a), lo + (far - hi), far)  # the rule is symmetric in the two sides
    assert not swapped.near_tie and swapped.gap == pytest.approx(-3.0) and swapped.hi_argmax == a
    ended = verdict(Divergence((1,), 0, None, b), lo, hi)
    assert not ended.near_tie and ended.margin is None


def test_classify_reruns_in_high_precision_and_names_the_true_greedy_token(tiny_lm_factory):
    """A fabricated mismatch against the model's true greedy output: a token far below the argmax is a real
    mismatch, and the high-precision rerun names the greedy side. The model is left in the high dtype; Fp64Judge,
    which reruns a float64 copy instead, rules the same to the bit and leaves its model as it was."""
    model = tiny_lm_factory("llama", seed=3)
    prompt = [5, 9, 17, 33]
    greedy = generate(model, torch.tensor([prompt]), config=DecodeConfig(max_new_tokens=4)).sequences[0]
    copy = type(model)(model.config).eval().requires_grad_(False)  # the fixture model stays fp32 for other tests
    copy.load_state_dict(model.state_dict())
    logits = copy(input_ids=torch.tensor([prompt + greedy[:2]])).logits[0, -1]
    worst = int(logits.argmin())
    wrong = greedy[:2] + [worst] + greedy[3:]
    d = first_divergence(prompt, greedy, wrong)
    [v] = classify(copy, [d], torch.float64)
    assert (d.index, d.left, d.right, v.hi_argmax) == (2, greedy[2], worst, greedy[2])
    assert not v.near_tie and v.margin > 1.0 and v.noise < 1e-3
    assert copy.lm_head.weight.dtype == torch.float64
    judge = Fp64Judge(model)
    assert judge(d) == v and judge.reruns == 1 and model.lm_head.weight.dtype == torch.float32
