"""Medusa-1: frozen backbone, K trainable heads.

Loss (Medusa paper, Eq. 1, with the decay weights of the reference implementation):
    L = Σ_{k=1..K} λ^k · [(1 - w) · CE(head_k(h_t), x_{t+k+1}) + w · CE(head_k(h_t), p_{t+k})]
λ = cfg.method.decay; λ = 1 gives the original repository's plain sum. w = cfg.method.soft_labels (default 0: hard
labels only): p_{t+k} = softmax(lm_head(h_{t+k})) is the frozen target's own next-token distribution at t+k, read off
the same forward pass (no generation), restricted to the heads' vocabulary. It is the self-distillation target of
Medusa §2.3.3 without the generated answers: head k learns what the target would say at t+k+1, with its second
choices, on any text. With data.features (a cache from `python -m train features`) the hidden states h and the
target's top-k distribution p come from the cache (`CachedSoftLabels`), and no target forward runs while training.
Dimension letters: B batch, T time, K heads, N selected positions, D hidden, V vocab.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn import functional as F

from data.chat import IGNORE_INDEX
from data.collate import left_pad, length_batches
from data.errors import UsageError
from inference.engine.tree import chain_choices, load_tree, walk_forwards
from models.backbone import final_hidden
from models.checkpoint import load_drafter, most_frequent, save_drafter
from models.medusa import MedusaConfig, MedusaHeads, head_targets
from train.distributed import gathered
from train.method import StepOutput, TokenCounts

log = logging.getLogger("draftsmith")

TOPK = (1, 5)
RANKS = 10  # candidates per head the engine-walk estimate looks at (the engine's trees use ranks < 10)


class MedusaTrainModule(nn.Module):
    """The frozen target plus trainable heads; only `heads` has parameters that require grad."""

    def __init__(self, target: nn.Module, heads: MedusaHeads) -> None:
        super().__init__()
        self.target = target
        self.heads = heads

    def lm_head(self) -> nn.Module:
        return self.target.get_output_embeddings()

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] -> frozen post-norm hidden states [B, T, D] in the heads' dtype."""
        return final_hidden(self.target, input_ids, attention_mask).to(next(self.heads.parameters()).dtype)


