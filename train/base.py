"""The shared training base: setup, HF Trainer loop, evaluation, checkpoints, logging.

A method (train/<name>.py) only says which modules train and how a batch becomes a loss (`TrainMethod`); this
module stays free of method branches.
"""

from __future__ import annotations

import importlib
import logging
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

log = logging.getLogger("draftsmith")

TRAINER_CHECKPOINTS = "checkpoints"


class NonFiniteLossError(ValueError):
    """The loss became NaN/inf; training stops before anything non-finite is saved."""


@dataclass(frozen=True)
class StepOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # detached scalars, averaged between log lines


class TrainMethod(Protocol):
    """What a method contributes; everything else is shared."""

    def build(self, target: nn.Module, tokenizer: Any) -> nn.Module: ...

    def forward_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> StepOutput: ...

    def evaluate(self, model: nn.Module, batches: Any, tokenizer: Any, prompts: list[list[int]]) -> dict[str, float]: ...

    def save(self, model: nn.Module, output_dir: Path, tokenizer: Any, extra: dict[str, Any]) -> None: ...

    def report(self, metrics: dict[str, float]) -> str: ...

    def param_groups(self, model: nn.Module, learning_rate: float) -> list[dict[str, Any]] | None:
        """Optimizer parameter groups (e.g. a learning-rate multiplier for heads); None: one group of all trainable
        parameters, as HF Trainer builds it."""
        ...

    def load(self, model: nn.Module, checkpoint_dir: Path) -> None: ...


def load_method(cfg: DictConfig) -> TrainMethod:
    module = importlib.import_module(f"train.{cfg.method.name}")
    return module.Method(cfg)


class DraftTrainer(Trainer):
    """HF Trainer whose loss, evaluation and checkpoint format come from a TrainMethod."""

    def __init__(self, *args, method: TrainMethod, prompts: list[list[int]], extra: dict[str, Any],
                 on_nonfinite: str = "stop", **kwargs):
        super().__init__(*args, **kwargs)
        self.method = method
        self.on_nonfinite = on_nonfinite
        self.prompts = prompts
        self.extra = extra
        self._metric_sums: dict[str, float] = {}
        self._metric_count = 0
        self.nonfinite_skipped = 0
        if isinstance(method, TrainerCallback):  # a method whose loss depends on the step (e.g. medusa2's schedule)
            self.add_callback(method)

    def create_optimizer(self, model=None):
        groups = self.method.param_groups(self.model, self.args.learning_rate)
        if groups is None or self.optimizer is not None:
            return super().create_optimizer(model)
        optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        self.optimizer = optimizer_cls(groups, **kwargs)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = self.method.forward_loss(model, inputs)
        if not torch.isfinite(out.loss):
            out = self._nonfinite(model, out)
        for key, value in out.metrics.items():
            self._metric_sums[key] = self._metric_sums.get(key, 0.0) + float(value)
        self._metric_count += 1
        return (out.loss, {}) if return_outputs else out.loss

    def _nonfinite(self, model: nn.Module, out: StepOutput) -> StepOutput:
        """training.on_nonfinite=stop: raise naming the step and the losses; =skip: this batch contributes a zero
        gradient (counted and logged as nonfinite_skipped)."""
        step = self.state.global_step + 1
        parts = ", ".join(f"{k}={float(v):.4g}" for k, v in out.metrics.items() if k.endswith("loss"))
        if self.on_nonfinite != "skip":
            raise NonFiniteLossError(
                f"step {step}: loss is {out.loss.item()} ({parts or 'no per-term losses'}); lower training.learning_rate, "
                f"check the data, or set training.on_nonfinite=skip"
            )
        self.nonfinite_skipped += 1
        log.warning("step %d: non-finite loss %s (%s), batch skipped (%d so far)", step, out.loss.item(), parts, self.nonfinite_skipped)
        zero = sum(p.sum() * 0.0 for p in model.parameters() if p.requires_grad)
        return StepOutput(loss=zero, metrics={"nonfinite_skipped": torch.tensor(float(self.nonfinite_skipped))})

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._metric_count:
            logs.update({k: round(v / self._metric_count, 4) for k, v in self._metric_sums.items()})
            self._metric_sums, self._metric_count = {}, 0
        super().log(logs, start_time)

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        dataloader = self.get_eval_dataloader(eval_dataset)
        model = self.model
        was_training = model.training
        model.eval()
        metrics = self.method.evaluate(model, dataloader, self.processing_class, self.prompts)
        model.train(was_training)
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        self.log(metrics)
        return metrics

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        output_dir = Path(output_dir or self.args.output_dir)
        extra = {**self.extra, "global_step": self.state.global_step}
        self.method.save(self.model, output_dir, self.processing_class, extra)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self.method.load(model or self.model, Path(resume_from_checkpoint))


