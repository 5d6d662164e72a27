"""CLLM: consistency training for Jacobi decoding (Kou et al. 2024, "CLLMs: Consistency Large Language Models").

The target itself is fine-tuned (LoRA, QLoRA with model.quantization=nf4, or full) so that from any Jacobi state y of
a block it predicts the block's fixed point y* in one iteration. Per sample (prefix x, state y, next state y', y*):

    global consistency (Eq. 5):  L_GC = Σ_i D(q_θ⁻(· | x, y*_<i) ‖ q_θ(· | x, y_<i))
    local consistency  (Eq. 6):  L_LC = Σ_i D(q_θ⁻(· | x, y'_<i) ‖ q_θ(· | x, y_<i))
    L = consistency_weight · L_C + ar_weight · L_AR       (Eq. 7; one backward per step)

θ⁻ is the same model without gradient (detached teacher logits). D is forward KL (`divergence=kl`) or the
cross-entropy to the teacher distribution (`soft_ce`: same gradient, without the teacher's entropy). Both are
averaged over the B·N block tokens. L_AR is next-token CE on the target's own greedy answer (`ar_source=
target_output`: the concatenated fixed points), the data's reply (`ground_truth`), or both rows pooled (`both`);
with `ar_loss=kl` it is instead KL(p_orig ‖ p_θ) on those tokens, p_orig the model before training (LoRA: adapters
disabled; full: a frozen copy loaded once), which holds the whole next-token distribution where it was, not just
its argmax. Trajectories come from
`python scripts/collect_jacobi.py`; data.validation_fraction / data.seed hold out records for evaluation, and the `data`
config's validation prompts (eval.greedy_prompts) measure Jacobi tokens per step before/after training.
Dimension letters: B batch, T time, N block size, V vocab, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn import functional as F

from data.chat import IGNORE_INDEX
from data.datasets import in_validation
from data.errors import UsageError
from data.jacobi import (
    PackedTrajectoryCollator, PackedTrajectoryDataset, TrajectoryCollator, TrajectoryDataset, read_records)
from data.readers import DataError
from inference.drafters.jacobi import JacobiDrafter, JacobiOptions
from inference.engine.cache import additive
from inference.engine.drafter import NoDrafter
from inference.engine.loop import DecodeConfig, generate
from models.backbone import final_hidden
from models.checkpoint import CheckpointError, backbone_folder, save_model_drafter
from models.loading import load_target
from train.config import CllmDivergence
from train.distributed import gathered, zero_stage
from train.medusa2_backbone import (
    BackboneOptions, backbone_writer, is_lora, load_backbone_weights, original_model, prepare_backbone)
from train.method import StepOutput
from train.quality_guard import eval_mode, scored_logits

DIVERGENCES = tuple(CllmDivergence)

# (input_ids, attention_mask, labels) [B, T] each -> the original model's float32 logits [M, V] at the positions
# scored_logits picks (same order), computed without gradient
ReferenceLogits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def block_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, block_start: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """Logits [B, N, V] predicting the N block tokens of right-padded rows [B, T] whose block starts at
    block_start [B]: the positions block_start - 1 .. block_start + N - 2 (only those are projected)."""
    hidden = final_hidden(model, input_ids, attention_mask)  # [B, T, D]
    index = block_start[:, None] - 1 + torch.arange(block_size, device=hidden.device)  # [B, N]
    picked = hidden.gather(1, index[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [B, N, D]
    lm_head = model.get_output_embeddings()
    return lm_head(picked.to(lm_head.weight.dtype)).float()


def consistency_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, divergence: str) -> torch.Tensor:
    """Mean over the B·N block tokens of D(softmax(teacher) ‖ softmax(logits)); both [B, N, V], teacher detached."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {divergence!r}")
    log_q = F.log_softmax(logits.float(), -1)
    log_p = F.log_softmax(teacher_logits.detach().float(), -1)
    per_token = (log_p.exp() * ((log_p if divergence == "kl" else 0.0) - log_q)).sum(-1)  # [B, N]
    return per_token.mean()


def ar_loss(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
            ) -> torch.Tensor:
    """Mean next-token CE over the trained (labels != -100) tokens."""
    return ar_terms(model, input_ids, attention_mask, labels)[0]


