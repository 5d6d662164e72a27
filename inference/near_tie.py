"""Is a greedy token that differs from our plain loop's float rounding, or an error? A float64 rerun decides.

Dimension letters: V vocab.

In exact arithmetic every greedy method returns our plain loop's tokens. In floating point a tree forward, a batched
verify or Hugging Face's own forward rounds differently from the plain step, and where the target's best logits are
nearly tied the argmax can flip; from there the two answers go separate ways. At the first position where a method's
tokens leave the reference's (`inference.benchstats.first_divergence`), the target is rerun once in float64 on the
context both read (prompt + common tokens), and with a = the reference's token, b = the method's, z = the float64
logits there:

    near-tie  iff  z[a] - z[b] <= tol * max(|z[a]|, |z[b]|)
    mismatch  otherwise: float64 clearly prefers the reference's token, so rounding does not explain b

b is thus a near-tie whenever float64 ranks it at least as high as a (in particular when b is the float64 argmax:
then the reference was the one rounding flipped), and otherwise when the two logits are within a relative `tol`
(--tie-tol, default 1e-3: orders of magnitude above what fp32 forwards differ by, but below bf16's unit roundoff
2^-8 = 3.9e-3, so for a bf16 target raise it, e.g. to 2e-2, or a genuine rounding flip may count as a mismatch).
A differing turn counts against a method only as a mismatch. The float64 copy of the target is made on first use, on
the target's device (twice an fp32 model's memory), and reused.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from inference.benchstats import Divergence, TieVerdict
from inference.devices import input_device

DEFAULT_TIE_TOL = 1e-3


def classify(logits: torch.Tensor, reference_token: int, method_token: int, tol: float) -> TieVerdict:
    """The rule above on float64 logits [V] at the divergence."""
    za, zb = float(logits[reference_token]), float(logits[method_token])
    gap, scale = za - zb, max(abs(za), abs(zb))
    return TieVerdict(near_tie=gap <= tol * scale, fp64_argmax=int(logits.argmax()), gap=gap,
                      relative_gap=gap / scale if scale > 0 else 0.0)


class Fp64Judge:
    """A `benchstats.Judge`: reruns `model` in float64 on each divergence's context."""

    def __init__(self, model: nn.Module, tol: float = DEFAULT_TIE_TOL) -> None:
        if not tol >= 0:
            raise ValueError(f"tie tolerance must be >= 0, got {tol}")
        self.model, self.tol = model, tol
        self.reruns = 0
        self._fp64: nn.Module | None = None

    def __call__(self, d: Divergence) -> TieVerdict:
        if d.reference_token is None or d.method_token is None:  # one side ended: no token to weigh
            return TieVerdict(near_tie=False)
        return classify(self.logits(d.context), d.reference_token, d.method_token, self.tol)

    @torch.no_grad()
    def logits(self, context: tuple[int, ...]) -> torch.Tensor:
        """Float64 next-token logits [V] after `context`."""
        if self._fp64 is None:
            self._fp64 = copy.deepcopy(self.model).to(torch.float64)
        self.reruns += 1
        ids = torch.tensor([context], device=input_device(self._fp64))
        return self._fp64(input_ids=ids, logits_to_keep=1).logits[0, -1]
