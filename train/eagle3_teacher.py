"""EAGLE-3's teacher: the target's next-token distribution p_{t+1} that the soft term of train/eagle3.py's loss is
scored against, over the draft vocabulary and renormalised there (SpecForge's `target_p`: a softmax over the target's
logits at the draft ids).

Two widths (method.teacher):
    topk  the target's k most likely ids and their probabilities (a feature cache's topk_ids / topk_probs, or the
          online forward's SOFT_TOPK), spread over the draft vocabulary: the mass outside the top k is dropped before
          the rest is renormalised.
    full  the target's whole distribution: its frozen lm_head over its last (post-norm) hidden state -- a cache's
          `hidden` or the online forward's hidden_states[-1] -- at the draft ids, softmaxed in fp32 (the same as
          renormalising the full softmax over them). Built once a batch, at the positions whose next token is trained,
          LOGITS_ROWS rows at a time, so [N, V] logits never exist whole.
A row counts for the soft loss where some of the teacher's mass lies in the draft vocabulary (every row of the full
teacher: SpecForge also drops rows whose argmax lies outside it, which keeps the two teachers from being compared at
one rule), and the metrics' reference is the target's argmax over its whole vocabulary (-1, a miss, outside).
Dimension letters: B batch, T time, D hidden, V target vocabulary, S draft vocabulary, k top-k width, M positions
with a trained next token, N the rows a TTT step scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from data.chat import IGNORE_INDEX
from models.eagle3 import Eagle3Draft
from train.medusa1 import spread_topk

TEACHERS = ("topk", "full")  # train.config.Eagle3Teacher
SOFT_TOPK = 20  # the online top-k teacher's width, as a feature cache stores it (features.topk's default)
LOGITS_ROWS = 2048  # rows the full teacher projects onto the vocabulary at once: [2048, V] fp32 stays small


@dataclass(frozen=True)
class SoftLabels:
    """The teacher at the N rows one TTT step scores."""

    probs: torch.Tensor  # [N, S] fp32 over the draft vocabulary, renormalised over it
    inside: torch.Tensor  # [N] bool: some of the teacher's mass lies in the draft vocabulary (the row counts)
    argmax: torch.Tensor  # [N] the draft id of the target's argmax over V; -1 outside the draft vocabulary


class Teacher(Protocol):
    def rows(self, draft: Eagle3Draft, start: int, keep: torch.Tensor) -> SoftLabels:
        """The distributions at positions start .. start + keep.shape[1] - 1 where keep [B, T'] holds."""
        ...


def soft_targets(draft: Eagle3Draft, topk_ids: torch.Tensor, topk_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids / topk_probs [N, k] -> (probabilities over the draft vocabulary [N, S], renormalised over the ids
    inside it; whether any mass fell inside [N])."""
    return spread_topk(draft.draft_index(topk_ids), topk_probs, draft.config.draft_vocab_size)


@dataclass(frozen=True)
class TopkTeacher:
    ids: torch.Tensor  # [B, T, k] the target's k most likely ids at t (for token t + 1)
    probs: torch.Tensor  # [B, T, k] their probabilities

    def rows(self, draft: Eagle3Draft, start: int, keep: torch.Tensor) -> SoftLabels:
        end = start + keep.shape[1]
        ids, probs = self.ids[:, start:end][keep], self.probs[:, start:end][keep].float()  # [N, k]
        dense, inside = soft_targets(draft, ids, probs)
        return SoftLabels(dense, inside, draft.draft_index(ids[:, 0]))


@dataclass(frozen=True)
class FullTeacher:
    probs: torch.Tensor  # [M, S] fp32, the target's distribution over the draft vocabulary, renormalised
    argmax: torch.Tensor  # [M] the draft id of the target's argmax over V (-1: outside)
    row: torch.Tensor  # [B, T] the row of probs holding position t's distribution; -1 where token t + 1 is untrained

    def rows(self, draft: Eagle3Draft, start: int, keep: torch.Tensor) -> SoftLabels:
        index = self.row[:, start : start + keep.shape[1]][keep]  # [N]
        if bool((index < 0).any()):
            raise ValueError("FullTeacher.rows: a scored position whose next token is untrained has no distribution")
        return SoftLabels(self.probs[index], torch.ones_like(index, dtype=torch.bool), self.argmax[index])


@torch.no_grad()
def full_teacher(draft: Eagle3Draft, lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                 chunk: int = LOGITS_ROWS) -> FullTeacher:
    """hidden [B, T, D] the target's last post-norm hidden state (what its lm_head reads), labels [B, T] unshifted
    (-100: untrained) -> its distribution at each t whose token t + 1 is trained, `chunk` rows projected at a time."""
    need = torch.zeros_like(labels, dtype=torch.bool)
    need[:, :-1] = labels[:, 1:] != IGNORE_INDEX  # [B, T]: the distribution at t is read for token t + 1
    states = hidden[need]  # [M, D]
    row = torch.full_like(labels, -1)
    row[need] = torch.arange(len(states), device=labels.device)
    vocab = draft.vocab_ids.to(hidden.device)  # [S] ascending: draft id i is target id vocab[i]
    dtype = next(lm_head.parameters()).dtype
    probs = [hidden.new_zeros((0, len(vocab)), dtype=torch.float32)]
    argmax = [labels.new_zeros(0)]
    for start in range(0, len(states), chunk):
        logits = lm_head(states[start : start + chunk].to(dtype)).float()  # [m, V]
        argmax.append(draft.draft_index(logits.argmax(-1)))
        probs.append(logits[:, vocab].softmax(-1))  # [m, S]
    return FullTeacher(torch.cat(probs), torch.cat(argmax), row)
