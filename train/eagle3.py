"""EAGLE-3: a one-layer feature drafter over the frozen target's low / mid / high hidden states (models/eagle3.py),
trained with training-time test.

Loss (EAGLE-3, Li et al. 2025, sec. 3; SpecForge's weighting): the draft is unrolled for n = method.ttt_steps steps
over each sequence, step j feeding back its own outputs with the embedding of the true token x_{t+1+j}:
    L = Σ_{j<n} λ^j · [w · CE(draft_j(t), p_{t+1+j}) + (1 - w) · CE(draft_j(t), x_{t+2+j})]
p is the target's next-token distribution at t+1+j restricted to the draft vocabulary and renormalised
(train/eagle3_teacher.py: its top-k, or with method.teacher=full its whole distribution), w = method.soft_labels,
λ = method.decay. A position counts where token t+2+j is trained (an assistant token) and, for the soft term, where
some of the teacher's mass lies in the draft vocabulary.

Step j's top-1 agreement with the target's argmax, counted where the drafts of steps < j at the same position were
all right, is the acceptance a_j of depth j+1 of a greedy chain; a chain of depth d then yields
τ = 1 + Σ_{k≤d} Π_{i≤k} a_i tokens per target step (`ChainCounter`). Training logs the marginal top-1, a_j and τ;
evaluation measures them on the target's own greedy continuations of validation prompts (what the engine meets), per
rank, and the checkpoint keeps that [depth][rank] table for the engine's default tree. That τ is a mean over every
position; the engine's steps start where the previous one ended, so they land more often where drafts fail, and
evaluation also replays the continuations step by step (`ContinuationWalk`): the τ the engine measures on the
same prompts, for a chain and for the default tree.
Dimension letters: B batch, T time, L fused layers, D hidden, S draft vocabulary, k soft-label width, N positions.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn import functional as F

from data.chat import IGNORE_INDEX
from data.errors import UsageError
from inference.drafters.eagle3 import default_tree
from inference.engine.tree import chain_choices
from models.checkpoint import most_frequent
from models.eagle3 import (Eagle3Config, Eagle3Draft, fused_layers, load_eagle3, norm_gain, save_eagle3,
                           target_text_config, token_lookup)
from models.loading import model_config
from train.distributed import gathered
from train.eagle3_teacher import SOFT_TOPK, Teacher, TopkTeacher, full_teacher
from train.medusa1 import ContinuationWalk, greedy_continuations, hit_rank
from train.method import StepOutput, TokenCounts

log = logging.getLogger("draftsmith")

DEFAULT_DRAFT_VOCAB = 32000  # EAGLE-3's (capped at the target's vocabulary)
RANKS = 10  # candidates per depth whose hit rates evaluation records (the engine's trees use ranks < 10)


class Eagle3TrainModule(nn.Module):
    """The frozen target plus the trainable draft; only `draft` has parameters that require grad."""

    def __init__(self, target: nn.Module, draft: Eagle3Draft) -> None:
        super().__init__()
        self.target = target
        self.draft = draft

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> rows of the target's frozen embedding table [B, T, D] (`token_lookup`) in the draft's dtype."""
        with torch.no_grad():
            return token_lookup(self.target.get_input_embeddings())(input_ids).to(self.draft.fc.weight.dtype)

    @torch.no_grad()
    def target_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: tuple[int, ...],
                        teacher: str | None = "topk") -> dict[str, torch.Tensor]:
        """Online (no cache): the target's layers [B, T, D] each and what `teacher` reads, as a feature cache would
        hold them: topk, its top-k next-token distribution [B, T, k]; full, its last post-norm hidden state [B, T, D]
        (`hidden`, what its lm_head reads); None, nothing more."""
        last = int(target_text_config(self.target)["num_hidden_layers"])  # hidden_states[last]: after the final norm
        wanted = sorted({*layers, last}) if teacher == "full" else list(layers)
        out = self.target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=wanted,
                          logits_to_keep=0 if teacher == "topk" else 1)
        batch = {f"layer_{i}": out.hidden_states[i].float() for i in layers}
        if teacher == "full":
            return {**batch, "hidden": out.hidden_states[last].float()}
        if teacher == "topk":
            top = out.logits.float().softmax(-1).topk(SOFT_TOPK, dim=-1)
            return {**batch, "topk_ids": top.indices, "topk_probs": top.values}
        return batch


