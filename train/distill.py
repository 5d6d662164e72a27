"""Draft-model distillation (DistillSpec, Zhou et al. 2024; GKD, Agarwal et al. 2024): a small causal LM sharing the
target's tokenizer learns to match the frozen target's next-token distributions, which raises the speculative
acceptance rate α = E_t[1 − TV(p_t, q_t)] (Leviathan et al. 2023, Thm 3.5).

Loss: mean over response positions t of D(p_t, q_t), p = softmax(target logits / τ), q = softmax(draft logits / τ):
    fkl   KL(p ‖ q)                                  forward KL
    rkl   KL(q ‖ p)                                  reverse KL
    jsd   β KL(p ‖ m) + (1 − β) KL(q ‖ m), m = βp + (1 − β)q   generalised JSD (GKD, eq. 2)
    tvd   ½ Σ_v |p − q|                              total variation (DistillSpec: directly 1 − α)
Data: the fixed dataset's response tokens, or, for a `method.on_policy_fraction` share of batches, responses the
draft samples itself from the batch's prompts (on-policy, GKD λ).
Dimension letters: B batch, T time, N selected positions, V vocab.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import torch
from omegaconf import DictConfig
from torch import nn
from transformers import AutoModelForCausalLM

from data.chat import IGNORE_INDEX
from data.collate import left_pad
from data.errors import UsageError
from models.backbone import padded_position_ids
from models.builtin import STOCK_MODULES
from models.checkpoint import CheckpointError, draft_model_folder, save_draft_model, shared_spec
from models.draft_model import check_vocab, check_vocab_files
from models.loading import load_target
from models.quiet import quiet_transformers
from models.refs import model_settings
from train.config import DistillDivergence
from train.method import StepOutput

DIVERGENCES = tuple(DistillDivergence)


def divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor, kind: str, beta: float = 0.5,
               temperature: float = 1.0) -> torch.Tensor:
    """[N, V] teacher (p) and student (q) logits -> [N] per-position divergence in float32 (see module docstring)."""
    logp = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    logq = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    if kind == "fkl":
        return (logp.exp() * (logp - logq)).sum(-1)
    if kind == "rkl":
        return (logq.exp() * (logq - logp)).sum(-1)
    if kind == "jsd":
        logm = torch.logsumexp(torch.stack([logp + math.log(beta), logq + math.log1p(-beta)]), dim=0)
        return beta * (logp.exp() * (logp - logm)).sum(-1) + (1 - beta) * (logq.exp() * (logq - logm)).sum(-1)
    if kind == "tvd":
        return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)
    raise ValueError(f"unknown divergence {kind!r}; choose one of {', '.join(DIVERGENCES)}")


def acceptance(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[N, V] -> [N]: α_t = Σ_v min(p, q) = 1 − TV(p, q), the probability speculative sampling accepts a draft."""
    return 1 - divergence(teacher_logits, student_logits, "tvd", temperature=temperature)


class DistillTrainModule(nn.Module):
    """The frozen target and the trainable draft model (the only parameters that require grad)."""

    def __init__(self, target: nn.Module, draft: nn.Module) -> None:
        super().__init__()
        self.target = target
        self.draft = draft


def response_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
                    ) -> torch.Tensor:
    """[N, V] logits at the positions that predict a response token (labels[t + 1] != IGNORE_INDEX).

    The lm_head runs on those N positions only (prompt positions are never scored): with a 49k vocabulary it is the
    biggest matmul of a small model, and [B, T, V] float logits the biggest tensor. Models whose logits are not
    lm_head(last hidden state) (soft-capped or scaled logits) take the full forward."""
    keep = labels[:, 1:] != IGNORE_INDEX  # [B, T - 1]
    positions = padded_position_ids(attention_mask)
    if not plain_readout(model):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                       use_cache=False).logits  # [B, T, V]
        return logits[:, :-1][keep]
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                                 use_cache=False).last_hidden_state  # [B, T, D]
    return model.get_output_embeddings()(hidden[:, :-1][keep])  # [N, V]


def plain_readout(model: nn.Module) -> bool:
    """Are the model's logits exactly lm_head(decoder's last hidden state)? (Llama, Qwen2, Mistral: yes; Gemma 2's
    final soft-capping, Cohere's logit_scale: no.)"""
    config = model.config.get_text_config()
    return (getattr(config, "final_logit_softcapping", None) is None and getattr(config, "logit_scale", None) is None
            and callable(getattr(model, "get_decoder", None)) and model.get_output_embeddings() is not None)