def ar_terms(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
             reference: ReferenceLogits | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mean CE, mean KL(p_ref ‖ p_model) or None without `reference`) over the trained tokens of [B, T] rows."""
    logits, targets = scored_logits(model, input_ids, attention_mask, labels)  # [M, V], [M]
    return ce_and_kl(logits, targets,
                     None if reference is None else lambda: reference(input_ids, attention_mask, labels))


def ce_and_kl(logits: torch.Tensor, targets: torch.Tensor, reference: Callable[[], torch.Tensor] | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mean CE, mean KL(p_ref ‖ p_model) or None without `reference`) of logits [M, V] against targets [M];
    reference() gives the original model's logits [M, V] and is called only when M > 0 (no targets: zeros)."""
    if targets.numel() == 0:
        zero = logits.sum() * 0.0
        return zero, (zero if reference is not None else None)
    ce = F.cross_entropy(logits, targets)
    if reference is None:
        return ce, None
    kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(reference(), -1), log_target=True, reduction="batchmean")
    return ce, kl


@dataclass(frozen=True)
class LossSettings:
    consistency: str = "global"
    divergence: str = "kl"
    consistency_weight: float = 1.0
    ar_weight: float = 1.0
    ar_loss: str = "ce"  # ce | kl (to `reference`, which cllm_loss then needs)


def cllm_loss(model: nn.Module, batch: dict[str, torch.Tensor], settings: LossSettings,
              reference: ReferenceLogits | None = None) -> StepOutput:
    """L = consistency_weight · L_C + ar_weight · L_AR (module docstring) for one TrajectoryCollator batch. The
    teacher forward runs without gradient, in eval mode (no dropout; 4-bit layers stay trainable). With
    settings.ar_loss == "kl", L_AR is KL(reference ‖ model) on the AR tokens (the CE is still reported)."""
    if settings.ar_loss == "kl" and reference is None:
        raise ValueError("ar_loss='kl' needs the original model's logits (reference=)")
    n = _block_size(batch)
    teacher_ids = batch["fixed_ids"] if settings.consistency == "global" else batch["next_ids"]
    with torch.no_grad(), eval_mode(model):
        teacher = block_logits(model, teacher_ids, batch["attention_mask"], batch["block_start"], n)
    logits = block_logits(model, batch["input_ids"], batch["attention_mask"], batch["block_start"], n)
    consistency = consistency_loss(logits, teacher, settings.divergence)
    loss = settings.consistency_weight * consistency
    metrics = {"consistency_loss": consistency.detach()}
    if settings.ar_weight:
        ce, kl = ar_terms(model, batch["ar_input_ids"], batch["ar_attention_mask"], batch["ar_labels"],
                          reference if settings.ar_loss == "kl" else None)
        loss = loss + settings.ar_weight * (ce if kl is None else kl)
        metrics["ar_loss"] = ce.detach()
        if kl is not None:
            metrics["ar_kl"] = kl.detach()
    return StepOutput(loss=loss, metrics=metrics)


# (packed batch) -> the original model's float32 logits [M, V] at the positions with an AR target (row-major order)
PackedReference = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def packed_hidden(model: nn.Module, batch: dict[str, torch.Tensor], width: int | None = None) -> torch.Tensor:
    """Post-norm hidden states [R, T', D] of a PackedTrajectoryCollator batch (its first `width` columns: a prefix of
    a packed row is itself a valid packed row), through the stock model with a 4-D additive mask."""
    width = width or batch["input_ids"].shape[1]
    dtype = model.get_input_embeddings().weight.dtype
    mask = additive(batch["visible"][:, None, :width, :width], dtype)  # [R, 1, T', T']
    out = model.get_decoder()(input_ids=batch["input_ids"][:, :width], attention_mask=mask,
                              position_ids=batch["position_ids"][:, :width], use_cache=False)
    return out.last_hidden_state


def ar_width(batch: dict[str, torch.Tensor]) -> int:
    """Columns up to the last position with an AR target (a packed row's states come after its answer)."""
    scored = (batch["ar_targets"] != IGNORE_INDEX).any(0).nonzero()
    return int(scored[-1]) + 1 if len(scored) else 1


