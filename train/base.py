"""The shared training base: setup, HF Trainer loop, evaluation, checkpoints, logging.

A method (train/<name>.py) only says which modules train and how a batch becomes a loss (`TrainMethod`); this
module stays free of method branches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import json
import logging
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import TrainerCallback, TrainingArguments, set_seed

from data.chat import encode_prompt, first_user_turn
from data.collate import ChatCollator
from data.datasets import SplitDatasets, build_datasets, label_counts, load_conversations
from data.extras import installed
from data.features import FeatureCollator, FeatureDataset, check_cache, read_prompts
from models.checkpoint import CheckpointError, read_drafter_config
from models.fingerprint import target_fingerprint, tokenizer_fingerprint
from models.loading import check_nf4_on_cpu, load_target, load_tokenizer, places_on_cpu
from train.checks import check_values
from train.config import RESUME_KEYS
from train.distributed import deepspeed_settings, gathered, init_deepspeed_comm, is_main_process
from train.self_distill import trainer_datasets
from train.trainer_hooks import ResumeHooks, check_private_hooks

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


@runtime_checkable
class ProvidesData(Protocol):
    """A method trained on its own sample shape (e.g. cllm's Jacobi trajectories) instead of `data`'s chat samples."""

    def datasets(self, tokenizer: Any) -> Any:
        """An object with .train and .validation (None when empty), like data.datasets.SplitDatasets."""
        ...

    def collator(self, tokenizer: Any) -> Callable[[list[dict]], dict[str, torch.Tensor]]: ...


@runtime_checkable
class CountsLabels(Protocol):
    """A method whose checkpoint records how often each token is a trained label in its train split (Medusa heads:
    inference's head_vocab shortlist). Called once with the final train dataset, before `build`."""

    def count_labels(self, dataset: Any) -> None: ...


class TokenCounts:
    """CountsLabels for a method with a draft vocabulary: the train labels' token frequencies (the S most frequent
    make the vocabulary), saved with the drafter as token_counts [V]."""

    label_counts: torch.Tensor | None = None  # [<= V] from count_labels

    def count_labels(self, dataset: Any) -> None:
        self.label_counts = label_counts(dataset)

    def token_counts(self, vocab_size: int) -> torch.Tensor | None:
        """[V] int64, zero past the largest label seen; None before count_labels."""
        if self.label_counts is None:
            return None
        counts = self.label_counts[:vocab_size]
        return torch.cat([counts, counts.new_zeros(vocab_size - len(counts))])


@runtime_checkable
class ChecksInputs(Protocol):
    """A method whose inputs span several files (a draft model against the target, heads against the base): checked
    from the files, before any model loads or any data is generated."""

    def check_inputs(self, tokenizer: Any) -> None: ...


@runtime_checkable
class ReadsFeatures(Protocol):
    """A method that says which stored features of a cache it reads (data.features)."""

    def feature_needs(self) -> tuple[list[int], bool]:
        """(hidden_states indices it reads, whether it reads soft labels)."""
        ...


@runtime_checkable
class Standalone(Protocol):
    """A method that runs its own loop (e.g. the stopper's trace collection and L-BFGS fit), not the HF Trainer."""

    def run(self, cfg: DictConfig) -> dict[str, float]: ...


def load_method(cfg: DictConfig) -> TrainMethod:
    module = importlib.import_module(f"train.{cfg.method.name}")
    return module.Method(cfg)


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


def configure_logger(cfg: DictConfig) -> list[str]:
    """Return Trainer's report_to; wandb runs offline when it cannot run online."""
    if cfg.logger.name == "none":
        return []
    if not installed("wandb"):  # the default logger on a core install (an explicit logger=wandb failed in check_extras)
        log.warning("logger=wandb: wandb is not installed, logging to the console only (pip install -e '.[wandb]')")
        return []
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


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a complete trainer checkpoint, or None when it is.

    HF Trainer writes a checkpoint in this order: weights (our atomic save, config.json last), optimizer, scheduler,
    RNG state, then trainer_state.json last (tests/test_resume.py pins that order). So a checkpoint is complete when
    config.json exists and trainer_state.json parses (a kill can cut its non-atomic write short) and names the step.
    """
    if not path.is_dir():
        return "no such directory"
    if not (path / "config.json").is_file():
        return "no config.json (the weights were not completely written)"
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except FileNotFoundError:
        return "no trainer_state.json (the checkpoint was not completely written)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"trainer_state.json is unreadable ({e})"
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return "trainer_state.json has no global_step"
    return None


def resolve_resume(setting: str | None, checkpoints_dir: Path) -> str | None:
    """"auto" -> newest complete trainer checkpoint (see `checkpoint_problem`), else None; a path -> that path,
    which must be complete. Torn checkpoints are skipped with a warning; on the main process, temporary directories
    left by a killed write (of a checkpoint, or of the final output next to `checkpoints_dir.parent`) are removed."""
    if setting in (None, "", "none"):
        return None
    if setting != "auto":
        problem = checkpoint_problem(Path(setting))
        if problem:
            raise CheckpointError(f"training.resume_from_checkpoint={setting}: not a complete checkpoint ({problem})")
        return setting
    if is_main_process():
        output_dir = checkpoints_dir.parent
        for stale in [*checkpoints_dir.glob(".checkpoint-*.tmp-*"), *output_dir.parent.glob(f".{output_dir.name}.tmp-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # models.checkpoint.atomic_write_dir temporaries
    found = [p for p in checkpoints_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    steps = {p: int(p.name.split("-")[-1]) for p in found}
    for path in sorted(steps, key=steps.get, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        log.warning("not resuming from %s: %s", path, problem)
    return None


def check_resume(cfg: DictConfig, checkpoint: Path) -> None:
    """Refuse, in one line and before any model loads, to resume a trainer checkpoint written with other values of
    the keys that fix what it holds (train.config.RESUME_KEYS); a checkpoint without a recorded config passes (its
    weights then fail to load with their own message)."""
    saved = read_drafter_config(checkpoint).get("training", {}).get("config")
    if not isinstance(saved, dict):
        return
    current = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    for key in RESUME_KEYS.get(cfg.method.name, ()):
        old, new = _lookup(saved, key), _lookup(current, key)
        if old != new and not (key == "model.path" and _same_directory(old, new)):
            raise CheckpointError(
                f"{checkpoint} was trained with {key}={_override_value(old)}, this run has {key}="
                f"{_override_value(new)}: pass {key}={_override_value(old)} to resume it, or choose another output_dir")


def _lookup(config: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def _same_directory(a: Any, b: Any) -> bool:
    paths = [Path(str(p)).expanduser() for p in (a, b)]
    return all(p.is_dir() for p in paths) and paths[0].resolve() == paths[1].resolve()


def _override_value(value: Any) -> str:
    """How the value is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    return str(value)


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


def prompt_ids(cfg: DictConfig, tokenizer: Any) -> list[list[int]]:
    """First user turn of validation conversations, formatted for generation (for the greedy-continuation eval)."""
    return first_user_prompts(cfg, tokenizer, "validation", cfg.eval.greedy_prompts)


def first_user_prompts(cfg: DictConfig, tokenizer: Any, split: str, limit: int, shuffle_seed: int | None = None
                       ) -> list[list[int]]:
    """The first user turn of up to `limit` conversations of `split`, chat-formatted with a generation prompt;
    conversations shuffled with `shuffle_seed` first when given."""
    import random

    if limit <= 0:
        return []
    conversations = load_conversations(cfg.data, split)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(conversations)
    prompts = []
    for conv in conversations:
        turn = first_user_turn(conv)
        if turn is None:
            continue
        prompts.append(encode_prompt(tokenizer, turn, chat_template=cfg.data.chat_template))
        if len(prompts) == limit:
            break
    return prompts


def throughput(train_metrics: dict[str, float], state: Any) -> dict[str, float]:
    """This process's training figures: optimizer steps, non-padding input tokens, seconds, tokens/s, seconds a step
    and the peak resident memory so far (GB; ru_maxrss is in KiB on Linux). A resumed run counts its own steps."""
    import resource

    seconds = float(train_metrics.get("train_runtime", 0.0))
    steps = int(state.global_step)
    tokens = int(state.num_input_tokens_seen)
    return {"steps": steps, "tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds else 0.0,
            "seconds_per_step": seconds / steps if steps else 0.0,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


@dataclass(frozen=True)
class CachedData:
    datasets: SplitDatasets
    collator: FeatureCollator
    prompts: list[list[int]]  # greedy-evaluation prompts stored with the cache


def feature_cache(cfg: DictConfig, tokenizer: Any, method: TrainMethod) -> CachedData:
    """data.features: the train / validation samples of a feature cache made for this target and tokenizer (checked
    from the files, before the target loads), with the layers the method reads (ReadsFeatures) and soft labels when
    it mixes them in."""
    folder = cfg.data.features
    if isinstance(method, ReadsFeatures):
        layers, soft = method.feature_needs()
    else:
        layers, soft = [], cfg.method.get("soft_labels", 0) > 0
    manifest = check_cache(
        folder, target=target_fingerprint(cfg.model.path, cfg.model.trust_remote_code, cfg.model.revision),
        tokenizer=tokenizer_fingerprint(tokenizer), need_layers=layers, need_topk=soft)
    validation = (FeatureDataset(folder, "validation", layers, topk=soft) if manifest.samples.get("validation")
                  else None)
    train = FeatureDataset(folder, "train", layers, topk=soft)
    if cfg.data.max_tokens is not None:
        train = train.sample(cfg.data.max_tokens, cfg.data.seed)
    log.info("data.features=%s: %s of its %s train tokens in %d samples (the cache's data recipe replaces data=%s)",
             folder, f"{train.tokens:,}", f"{manifest.tokens['train']:,}", len(train), cfg.data.name)
    return CachedData(
        datasets=SplitDatasets(train=train, validation=validation),
        collator=FeatureCollator(tokenizer.pad_token_id),
        prompts=read_prompts(folder)[: cfg.eval.greedy_prompts],
    )


def run(cfg: DictConfig) -> dict[str, float]:
    """Hydra task: set up, train, evaluate, save. Returns the final metrics.

    Everything a user gave is checked before the expensive work: values and combinations, the resumed checkpoint
    against this config, the 4-bit layers' shapes, cross-file inputs (ChecksInputs), then every data record; only
    then does the target load and the data get generated (self-distillation) or trained on."""
    check_values(cfg)  # again for each job of a multirun, whose values were not checked before Hydra started
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    set_seed(cfg.seed)
    output_dir = Path(cfg.output_dir)
    method = load_method(cfg)
    resume = resolve_resume(cfg.training.resume_from_checkpoint, output_dir / TRAINER_CHECKPOINTS)
    if resume:
        check_resume(cfg, Path(resume))
    output_dir.mkdir(parents=True, exist_ok=True)
    report_to = configure_logger(cfg)
    if isinstance(method, Standalone):
        return method.run(cfg)

    deepspeed = deepspeed_settings(cfg)  # checks the combination and reads the target's config only
    if cfg.model.quantization == "nf4" and places_on_cpu(None):
        check_nf4_on_cpu(cfg.model.path, cfg.model.trust_remote_code, cfg.model.revision)
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.chat_template or cfg.data.chat_template, cfg.model.trust_remote_code)
    if isinstance(method, ChecksInputs):
        method.check_inputs(tokenizer)
    own_data = isinstance(method, ProvidesData)
    cache = feature_cache(cfg, tokenizer, method) if cfg.data.features else None
    if cache is not None:
        datasets = cache.datasets
    else:
        datasets = method.datasets(tokenizer) if own_data else build_datasets(cfg.data, tokenizer)
    args = training_arguments(cfg, report_to, deepspeed)  # before the target: ZeRO-3 loads it partitioned
    target = load_target(
        cfg.model.path,
        dtype=cfg.model.dtype,
        quantization=cfg.model.quantization,
        double_quant=cfg.model.double_quant,
        attn_implementation=cfg.model.attn_implementation,
        trust_remote_code=cfg.model.trust_remote_code,
        revision=cfg.model.revision,
    )
    if cfg.data.self_distill and not own_data and cache is None:
        datasets = trainer_datasets(cfg, target, tokenizer, args, output_dir, datasets)
    if isinstance(method, CountsLabels):
        method.count_labels(datasets.train)
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
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
    }
    trainer = DraftTrainer(
        model=LossModule(model, method),
        args=args,
        train_dataset=datasets.train,
        eval_dataset=datasets.validation,
        data_collator=(cache.collator if cache is not None else method.collator(tokenizer) if own_data
                       else ChatCollator(tokenizer.pad_token_id)),
        processing_class=tokenizer,
        method=method,
        prompts=cache.prompts if cache is not None else prompt_ids(cfg, tokenizer),
        extra=extra,
        on_nonfinite=cfg.training.on_nonfinite,
    )
    if cfg.training.max_minutes:
        trainer.add_callback(TimeBudget(cfg.training.max_minutes))
    libc = glibc() if cfg.training.trim_heap and args.device.type == "cpu" else None
    if libc is not None:
        trainer.add_callback(TrimHeap(libc))
    if resume:
        log.info("resuming from %s", resume)
    trained = trainer.train(resume_from_checkpoint=resume)
    extra["throughput"] = throughput(trained.metrics, trainer.state)
    log.info("training: %(steps)d steps, %(tokens)d tokens in %(seconds).0f s: %(tokens_per_second).0f tokens/s, "
             "%(seconds_per_step).2f s a step, peak resident memory %(peak_rss_gb).2f GB", extra["throughput"])
    metrics = trainer.evaluate() if n_val else {}
    extra["metrics"] = {k: v for k, v in metrics.items() if isinstance(v, float)}
    trainer.save_drafter(output_dir, {**extra, "global_step": trainer.state.global_step})
    if not is_main_process():
        return metrics
    if metrics:
        print(method.report(metrics), flush=True)
    print(f"checkpoint: {output_dir}", flush=True)
    return metrics
