"""Float rounding or an engine bug? Judge a greedy output that parts from the reference's against high precision.

Dimension letters: N checked positions, V vocab.

Two greedy decoders over the same weights can part where the target's top logits are nearly tied: a K-node tree
forward, a one-token step and Hugging Face `generate` add the same products in different orders, which moves a logit
difference by a few units of the run dtype's rounding (inference.engine.loop says so too). Up to the first differing new
token t the two outputs share their prefix, so the question is well posed there; after it, the method's output
follows its own prefix, and each of its tokens must still be that prefix's greedy choice. The judge is a
recomputation in higher precision ("hi": float64 on a CPU and in the bench's copy, fp32 on a GPU), one teacher-forced
forward over prompt + shared prefix + the method's tokens from t on, never the run dtype itself:

    deficit(x)   hi.max() - hi[x] at a position: how far token x lies below the high-precision greedy choice
    tolerance    (TIE_ULPS[run] x u(run) + TIE_ULPS[hi] x u(hi)) x max|hi| at that position, u the dtype's unit
                 roundoff (2^-8 bf16, 2^-11 fp16, 2^-24 fp32, 2^-53 fp64): a stated bound, not a noise measured
                 at the position, so a bug cannot widen it
    near tie     at t, both the reference's token and the method's have deficit <= tolerance (tied with each other
                 and with the high-precision argmax), and so does every later token of the method's output
Anything else is a mismatch (an engine bug, not rounding: `failed_at` names the first new-token position past the
tolerance, `hi_argmax` and `gap` say which side was right at t), and so is a divergence where one output ended.
Checking the method's later tokens catches a bug that first shows right after a genuine tie; it costs nothing extra
(the forward that scores t scores them too). A turn identical to the reference's is not rerun.

Two drivers apply the rule. `classify` (the GPU check's engine section) casts the model to the hi dtype in place,
since a 7B target has room for one copy only. `Fp64Judge` (the bench's judge, called once per differing turn) reruns
a float64 copy of the model, made on the first divergence (none when the outputs agree) on the model's device, twice
an fp32 model's memory, and reused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from inference.engine.devices import input_device

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24,
                 torch.float64: 2.0 ** -53}
# How many units of roundoff x max|hi| a dtype may move a logit difference; measured against float64 reruns (issue
# #34 item 4). bf16 / fp16 matmuls accumulate in fp32, so their error is the rounding of stored activations:
#   SmolLM2-135M-Instruct in bf16, engine with and without prompt lookup, 8 MT-bench prompts x 64 greedy tokens:
#     36 of 1024 tokens off the fp64 argmax, by at most 1.94 u x max|hi| (0.22 logits; max|hi| is 17-39 there);
#     teacher-forced over 567 positions of MT-bench text, the top-1 vs top-2 difference moved by at most 4.1
#     (median 0.5, 99th percentile 2.7; top-10 differences: at most 5.9).
#   Tiny random test Llamas (hidden 32, max|hi| ~ 2-5), bf16: tokens off the argmax by at most 1.91; top-1 vs top-2
#     moved by at most 12.2 over 480 positions (median 1.4, 99th percentile 6.8); fp16 at most 10.8.
# 16 covers every one of these (1.6 logits at SmolLM2's max|hi| ~ 25, 0.2 on the tiny Llamas), where an off-by-one
# position bug on a tiny Llama puts tokens up to 270 u x max|hi| below the argmax. fp32 / fp64 accumulate in their
# own precision, so their error grows with the reduction length: top-1 vs top-2 moved by up to 24 (SmolLM2) and
# 29 (tiny Llamas) units in fp32; 64 covers that (1e-4 logits at max|hi| ~ 25, far below any indexing bug).
# The same off-by-one bug on SmolLM2 stays inside bf16 rounding (its tokens at most 2.4 u x max|hi| off the
# argmax, as many as a clean run's): no per-token rule sees it in bf16; a --dtype fp64 bench (tolerance ~1e-12
# logits) is the check for such bugs.
TIE_ULPS = {torch.bfloat16: 16.0, torch.float16: 16.0, torch.float32: 64.0, torch.float64: 64.0}


@dataclass(frozen=True)
class Divergence:
    """Where two greedy outputs for one prompt first differ. Left is the reference, right the output under test
    (in the bench: the method), whose later tokens `rest` are checked too."""

    context: tuple[int, ...]  # the prompt + the new tokens both outputs share
    index: int  # first differing new-token position (0-based)
    left: int | None  # the left output's token there; None: that output ended before it
    right: int | None
    rest: tuple[int, ...] = ()  # the right output's tokens after `right`


@dataclass(frozen=True)
class TieVerdict:
    """The rule's ruling on one Divergence; the logit fields are None where nothing was rerun or an output ended.
    Logit values are high-precision ones; positions count new tokens from 0."""

    near_tie: bool
    hi_argmax: int | None = None  # the high-precision greedy token at the first differing position
    gap: float | None = None  # hi[left] - hi[right] there: > 0 where high precision prefers the left token
    tolerance: float | None = None  # the tolerance there
    relative_gap: float | None = None  # gap / max(|hi[left]|, |hi[right]|)
    failed_at: int | None = None  # first position whose token lies further than the tolerance below the hi argmax
    failed_by: float | None = None  # that token's deficit (hi.max() - hi[token]) there
    failed_tolerance: float | None = None  # the tolerance there
    checked: int = 0  # positions scored: the first differing one and the right output's later tokens

    @property
    def margin(self) -> float | None:
        return None if self.gap is None else abs(self.gap)


Judge = Callable[[Divergence], TieVerdict]


def first_divergence(prompt: Sequence[int], left: Sequence[int], right: Sequence[int]) -> Divergence | None:
    """None when the outputs are identical, else where they first differ (and the right output's tokens after it)."""
    for i in range(max(len(left), len(right))):
        a = left[i] if i < len(left) else None
        b = right[i] if i < len(right) else None
        if a != b:
            return Divergence(tuple(prompt) + tuple(left[:i]), i, a, b, tuple(right[i + 1:]))
    return None


def tolerance(hi: torch.Tensor, run_dtype: torch.dtype, hi_dtype: torch.dtype) -> torch.Tensor:
    """The near-tie tolerance [N] for high-precision logits hi [N, V] (module docstring, TIE_ULPS)."""
    unknown = [d for d in (run_dtype, hi_dtype) if d not in UNIT_ROUNDOFF]
    if unknown:
        raise ValueError(f"greedy ties: no rounding bound for {unknown[0]} (known: "
                         f"{', '.join(str(d).removeprefix('torch.') for d in UNIT_ROUNDOFF)})")
    ulps = TIE_ULPS[run_dtype] * UNIT_ROUNDOFF[run_dtype] + TIE_ULPS[hi_dtype] * UNIT_ROUNDOFF[hi_dtype]
    return ulps * hi.abs().amax(-1)


@torch.no_grad()
def forced_logits(model: torch.nn.Module, d: Divergence) -> torch.Tensor:
    """Logits [N, V] before each of the right output's tokens `right, *rest` (N = 1 + len(rest)), from one plain
    forward over context + those tokens (teacher forcing, no cache), as float64 on the CPU."""
    checked = [d.right, *d.rest]
    x = torch.tensor([list(d.context) + checked[:-1]], device=input_device(model))
    return model(input_ids=x, logits_to_keep=len(checked)).logits[0].double().cpu()


def ended(d: Divergence) -> TieVerdict:
    """One output stopped where the other went on: a mismatch, nothing to rerun."""
    return TieVerdict(False, failed_at=d.index)


def verdict(d: Divergence, hi: torch.Tensor, run_dtype: torch.dtype, hi_dtype: torch.dtype) -> TieVerdict:
    """Rule on `d` from `forced_logits` in high precision, hi [N, V], for a run in `run_dtype`."""
    if d.left is None or d.right is None:
        return ended(d)
    tol = tolerance(hi, run_dtype, hi_dtype)  # [N]
    top = hi.amax(-1)  # [N]
    checked = torch.tensor([d.right, *d.rest])  # [N]
    deficit = top - hi.gather(1, checked[:, None])[:, 0]  # [N]
    deficit[0] = torch.maximum(deficit[0], top[0] - hi[0, d.left])  # at t both sides must be near the argmax
    over = (deficit > tol).nonzero()
    k = int(over[0]) if len(over) else None
    a, b = float(hi[0, d.left]), float(hi[0, d.right])
    scale = max(abs(a), abs(b))
    return TieVerdict(
        near_tie=k is None, hi_argmax=int(hi[0].argmax()), gap=a - b, tolerance=float(tol[0]),
        relative_gap=(a - b) / scale if scale > 0 else 0.0, failed_at=None if k is None else d.index + k,
        failed_by=None if k is None else float(deficit[k]), failed_tolerance=None if k is None else float(tol[k]),
        checked=len(checked))


def classify(model: torch.nn.Module, divergences: Sequence[Divergence], hi_dtype: torch.dtype) -> list[TieVerdict]:
    """One verdict per divergence, for a run in the model's current dtype. Casts `model` to `hi_dtype` in place and
    leaves it there (a 7B target has room for one copy only): call it once, after everything else that uses the
    model in its own dtype."""
    run_dtype = model.dtype
    if any(d.left is not None and d.right is not None for d in divergences):
        model.to(hi_dtype)
    return [verdict(d, forced_logits(model, d), run_dtype, hi_dtype) if d.left is not None and d.right is not None
            else ended(d) for d in divergences]


class Fp64Judge:
    """A `Judge` that leaves `model` as it is: hi from a float64 copy made on the first rerun, the tolerance for the
    model's own dtype."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.run_dtype = model.dtype
        self.reruns = 0
        self._fp64: torch.nn.Module | None = None

    def __call__(self, d: Divergence) -> TieVerdict:
        if d.left is None or d.right is None:
            return ended(d)
        if self._fp64 is None:
            self._fp64 = copy.deepcopy(self.model).to(torch.float64)
        self.reruns += 1
        return verdict(d, forced_logits(self._fp64, d), self.run_dtype, torch.float64)