SoftLabels = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(b [n], t [n]) -> [n, V|S] probabilities: the target's distribution for token t + 1 of row b, over the heads'
vocabulary."""


def medusa_loss(
    heads: MedusaHeads,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    decay: float,
    lm_head: nn.Module | None = None,
    soft_weight: float = 0.0,
    base_lm_head: nn.Module | None = None,
    soft: SoftLabels | None = None,
) -> StepOutput:
    """Σ_k λ^k · CE_k over positions whose head-k target is a trained token (inside the draft vocabulary, if any).

    hidden [B, T, D], labels [B, T] unshifted (-100 = untrained). Only positions where some head has a target are
    projected onto the vocabulary, so padding and prompt tokens cost nothing. `lm_head`: the base lm_head the heads
    share (share_lm_head heads only). soft_weight w > 0 mixes in the soft-label term (module docstring), read from
    `soft` (a feature cache's, `CachedSoftLabels`) or, without it, computed from `base_lm_head`, the frozen target's.
    """
    if soft_weight > 0 and soft is None:
        if base_lm_head is None:
            raise ValueError("medusa_loss: soft_weight > 0 needs base_lm_head or soft (the target's soft labels)")
        soft = lambda b, t: soft_labels(heads, hidden[b, t], base_lm_head)  # noqa: E731
    K = heads.config.num_heads
    full = torch.stack([head_targets(labels, k) for k in range(1, K + 1)])  # [K, B, T] full token ids
    targets = heads.draft_targets(full)  # [K, B, T] indices into the heads' logits; outside a draft vocabulary: -100
    keep = (targets != -100).any(0)  # [B, T]
    h = hidden[keep]  # [N, D]
    targets = targets[:, keep]  # [K, N]
    batch_pos = keep.nonzero() if soft_weight > 0 else None  # [N, 2] (b, t) of each kept position: soft labels
    loss = hidden.new_zeros((), dtype=torch.float32)
    metrics: dict[str, torch.Tensor] = {}
    if heads.config.draft_vocab_size is not None:  # share of the targets the draft vocabulary can express at all
        metrics["draft_vocab_coverage"] = (targets != -100).sum() / (full != -100).sum().clamp(min=1)
    for k in range(K):
        logits = heads.head_logits(k, h, lm_head).float()  # [N, V]
        valid = targets[k] != -100
        if valid.any():
            ce = F.cross_entropy(logits[valid], targets[k][valid])
            metrics[f"head{k + 1}_loss"] = ce.detach()
            if soft_weight > 0:
                b, t = batch_pos[valid].unbind(-1)  # head k+1 at t predicts x_{t+k+2}, as the target does at t+k+1
                soft_ce = F.cross_entropy(logits[valid], soft(b, t + k + 1))  # target [n, V|S]
                metrics[f"head{k + 1}_soft_loss"] = soft_ce.detach()
                ce = (1 - soft_weight) * ce + soft_weight * soft_ce
            loss = loss + decay ** (k + 1) * ce
            metrics.update(topk_accuracy(logits[valid].detach(), targets[k][valid], f"head{k + 1}"))
    return StepOutput(loss=loss, metrics=metrics)


@torch.no_grad()
def soft_labels(heads: MedusaHeads, hidden: torch.Tensor, base_lm_head: nn.Module) -> torch.Tensor:
    """The frozen target's next-token distribution over the heads' vocabulary: [n, D] -> [n, V|S] probabilities
    (fp32; renormalised over the S draft-vocabulary tokens when the heads have one)."""
    return heads.base_logits(hidden, base_lm_head).float().softmax(-1)


class CachedSoftLabels:
    """Soft labels from a feature cache (data/features.py): the target's top-k next-token probabilities [B, T, k] and
    their ids, as a dense distribution over the heads' vocabulary. Ids outside a draft vocabulary are dropped and the
    rest renormalised, as `soft_labels` renormalises over the draft vocabulary; with k = V the two are equal. The
    mass beyond the top k is not spread (it is what the cache's topk_rest records)."""

    def __init__(self, heads: MedusaHeads, topk_ids: torch.Tensor, topk_probs: torch.Tensor) -> None:
        self.index = heads.draft_targets(topk_ids, missing=-1)  # [B, T, k] into the heads' logits; -1: outside
        self.probs = topk_probs
        self.width = heads.config.out_size

    def __call__(self, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return spread_topk(self.index[b, t], self.probs[b, t].float(), self.width)[0]


def spread_topk(index: torch.Tensor, probs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k probabilities [n, k] at positions `index` [n, k] of a drafter's vocabulary (-1: outside it) -> (a dense
    distribution [n, width], renormalised over the ids inside; whether any mass fell inside [n])."""
    inside = index >= 0
    dense = probs.new_zeros(len(index), width)
    dense.scatter_add_(1, index.clamp_min(0), torch.where(inside, probs, torch.zeros_like(probs)))
    mass = dense.sum(-1, keepdim=True)
    return dense / mass.clamp_min(1e-12), mass[:, 0] > 0


def topk_accuracy(logits: torch.Tensor, targets: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """logits [N, V], targets [N] -> {"<prefix>_top1": ..., "<prefix>_top5": ...}."""
    top = logits.topk(max(TOPK), dim=-1).indices  # [N, 5]
    hits = top == targets[:, None]
    return {f"{prefix}_top{k}": hits[:, :k].any(-1).float().mean() for k in TOPK}


class AccuracyCounter:
    """Sums top-k hits over an evaluation pass."""

    def __init__(self) -> None:
        self.hits: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, logits: torch.Tensor, targets: torch.Tensor) -> None:
        valid = targets != -100
        if not valid.any():
            return
        top = logits[valid].topk(max(TOPK), dim=-1).indices
        hits = top == targets[valid][:, None]
        for k in TOPK:
            key = f"{name}_top{k}"
            self.hits[key] = self.hits.get(key, 0.0) + hits[:, :k].any(-1).sum().item()
            self.counts[key] = self.counts.get(key, 0) + int(valid.sum())

    def result(self) -> dict[str, float]:
        return {k: self.hits[k] / self.counts[k] for k in self.hits}


class Method(TokenCounts):
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.m = cfg.method

    def build(self, target: nn.Module, tokenizer: Any) -> MedusaTrainModule:
        lm_head = target.get_output_embeddings()
        with gathered([lm_head.weight]):  # ZeRO-3 loads the target partitioned: read the full lm_head (all ranks)
            vocab_size = lm_head.weight.shape[0]
            config = MedusaConfig(
                num_heads=self.m.num_heads,
                num_layers=self.m.num_layers,
                hidden_size=target.config.get_text_config().hidden_size,
                vocab_size=vocab_size,
                share_lm_head=self.m.share_lm_head,
                draft_vocab_size=self._draft_vocab_size(vocab_size),
            )
            heads = MedusaHeads(config)
            if config.draft_vocab_size is not None:  # the S most frequent train labels (count_labels ran first)
                heads.set_draft_vocab(most_frequent(self.token_counts(vocab_size), config.draft_vocab_size))
            if self.m.init_from_lm_head and not config.share_lm_head:
                heads.init_from_base(lm_head)
        target.requires_grad_(False).eval()
        return MedusaTrainModule(target, heads.float())

    def _draft_vocab_size(self, vocab_size: int) -> int | None:
        size = self.m.get("draft_vocab")
        if size is not None and size > vocab_size:
            raise UsageError(f"method.draft_vocab={size}: the target's vocabulary has only {vocab_size} tokens")
        if size is not None and self.label_counts is None:
            raise UsageError("method.draft_vocab needs the training labels' token counts (count_labels)")
        return size

    def forward_loss(self, model: MedusaTrainModule, batch: dict[str, torch.Tensor]) -> StepOutput:
        model.target.eval()  # Trainer calls model.train(); the frozen backbone keeps eval semantics (no dropout)
        hidden = self._hidden(model, batch)
        base = model.lm_head()
        shared = base if model.heads.config.share_lm_head else None
        soft = CachedSoftLabels(model.heads, batch["topk_ids"], batch["topk_probs"]) if "topk_ids" in batch else None
        return medusa_loss(model.heads, hidden, batch["labels"], self.m.decay, shared,
                           soft_weight=self.m.soft_labels, base_lm_head=base, soft=soft)

    @staticmethod
    def _hidden(model: MedusaTrainModule, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, T, D] in the heads' dtype: a feature cache's stored states (data.features), else the frozen target's."""
        if "hidden" in batch:
            return batch["hidden"].to(next(model.heads.parameters()).dtype)
        return model.hidden(batch["input_ids"], batch["attention_mask"])

    @torch.no_grad()
    def evaluate(self, model: MedusaTrainModule, batches: Iterable, tokenizer: Any, prompts: list[list[int]]) -> dict[str, float]:
        """Per-head top-1/top-5 and the backbone's own next-token top-1 on validation data; then the heads on the
        target's greedy continuations of validation prompts (what decoding acceptance depends on)."""
        counter = AccuracyCounter()
        max_batches = self.cfg.eval.max_batches
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            self._score(model, batch, counter, "")
        metrics = counter.result()
        if prompts:
            log.info("evaluation: heads on the target's greedy continuations of %d prompts", len(prompts))
            greedy, walk = AccuracyCounter(), ContinuationWalk()
            for input_ids, attention_mask, labels in greedy_continuations(
                model.target, prompts, self.cfg.eval.greedy_new_tokens, tokenizer, self.cfg.training.per_device_eval_batch_size
            ):
                batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
                self._score(model, batch, greedy, "greedy_", backbone=False, walk=walk)
            metrics.update(greedy.result())
            heads = self.m.num_heads
            metrics["greedy_tau_walk_chain"] = walk.tau(chain_choices(heads))
            default = load_tree("default", heads, RANKS).choices  # the engine's default tree for this many heads
            metrics["greedy_tau_walk_tree"] = walk.tau(default)
        return metrics

    def _score(self, model, batch: dict[str, torch.Tensor], counter: AccuracyCounter, prefix: str,
               backbone: bool = True, walk: ContinuationWalk | None = None) -> None:
        device = next(model.heads.parameters()).device
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch["labels"]
        hidden = self._hidden(model, batch)  # [B, T, D]
        lm_head = model.lm_head()
        if backbone:
            base_logits = lm_head(hidden.to(lm_head.weight.dtype) if lm_head.weight.is_floating_point() else hidden)
            counter.add(f"{prefix}backbone", base_logits[:, :-1].float(), labels[:, 1:])
        shared = lm_head if model.heads.config.share_lm_head else None
        ranks = []
        for k in range(model.heads.config.num_heads):
            logits = model.heads.head_logits(k, hidden, shared).float()  # [B, T, V]
            # a target outside a draft vocabulary maps to S, which no top-k index equals: it counts as a miss
            targets = model.heads.draft_targets(head_targets(labels, k + 1), missing=logits.shape[-1])
            counter.add(f"{prefix}head{k + 1}", logits, targets)
            if walk is not None:
                ranks.append(candidate_ranks(logits, targets, RANKS))  # [B, T]
        if walk is not None:
            walk.add(torch.stack(ranks, dim=-1), labels)  # head k at t: token t+k+1, depth k of the root at t

    def param_groups(self, model: MedusaTrainModule, learning_rate: float) -> None:
        return None  # heads only: HF Trainer's default single group

    def report(self, metrics: dict[str, float]) -> str:
        """The evaluation as a table: per-head top-1/top-5 next to the backbone's own next-token accuracy."""
        rows = [f"{'':32}{'top-1':>8}{'top-5':>8}"]
        for title, prefix, names in (
            ("validation data (ground truth)", "eval_", ["backbone"] + [f"head{k}" for k in range(1, self.m.num_heads + 1)]),
            ("target's greedy continuations", "eval_greedy_", [f"head{k}" for k in range(1, self.m.num_heads + 1)]),
        ):
            if f"{prefix}{names[-1]}_top1" not in metrics:
                continue
            rows.append(title)
            for name in names:
                label = "backbone (predicts t+1)" if name == "backbone" else f"head {name[4:]} (predicts t+{int(name[4:]) + 1})"
                rows.append(f"  {label:30}{metrics[f'{prefix}{name}_top1']:8.3f}{metrics[f'{prefix}{name}_top5']:8.3f}")
            for key, label in (("tau_walk_chain", "chain tau (engine walk)"), ("tau_walk_tree", "default tree tau (walk)")):
                if f"{prefix}{key}" in metrics:
                    rows.append(f"  {label:30}{metrics[f'{prefix}{key}']:8.2f}")
        return "\n".join(rows)

    def save(self, model: MedusaTrainModule, output_dir: Path, tokenizer: Any, extra: dict[str, Any]) -> None:
        save_drafter(output_dir, model.heads, self.cfg.model.path, tokenizer=tokenizer, extra=extra,
                     token_counts=self.token_counts(model.heads.config.vocab_size))

    def load(self, model: MedusaTrainModule, checkpoint_dir: Path) -> None:
        loaded = load_drafter(checkpoint_dir)
        model.heads.load_state_dict(loaded.heads.state_dict())


class ContinuationWalk:
    """The ranks a drafter gave the target's greedy tokens (`greedy_continuations`), kept per continuation by the root
    the engine drafts from, to replay a static tree's greedy decode step by step: τ = tokens / target forwards, as the
    engine counts them on the same prompts (`inference.engine.tree.walk_forwards`). A mean of accepted lengths over
    every position overstates it where easy and hard stretches alternate: each step starts where the last one ended,
    so steps land more often where drafts fail."""

    def __init__(self) -> None:
        self.texts: list[tuple[list[list[int]], int]] = []  # per continuation: (ranks at the root after c tokens, N)

    def add(self, ranks: torch.Tensor, labels: torch.Tensor) -> None:
        """ranks [B, T, H]: at position t, where token t+2+d ranked among depth d+1's candidates (-1: not among them,
        or no such token); labels [B, T] mark each row's generated tokens, right after its prompt. The root after c
        committed tokens is the position whose next token is the c-th: P + c - 2 for a prompt ending at P - 1."""
        for row, lab in zip(ranks.cpu(), labels.cpu()):
            made = (lab != IGNORE_INDEX).nonzero().flatten()
            if len(made):
                start, new = int(made[0]), len(made)
                self.texts.append((row[start - 1 : start + new - 2].tolist(), new))

    def tau(self, choices: Sequence[Sequence[int]]) -> float:
        """Tokens per target forward (prefill included) of decoding every continuation greedily with `choices`."""
        tokens = sum(new for _, new in self.texts)
        forwards = sum(walk_forwards(choices, ranks, new) for ranks, new in self.texts)
        return tokens / forwards if forwards else float("nan")


def candidate_ranks(logits: torch.Tensor, targets: torch.Tensor, ranks: int) -> torch.Tensor:
    """logits [..., V], targets [...] -> where each target ranks among the top `ranks` candidates [...], -1 where it
    is not among them (a target of -100 or outside the vocabulary never is)."""
    return hit_rank(logits.topk(min(ranks, logits.shape[-1]), dim=-1).indices == targets[..., None])


def hit_rank(hit: torch.Tensor) -> torch.Tensor:
    """hit [..., R] (candidate r is the target) -> the rank of the hit [...], -1 where none."""
    return torch.where(hit.any(-1), hit.long().argmax(-1), -1)


@torch.no_grad()
def greedy_continuations(target: nn.Module, prompts: list[list[int]], max_new_tokens: int, tokenizer: Any, batch_size: int):
    """Yield (input_ids [B, T], attention_mask [B, T], labels [B, T]) where labels mark only generated tokens up to
    and including EOS. Prompts are left-padded, so positions come from the attention mask; batches group prompts of
    about one length (`length_batches`, at most `batch_size` rows), so a long prompt does not pad a batch of short
    ones to its length. Batches come longest first, not in the order of `prompts`."""
    device = next(target.parameters()).device
    pad = tokenizer.pad_token_id
    for rows in length_batches([len(p) for p in prompts], batch_size, extra=max_new_tokens):
        chunk = [prompts[i] for i in rows]
        input_ids, attention_mask = left_pad(chunk, pad, device)  # [B, width] each
        width = input_ids.shape[1]
        out = target.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )  # [B, width + new]
        generated = out[:, width:]
        alive = torch.ones_like(generated, dtype=torch.bool)
        if tokenizer.eos_token_id is not None:
            ended = (generated == tokenizer.eos_token_id).long().cumsum(-1)
            alive = (ended - (generated == tokenizer.eos_token_id).long()) == 0  # up to and including the first EOS
        labels = torch.full_like(out, -100)
        labels[:, width:] = torch.where(alive, generated, torch.full_like(generated, -100))
        mask = torch.cat([attention_mask, alive.long()], dim=1)
        yield out, mask, labels
