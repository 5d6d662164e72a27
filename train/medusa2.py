"""Medusa-2: the backbone and K Medusa heads trained together, keeping the backbone's quality (Cai et al. 2024, §2.3.2).

Loss (paper Eq. 2 with the weights of its axolotl fork):
    L = λ0 · L_LM + c · s(step) · Σ_{k=1..K} λ^k · CE_k
L_LM is the backbone's next-token CE or, with method.lm_loss=kl, KL(p_orig ‖ p) where p_orig is the same model with its
LoRA adapters disabled (self-distillation, §2.3.3; no second copy in memory). s ramps the head term over the joint
phase (`head_schedule`). Heads train at learning rate × heads_lr_multiplier, in their own optimizer groups.
Stage 1 (method.heads_warmup_steps=N, or method.init_heads=<medusa1 checkpoint>): heads only, Medusa-1's loss.
Backbones (train/medusa2_backbone.py): LoRA, QLoRA (LoRA with model.quantization=nf4), full fine-tuning.
Evaluation adds the quality guard (train/quality_guard.py). Dimension letters: B batch, T time, N scored positions,
D hidden, V vocab.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn import functional as F
from transformers import TrainerCallback

from data.errors import UsageError
from models.backbone import final_hidden
from models.checkpoint import (
    CheckpointError, DrafterMismatchError, backbone_folder, check_compatible, read_drafter_config, save_drafter)
from models.interop import is_medusa_dir, load_heads
from models.loading import load_target, model_config
from models.medusa import MedusaHeads
from train import medusa1
from train.config import HeadSchedule
from train.medusa1 import MedusaTrainModule, medusa_loss
from train.medusa2_backbone import (
    BackboneOptions, backbone_writer, load_backbone_weights, original_model, prepare_backbone, trainable)
from train.method import StepOutput
from train.quality_guard import (
    Reference, degraded, eval_mode, greedy_reference, guard_report, guard_summary, lm_quality, next_token_targets,
    warning_line)

log = logging.getLogger("draftsmith")

SCHEDULES = tuple(HeadSchedule)


@dataclass(frozen=True)
class LossWeights:
    lm: float  # λ0
    heads: float  # c
    decay: float  # λ
    schedule: float  # s(step) in [0, 1]


def head_schedule(kind: str, progress: float, fraction: float = 1.0) -> float:
    """s at `progress` in [0, 1] of the joint phase: "constant" 1; "linear" x; "sine" sin(π/2 · x), with
    x = min(progress / fraction, 1) (the axolotl fork's "sine" is fraction 1, its "sine_<r>" fraction r)."""
    if kind not in SCHEDULES:
        raise ValueError(f"head schedule must be one of {', '.join(SCHEDULES)}, got {kind!r}")
    x = min(max(progress, 0.0) / fraction, 1.0)
    return {"constant": 1.0, "linear": x, "sine": math.sin(math.pi / 2 * x)}[kind]


def medusa2_loss(
    heads: MedusaHeads,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head: nn.Module,
    weights: LossWeights,
    teacher_logits: torch.Tensor | None = None,
) -> StepOutput:
    """λ0 · L_LM + c · s · Σ_k λ^k · CE_k (module docstring); gradients reach `hidden`, hence the backbone.

    hidden [B, T, D] in the heads' dtype, labels [B, T] unshifted (-100 = untrained). L_LM is scored at the positions
    whose next token is trained (N of them): CE, or, when `teacher_logits` [N, V] is given (same positions, same
    order), the mean over positions of KL(softmax(teacher) ‖ softmax(logits)). The head term is medusa1's loss.
    """
    targets = next_token_targets(labels)  # [B, T]
    keep = targets != -100
    logits = lm_head(hidden[keep].to(lm_head.weight.dtype)).float()  # [N, V]
    if not keep.any():  # no trained token: the LM term is zero (and keeps the graph)
        lm = ce = logits.sum() * 0.0
    else:
        lm = ce = F.cross_entropy(logits, targets[keep])
    metrics = {"lm_loss": ce.detach()}
    if teacher_logits is not None and keep.any():
        lm = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher_logits.float(), -1), log_target=True,
                      reduction="batchmean")
        metrics["lm_kl"] = lm.detach()
    shared = lm_head if heads.config.share_lm_head else None
    head_out = medusa_loss(heads, hidden, labels, weights.decay, shared)
    head_weight = weights.heads * weights.schedule
    metrics.update(head_out.metrics)
    metrics["head_term_weight"] = torch.tensor(head_weight)
    return StepOutput(loss=weights.lm * lm + head_weight * head_out.loss, metrics=metrics)