def packed_cllm_loss(model: nn.Module, batch: dict[str, torch.Tensor], settings: LossSettings,
                     reference: PackedReference | None = None) -> StepOutput:
    """cllm_loss for a PackedTrajectoryCollator batch: one forward gives the teacher (detached; the same forward, so
    in train mode: equal to the unpacked eval-mode teacher when the model has no dropout), the student and the AR
    logits. Global consistency only (local needs each state's next state as a teacher). Same means as cllm_loss:
    consistency over every block token of the batch, AR over every AR target."""
    if settings.consistency != "global":
        raise ValueError("packed CLLM batches train global consistency only (method.packing=false for local)")
    if settings.ar_loss == "kl" and reference is None:
        raise ValueError("ar_loss='kl' needs the original model's logits (reference=)")
    hidden = packed_hidden(model, batch)  # [R, T, D]
    lm_head = model.get_output_embeddings()
    valid = batch["block_valid"]  # [R, J]

    def project(index: torch.Tensor) -> torch.Tensor:  # [R, J, N] -> logits [M, N, V] of the valid blocks
        r, j, n = index.shape
        picked = hidden.gather(1, index.reshape(r, j * n, 1).expand(-1, -1, hidden.shape[-1]))  # [R, J·N, D]
        return lm_head(picked.reshape(r, j, n, -1)[valid].to(lm_head.weight.dtype)).float()

    metrics: dict[str, torch.Tensor] = {}
    loss = hidden.sum() * 0.0
    if settings.consistency_weight and bool(valid.any()):
        with torch.no_grad():
            teacher = project(batch["teacher_index"])
        consistency = consistency_loss(project(batch["student_index"]), teacher, settings.divergence)
        loss = loss + settings.consistency_weight * consistency
        metrics["consistency_loss"] = consistency.detach()
    else:
        metrics["consistency_loss"] = loss.detach()
    if settings.ar_weight:
        keep = batch["ar_targets"] != IGNORE_INDEX  # [R, T]
        logits = lm_head(hidden[keep].to(lm_head.weight.dtype)).float()  # [M, V]
        ce, kl = ce_and_kl(logits, batch["ar_targets"][keep],
                           (lambda: reference(batch)) if settings.ar_loss == "kl" else None)
        loss = loss + settings.ar_weight * (ce if kl is None else kl)
        metrics["ar_loss"] = ce.detach()
        if kl is not None:
            metrics["ar_kl"] = kl.detach()
    return StepOutput(loss=loss, metrics=metrics)


