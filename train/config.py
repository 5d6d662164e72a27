"""Structured config schema. YAML under conf/ sets values; these dataclasses define which keys exist, so a misspelt
key fails at composition with the key's full name, and RANGES gives every numeric key its valid values, checked
(train.checks) before any model loads or any data is generated."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from data.config import DataConfig, choice
from models.draft_limits import MAX_DRAFT_TOKENS

# Keys with a fixed set of values. Values of other layers are repeated here, not imported (the schema loads without
# torch); tests/test_config.py checks each against its source.
Dtype = choice("Dtype", "bf16", "fp16", "fp32", "fp64", module=__name__)  # models.builtin.DTYPES
Quantization = choice("Quantization", "none", "nf4", module=__name__)  # models.builtin.QUANTIZATIONS (and null)
OnNonfinite = choice("OnNonfinite", "stop", "skip", module=__name__)
LoggerName = choice("LoggerName", "none", "wandb", module=__name__)
WandbMode = choice("WandbMode", "online", "offline", "disabled", module=__name__)
Backbone = choice("Backbone", "lora", "full", module=__name__)
LmLoss = choice("LmLoss", "ce", "kl", module=__name__)
HeadSchedule = choice("HeadSchedule", "constant", "linear", "sine", module=__name__)
JacobiInit = choice("JacobiInit", "random", "pad", "repeat", module=__name__)  # inference.drafters.jacobi.INITS
Consistency = choice("Consistency", "global", "local", module=__name__)
CllmDivergence = choice("CllmDivergence", "kl", "soft_ce", module=__name__)
ArSource = choice("ArSource", "ground_truth", "target_output", "both", module=__name__)  # data.jacobi.AR_SOURCES
ArLoss = choice("ArLoss", "ce", "kl", module=__name__)
DistillDivergence = choice("DistillDivergence", "fkl", "rkl", "jsd", "tvd", module=__name__)
Eagle3Teacher = choice("Eagle3Teacher", "topk", "full", module=__name__)  # train.eagle3_teacher.TEACHERS


@dataclass
class ModelConfig:
    name: str = MISSING
    path: str = MISSING  # hub id, local directory, or builtin:<name>
    dtype: Dtype = Dtype.bf16
    quantization: Optional[Quantization] = None  # nf4: bitsandbytes 4-bit; null and none: unquantised
    double_quant: bool = True
    attn_implementation: str = "sdpa"
    chat_template: Optional[str] = None  # shipped template name for models without one (data.templates)
    trust_remote_code: bool = False
    revision: Optional[str] = None


@dataclass
class TrainingConfig:
    """The subset of transformers.TrainingArguments draftsmith exposes; passed through by name."""

    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    lr_scheduler_type: str = "cosine"
    warmup_steps: float = 0.05  # < 1: fraction of total steps
    num_train_epochs: float = 1.0
    max_steps: int = -1
    logging_steps: int = 10
    eval_steps: Optional[int] = None  # null: evaluate at the end only
    save_steps: int = 500
    save_total_limit: Optional[int] = 2
    max_grad_norm: float = 1.0
    dataloader_num_workers: int = 0
    resume_from_checkpoint: Optional[str] = None  # a checkpoint directory, or "auto" for the newest complete one
    on_nonfinite: OnNonfinite = OnNonfinite.stop  # what a NaN/inf loss does: stop the run, or skip the batch
    bf16: bool = False  # autocast the trainable modules in bf16 (the frozen backbone follows model.dtype)
    # wall-clock budget: stop after the step that crosses it, then evaluate and save as at max_steps (null: none).
    # The schedule still spans max_steps / num_train_epochs: size those to the budget
    max_minutes: Optional[float] = None
    # CPU: return freed heap pages to the OS after every step (glibc malloc_trim); varying row lengths otherwise
    # fragment the heap until the OOM killer ends a long run
    trim_heap: bool = True


@dataclass
class LoggerConfig:
    name: LoggerName = LoggerName.none
    project: str = "draftsmith"
    entity: Optional[str] = None
    run_name: Optional[str] = None
    mode: Optional[WandbMode] = None  # null: offline when there is no API key, WANDB_MODE respected


@dataclass
class DeepSpeedConfig:
    name: str = "none"
    config: Optional[Any] = None  # a DeepSpeed JSON config as a mapping; null: DeepSpeed off


@dataclass
class EvalConfig:
    greedy_prompts: int = 32  # validation prompts whose greedy continuation the heads are scored on
    greedy_new_tokens: int = 64
    max_batches: Optional[int] = None  # cap on validation batches (null: all)


@dataclass
class Medusa1Config:
    name: str = "medusa1"
    num_heads: int = 5
    num_layers: int = 1
    decay: float = 0.8  # λ: head k's loss is weighted λ^k; 1.0 gives the original repository's plain sum
    share_lm_head: bool = False  # reuse the frozen base lm_head ("Medusa v2" layout) instead of one per head
    init_from_lm_head: bool = True  # start each head's projection as a copy of the base lm_head
    # S: heads predict over the S most frequent train-label tokens (EAGLE-3's draft vocabulary); null: all V.
    # On a 32k-150k vocabulary the heads' V x D projections cost more than a small target itself.
    draft_vocab: Optional[int] = None
    # w in [0, 1]: each head's loss is (1 - w) · CE(next tokens of the data) + w · CE(the frozen target's own
    # distribution at t+k, from the same forward pass). w > 0 distils the target on any text, no generation needed.
    soft_labels: float = 0.0


@dataclass
class BackboneTrainingConfig:
    """How a method fine-tunes the target's backbone (medusa2, cllm; read by train.medusa2_backbone.BackboneOptions).
    Inherited: the keys stay method.<key>, so overrides, YAML and saved configs read the same in both methods."""

    backbone: Backbone = Backbone.lora  # lora: QLoRA with model.quantization=nf4
    lora_r: int = 32
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_target_modules: Optional[list[str]] = None  # null: every linear layer except lm_head (peft "all-linear")
    merge_adapter: bool = False  # final checkpoint: LoRA merged into a full backbone/ instead of adapter/
    gradient_checkpointing: bool = False


@dataclass
class Medusa2Config(BackboneTrainingConfig):
    """Medusa-2 (train/medusa2.py): L = lm_weight·L_LM + heads_weight·s(step)·Σ_k decay^k·CE_k, backbone trained too."""

    name: str = "medusa2"
    num_heads: int = 5
    num_layers: int = 1
    decay: float = 0.8  # λ
    share_lm_head: bool = False
    init_from_lm_head: bool = True
    draft_vocab: Optional[int] = None  # S: heads over the S most frequent train-label tokens; null: all V
    init_heads: Optional[str] = None  # start from the heads of a medusa1/medusa2 checkpoint (its structure wins)
    heads_warmup_steps: int = 0  # stage 1 in the same run: heads only, Medusa-1 loss, backbone frozen
    lm_loss: LmLoss = LmLoss.ce  # kl: KL(original ‖ backbone), original = adapters disabled (self-distillation)
    lm_weight: float = 1.0  # λ0
    heads_weight: float = 0.2  # c
    head_schedule: HeadSchedule = HeadSchedule.constant  # s(step), ramp of the head term over the joint phase
    head_schedule_fraction: float = 1.0  # the ramp spans this fraction of the joint phase, then s = 1
    heads_lr_multiplier: float = 4.0  # heads' learning rate = training.learning_rate × this
    guard_max_ppl_increase: float = 0.02  # warn when held-out perplexity rises more than this (relative)


@dataclass
class CllmConfig(BackboneTrainingConfig):
    """CLLM (train/cllm.py): L = consistency_weight·L_consistency + ar_weight·L_AR on Jacobi trajectories."""

    name: str = "cllm"
    trajectories: Optional[str] = None  # JSONL from `scripts/collect_jacobi.py` (required)
    block_size: Optional[int] = None  # null: the trajectories' own N; set: must match them (16 or 32 in the paper)
    init: JacobiInit = JacobiInit.random  # Jacobi initialisation the engine uses with this checkpoint
    consistency: Consistency = Consistency("global")  # global: any state -> fixed point | local: each state -> the next one
    divergence: CllmDivergence = CllmDivergence.kl  # kl: forward KL(teacher ‖ model) | soft_ce: CE to the teacher distribution
    consistency_weight: float = 1.0
    ar_source: ArSource = ArSource.target_output  # target_output: the target's greedy answer | ground_truth: the data's reply | both
    ar_weight: float = 1.0  # 0 skips the AR term
    ar_loss: ArLoss = ArLoss.ce  # ce: next-token CE | kl: KL(original model ‖ trained) on the same tokens (full: frozen copy)
    # true: one row per (trajectory, draw) holding one state of every block (data.jacobi.PackedTrajectoryCollator):
    # one forward where the unpacked layout runs three per state; global consistency only
    packing: bool = False


@dataclass
class DistillConfig:
    """Draft-model distillation (train/distill.py): the draft learns the frozen target's next-token distributions."""

    name: str = "distill"
    # the draft causal LM: a conf/model name, hub id, directory, builtin:<name> or early_exit:<model>:<layers>
    draft: str = "builtin:tiny-draft"
    draft_dtype: Dtype = Dtype.fp32  # the draft's training dtype
    divergence: DistillDivergence = DistillDivergence.fkl
    jsd_beta: float = 0.5  # β of the generalised JSD, in (0, 1)
    temperature: float = 1.0  # τ on both models' logits in the loss and the α estimate
    on_policy_fraction: float = 0.0  # share of batches whose responses the draft samples itself (GKD λ)
    max_new_tokens: int = 64  # length of on-policy samples
    sample_temperature: float = 1.0  # temperature of on-policy sampling
    eval_initial: bool = True  # also evaluate the untrained draft (α before/after in one table)
    # keep the draft's embeddings and lm_head fixed (an early-exit draft: the target's own, shared)
    freeze_embeddings: bool = False