@torch.no_grad()
def original_logits(backbone: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
                    ) -> torch.Tensor:
    """The LoRA backbone's logits [N, V] with adapters disabled (the original model), at the positions medusa2_loss
    scores L_LM on. Runs under quality_guard.eval_mode: no dropout, 4-bit weights stay trainable."""
    with backbone.disable_adapter(), eval_mode(backbone):
        hidden = final_hidden(backbone, input_ids, attention_mask)  # [B, T, D]
        return backbone.get_output_embeddings()(hidden[next_token_targets(labels) != -100]).float()


class Medusa2TrainModule(MedusaTrainModule):
    """`target` is the trainable backbone (a peft model for LoRA); `hidden` keeps the graph when grad is enabled."""

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] -> post-norm hidden states [B, T, D] in the heads' dtype."""
        return final_hidden(self.target, input_ids, attention_mask).to(next(self.heads.parameters()).dtype)


def check_options(cfg: DictConfig) -> None:
    """Reject bad method settings in one line, before any model is loaded."""
    m = cfg.method
    quantized = cfg.model.quantization not in (None, "none")
    problems = [
        (m.backbone == "full" and quantized,
         "method.backbone=full cannot train 4-bit weights (model.quantization=nf4): use method.backbone=lora (QLoRA)"),
        (m.lm_loss == "kl" and m.backbone != "lora",
         "method.lm_loss=kl needs method.backbone=lora: the teacher is the backbone with its adapters disabled"),
        (not 0 < m.head_schedule_fraction <= 1,
         f"method.head_schedule_fraction={m.head_schedule_fraction}: must be in (0, 1]"),
        (m.heads_warmup_steps < 0, f"method.heads_warmup_steps={m.heads_warmup_steps}: must be >= 0"),
        (0 < cfg.training.max_steps <= m.heads_warmup_steps,
         f"method.heads_warmup_steps={m.heads_warmup_steps} leaves no joint step "
         f"(training.max_steps={cfg.training.max_steps})"),
        (m.heads_lr_multiplier <= 0, f"method.heads_lr_multiplier={m.heads_lr_multiplier}: must be > 0"),
    ]
    for bad, message in problems:
        if bad:
            raise UsageError(message)


