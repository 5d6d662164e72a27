"""When a draft model stops drafting (dynamic draft length). The decision is made after each draft depth d < gamma,
from the draft's own distributions only, so every policy keeps speculative decoding exact: it changes which tree is
verified, never how.

    fixed            always draft gamma tokens
    confidence:<t>   stop once the draft's top-1 probability (the drafted token's, when greedy) is < t for every
                     row and branch (Hugging Face assisted generation's `assistant_confidence_threshold` rule)
    learned[:<t>]    a trained `StopperModel` predicts each token's acceptance; stop once every row's predicted
                     probability that all its drafts so far are accepted is < t (the threshold saved with the
                     stopper when t is omitted)

Dimension letters: B batch, k branches, G draft depth, F features.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from data.errors import UsageError
from models.stopper import FEATURES, StopperModel

KINDS = ("fixed", "confidence", "learned")


class StopSpecError(UsageError):
    """A bad `draft_stop` spec; the message names it."""


@dataclass(eq=False)
class DraftStop:
    kind: str = "fixed"
    threshold: float = 0.0
    model: StopperModel | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StopSpecError(f"draft stop {self.kind!r}: choose one of {', '.join(KINDS)}")
        if self.kind == "learned" and self.model is None:
            raise StopSpecError("draft stop 'learned' needs a stopper: train one with `python -m train stopper` and "
                                 "load its checkpoint")
        if not 0.0 <= self.threshold <= 1.0:
            raise StopSpecError(f"draft stop threshold {self.threshold}: must be in [0, 1]")

    def survival(self, features: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """[B, k, F] features of the tokens just drafted -> [B, k] the policy's score: the draft's top-1 probability
        (confidence) or the predicted probability that every draft so far is accepted (learned)."""
        if self.kind == "confidence":
            return features[..., FEATURES.index("top1")]
        if self.kind == "learned":
            p = self.model.accept_prob(features.to(self.model.mean.device))
            return p if previous is None else previous * p
        return torch.ones(features.shape[:-1], device=features.device)

    def keeps(self, score: torch.Tensor) -> torch.Tensor:
        """[...] scores -> [...] bool: which rows (and branches) would draft one more token."""
        return score >= self.threshold if self.kind != "fixed" else torch.ones_like(score, dtype=torch.bool)

    def keep_drafting(self, score: torch.Tensor | None) -> bool:
        """Draft one more depth while any row or branch keeps going (`score` may be None for "fixed")."""
        return self.kind == "fixed" or bool(self.keeps(score).any())


def parse_stop(spec: str | None, stopper: StopperModel | None, saved_threshold: float | None) -> DraftStop:
    """`spec` (see the module docstring) -> a DraftStop; None picks 'learned' when a stopper is given, else 'fixed'."""
    if spec is None:
        spec = "learned" if stopper is not None else "fixed"
    kind, threshold = check_stop_spec(spec, stopper is not None)
    if kind == "fixed":
        return DraftStop()
    return DraftStop(kind, saved_threshold if threshold is None else threshold, stopper if kind == "learned" else None)


def check_stop_spec(spec: str, has_stopper: bool) -> tuple[str, float | None]:
    """Validate a stop spec without loading anything: (kind, threshold or None for the saved one), or StopSpecError."""
    kind, _, value = spec.partition(":")
    if kind not in KINDS:
        raise StopSpecError(f"draft stop {spec!r}: choose fixed, confidence:<t> or learned[:<t>]")
    if kind == "fixed":
        if value:
            raise StopSpecError(f"draft stop {spec!r}: 'fixed' takes no threshold (the draft length is the tree's)")
        return kind, None
    if not value and kind == "confidence":
        raise StopSpecError(f"draft stop {spec!r}: give the threshold, e.g. confidence:0.4")
    if kind == "learned" and not has_stopper:
        raise StopSpecError(f"draft stop {spec!r}: this draft model has no stopper; train one with "
                            "`python -m train stopper` and load that checkpoint")
    if not value:
        return kind, None
    try:
        threshold = float(value)
    except ValueError:
        raise StopSpecError(f"draft stop {spec!r}: threshold {value!r} is not a number") from None
    if not 0.0 <= threshold <= 1.0:
        raise StopSpecError(f"draft stop threshold {threshold}: must be in [0, 1]")
    return kind, threshold


@dataclass(eq=False)
class StopTrace:
    """Accept/reject traces for training a stopper: per step the features of every draft depth and how many drafts
    the target accepted (chain drafting only)."""

    features: list[torch.Tensor] = field(default_factory=list)  # per step [B, G, F]
    accepted: list[torch.Tensor] = field(default_factory=list)  # per step [B]

    def rows(self, active: list[tuple[int, ...]]) -> list[tuple[torch.Tensor, int]]:
        """One (features [G, F], accepted drafts) pair per step and row that `active` (GenerationStats.accepted,
        -1 for finished rows) marks as live. Clears the trace."""
        out = []
        for f, n, step in zip(self.features, self.accepted, active):
            out += [(f[row], int(n[row])) for row, a in enumerate(step) if a >= 0]
        self.features, self.accepted = [], []
        return out
