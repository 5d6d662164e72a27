"""Quality guard for methods that change the backbone (Medusa-2): does the base model still do its own job?

Dimension letters: B batch, T time, N scored positions, V vocab.

Two numbers on held-out data, for the original model ("before") and the trained backbone ("after"):
  * LM loss / perplexity on validation chats: next-token CE at trained positions, token-weighted;
  * greedy agreement: along the original model's greedy continuations of validation prompts, the share of positions
    where the trained model's argmax equals the original's (teacher-forced, so one early difference does not count
    against every later position).

bitsandbytes trap: on CPUs with AVX512-BF16, a Linear4bit forward in eval mode on an input that does not require grad
repacks the weight for CPU inference, and a later backward through it yields no gradient, silently. Every forward here
runs under `eval_mode`, which puts a model in eval mode EXCEPT its bitsandbytes Linear4bit layers: their `training`
flag only selects that repacking (they have no dropout), so leaving it on keeps a QLoRA backbone trainable.
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from models.backbone import final_hidden
from models.medusa import head_targets
from train.medusa1 import greedy_continuations

GUARD_KEYS = ("guard_loss_before", "guard_loss_after", "guard_ppl_before", "guard_ppl_after", "guard_ppl_increase",
              "guard_greedy_agreement")


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Eval semantics (no dropout) for `model` except bitsandbytes Linear4bit layers, which stay in training mode
    (see the module docstring); every module's previous mode is restored on exit."""
    flags = [(m, m.training) for m in model.modules()]  # pre-order: parents before children
    bnb = sys.modules.get("bitsandbytes")  # not imported -> no Linear4bit layer can exist
    model.eval()
    if bnb is not None:
        for m in model.modules():
            if isinstance(m, bnb.nn.Linear4bit):
                m.train()
    try:
        yield model
    finally:
        for m, flag in flags:  # parents first, so each child's own flag is set last
            m.train(flag)


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """[B, T] unshifted labels -> [B, T] token t+1 at position t (-100 where untrained): the base lm_head's target,
    i.e. "head 0" in models.medusa's offset convention."""
    return head_targets(labels, 0)


def scored_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal LM's float32 logits [N, V] at the positions whose next token is trained, and those tokens [N].
    Only the N scored positions are projected onto the vocabulary."""
    targets = next_token_targets(labels)  # [B, T]
    keep = targets != -100
    hidden = final_hidden(model, input_ids, attention_mask)  # [B, T, D]
    return model.get_output_embeddings()(hidden[keep]).float(), targets[keep]


@dataclass(frozen=True)
class LMQuality:
    loss: float  # mean next-token CE per scored token, nats
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@dataclass(frozen=True)
class GreedyReference:
    """The original model's greedy continuations (input_ids, attention_mask, labels per batch, labels marking the
    generated tokens) and its argmax [N] at each batch's scored positions."""

    batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    argmax: list[torch.Tensor]


@dataclass(frozen=True)
class Reference:
    """What the guard compares against, computed once from the original model."""

    quality: LMQuality
    greedy: GreedyReference


@torch.no_grad()
def lm_quality(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]], max_batches: int | None = None) -> LMQuality:
    device = model.get_input_embeddings().weight.device
    total, count = 0.0, 0
    with eval_mode(model):
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            logits, targets = scored_logits(model, *(batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")))
            total += F.cross_entropy(logits, targets, reduction="sum").item()
            count += targets.numel()
    return LMQuality(loss=total / max(count, 1), tokens=count)


@torch.no_grad()
def greedy_reference(model: nn.Module, prompts: list[list[int]], tokenizer: Any, max_new_tokens: int, batch_size: int
                     ) -> GreedyReference:
    batches, argmax = [], []
    with eval_mode(model):
        for input_ids, attention_mask, labels in greedy_continuations(model, prompts, max_new_tokens, tokenizer, batch_size):
            batches.append((input_ids, attention_mask, labels))
            argmax.append(scored_logits(model, input_ids, attention_mask, labels)[0].argmax(-1))
    return GreedyReference(batches=batches, argmax=argmax)


@torch.no_grad()
def greedy_agreement(model: nn.Module, reference: GreedyReference) -> tuple[int, int]:
    """(positions where `model`'s argmax equals the original's, positions) along the reference continuations."""
    device = model.get_input_embeddings().weight.device
    hits, total = 0, 0
    with eval_mode(model):
        for batch, original in zip(reference.batches, reference.argmax):
            logits, _ = scored_logits(model, *(t.to(device) for t in batch))
            hits += int((logits.argmax(-1) == original.to(device)).sum())
            total += original.numel()
    return hits, total


@dataclass(frozen=True)
class GuardReport:
    before: LMQuality
    after: LMQuality
    agreement: float  # nan when there were no prompts
    agreement_tokens: int

    @property
    def ppl_increase(self) -> float:
        """Relative perplexity change, after / before - 1."""
        return self.after.perplexity / self.before.perplexity - 1.0

    def metrics(self) -> dict[str, float]:
        return dict(zip(GUARD_KEYS, (self.before.loss, self.after.loss, self.before.perplexity, self.after.perplexity,
                                     self.ppl_increase, self.agreement)))


def guard_report(model: nn.Module, reference: Reference, batches: Iterable, max_batches: int | None = None) -> GuardReport:
    """The trained backbone `model` against the original's `reference`, on the same validation batches."""
    after = lm_quality(model, batches, max_batches)
    hits, total = greedy_agreement(model, reference.greedy)
    return GuardReport(before=reference.quality, after=after, agreement=hits / total if total else float("nan"),
                       agreement_tokens=total)


def degraded(metrics: dict[str, float], max_increase: float, prefix: str = "eval_") -> bool:
    return metrics.get(f"{prefix}guard_ppl_increase", 0.0) > max_increase


def guard_summary(metrics: dict[str, float], max_increase: float, prefix: str = "eval_") -> str:
    """The guard's lines for the end-of-run report; a loud WARNING line when perplexity rose past `max_increase`."""
    if f"{prefix}guard_ppl_after" not in metrics:
        return ""
    get = lambda key: metrics[f"{prefix}{key}"]  # noqa: E731
    rows = [
        "base-model quality guard (held-out chats)",
        f"  {'':30}{'before':>10}{'after':>10}",
        f"  {'LM loss':30}{get('guard_loss_before'):10.4f}{get('guard_loss_after'):10.4f}",
        f"  {'perplexity':30}{get('guard_ppl_before'):10.3f}{get('guard_ppl_after'):10.3f}"
        f"  ({get('guard_ppl_increase'):+.2%})",
        f"  {'greedy agreement with original':30}{get('guard_greedy_agreement'):20.3f}",
    ]
    if degraded(metrics, max_increase, prefix):
        rows.append(warning_line(metrics, max_increase, prefix))
    return "\n".join(rows)


def warning_line(metrics: dict[str, float], max_increase: float, prefix: str = "eval_") -> str:
    return (
        f"WARNING !!! base-model perplexity rose {metrics[f'{prefix}guard_ppl_increase']:.2%} "
        f"({metrics[f'{prefix}guard_ppl_before']:.3f} -> {metrics[f'{prefix}guard_ppl_after']:.3f}), more than "
        f"{max_increase:.0%} (method.guard_max_ppl_increase): the backbone lost quality; lower training.learning_rate "
        "or method.heads_weight, use method.lm_loss=kl, or train on self-distilled data !!!"
    )
