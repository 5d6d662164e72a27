"""Is a greedy mismatch float rounding? Classify the first position where two greedy outputs of one target differ.

Dimension letters: V vocab.

Two greedy decoders over the same weights can part where the target's top logits are nearly tied: a K-node tree
forward, a one-token step and Hugging Face `generate` add the same products in different orders, and in bf16 that
moves a logit by ~1e-2 (inference.generate says so too), in fp32 by far less. Up to the first differing new token t the
two outputs share their prefix, so the question is well posed there (later tokens follow different prefixes and say
nothing). Re-run prompt + shared prefix once in the run dtype ("lo") and once in higher precision ("hi") and compare
the two disputed tokens a (left) and b (right):

    margin     |hi[a] - hi[b]|: how far apart the two tokens really are
    noise      max over the hi top-R tokens j (and b) of |(lo[j] - lo[a]) - (hi[j] - hi[a])|: how far the run dtype
               moves logit differences at this very position
    near tie   margin <= 2 x noise: each decoder may err by about `noise`, in opposite directions
Anything else is a real mismatch (an engine bug, not rounding, whichever side hi prefers: `hi_argmax` says which side
was right), and so is a divergence where one output has ended. The tolerance is measured, not set: the same rule holds
for bf16 and fp32 targets.

Two drivers apply the rule. `classify` (the GPU check's engine section, hi = fp32 on a GPU, fp64 on a CPU) takes
every lo rerun first, then casts the model in place, since a 7B target has room for one copy only. `Fp64Judge` (the
bench's judge, called once per differing turn) reruns the model itself for lo and a float64 copy for hi, made on the
first divergence (none when the outputs agree) on the model's device, twice an fp32 model's memory, and reused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from inference.devices import input_device

NOISE_RANK = 10  # hi top-R tokens whose logit differences estimate the rounding noise
TIE_FACTOR = 2.0  # two decoders, each off by up to `noise`


@dataclass(frozen=True)
class Divergence:
    """Where two greedy outputs for one prompt first differ (in the bench: left = the reference, right = the method)."""

    context: tuple[int, ...]  # the prompt + the new tokens both outputs share
    index: int  # first differing new-token position (0-based)
    left: int | None  # the left output's token there; None: that output ended before it
    right: int | None


@dataclass(frozen=True)
class TieVerdict:
    """The rule's ruling on one Divergence; the logit fields are None where nothing was rerun or an output ended."""

    near_tie: bool
    hi_argmax: int | None = None  # the high-precision greedy token: which side (if either) was right
    gap: float | None = None  # hi[left] - hi[right]: > 0 where high precision prefers the left token
    noise: float | None = None
    relative_gap: float | None = None  # gap / max(|hi[left]|, |hi[right]|)

    @property
    def margin(self) -> float | None:
        return None if self.gap is None else abs(self.gap)


Judge = Callable[[Divergence], TieVerdict]


def first_divergence(prompt: Sequence[int], left: Sequence[int], right: Sequence[int]) -> Divergence | None:
    """None when the outputs are identical, else where they first differ."""
    for i in range(max(len(left), len(right))):
        a = left[i] if i < len(left) else None
        b = right[i] if i < len(right) else None
        if a != b:
            return Divergence(tuple(prompt) + tuple(left[:i]), i, a, b)
    return None


@torch.no_grad()
def next_logits(model: torch.nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """Logits [V] after `ids` (one plain forward, no cache), as float64 on the CPU."""
    x = torch.tensor([list(ids)], device=input_device(model))
    return model(input_ids=x, logits_to_keep=1).logits[0, -1].double().cpu()


def verdict(d: Divergence, lo: torch.Tensor, hi: torch.Tensor) -> TieVerdict:
    """Classify `d` from the next-token logits [V] after its prefix in the run dtype (`lo`) and higher precision."""
    hi_argmax = int(hi.argmax())
    if d.left is None or d.right is None:
        return TieVerdict(False, hi_argmax)
    a, b = d.left, d.right
    rivals = torch.cat([hi.topk(min(NOISE_RANK, hi.numel())).indices, torch.tensor([b])])
    noise = float(((lo[rivals] - lo[a]) - (hi[rivals] - hi[a])).abs().max())
    gap = float(hi[a] - hi[b])
    scale = max(abs(float(hi[a])), abs(float(hi[b])))
    return TieVerdict(abs(gap) <= TIE_FACTOR * noise, hi_argmax, gap, noise, gap / scale if scale > 0 else 0.0)


def classify(model: torch.nn.Module, divergences: Sequence[Divergence], hi_dtype: torch.dtype) -> list[TieVerdict]:
    """One verdict per divergence. Casts `model` to `hi_dtype` in place and leaves it there (a 7B target has room
    for one copy only): call it once, after everything else that uses the model in its own dtype."""
    lo = [next_logits(model, d.context) for d in divergences]
    if divergences:
        model.to(hi_dtype)
    hi = [next_logits(model, d.context) for d in divergences]
    return [verdict(d, lo_d, hi_d) for d, lo_d, hi_d in zip(divergences, lo, hi)]


class Fp64Judge:
    """A `Judge` that leaves `model` as it is: lo from `model`, hi from a float64 copy made on the first call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.reruns = 0
        self._fp64: torch.nn.Module | None = None

    def __call__(self, d: Divergence) -> TieVerdict:
        if self._fp64 is None:
            self._fp64 = copy.deepcopy(self.model).to(torch.float64)
        self.reruns += 1
        return verdict(d, next_logits(self.model, d.context), next_logits(self._fp64, d.context))