def eagle3_loss(draft: Eagle3Draft, hidden: torch.Tensor, embeds: torch.Tensor, labels: torch.Tensor,
                teacher: Teacher | None, steps: int, decay: float, soft_weight: float) -> StepOutput:
    """The module docstring's loss. hidden [B, T, L*D] concatenated target layers, embeds [B, T, D], labels [B, T]
    unshifted (-100: untrained), teacher the target's distribution at t (for token t+1) or None (hard labels only:
    soft_weight must be 0). Metrics per step: loss, top-1 agreement with the target's argmax (or the data's next
    token without a teacher), and the chain τ they imply."""
    if soft_weight > 0 and teacher is None:
        raise ValueError("eagle3_loss: soft_weight > 0 needs the target's distribution (a teacher)")
    b, t = labels.shape
    outputs = draft.unroll(draft.fuse(hidden), embeds, steps)  # steps x [B, T, D]
    loss = hidden.new_zeros((), dtype=torch.float32)
    metrics: dict[str, torch.Tensor] = {}
    chain = ChainCounter(steps)
    for j, out in enumerate(outputs):
        shift = 2 + j  # output j at t predicts token t + 2 + j, the target's distribution at t + 1 + j
        if shift >= t:
            break
        keep = labels[:, shift:] != IGNORE_INDEX  # [B, T - shift]
        if not keep.any():
            continue
        logits = draft.logits(out[:, : t - shift][keep]).float()  # [N, S]
        hard = draft.draft_index(labels[:, shift:][keep])  # [N]; -1 outside the draft vocabulary
        if teacher is not None:
            soft = teacher.rows(draft, shift - 1, keep)  # the target's distribution at t + 1 + j, [N, S]
            inside, reference = soft.inside, soft.argmax
        else:
            inside, reference = hard >= 0, hard
        ce = logits.new_zeros(())
        if soft_weight > 0 and inside.any():
            scored, target = (logits, soft.probs) if inside.all() else (logits[inside], soft.probs[inside])
            soft_ce = F.cross_entropy(scored, target)
            metrics[f"step{j + 1}_soft_loss"] = soft_ce.detach()
            ce = ce + soft_weight * soft_ce
        if soft_weight < 1 and (hard >= 0).any():
            hard_ce = F.cross_entropy(logits[hard >= 0], hard[hard >= 0])
            metrics[f"step{j + 1}_hard_loss"] = hard_ce.detach()
            ce = ce + (1 - soft_weight) * hard_ce
        loss = loss + decay ** j * ce
        correct = logits.detach().argmax(-1) == reference  # [N]; a miss where the argmax is outside
        metrics[f"step{j + 1}_top1"] = correct.float().mean()
        chain.add(j, keep, correct)
    metrics.update({k: torch.tensor(v) for k, v in chain.metrics().items()})
    return StepOutput(loss=loss, metrics=metrics)