@dataclass
class StopperConfig:
    """Draft-length decision model (train/stopper.py): traces from chain decoding, a logistic/MLP fit, a threshold."""

    name: str = "stopper"
    # a conf/model name, hub id, directory, builtin:<name>, early_exit:<model>:<layers> or draft_model checkpoint
    draft: str = "builtin:tiny-draft"
    max_gamma: int = 8  # draft length of the traces (the longest a step may draft)
    prompts: int = 256  # train prompts traced (the first validation_fraction of them held out)
    validation_fraction: float = 0.25
    max_new_tokens: int = 128  # per prompt
    batch_size: int = 8
    temperature: float = 0.0  # decoding temperature of the traces (0 = greedy)
    hidden: int = 0  # 0: logistic regression; else a one-layer MLP of this width
    calibration_prompts: int = 4  # batch-1 runs that measure the draft/target cost ratio
    draft_cost: Optional[float] = None  # one draft forward / the rest of a step; null = measured here


@dataclass
class FeaturesConfig:
    """The feature cache (train/features.py): a teacher-forced pass of the frozen target, written for drafter trainers."""

    name: str = "features"
    # extra hidden states to keep, numbered as transformers' hidden_states (0: embeddings, i: after decoder layer i);
    # the last layer's post-norm state is always kept. EAGLE-3 drafters read a low, a middle and a high layer: null
    # keeps EAGLE-3's 2, N/2, N-3 for the target's N layers (models.eagle3.fused_layers).
    layers: Optional[list[int]] = field(default_factory=list)
    topk: int = 20  # soft labels: the target's k most likely next tokens per position (0: none)
    dtype: Dtype = Dtype.bf16  # storage dtype of the hidden states (the forward runs in model.dtype)
    batch_tokens: int = 8192  # padded tokens per forward (samples of similar length batched together)
    shard_tokens: int = 131072  # tokens per shard file: the unit a killed run resumes from
    prompts: int = 64  # validation prompts stored for trainers' greedy evaluation