class Method(medusa1.Method, TrainerCallback):
    """Medusa-1's heads, evaluation and checkpoint format, plus a trained backbone. A TrainerCallback so the loss
    knows the step (train.trainer.DraftTrainer registers it)."""

    def __init__(self, cfg: DictConfig) -> None:
        check_options(cfg)
        super().__init__(cfg)
        self.step = 0
        self.max_steps = max(cfg.training.max_steps, 1)
        self.reference: Reference | None = None  # the original model's guard numbers, computed at the first evaluation

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.step, self.max_steps = state.global_step, state.max_steps

    def build(self, target: nn.Module, tokenizer: Any) -> Medusa2TrainModule:
        heads = super().build(target, tokenizer).heads  # medusa1: heads initialised from the base lm_head
        if self.m.init_heads:
            heads = self.initial_heads(target)
        options = BackboneOptions.from_config(self.m, self.cfg.model)
        return Medusa2TrainModule(prepare_backbone(target, options), heads)

    def check_inputs(self, tokenizer: Any) -> None:
        """method.init_heads fits the base model (hidden size, vocabulary): from the files, before any model loads or
        any data is generated (train.method.ChecksInputs)."""
        if not self.m.init_heads:
            return
        if is_medusa_dir(Path(self.m.init_heads)):
            return  # original-Medusa heads carry no config.json: checked when loaded
        c = self.cfg.model
        base = model_config(c.path, c.trust_remote_code, c.revision).get_text_config()
        try:
            check_compatible(read_drafter_config(self.m.init_heads), base)
        except DrafterMismatchError as e:
            raise DrafterMismatchError(f"method.init_heads={self.m.init_heads}: {e}") from None

    def initial_heads(self, target: nn.Module) -> MedusaHeads:
        """Heads of the checkpoint at method.init_heads (stage 1 run separately); its head structure wins."""
        loaded = load_heads(self.m.init_heads)
        check_compatible(loaded.config, target.config.get_text_config())
        c = loaded.heads.config
        if (c.num_heads, c.num_layers, c.share_lm_head) != (self.m.num_heads, self.m.num_layers, self.m.share_lm_head):
            log.warning("method.init_heads=%s: using its %d heads × %d layers (share_lm_head=%s), not the method's",
                        self.m.init_heads, c.num_heads, c.num_layers, c.share_lm_head)
        return loaded.heads.float().requires_grad_(True).train()

    def loss_weights(self) -> LossWeights:
        joint_steps = max(self.max_steps - self.m.heads_warmup_steps, 1)
        progress = (self.step - self.m.heads_warmup_steps) / joint_steps
        return LossWeights(lm=self.m.lm_weight, heads=self.m.heads_weight, decay=self.m.decay,
                           schedule=head_schedule(self.m.head_schedule, progress, self.m.head_schedule_fraction))

    def forward_loss(self, model: Medusa2TrainModule, batch: dict[str, torch.Tensor]) -> StepOutput:
        input_ids, attention_mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        if self.step < self.m.heads_warmup_steps:  # stage 1: Medusa-1 on the frozen backbone
            with torch.no_grad(), eval_mode(model.target):
                hidden = model.hidden(input_ids, attention_mask)
            shared = model.lm_head() if model.heads.config.share_lm_head else None
            return medusa_loss(model.heads, hidden, labels, self.m.decay, shared)
        teacher = original_logits(model.target, input_ids, attention_mask, labels) if self.m.lm_loss == "kl" else None
        hidden = model.hidden(input_ids, attention_mask)
        return medusa2_loss(model.heads, hidden, labels, model.lm_head(), self.loss_weights(), teacher)

    def param_groups(self, model: Medusa2TrainModule, learning_rate: float) -> list[dict[str, Any]]:
        """Backbone at `learning_rate`, heads at learning_rate × heads_lr_multiplier; weight decay (training.weight_decay)
        on matrices only, not on biases and norm weights, as HF Trainer does."""
        decay = self.cfg.training.weight_decay
        groups = []
        for name, params, lr in (("backbone", trainable(model.target), learning_rate),
                                 ("heads", trainable(model.heads), learning_rate * self.m.heads_lr_multiplier)):
            groups.append({"name": name, "params": [p for p in params if p.ndim >= 2], "lr": lr, "weight_decay": decay})
            groups.append({"name": f"{name}_no_decay", "params": [p for p in params if p.ndim < 2], "lr": lr,
                           "weight_decay": 0.0})
        return [g for g in groups if g["params"]]

    @torch.no_grad()
    def evaluate(self, model: Medusa2TrainModule, batches: Iterable, tokenizer: Any, prompts: list[list[int]]
                 ) -> dict[str, float]:
        """Medusa-1's head accuracies, then the quality guard: the backbone against the original model."""
        with eval_mode(model):  # keeps a 4-bit backbone trainable for the steps after a mid-training evaluation
            metrics = super().evaluate(model, batches, tokenizer, prompts)
            if self.reference is None:
                log.info("quality guard: the original model's perplexity and greedy answers (once)")
                self.reference = self.original_reference(model, batches, tokenizer, prompts)
            log.info("quality guard: the fine-tuned backbone against them")
            metrics.update(guard_report(model.target, self.reference, batches, self.cfg.eval.max_batches).metrics())
        if degraded(metrics, self.m.guard_max_ppl_increase, prefix=""):
            log.warning(warning_line(metrics, self.m.guard_max_ppl_increase, prefix=""))
        return metrics

    def original_reference(self, model: Medusa2TrainModule, batches: Iterable, tokenizer: Any, prompts: list[list[int]]
                           ) -> Reference:
        """The original model's numbers (LoRA: adapters disabled; full: a fresh copy). Computed lazily, at the first
        evaluation, so no eval-mode forward ever runs through a 4-bit model before it trains."""
        with original_model(model.target, lambda: self.load_original(self.cfg.model.quantization)) as original:
            quality = lm_quality(original, batches, self.cfg.eval.max_batches)
            greedy = greedy_reference(original, prompts, tokenizer, self.cfg.eval.greedy_new_tokens,
                                      self.cfg.training.per_device_eval_batch_size)
        return Reference(quality=quality, greedy=greedy)

    def load_original(self, quantization: str | None) -> nn.Module:
        c = self.cfg.model
        return load_target(c.path, dtype=c.dtype, quantization=quantization, double_quant=c.double_quant,
                           attn_implementation=c.attn_implementation, trust_remote_code=c.trust_remote_code,
                           revision=c.revision)

    def report(self, metrics: dict[str, float]) -> str:
        guard = guard_summary(metrics, self.m.guard_max_ppl_increase)
        return super().report(metrics) + (f"\n{guard}" if guard else "")

    def save(self, model: Medusa2TrainModule, output_dir: Path, tokenizer: Any, extra: dict[str, Any]) -> None:
        """Heads + backbone in one checkpoint. Trainer checkpoints keep the LoRA adapter (to resume); the final one
        has it merged into a full backbone when method.merge_adapter is set."""
        final = Path(output_dir).resolve() == Path(self.cfg.output_dir).resolve()
        load_base = (lambda: self.load_original(None)) if final and self.m.merge_adapter else None
        writer = backbone_writer(model.target, tokenizer, load_base)
        save_drafter(output_dir, model.heads, self.cfg.model.path, tokenizer=tokenizer, extra=extra, backbone=writer,
                     token_counts=self.token_counts(model.heads.config.vocab_size))

    def load(self, model: Medusa2TrainModule, checkpoint_dir: Path) -> None:
        super().load(model, checkpoint_dir)
        found = backbone_folder(checkpoint_dir)
        if found is None:
            raise CheckpointError(f"{checkpoint_dir}: no backbone in config.json; not a medusa2 checkpoint")
        load_backbone_weights(model.target, *found)