def packed_reference(original: nn.Module) -> PackedReference:
    """PackedReference of `original` (no gradient): only the columns up to the last AR target are run."""
    def logits(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            width = ar_width(batch)
            hidden = packed_hidden(original, batch, width)
            keep = batch["ar_targets"][:, :width] != IGNORE_INDEX
            lm_head = original.get_output_embeddings()
            return lm_head(hidden[keep].to(lm_head.weight.dtype)).float()
    return logits


def is_packed(batch: dict[str, torch.Tensor]) -> bool:
    return "visible" in batch


def _block_size(batch: dict[str, torch.Tensor]) -> int:
    """N: every row is prefix + N block tokens, so N = row length - block_start (same for all rows)."""
    lengths = batch["attention_mask"].sum(-1) - batch["block_start"]  # [B]
    return int(lengths[0])


@dataclass(frozen=True)
class SplitTrajectories:
    train: TrajectoryDataset
    validation: TrajectoryDataset | None


def check_options(cfg: DictConfig) -> None:
    """Reject bad method settings in one line, before any model is loaded."""
    m = cfg.method
    quantized = cfg.model.quantization not in (None, "none")
    problems = [
        (not m.trajectories,
         "method.trajectories is not set: pass a JSONL written by `python scripts/collect_jacobi.py`"),
        (m.ar_loss == "kl" and not m.ar_weight, "method.ar_loss=kl with method.ar_weight=0 trains no KL term"),
        (m.backbone == "full" and quantized,
         "method.backbone=full cannot train 4-bit weights (model.quantization=nf4): use method.backbone=lora (QLoRA)"),
        (m.consistency_weight < 0 or m.ar_weight < 0, "method.consistency_weight and method.ar_weight must be >= 0"),
        (m.packing and m.consistency == "local",
         "method.packing=true trains global consistency only: set method.consistency=global or method.packing=false"),
        (m.ar_loss == "kl" and m.backbone == "full" and zero_stage(cfg.deepspeed.config) == 3,
         "method.ar_loss=kl with method.backbone=full under deepspeed=zero3 would gather a frozen copy of the target "
         "at every step: use method.backbone=lora (the teacher is the model with its adapters off) or ar_loss=ce"),
    ]
    for bad, message in problems:
        if bad:
            raise UsageError(message)


class Method:
    """The target is the trained module (a peft model for LoRA); the checkpoint is that model or adapter."""

    def __init__(self, cfg: DictConfig) -> None:
        check_options(cfg)
        self.cfg = cfg
        self.m = cfg.method
        self.settings = LossSettings(self.m.consistency, self.m.divergence, self.m.consistency_weight,
                                     self.m.ar_weight, self.m.ar_loss)
        self.block_size: int | None = None  # read from the trajectories
        self.reference: dict[str, float] | None = None  # the original model's eval numbers, computed once
        self.frozen_original: nn.Module | None = None  # ar_loss=kl with full fine-tuning: the KL teacher

    def datasets(self, tokenizer: Any) -> SplitTrajectories:
        """Trajectory records split like chat data: data.validation_fraction of them by a seeded hash of the index.
        Every record is checked first, its token ids against the tokenizer's vocabulary (train.task runs this
        before the target loads)."""
        records = read_records(self.m.trajectories, vocab_size=len(tokenizer))
        if not records:
            raise DataError(f"method.trajectories={self.m.trajectories}: no usable records")
        sizes = {len(r["blocks"][0]["states"][0]) for r in records}
        if len(sizes) != 1 or (self.m.block_size is not None and sizes != {self.m.block_size}):
            raise DataError(f"method.trajectories={self.m.trajectories}: block sizes {sorted(sizes)}, expected one"
                            + (f" equal to method.block_size={self.m.block_size}" if self.m.block_size else ""))
        self.block_size = sizes.pop()
        d = self.cfg.data
        held = [in_validation(i, d.seed, d.validation_fraction) for i in range(len(records))]
        train = [r for r, h in zip(records, held) if not h]
        validation = [r for r, h in zip(records, held) if h]
        if not train:
            raise DataError(f"method.trajectories={self.m.trajectories}: every record went to validation "
                            f"(data.validation_fraction={d.validation_fraction})")
        dataset = PackedTrajectoryDataset if self.m.packing else TrajectoryDataset
        return SplitTrajectories(dataset(train, self.m.ar_source),
                                 dataset(validation, self.m.ar_source) if validation else None)

    def collator(self, tokenizer: Any) -> TrajectoryCollator | PackedTrajectoryCollator:
        return (PackedTrajectoryCollator if self.m.packing else TrajectoryCollator)(tokenizer.pad_token_id)

    def build(self, target: nn.Module, tokenizer: Any) -> nn.Module:
        options = BackboneOptions.from_config(self.m, self.cfg.model)
        model = prepare_backbone(target, options)
        if self.m.ar_loss == "kl" and not is_lora(model):  # full fine-tuning: the teacher is a frozen copy
            self.frozen_original = self.load_original().requires_grad_(False).eval()
        return model

    def forward_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> StepOutput:
        return self.loss(model, batch, self.settings, self.m.ar_loss == "kl")

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], settings: LossSettings, with_reference: bool
             ) -> StepOutput:
        """cllm_loss or packed_cllm_loss, whichever the batch is, with the original model as the KL reference."""
        packed = is_packed(batch)
        reference = self.reference_logits(model, packed) if with_reference else None
        return (packed_cllm_loss if packed else cllm_loss)(model, batch, settings, reference)

    def reference_logits(self, model: nn.Module, packed: bool = False) -> ReferenceLogits | PackedReference:
        """The original model's AR logits: LoRA -> the same model with adapters disabled (eval semantics, 4-bit
        layers left trainable); full -> the frozen copy, moved once to the trained model's device."""
        if packed and is_lora(model):
            base = packed_reference(model)

            def lora_packed(batch):
                with model.disable_adapter(), eval_mode(model):
                    return base(batch)
            return lora_packed
        if is_lora(model):
            def lora_original(input_ids, attention_mask, labels):
                with torch.no_grad(), model.disable_adapter(), eval_mode(model):
                    return scored_logits(model, input_ids, attention_mask, labels)[0]
            return lora_original
        original = self.frozen_original
        device = next(model.parameters()).device
        if next(original.parameters()).device != device:
            original.to(device)
        if packed:
            return packed_reference(original)

        def copy_original(input_ids, attention_mask, labels):
            with torch.no_grad():
                return scored_logits(original, input_ids, attention_mask, labels)[0]
        return copy_original

    def param_groups(self, model: nn.Module, learning_rate: float) -> None:
        return None

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable, tokenizer: Any, prompts: list[list[int]]) -> dict[str, float]:
        """Consistency and AR losses, AR perplexity and Jacobi tokens per step on the eval prompts, for the trained
        model and (once) the original one; `jacobi_greedy_match` checks Jacobi output == greedy on the trained one;
        with ar_loss=kl also `ar_kl`, the trained model's KL from the original on the held-out AR tokens."""
        with eval_mode(model):
            metrics = self.quality(model, batches, prompts, check_greedy=True, with_reference=self.m.ar_loss == "kl")
            if self.reference is None:
                with original_model(model, lambda: self.frozen_original or self.load_original()) as original, \
                        gathered(original.parameters() if original is not model else ()):  # ZeRO-3: a loaded copy
                    self.reference = self.quality(original, batches, prompts, check_greedy=False)  # is partitioned
        metrics.update({f"original_{k}": v for k, v in self.reference.items()})
        return metrics

    def quality(self, model: nn.Module, batches: Iterable, prompts: list[list[int]], check_greedy: bool,
                with_reference: bool = False) -> dict[str, float]:
        sums = {"consistency_loss": 0.0, "ar_loss": 0.0} | ({"ar_kl": 0.0} if with_reference else {})
        count = 0
        device = model.get_input_embeddings().weight.device
        for i, batch in enumerate(batches):
            if self.cfg.eval.max_batches is not None and i >= self.cfg.eval.max_batches:
                break
            settings = LossSettings(self.m.consistency, self.m.divergence, 1.0, 1.0, "kl" if with_reference else "ce")
            out = self.loss(model, {k: v.to(device) for k, v in batch.items()}, settings, with_reference)
            for key in sums:
                sums[key] += float(out.metrics[key])
            count += 1
        metrics = {k: v / max(count, 1) for k, v in sums.items()}
        metrics["ppl"] = float(torch.tensor(metrics["ar_loss"]).exp())
        runner = model.get_base_model() if is_lora(model) else model  # LoRA layers live in the base model
        drafter = JacobiDrafter(JacobiOptions(self.block_size or 16, self.m.init), pad_id(runner))
        config = DecodeConfig(max_new_tokens=self.cfg.eval.greedy_new_tokens)
        forwards = tokens = matches = 0
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = generate(runner, ids, drafter, config)
            forwards, tokens = forwards + out.stats.steps, tokens + len(out.sequences[0]) - 1
            if check_greedy:
                matches += generate(runner, ids, NoDrafter(), config).sequences == out.sequences
        if prompts:
            metrics["jacobi_tokens_per_step"] = tokens / max(forwards, 1)
            if check_greedy:
                metrics["jacobi_greedy_match"] = matches / len(prompts)
        return metrics

    def load_original(self) -> nn.Module:
        c = self.cfg.model
        return load_target(c.path, dtype=c.dtype, quantization=c.quantization, double_quant=c.double_quant,
                           attn_implementation=c.attn_implementation, trust_remote_code=c.trust_remote_code,
                           revision=c.revision)

    def report(self, metrics: dict[str, float]) -> str:
        def get(key: str) -> str:
            value = metrics.get(f"eval_{key}")
            return "n/a" if value is None else f"{value:.4g}"

        return "\n".join([
            f"cllm: consistency loss {get('consistency_loss')} (original {get('original_consistency_loss')}), "
            f"AR loss {get('ar_loss')}" + (f", AR KL to the original {get('ar_kl')}" if self.m.ar_loss == "kl" else ""),
            f"validation perplexity {get('ppl')} (original {get('original_ppl')})",
            f"Jacobi tokens per step {get('jacobi_tokens_per_step')} (original "
            f"{get('original_jacobi_tokens_per_step')}); fraction of eval prompts where Jacobi output == greedy: "
            f"{get('jacobi_greedy_match')}",
        ])

    def save(self, model: nn.Module, output_dir: Path, tokenizer: Any, extra: dict[str, Any]) -> None:
        """Trainer checkpoints keep the LoRA adapter (to resume); the final one is merged into a full backbone when
        method.merge_adapter is set."""
        final = Path(output_dir).resolve() == Path(self.cfg.output_dir).resolve()
        load_base = self.load_unquantized if final and self.m.merge_adapter else None
        settings = {"block_size": self.block_size or 16, "init": self.m.init}
        save_model_drafter(output_dir, "cllm", self.cfg.model.path, backbone_writer(model, tokenizer, load_base),
                           settings=settings, tokenizer=tokenizer, extra=extra)

    def load_unquantized(self) -> nn.Module:
        c = self.cfg.model
        return load_target(c.path, dtype=c.dtype, attn_implementation=c.attn_implementation,
                           trust_remote_code=c.trust_remote_code, revision=c.revision)

    def load(self, model: nn.Module, checkpoint_dir: Path) -> None:
        found = backbone_folder(checkpoint_dir)
        if found is None:
            raise CheckpointError(f"{checkpoint_dir}: no backbone in config.json; not a cllm checkpoint")
        load_backbone_weights(model, *found)


def pad_id(model: nn.Module) -> int:
    return model.config.pad_token_id or 0