@dataclass
class Eagle3MethodConfig:
    """EAGLE-3 (train/eagle3.py): one decoder layer over the target's fused low / mid / high features."""

    name: str = "eagle3"
    # fused target hidden_states indices (transformers' numbering); null or empty: EAGLE-3's 2, N/2, N-3 for an
    # N-layer target
    layers: Optional[list[int]] = field(default_factory=list)
    ttt_steps: int = 7  # training-time test: steps unrolled on the draft's own outputs (EAGLE-3: 7)
    decay: float = 0.8  # step j's loss is weighted decay^j
    # S: the draft predicts over the S most frequent train-label tokens; null: min(32000, V) (EAGLE-3's size)
    draft_vocab: Optional[int] = None
    soft_labels: float = 1.0  # w: w · CE(target's distribution) + (1 - w) · CE(data's next token)
    # the soft term's target distribution: topk, the target's 20 most likely tokens (a cache's features.topk) | full,
    # its whole distribution over the draft vocabulary, from its lm_head over the last hidden state (any cache)
    teacher: Eagle3Teacher = Eagle3Teacher.topk
    # start as the target's own head: lm_head rows and final norm copied, fc passing the highest fused layer through
    init_from_lm_head: bool = True
    # the draft layer's MLP width; null: the target's intermediate_size (EAGLE-3's and SpecForge's default)
    intermediate_size: Optional[int] = None
    eval_depth: int = 6  # steps unrolled when evaluating (per-depth acceptance for the engine's default tree)