def configure_logger(cfg: DictConfig) -> list[str]:
    """Return Trainer's report_to; wandb runs offline when it cannot run online."""
    if cfg.logger.name == "none":
        return []
    if cfg.logger.name != "wandb":
        raise ValueError(f"logger.name={cfg.logger.name!r}: choose wandb or none")
    os.environ.setdefault("WANDB_PROJECT", cfg.logger.project)
    if cfg.logger.entity:
        os.environ.setdefault("WANDB_ENTITY", cfg.logger.entity)
    os.environ.setdefault("WANDB_DIR", str(Path(cfg.output_dir).resolve()))
    if cfg.logger.mode:
        os.environ["WANDB_MODE"] = cfg.logger.mode
    elif "WANDB_MODE" not in os.environ and not _wandb_key_available():
        os.environ["WANDB_MODE"] = "offline"
        log.info("wandb: no API key found, logging offline to %s", os.environ["WANDB_DIR"])
    return ["wandb"]


def _wandb_key_available() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def resolve_resume(setting: str | None, checkpoints_dir: Path) -> str | None:
    """"auto" -> newest complete trainer checkpoint (config.json and trainer_state.json written), else None."""
    if setting in (None, "", "none"):
        return None
    if setting != "auto":
        if not (Path(setting) / "trainer_state.json").is_file():
            raise ValueError(f"training.resume_from_checkpoint={setting}: not a complete trainer checkpoint")
        return setting
    complete = [
        p for p in checkpoints_dir.glob("checkpoint-*")
        if (p / "trainer_state.json").is_file() and (p / "config.json").is_file() and p.name.split("-")[-1].isdigit()
    ]
    return str(max(complete, key=lambda p: int(p.name.split("-")[-1]))) if complete else None


def training_arguments(cfg: DictConfig, report_to: list[str]) -> TrainingArguments:
    t = cfg.training
    passthrough = {k: v for k, v in OmegaConf.to_container(t).items() if k not in ("resume_from_checkpoint", "eval_steps", "on_nonfinite")}
    return TrainingArguments(
        output_dir=str(Path(cfg.output_dir) / TRAINER_CHECKPOINTS),
        eval_strategy="steps" if t.eval_steps else "no",
        eval_steps=t.eval_steps,
        save_strategy="steps",
        report_to=report_to,
        run_name=cfg.logger.run_name,
        seed=cfg.seed,
        data_seed=cfg.seed,
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=False,
        **passthrough,
    )


def prompt_ids(cfg: DictConfig, tokenizer: Any) -> list[list[int]]:
    """First user turn of validation conversations, formatted for generation (for the greedy-continuation eval)."""
    from data.chat import encode_prompt
    from data.datasets import load_conversations

    n = cfg.eval.greedy_prompts
    if n <= 0:
        return []
    conversations = load_conversations(cfg.data, "validation")
    prompts = []
    for conv in conversations:
        first_user = next((i for i, m in enumerate(conv) if m["role"] == "user"), None)
        if first_user is None:
            continue
        prompts.append(encode_prompt(tokenizer, conv[: first_user + 1], chat_template=cfg.data.chat_template))
        if len(prompts) == n:
            break
    return prompts


def run(cfg: DictConfig) -> dict[str, float]:
    """Hydra task: set up, train, evaluate, save. Returns the final metrics."""
    from data.collate import ChatCollator
    from data.datasets import build_datasets
    from models.loading import load_target, load_tokenizer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    set_seed(cfg.seed)
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    report_to = configure_logger(cfg)
    method = load_method(cfg)

    tokenizer = load_tokenizer(cfg.model.path, cfg.model.chat_template or cfg.data.chat_template, cfg.model.trust_remote_code)
    target = load_target(
        cfg.model.path,
        dtype=cfg.model.dtype,
        quantization=cfg.model.quantization,
        double_quant=cfg.model.double_quant,
        attn_implementation=cfg.model.attn_implementation,
        trust_remote_code=cfg.model.trust_remote_code,
        revision=cfg.model.revision,
    )
    datasets = build_datasets(cfg.data, tokenizer)
    model = method.build(target, tokenizer)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_val = len(datasets.validation) if datasets.validation is not None else 0
    log.info("method %s: %.2fM trainable parameters; %d train / %d validation samples",
             cfg.method.name, n_train / 1e6, len(datasets.train), n_val)
    if not n_val:
        log.warning("no validation samples (data.validation_path / data.validation_fraction): skipping evaluation")

    extra = {
        "method": cfg.method.name,
        "data": cfg.data.path or cfg.data.name,
        "command": "python -m train " + shlex.join(sys.argv[1:]),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    args = training_arguments(cfg, report_to)
    trainer = DraftTrainer(
        model=model,
        args=args,
        train_dataset=datasets.train,
        eval_dataset=datasets.validation,
        data_collator=ChatCollator(tokenizer.pad_token_id),
        processing_class=tokenizer,
        method=method,
        prompts=prompt_ids(cfg, tokenizer),
        extra=extra,
        on_nonfinite=cfg.training.on_nonfinite,
    )
    resume = resolve_resume(cfg.training.resume_from_checkpoint, Path(args.output_dir))
    if resume:
        log.info("resuming from %s", resume)
    trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate() if n_val else {}
    extra["metrics"] = {k: v for k, v in metrics.items() if isinstance(v, float)}
    method.save(model, output_dir, tokenizer, {**extra, "global_step": trainer.state.global_step})
    if metrics:
        print(method.report(metrics), flush=True)
    print(f"checkpoint: {output_dir}", flush=True)
    return metrics
