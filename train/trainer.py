"""The HF Trainer around a method: `DraftTrainer` (loss, evaluation and checkpoint format from a TrainMethod), the
module it wraps, its callbacks (time budget, heap trim), its arguments and the throughput it reports.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import TrainerCallback, TrainingArguments

from train.distributed import gathered, init_deepspeed_comm
from train.method import StepOutput, TrainMethod
from train.trainer_hooks import ResumeHooks, check_private_hooks

log = logging.getLogger("draftsmith")

TRAINER_CHECKPOINTS = "checkpoints"  # under output_dir: HF Trainer's checkpoint-<step> folders


class NonFiniteLossError(ValueError):
    """The loss became NaN/inf; training stops before anything non-finite is saved."""


class LossModule(nn.Module):
    """What HF Trainer wraps (DDP, a DeepSpeed engine): forward(**batch) is the method's loss on `model`, the module
    `method.build` returned. Training forwards must pass through the wrapper: DDP syncs gradients, and DeepSpeed
    scales, reduces and (ZeRO-3) fetches parameters, only for those."""

    accepts_loss_kwargs = False  # HF Trainer divides the loss by the accumulation steps itself

    def __init__(self, model: nn.Module, method: TrainMethod) -> None:
        super().__init__()
        self.model = model
        self.method = method

    def forward(self, **batch: torch.Tensor) -> dict[str, Any]:
        out = self.method.forward_loss(self.model, batch)
        return {"loss": out.loss, "metrics": out.metrics}  # a dict: DeepSpeed hooks output tensors of dicts only


class TimeBudget(TrainerCallback):
    """training.max_minutes: ends training after the optimizer step that crosses the budget (counted from this
    process's first step), so the run still evaluates and saves its drafter. Under several processes the decision
    is all-reduced, so every rank stops on the same step."""

    def __init__(self, minutes: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = minutes * 60
        self.clock = clock
        self.start: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.start is None:
            self.start = self.clock()

    def on_step_end(self, args, state, control, **kwargs):
        over = self.start is not None and self.clock() - self.start >= self.seconds
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = torch.tensor(float(over), device=args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            over = bool(flag.item())
        if over and not control.should_training_stop:
            log.info("training.max_minutes=%g reached at step %d: stopping", self.seconds / 60, state.global_step)
            control.should_training_stop = True
        return control


class RunStart(TrainerCallback):
    """Where this process's training began: the optimizer step and input tokens a resumed checkpoint had already
    counted (read when training begins, after the Trainer restored its state), so `throughput` counts this run's."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.step, self.tokens = int(state.global_step), int(state.num_input_tokens_seen)
        return control


class TrimHeap(TrainerCallback):
    """training.trim_heap on CPU: after every optimizer step, glibc's malloc_trim(0) hands the freed pages inside the
    heap back to the OS. Batches whose shapes vary (packed or chat rows of different lengths) otherwise fragment the
    heap: a CLLM run on smollm2 grew ~0.1 GB a step until the OOM killer stopped it; with the trim it stays flat at
    the same step time (README). `libc`: the C library (`glibc()`); without glibc (musl, macOS) the run adds no trim."""

    def __init__(self, libc: Any) -> None:
        self.libc = libc

    def on_step_end(self, args, state, control, **kwargs):
        self.libc.malloc_trim(0)
        return control


def glibc() -> Any:
    """The C library through ctypes when it is glibc (has malloc_trim), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


class DraftTrainer(ResumeHooks):
    """HF Trainer whose loss, evaluation and checkpoint format come from a TrainMethod. Public Trainer API only, except
    the two private resume hooks it inherits from train.trainer_hooks.ResumeHooks."""

    def __init__(self, *args, method: TrainMethod, prompts: list[list[int]], extra: dict[str, Any],
                 on_nonfinite: str = "stop", **kwargs):
        check_private_hooks()
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

    @property
    def method_model(self) -> nn.Module:
        """The module `method.build` returned (self.model is the LossModule around it)."""
        return self.model.model

    def create_optimizer(self, model=None):
        groups = self.method.param_groups(self.method_model, self.args.learning_rate)
        if groups is None or self.optimizer is not None:
            return super().create_optimizer(model)
        optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        self.optimizer = optimizer_cls(groups, **kwargs)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)  # through the DDP/DeepSpeed wrapper, see LossModule
        out = StepOutput(loss=outputs["loss"], metrics=outputs["metrics"])
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
        # Every process evaluates the whole validation set (not a 1/world shard): the metrics need no reduction and equal
        # a one-process run's, and under ZeRO-3 every process runs the same forwards, as its parameter gathers require.
        dataloader = torch.utils.data.DataLoader(
            eval_dataset if eval_dataset is not None else self.eval_dataset, batch_size=self.args.eval_batch_size,
            collate_fn=self.data_collator, num_workers=self.args.dataloader_num_workers)
        model = self.method_model
        was_training = model.training
        model.eval()
        start = time.monotonic()
        log.info("evaluation: %d validation batches, %d greedy prompts (phases follow)", len(dataloader),
                 len(self.prompts or []))
        metrics = self.method.evaluate(model, dataloader, self.processing_class, self.prompts)
        log.info("evaluation: done in %.0f s", time.monotonic() - start)
        model.train(was_training)
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        self.log(metrics)
        return metrics

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The drafter checkpoint only; never HF's whole-model state dict (under ZeRO-3 that gathers the frozen target
        into one process at every save)."""
        extra = {**self.extra, "global_step": self.state.global_step}
        self.save_drafter(Path(output_dir or self.args.output_dir), extra)

    def save_drafter(self, output_dir: Path, extra: dict[str, Any]) -> None:
        """Every process calls this: under ZeRO-3 the trainable parameters are gathered (a collective) and the main
        process writes them, full-size, in the draftsmith format. Gathered weights are the module's: fp32, or 16-bit
        with training.bf16 under DeepSpeed."""
        with gathered(p for p in self.method_model.parameters() if p.requires_grad):
            if self.args.should_save:
                # Rewriting a checkpoint (resumed from an earlier one): incomplete until Trainer rewrites this last.
                (output_dir / "trainer_state.json").unlink(missing_ok=True)
                self.method.save(self.method_model, output_dir, self.processing_class, extra)

    def load_resumed_weights(self, checkpoint_dir: Path) -> None:
        """Resuming: the drafter checkpoint's weights, in the method's own format (see train.trainer_hooks)."""
        self.method.load(self.method_model, checkpoint_dir)


def training_arguments(cfg: DictConfig, report_to: list[str], deepspeed: dict[str, Any] | None = None) -> TrainingArguments:
    """`deepspeed`: a resolved DeepSpeed dict (train.distributed.deepspeed_settings) or None. Under ZeRO-3, build the
    arguments before loading the target: from_pretrained partitions it only while they are alive."""
    t = cfg.training
    passthrough = {k: v for k, v in OmegaConf.to_container(t, enum_to_str=True).items() if k not in ("resume_from_checkpoint", "eval_steps", "on_nonfinite", "max_minutes", "trim_heap")}
    args = TrainingArguments(
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
        deepspeed=deepspeed,
        include_num_input_tokens_seen="non_padding",  # training tokens/s in the log and the checkpoint's config
        **passthrough,
    )
    if deepspeed is not None:
        init_deepspeed_comm()
    return args


def throughput(train_metrics: dict[str, float], state: Any, start: RunStart) -> dict[str, float]:
    """This process's training figures: optimizer steps, non-padding input tokens, seconds, tokens/s, seconds a step
    and the peak resident memory so far (GB; ru_maxrss is in KiB on Linux). A resumed run counts its own steps and
    tokens: those after `start`."""
    import resource

    seconds = float(train_metrics.get("train_runtime", 0.0))
    steps = int(state.global_step) - start.step
    tokens = int(state.num_input_tokens_seen) - start.tokens
    return {"steps": steps, "tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds else 0.0,
            "seconds_per_step": seconds / steps if steps else 0.0,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