@dataclass
class TrainConfig:
    method: Any = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    output_dir: str = MISSING
    seed: int = 42


METHOD_SCHEMAS = {"medusa1": Medusa1Config, "medusa2": Medusa2Config, "cllm": CllmConfig, "distill": DistillConfig,
                  "stopper": StopperConfig, "features": FeaturesConfig, "eagle3": Eagle3MethodConfig}


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric key: from `low` to `high` (None: unbounded; an open end excludes its bound),
    finite, plus `sentinels` outside that span, each with what it means. Null passes for an Optional field."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    sentinels: tuple[tuple[int, str], ...] = ()

    def contains(self, value: float) -> bool:
        if any(value == s for s, _ in self.sentinels):
            return True
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self) -> str:
        low, high = (f"{b:g}" if isinstance(b, float) else str(b) for b in (self.low, self.high))
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {low}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {high}"
        else:
            text = "a finite number"
        return text + "".join(f", or {s} to {meaning}" for s, meaning in self.sentinels)


POSITIVE = Range(1)  # counts and sizes
NATURAL = Range(0)
FRACTION = Range(0, 1, high_open=True)  # a share held out: [0, 1)
PROBABILITY = Range(0, 1)
SEED = Range(0, 2**32 - 1)  # numpy's seed range (HF set_seed seeds numpy too)
LORA = {"lora_r": POSITIVE, "lora_alpha": POSITIVE, "lora_dropout": FRACTION}
HEADS = {"num_heads": POSITIVE, "num_layers": NATURAL, "draft_vocab": POSITIVE,
         "decay": Range(0, 1, low_open=True)}  # λ^k weights head k's loss: 0 trains nothing, > 1 favours far heads