def freeze_embeddings(draft: nn.Module) -> int:
    """Freeze the draft's input embeddings and lm_head (one tensor when tied); returns the parameters frozen.
    For an early-exit draft these are the target's own: frozen, they stay identical to it, the draft trains only its
    decoder layers and final norm, and no optimizer state or weight gradient is spent on the V x D matrix."""
    frozen = {id(p): p for m in (draft.get_input_embeddings(), draft.get_output_embeddings()) if m is not None
              for p in m.parameters()}
    for p in frozen.values():
        p.requires_grad_(False)
    return sum(p.numel() for p in frozen.values())


@torch.no_grad()
def sample_responses(draft: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, max_new_tokens: int,
                     temperature: float, pad_token_id: int, eos_token_id: int | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On-policy data: each row's prompt (its tokens before the first labelled one) continued by the draft's own
    samples. Returns left-padded (input_ids, attention_mask, labels) [B, T'], labels on sampled tokens up to and
    including EOS."""
    labelled = labels != IGNORE_INDEX  # [B, T]
    real = input_ids != pad_token_id
    starts = torch.where(labelled.any(-1), labelled.float().argmax(-1), real.sum(-1))  # prompt lengths
    prompts = [row[: max(int(s), 1)].tolist() for row, s in zip(input_ids, starts)]
    ids, mask = left_pad(prompts, pad_token_id, input_ids.device)  # [B, width] each
    width = ids.shape[1]
    out = draft.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=True,
                         temperature=temperature, top_k=0, top_p=1.0, pad_token_id=pad_token_id,
                         eos_token_id=eos_token_id)  # [B, width + new]
    new = out[:, width:]
    alive = torch.ones_like(new, dtype=torch.bool)
    if eos_token_id is not None:
        is_eos = (new == eos_token_id).long()
        alive = (is_eos.cumsum(-1) - is_eos) == 0  # up to and including the first EOS
    new_labels = torch.where(alive, new, torch.full_like(new, IGNORE_INDEX))
    return out, torch.cat([mask, alive.long()], dim=1), torch.cat([torch.full_like(ids, IGNORE_INDEX), new_labels], 1)


def draft_path(draft: str) -> str:
    """method.draft -> a model path: the name of a model config (conf/model/<name>.yaml, e.g. "tiny-draft") gives
    that config's path; anything else (hub id, directory, builtin:<name>, early_exit:<model>:<N>: the first N layers
    of <model>, see models.early_exit) is used as is and located when loaded. Names are models.refs'
    `model_settings`, as `--drafter` and `--base` take them."""
    return model_settings(draft).path


class Method:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.m = cfg.method
        if not 0 < self.m.jsd_beta < 1:
            raise UsageError(f"method.jsd_beta={self.m.jsd_beta}: must be in (0, 1)")
        if not 0 <= self.m.on_policy_fraction <= 1:
            raise UsageError(f"method.on_policy_fraction={self.m.on_policy_fraction}: must be in [0, 1]")
        for key in ("temperature", "sample_temperature"):
            if not self.m[key] > 0:
                raise UsageError(f"method.{key}={self.m[key]}: must be > 0")
        self.coin = torch.Generator().manual_seed(cfg.seed)  # which batches are on-policy
        self.tokenizer: Any = None
        self.initial: nn.Module | None = None  # the draft before training, for the α before/after evaluation

    def check_inputs(self, tokenizer: Any) -> None:
        """The draft shares the target's vocabulary and tokenizer: from their files, before any model loads or any
        data is generated (train.method.ChecksInputs)."""
        check_vocab_files(draft_path(self.m.draft), self.cfg.model.path, tokenizer, f"method.draft={self.m.draft}",
                          self.cfg.model.trust_remote_code)

    def _load_draft(self, frozen: bool) -> nn.Module:
        return load_target(draft_path(self.m.draft), dtype=self.m.draft_dtype,
                           attn_implementation=self.cfg.model.attn_implementation,
                           trust_remote_code=self.cfg.model.trust_remote_code, frozen=frozen)

    def build(self, target: nn.Module, tokenizer: Any) -> DistillTrainModule:
        draft = self._load_draft(frozen=False)
        check_vocab(draft, target)
        draft.train().requires_grad_(True)
        if self.m.freeze_embeddings:
            freeze_embeddings(draft)
        target.requires_grad_(False).eval()
        self.tokenizer = tokenizer
        if self.m.eval_initial:
            self.initial = self._load_draft(frozen=True).to(next(draft.parameters()).device)
        return DistillTrainModule(target, draft)

    def forward_loss(self, model: DistillTrainModule, batch: dict[str, torch.Tensor]) -> StepOutput:
        model.target.eval()  # Trainer calls model.train(); the frozen target keeps eval semantics
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        on_policy = bool(torch.rand(1, generator=self.coin) < self.m.on_policy_fraction)
        if on_policy:
            model.draft.eval()
            ids, mask, labels = sample_responses(
                model.draft, ids, labels, self.m.max_new_tokens, self.m.sample_temperature,
                self.tokenizer.pad_token_id, self.tokenizer.eos_token_id)
            model.draft.train()
        with torch.no_grad():
            p_logits = response_logits(model.target, ids, mask, labels)  # [N, V]
        q_logits = response_logits(model.draft, ids, mask, labels)  # [N, V]
        if q_logits.shape[0] == 0:  # nothing to learn from (e.g. every sample ended at once): a zero-gradient step
            zero = sum(p.sum() * 0.0 for p in model.draft.parameters())
            return StepOutput(loss=zero, metrics={"on_policy": torch.tensor(float(on_policy))})
        loss = divergence(p_logits, q_logits, self.m.divergence, self.m.jsd_beta, self.m.temperature).mean()
        alpha = acceptance(p_logits.detach(), q_logits.detach(), self.m.temperature).mean()
        return StepOutput(loss=loss, metrics={f"{self.m.divergence}_loss": loss.detach(), "alpha": alpha,
                                              "on_policy": torch.tensor(float(on_policy))})

    @torch.no_grad()
    def evaluate(self, model: DistillTrainModule, batches: Iterable, tokenizer: Any, prompts: list[list[int]]
                 ) -> dict[str, float]:
        """Estimated acceptance on held-out response positions: alpha = mean 1 − TV(p, q) at method.temperature
        (speculative sampling), greedy_alpha = argmax agreement (greedy drafting); the same for the initial draft."""
        device = next(model.draft.parameters()).device
        drafts = {"": model.draft} | ({"initial_": self.initial} if self.initial is not None else {})
        sums: dict[str, float] = {}
        count = 0
        for i, batch in enumerate(batches):
            if self.cfg.eval.max_batches is not None and i >= self.cfg.eval.max_batches:
                break
            ids, mask, labels = (batch[k].to(device) for k in ("input_ids", "attention_mask", "labels"))
            p_logits = response_logits(model.target, ids, mask, labels)
            count += p_logits.shape[0]
            for prefix, draft in drafts.items():
                q_logits = response_logits(draft, ids, mask, labels)
                values = {
                    "alpha": acceptance(p_logits, q_logits, self.m.temperature),
                    "greedy_alpha": (p_logits.argmax(-1) == q_logits.argmax(-1)).float(),
                    f"{self.m.divergence}": divergence(p_logits, q_logits, self.m.divergence, self.m.jsd_beta,
                                                       self.m.temperature),
                }
                for name, v in values.items():
                    sums[prefix + name] = sums.get(prefix + name, 0.0) + float(v.sum())
        return {k: v / count for k, v in sums.items()} if count else {}

    def param_groups(self, model: DistillTrainModule, learning_rate: float) -> None:
        return None  # the whole draft model: HF Trainer's default single group

    def report(self, metrics: dict[str, float]) -> str:
        rows = [f"{'held-out response positions':32}{'initial':>10}{'distilled':>10}"]
        for name, label in (("alpha", f"alpha = 1 - TV (tau={self.m.temperature:g})"), ("greedy_alpha", "greedy agreement"),
                            (self.m.divergence, f"{self.m.divergence} divergence")):
            before = metrics.get(f"eval_initial_{name}")
            shown = "-" if before is None else f"{before:.4f}"
            rows.append(f"  {label:30}{shown:>10}{metrics.get(f'eval_{name}', float('nan')):10.4f}")
        return "\n".join(rows)

    def save(self, model: DistillTrainModule, output_dir: Path, tokenizer: Any, extra: dict[str, Any]) -> None:
        save_draft_model(output_dir, model.draft, self.cfg.model.path, tokenizer=tokenizer, extra=extra,
                         target=model.target)

    def load(self, model: DistillTrainModule, checkpoint_dir: Path) -> None:
        shared = shared_spec(checkpoint_dir)  # left out of the files: the draft keeps the target's own (frozen)
        with quiet_transformers(bool(shared)):
            saved = AutoModelForCausalLM.from_pretrained(str(draft_model_folder(checkpoint_dir)), dtype=model.draft.dtype,
                                                         **STOCK_MODULES)
        state = {k: v for k, v in saved.state_dict().items() if k not in shared}
        missing, unexpected = model.draft.load_state_dict(state, strict=False)
        if set(missing) - set(shared) or unexpected:
            raise CheckpointError(f"{checkpoint_dir}: the saved draft does not match this run's draft "
                                  f"({', '.join(sorted(set(missing) - set(shared)) + unexpected)[:200]})")