class ChainCounter:
    """What a chain drafted from each position would get accepted (greedy): step j's draft at t counts only where
    the drafts of steps < j at t were all right. accept_j = P(step j right | steps < j right); tau = 1 + the mean
    accepted length, which is 1 + Σ_d Π_{j<d} accept_j."""

    def __init__(self, steps: int) -> None:
        self.alive: torch.Tensor | None = None  # [B, T] positions whose chain is still accepted
        self.tried = [0] * steps
        self.right = [0] * steps

    def add(self, j: int, keep: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
        """keep [B, T - 2 - j] positions scored at step j; correct [N] over them. Returns which of the N still had an
        accepted chain (the ones this step counts)."""
        b, width = keep.shape
        full = torch.zeros(b, width + 2 + j, dtype=torch.bool, device=keep.device)
        full[:, :width][keep] = correct
        scored = torch.zeros_like(full)
        scored[:, :width] = keep
        alive = scored if self.alive is None else self.alive[:, : full.shape[1]] & scored
        self.tried[j] += int(alive.sum())
        self.right[j] += int((alive & full).sum())
        self.alive = alive & full
        return alive[:, :width][keep]

    def accept(self) -> list[float]:
        return [r / n for r, n in zip(self.right, self.tried) if n]

    def metrics(self) -> dict[str, float]:
        rates = self.accept()
        return {**{f"step{j + 1}_accept": a for j, a in enumerate(rates)}, "tau_chain": chain_tau(rates)}


class RankCounter:
    """Per depth, over an evaluation: where the target's token ranked among the draft's candidates (r < RANKS) at the
    positions whose chain was accepted so far (every shallower top-1 right): the conditional [depth][rank] hit rates
    a tree is built from, and the marginal top-1 over every position. It also keeps each continuation's ranks by
    root, which its `walk` replays the way the engine steps through a text."""

    def __init__(self, depth: int) -> None:
        self.hits = torch.zeros(depth, RANKS, dtype=torch.float64)
        self.counts = torch.zeros(depth, dtype=torch.float64)
        self.top1 = torch.zeros(depth, 2, dtype=torch.float64)  # [depth] (right, scored) over every position
        self.chain = ChainCounter(depth)
        self.depth = depth
        self.ranks: torch.Tensor | None = None  # [B, T, depth] this batch's rank of the target's token, -1: none
        self.walk = ContinuationWalk()

    def start(self) -> None:
        """A new batch: chains start again."""
        self.chain.alive = None
        self.ranks = None

    def add(self, j: int, keep: torch.Tensor, logits: torch.Tensor, reference: torch.Tensor) -> None:
        """keep [B, T - 2 - j] the positions scored at step j; logits [N, S] there; reference [N] the draft id of
        the target's token (-1: outside the draft vocabulary, a miss)."""
        top = logits.topk(min(RANKS, logits.shape[-1]), dim=-1).indices  # [N, R]
        hit = top == reference[:, None]  # [N, R]
        counted = self.chain.add(j, keep, hit[:, 0])  # [N] which scored positions still had an accepted chain
        self.hits[j, : top.shape[1]] += hit[counted].double().sum(0).cpu()
        self.counts[j] += float(counted.sum())
        self.top1[j] += torch.tensor([float(hit[:, 0].sum()), float(len(hit))], dtype=torch.float64)
        b, width = keep.shape
        if self.ranks is None:
            self.ranks = torch.full((b, width + 2 + j, self.depth), -1, dtype=torch.long)
        self.ranks[:, :width, j][keep.cpu()] = hit_rank(hit).cpu()  # [N]

    def finish(self, labels: torch.Tensor) -> None:
        """The batch's continuations, labels [B, T] (right-padded rows, the generated tokens marked), into the walk."""
        if self.ranks is None:  # nothing scored (continuations of a token or two): no draft accepted anywhere
            self.ranks = torch.full((*labels.shape, self.depth), -1, dtype=torch.long)
        self.walk.add(self.ranks, labels)

    def table(self) -> list[list[float]]:
        """[depth][rank] conditional hit rates (a depth never reached is all zeros)."""
        return (self.hits / self.counts.clamp(min=1)[:, None]).tolist()

    def marginal_top1(self) -> list[float]:
        return (self.top1[:, 0] / self.top1[:, 1].clamp(min=1)).tolist()


def chain_tau(top1: list[float]) -> float:
    """Tokens per target step of a chain with these per-depth (conditional) acceptances."""
    tau, survive = 1.0, 1.0
    for a in top1:
        survive *= a
        tau += survive
    return tau


@torch.no_grad()
def record_ranks(model: Eagle3TrainModule, layers: tuple[int, ...], input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, labels: torch.Tensor, depth: int, counter: RankCounter) -> None:
    """Left-padded greedy continuations [B, T] (`greedy_continuations`): unroll the draft `depth` steps over the
    target's features of `layers` and record in `counter` where the target's next greedy token ranked. The unroll
    assumes right padding, so each row is shifted left first."""
    rows = []
    for ids, mask, lab in zip(input_ids, attention_mask, labels):
        real = mask.bool()
        rows.append((ids[real], lab[real]))
    width = max(len(ids) for ids, _ in rows)
    pad = lambda x, fill: F.pad(x, (0, width - len(x)), value=fill)  # noqa: E731
    ids = torch.stack([pad(i, 0) for i, _ in rows])
    mask = torch.stack([pad(torch.ones_like(i), 0) for i, _ in rows])
    lab = torch.stack([pad(label, IGNORE_INDEX) for _, label in rows])
    feats = model.target_features(ids, mask, layers, teacher=None)  # the labels are the greedy tokens
    hidden = torch.cat([feats[f"layer_{i}"] for i in layers], dim=-1)
    outputs = model.draft.unroll(model.draft.fuse(hidden), model.embed(ids), depth)
    counter.start()
    for j, out in enumerate(outputs):
        shift = 2 + j
        if shift >= width:
            break
        keep = lab[:, shift:] != IGNORE_INDEX  # greedy tokens: the data is the target's argmax
        if keep.any():
            logits = model.draft.logits(out[:, : width - shift][keep]).float()
            counter.add(j, keep, logits, model.draft.draft_index(lab[:, shift:][keep]))
    counter.finish(lab)


class Method(TokenCounts):
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.m = cfg.method
        self.layers = self._layers()
        self.acceptance: list[list[float]] = []  # the last greedy evaluation's [depth][rank] hit rates

    def _layers(self) -> tuple[int, ...]:
        """method.layers, or (null or empty) EAGLE-3's defaults for the target's depth (its config.json alone)."""
        depth = model_config(self.cfg.model.path, self.cfg.model.trust_remote_code, self.cfg.model.revision
                             ).get_text_config().num_hidden_layers
        layers = fused_layers(self.m.layers or None, depth)
        bad = [i for i in layers if not 0 <= i <= depth]
        if bad or len(set(layers)) != len(layers):
            raise UsageError(f"method.layers={list(layers)}: need distinct hidden_states indices in [0, {depth}] "
                             f"({self.cfg.model.path} has {depth} decoder layers)")
        return layers

    # -- what the run reads ----------------------------------------------------------------------------------------

    def feature_needs(self) -> tuple[list[int], bool]:
        """(layers, top-k soft labels) a feature cache must hold for this run (the full teacher reads the last hidden
        state, which every cache holds)."""
        return list(self.layers), self.m.soft_labels > 0 and self.m.teacher == "topk"

    def build(self, target: nn.Module, tokenizer: Any) -> Eagle3TrainModule:
        text = target_text_config(target)
        vocab_size = int(text["vocab_size"])
        size = self.m.draft_vocab if self.m.draft_vocab is not None else min(DEFAULT_DRAFT_VOCAB, vocab_size)
        if size > vocab_size:
            raise UsageError(f"method.draft_vocab={size}: the target's vocabulary has only {vocab_size} tokens")
        config = Eagle3Config(target=text, layers=self.layers, draft_vocab_size=size, ttt_steps=self.m.ttt_steps,
                              intermediate_size=self.m.intermediate_size)
        draft = Eagle3Draft(config)
        counts = self.token_counts(vocab_size)
        if counts is not None:
            draft.set_draft_vocab(most_frequent(counts, size))
        if self.m.init_from_lm_head:
            lm_head = target.get_output_embeddings()
            with gathered([lm_head.weight]), torch.no_grad():
                draft.lm_head.weight.copy_(lm_head.weight[draft.vocab_ids.to(lm_head.weight.device)])
                draft.init_as_target_head()
                norm = getattr(target.get_decoder(), "norm", None)
                if norm is not None and getattr(norm, "weight", None) is not None:
                    draft.norm.weight.copy_(norm_gain(norm, draft.config.hidden_size))  # the target's final norm's gain
        target.requires_grad_(False).eval()
        return Eagle3TrainModule(target, draft.float())

    # -- training ---------------------------------------------------------------------------------------------------

    def _inputs(self, model: Eagle3TrainModule, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch with the target's features: a cache's as they are, else from one no-grad target forward."""
        if f"layer_{self.layers[0]}" not in batch:
            teacher = str(self.m.teacher) if self.m.soft_labels > 0 else None
            batch = {**batch, **model.target_features(batch["input_ids"], batch["attention_mask"], self.layers,
                                                      teacher)}
        return batch

    def _teacher(self, model: Eagle3TrainModule, batch: dict[str, torch.Tensor]) -> Teacher | None:
        """method.teacher over this batch (None: no soft term, or a top-k teacher without stored soft labels)."""
        if self.m.soft_labels == 0:
            return None
        if self.m.teacher == "full":  # the target's frozen lm_head over its last hidden state (a cache's `hidden`)
            return full_teacher(model.draft, model.target.get_output_embeddings(), batch["hidden"], batch["labels"])
        return TopkTeacher(batch["topk_ids"], batch["topk_probs"]) if "topk_ids" in batch else None

    def _loss(self, model: Eagle3TrainModule, batch: dict[str, torch.Tensor], steps: int) -> StepOutput:
        batch = self._inputs(model, batch)
        hidden = torch.cat([batch[f"layer_{i}"] for i in self.layers], dim=-1)  # [B, T, L*D]
        teacher = self._teacher(model, batch)
        return eagle3_loss(model.draft, hidden, model.embed(batch["input_ids"]), batch["labels"], teacher, steps,
                           self.m.decay, self.m.soft_labels if teacher is not None else 0.0)

    def forward_loss(self, model: Eagle3TrainModule, batch: dict[str, torch.Tensor]) -> StepOutput:
        model.target.eval()
        return self._loss(model, batch, self.m.ttt_steps)

    def param_groups(self, model: Eagle3TrainModule, learning_rate: float) -> None:
        return None  # the draft only: HF Trainer's default group

    # -- evaluation -------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model: Eagle3TrainModule, batches: Iterable, tokenizer: Any, prompts: list[list[int]]
                 ) -> dict[str, float]:
        """Per-depth top-1 on validation data (teacher-forced text), then per-depth, per-rank hit rates on the
        target's own greedy continuations of validation prompts, unrolled to method.eval_depth steps."""
        depth = max(self.m.eval_depth, self.m.ttt_steps)
        device = model.draft.fc.weight.device
        sums: dict[str, float] = {}
        count = 0
        for i, batch in enumerate(batches):
            if self.cfg.eval.max_batches is not None and i >= self.cfg.eval.max_batches:
                break
            out = self._loss(model, {k: v.to(device) for k, v in batch.items()}, depth)
            for key, value in out.metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
            count += 1
        metrics = {k: v / count for k, v in sums.items() if k.endswith(("top1", "accept"))} if count else {}
        if count:
            metrics["tau_chain"] = chain_tau([metrics[f"step{j + 1}_accept"] for j in range(depth)
                                              if f"step{j + 1}_accept" in metrics])
        if prompts:
            log.info("evaluation: the draft on the target's greedy continuations of %d prompts", len(prompts))
            counter = RankCounter(depth)
            for input_ids, attention_mask, labels in greedy_continuations(
                model.target, prompts, self.cfg.eval.greedy_new_tokens, tokenizer,
                self.cfg.training.per_device_eval_batch_size
            ):
                record_ranks(model, self.layers, input_ids, attention_mask, labels, depth, counter)
            self.acceptance = counter.table()
            for j, (row, top1) in enumerate(zip(self.acceptance, counter.marginal_top1())):
                metrics[f"greedy_step{j + 1}_top1"] = top1
                metrics[f"greedy_step{j + 1}_accept"] = row[0]
                metrics[f"greedy_step{j + 1}_accept_top5"] = sum(row[:5])
            metrics["greedy_tau_chain"] = chain_tau([row[0] for row in self.acceptance])
            metrics["greedy_tau_walk_chain"] = counter.walk.tau(chain_choices(depth))
            metrics["greedy_tau_walk_tree"] = counter.walk.tau(default_tree(self.acceptance))
        return metrics

    def report(self, metrics: dict[str, float]) -> str:
        """Per-depth acceptance as a table, with the chain τ it implies."""
        rows = [f"{'':34}{'top-1':>8}{'accept':>8}{'top-5':>8}   (accept, top-5: where shallower drafts were right)"]
        depth = max(self.m.eval_depth, self.m.ttt_steps)
        for title, prefix in (("validation data (teacher-forced)", "eval_"),
                              ("target's greedy continuations", "eval_greedy_")):
            if f"{prefix}step1_top1" not in metrics:
                continue
            rows.append(title)
            for j in range(1, depth + 1):
                if f"{prefix}step{j}_top1" in metrics:
                    cells = [metrics.get(f"{prefix}step{j}_{key}") for key in ("top1", "accept", "accept_top5")]
                    rows.append(f"  {f'depth {j} (token t+{j + 1})':32}"
                                + "".join(f"{c:8.3f}" if c is not None else f"{'':8}" for c in cells))
            rows.append(f"  {'chain tau (mean over positions)':32}{metrics[f'{prefix}tau_chain']:8.2f}")
            for key, title in (("tau_walk_chain", f"chain tau (engine walk, {depth})"),
                               ("tau_walk_tree", "default tree tau (engine walk)")):
                if f"{prefix}{key}" in metrics:
                    rows.append(f"  {title:32}{metrics[f'{prefix}{key}']:8.2f}")
        return "\n".join(rows)

    # -- checkpoints ------------------------------------------------------------------------------------------------

    def save(self, model: Eagle3TrainModule, output_dir: Path, tokenizer: Any, extra: dict[str, Any]) -> None:
        draft = model.draft
        if self.acceptance:
            draft.config = Eagle3Config(**{**draft.config.to_dict(), "acceptance": self.acceptance})
        save_eagle3(output_dir, draft, self.cfg.model.path, tokenizer=tokenizer, extra=extra,
                    token_counts=self.token_counts(draft.config.vocab_size))

    def load(self, model: Eagle3TrainModule, checkpoint_dir: Path) -> None:
        loaded = load_eagle3(checkpoint_dir)
        model.draft.load_state_dict(loaded.state_dict())