# Every int/float key of every schema, with its valid values (tests/test_config.py checks none is missing).
RANGES: dict[type, dict[str, Range]] = {
    TrainConfig: {"seed": SEED},
    DataConfig: {"validation_fraction": FRACTION, "max_length": POSITIVE, "max_samples": POSITIVE, "seed": SEED,
                 "max_tokens": POSITIVE, "self_distill_samples": POSITIVE, "self_distill_new_tokens": POSITIVE,
                 "self_distill_batch_size": POSITIVE, "self_distill_answers": POSITIVE, "self_distill_turns": POSITIVE,
                 "self_distill_temperature": Range(0, low_open=True), "self_distill_top_p": Range(0, 1, low_open=True)},
    TrainingConfig: {
        "per_device_train_batch_size": POSITIVE, "per_device_eval_batch_size": POSITIVE,
        "gradient_accumulation_steps": POSITIVE, "learning_rate": Range(0, low_open=True), "weight_decay": NATURAL,
        "warmup_steps": NATURAL, "num_train_epochs": Range(0, low_open=True),
        # HF Trainer's convention: max_steps <= 0 trains num_train_epochs; only -1 says so on purpose
        "max_steps": Range(1, sentinels=((-1, "train for training.num_train_epochs"),)),
        "logging_steps": POSITIVE, "eval_steps": POSITIVE, "save_steps": POSITIVE, "save_total_limit": POSITIVE,
        "max_grad_norm": NATURAL,  # 0: no clipping
        "dataloader_num_workers": NATURAL, "max_minutes": Range(0, low_open=True),
    },
    EvalConfig: {"greedy_prompts": NATURAL, "greedy_new_tokens": POSITIVE, "max_batches": POSITIVE},
    Medusa1Config: {**HEADS, "soft_labels": PROBABILITY},
    Medusa2Config: {
        **HEADS, **LORA, "heads_warmup_steps": NATURAL,
        "lm_weight": Range(),  # λ0 < 0 ascends the LM loss (tests trip the quality guard with it)
        "heads_weight": NATURAL, "head_schedule_fraction": Range(0, 1, low_open=True),
        "heads_lr_multiplier": Range(0, low_open=True), "guard_max_ppl_increase": NATURAL,
    },
    CllmConfig: {"block_size": POSITIVE, "consistency_weight": NATURAL, "ar_weight": NATURAL, **LORA},
    DistillConfig: {"jsd_beta": Range(0, 1, low_open=True, high_open=True), "temperature": Range(0, low_open=True),
                    "on_policy_fraction": PROBABILITY, "max_new_tokens": POSITIVE,
                    "sample_temperature": Range(0, low_open=True)},
    Eagle3MethodConfig: {"ttt_steps": Range(1, 16), "decay": Range(0, 1, low_open=True), "draft_vocab": POSITIVE,
                         "soft_labels": PROBABILITY, "eval_depth": Range(1, 16), "intermediate_size": POSITIVE},
    FeaturesConfig: {"topk": NATURAL, "batch_tokens": POSITIVE, "shard_tokens": POSITIVE, "prompts": NATURAL},
    StopperConfig: {"max_gamma": Range(2, MAX_DRAFT_TOKENS), "prompts": Range(2),
                    "validation_fraction": Range(0, 1, low_open=True, high_open=True), "max_new_tokens": POSITIVE,
                    "batch_size": POSITIVE, "temperature": NATURAL, "hidden": NATURAL, "calibration_prompts": POSITIVE,
                    "draft_cost": NATURAL},
}


# The keys that fix what a trainer checkpoint of each method holds (module shapes, which modules): resuming one
# needs the same values (train.resume.check_resume), and the same base model.
_LORA_KEYS = ("method.backbone", "method.lora_r", "method.lora_target_modules")
_HEAD_KEYS = ("method.num_heads", "method.num_layers", "method.share_lm_head", "method.draft_vocab")
RESUME_KEYS: dict[str, tuple[str, ...]] = {
    "medusa1": ("method.name", "model.path", *_HEAD_KEYS),
    "medusa2": ("method.name", "model.path", *_HEAD_KEYS, *_LORA_KEYS),
    "cllm": ("method.name", "model.path", *_LORA_KEYS),
    "distill": ("method.name", "model.path", "method.draft"),
    "stopper": (),  # fits in one go, never resumes
    "eagle3": ("method.name", "model.path", "method.layers", "method.draft_vocab",
               "method.intermediate_size"),
    "features": (),  # resumes by shard, checked against its manifest (train/features.py)
}


def out_of_range(cfg: Any) -> Optional[str]:
    """"<key>=<value>: must be ..." for the first numeric key of a composed config outside its Range, else None."""
    from omegaconf import DictConfig, OmegaConf

    nodes = [("", cfg)] + [(f"{k}.", cfg[k]) for k in cfg if isinstance(cfg[k], DictConfig)]
    for prefix, node in nodes:
        schema = OmegaConf.get_type(node)
        for name, allowed in RANGES.get(schema, {}).items():
            value = node.get(name)
            if value is None or allowed.contains(value):
                continue
            optional = str(typing.get_type_hints(schema)[name]).startswith("typing.Optional")
            return f"{prefix}{name}={value}: must be {allowed.describe()}" + (" or null" if optional else "")
    return None


def register_configs() -> None:
    """Typed groups (model, data, ...) are checked through TrainConfig's fields; `method` is typed per method, so
    each conf/method/<name>.yaml starts from its own <name>_schema."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name, schema in METHOD_SCHEMAS.items():
        cs.store(group="method", name=f"{name}_schema", node=schema)
