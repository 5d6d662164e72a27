"""Predicted peak memory of one training step, per GPU, from the target's shapes: which batch fits before a launch.

Dimension letters: B batch, T time (tokens per row), K Medusa heads or TTT steps, D hidden, Dkv = Hkv·Hd the key /
value width, I intermediate, L target layers, F fused EAGLE-3 layers, V target vocabulary, S draft vocabulary,
N = positions a loss scores (B·(T - 2) for Medusa head 1, B·(T - 2 - j) for TTT step j), r LoRA rank.

The step's memory is the sum of what lives through it (weights, the optimizer's moments, an fp32 master copy where
DeepSpeed keeps one) plus the largest of three phases:
    frozen forward   the no-grad target forward: one layer's MLP in flight (residual, norm, gate, up, act, product);
                     EAGLE-3 online also materialises the logits [B, T, V] in bf16 and fp32 and their softmax
    loss/backward    the tensors the trained graph saves (`activations`, `saved_attention`, `logits`: Medusa keeps
                     one log-softmax [N, V] fp32 per head; EAGLE-3 keeps per step the log-softmax and the soft target
                     [N_j, S] fp32) plus the few logits-sized buffers in flight at the last head / step and in the
                     first backward node (counted in `logits`), plus one module's gradients
    optimizer step   all gradients plus AdamW's temporaries (foreach: one fp32 copy of the trained parameters)
The sizes follow train/medusa1.py, train/eagle3.py and train/cllm.py line by line; the module's tests pin the
parameter counts against the real modules and the figures against measured peaks (scripts/train_memory.py --measure).
Positions are counted as if every token is trained (an upper bound: prompt tokens cost less).
EAGLE-3's TTT attention is models/ttt_attention.py's: every step saves q, k, v, its output and a per-row log-sum-exp,
O(B·H·T), never a [B, H, T, T] block (its chunked backward's scores pass after the loss's buffers are freed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

GIB = 2**30
METHODS = ("medusa1", "eagle3", "cllm")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP32 = 4
EAGLE3_SOFT_TOPK = 20  # train/eagle3_teacher.py SOFT_TOPK (online soft labels: the target's top-k)
EAGLE3_DRAFT_VOCAB = 32000  # train/eagle3.py DEFAULT_DRAFT_VOCAB
LOGITS_ROWS = 2048  # train/eagle3_teacher.py: rows the full teacher projects onto V at once
FIT_SEQ = 2048
FIT_GPUS_GIB = {"40 GB": 40536 / 1024, "80 GB": 81559 / 1024, "141 GB": 143771 / 1024}  # A100-40GB, H100, H200
HEADROOM = 0.9  # usable share of a GPU: the CUDA context, the allocator's fragmentation, NCCL buffers


class MemoryModelError(ValueError):
    """Bad input to the memory model: one line naming the file, model name or option."""


@dataclass(frozen=True)
class Shape:
    """A decoder-only target's shapes (a Llama / Qwen2 / Mistral config.json)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o, gate, up, down and two norms."""
        d, kv, i = self.hidden, self.kv_width, self.intermediate
        bias = d + 2 * kv if self.qkv_bias else 0
        return 2 * d * d + 2 * d * kv + bias + 3 * d * i + 2 * d

    def params(self) -> int:
        """The whole target: embeddings, layers, final norm, lm_head (unless tied)."""
        lm_head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * self.layer_params() + self.hidden + lm_head

    @classmethod
    def from_config(cls, config: dict, name: str) -> "Shape":
        """A config.json's dict (a multimodal config's text_config is read); MemoryModelError naming a missing key."""
        text = config.get("text_config") or config
        try:
            heads = int(text["num_attention_heads"])
            return cls(name=name, hidden=int(text["hidden_size"]), layers=int(text["num_hidden_layers"]), heads=heads,
                       kv_heads=int(text.get("num_key_value_heads") or heads),
                       intermediate=int(text["intermediate_size"]), vocab=int(text["vocab_size"]),
                       tied=bool(text.get("tie_word_embeddings", False)),
                       qkv_bias=text.get("model_type") == "qwen2" or bool(text.get("attention_bias", False)))
        except KeyError as e:
            raise MemoryModelError(f"{name}: config has no {e.args[0]!r}") from None


# The shapes of the targets conf/model names, from their config.json files (no hub access needed).
SHAPES = {
    "vicuna7b": Shape("vicuna7b", 4096, 32, 32, 32, 11008, 32000),  # = Llama-2-7B
    "llama3_1_8b": Shape("llama3_1_8b", 4096, 32, 32, 8, 14336, 128256),  # = Llama-3-8B
    "qwen2_5_7b": Shape("qwen2_5_7b", 3584, 28, 28, 4, 18944, 152064, qkv_bias=True),
    "mistral7b": Shape("mistral7b", 4096, 32, 32, 8, 14336, 32000),
    "vicuna13b": Shape("vicuna13b", 5120, 40, 40, 40, 13824, 32000),
    "vicuna33b": Shape("vicuna33b", 6656, 60, 52, 52, 17920, 32000),
    "qwen3_8b": Shape("qwen3_8b", 4096, 36, 32, 8, 12288, 151936),  # its per-head q / k norms (256 a layer) left out
    "smollm2": Shape("smollm2", 576, 30, 9, 3, 1536, 49152, tied=True),  # SmolLM2-135M
    "tiny": Shape("tiny", 256, 4, 4, 4, 768, 4096, tied=True),  # train/tiny_build.py SPECS["tiny"]
}
ALIASES = {"llama2_7b_chat": "vicuna7b", "llama3_8b_instruct": "llama3_1_8b", "llama3_1_8b_instruct": "llama3_1_8b",
           "qwen2_5_7b_instruct": "qwen2_5_7b", "mistral7b_instruct": "mistral7b", "zephyr7b": "mistral7b"}
FIT_TARGETS = ("llama3_1_8b", "qwen2_5_7b", "vicuna7b")


SPEC_KEYS = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "tied")
OPTIONAL_SPEC_KEYS = ("kv_heads", "tied")


def parse_shape_spec(text: str, flag: str = "--shape") -> Shape:
    """"hidden=2048,layers=16,heads=32,kv_heads=8,intermediate=8192,vocab=128256,tied=1" -> a Shape named "shape"
    (kv_heads defaults to heads, tied (0 or 1: lm_head is the embedding) to 0); MemoryModelError naming `flag`."""
    parts = [part for part in text.split(",") if part]
    items = dict(part.split("=", 1) for part in parts if "=" in part)
    unknown = sorted(set(items) - set(SPEC_KEYS))
    missing = [k for k in SPEC_KEYS if k not in items and k not in OPTIONAL_SPEC_KEYS]
    if unknown or missing or len(items) != len(parts):
        raise MemoryModelError(f"{flag} {text!r}: give {', '.join(SPEC_KEYS)} as key=value (kv_heads, tied optional)"
                               + (f"; unknown {', '.join(unknown)}" if unknown else ""))
    try:
        values = {k: int(v) for k, v in items.items()}
    except ValueError:
        raise MemoryModelError(f"{flag} {text!r}: values must be integers") from None
    tied = values.pop("tied", 0)
    if any(v < 1 for v in values.values()) or values["hidden"] % values["heads"] or tied not in (0, 1):
        raise MemoryModelError(f"{flag} {text!r}: positive values, hidden a multiple of heads, tied 0 or 1")
    values.setdefault("kv_heads", values["heads"])
    return Shape(name="shape", tied=bool(tied), **values)


def resolve_shape(target: str, conf_dir: Path | None = None, flag: str = "--target") -> Shape:
    """A config.json (or a folder holding one), a model name (SHAPES, or a conf/model name) or a key=value spec
    (parse_shape_spec) -> its Shape; MemoryModelError naming `flag` otherwise."""
    if "=" in target:
        return parse_shape_spec(target, flag)
    path = Path(target)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.parent != Path("."):
        if not path.is_file():
            raise MemoryModelError(f"{flag} {target}: no such file")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise MemoryModelError(f"{path}: not JSON (line {e.lineno}: {e.msg})") from None
        return Shape.from_config(config, str(path))
    key = ALIASES.get(target, target)
    if key in SHAPES:
        return SHAPES[key]
    known = sorted({*SHAPES, *ALIASES})
    if conf_dir is not None and (conf_dir / f"{target}.yaml").is_file():
        raise MemoryModelError(f"{flag} {target}: conf/model/{target}.yaml names no shapes here; pass its "
                               f"config.json (known names: {', '.join(known)})")
    raise MemoryModelError(f"{flag} {target}: unknown model (a config.json path or one of {', '.join(known)})")


@dataclass(frozen=True)
class TrainSetup:
    """One training step's settings (the method config's defaults unless set)."""

    method: str
    batch: int
    seq: int
    steps: int  # K: Medusa heads, EAGLE-3 TTT steps (CLLM: unused)
    target_bytes: int = 2  # model.dtype
    autocast: bool = False  # training.bf16: the trained modules' matmuls save bf16 inputs
    foreach: bool = True  # AdamW's multi-tensor path (torch's default on CUDA; CPU runs one tensor at a time)
    fp32_master: bool = False  # DeepSpeed's bf16 mode: an fp32 copy of the trained weights
    medusa_layers: int = 1
    share_lm_head: bool = False
    teacher: str = "topk"  # eagle3 method.teacher: topk, full (the target's whole distribution over S), none
    soft_topk: int = EAGLE3_SOFT_TOPK
    draft_vocab: int | None = None  # eagle3: S (None: min(32000, V)); medusa1: method.draft_vocab
    features: str = "online"  # eagle3: online (the target runs every step) or cache (data.features)
    fused_layers: int = 3
    backbone: str = "lora"  # cllm: lora or full
    lora_r: int = 32
    ar_loss: str = "ce"  # cllm: ce or kl
    packing: bool = False
    block_size: int = 16

    def __post_init__(self) -> None:
        checks = ((self.method in METHODS, f"method {self.method!r}: one of {', '.join(METHODS)}"),
                  (self.batch > 0, f"batch {self.batch}: must be positive"),
                  (self.seq > 2, f"seq {self.seq}: must be at least 3"),
                  (self.steps > 0, f"ttt-steps {self.steps}: must be positive"),
                  (self.teacher in ("topk", "full", "none"), f"teacher {self.teacher!r}: topk, full or none"),
                  (self.features in ("online", "cache"), f"features {self.features!r}: online or cache"),
                  (self.backbone in ("lora", "full"), f"backbone {self.backbone!r}: lora or full"),
                  (self.ar_loss in ("ce", "kl"), f"ar loss {self.ar_loss!r}: ce or kl"))
        for ok, message in checks:
            if not ok:
                raise MemoryModelError(message)

    @property
    def act_bytes(self) -> int:
        return 2 if self.autocast else FP32


@dataclass(frozen=True)
class Breakdown:
    """Bytes of one step, by what holds them; `peak` is the model's prediction (module docstring)."""

    target_weights: int
    trained_weights: int
    gradients: int
    optimizer_state: int  # AdamW's two moments
    master_copy: int
    activations: int  # saved by the trained graph, attention and logits apart
    logits: int  # logits / targets saved for the loss, with the logits-sized buffers in flight at its peak
    saved_attention: int
    frozen_forward: int  # in flight during the no-grad target forward (online features, teacher logits)
    first_gradients: int  # the gradients that exist while the loss's saved tensors are still alive
    optimizer_temp: int
    trained_params: int

    @property
    def resident(self) -> int:
        return self.target_weights + self.trained_weights + self.optimizer_state + self.master_copy

    @property
    def phases(self) -> dict[str, int]:
        return {"frozen forward": self.frozen_forward,
                "loss/backward": self.activations + self.logits + self.saved_attention + self.first_gradients,
                "optimizer step": self.gradients + self.optimizer_temp}

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def peak(self) -> int:
        return self.resident + max(self.phases.values())

    def rows(self) -> list[tuple[str, int]]:
        names = ("target_weights", "trained_weights", "gradients", "optimizer_state", "master_copy", "activations",
                 "logits", "saved_attention", "frozen_forward")
        return [(n.replace("_", " "), getattr(self, n)) for n in names]


def frozen_forward_bytes(shape: Shape, tokens: int, dtype_bytes: int) -> int:
    """The no-grad target forward at its widest point: residual, normed input, and gate / up / act·up of one MLP."""
    return tokens * (2 * shape.hidden + 3 * shape.intermediate) * dtype_bytes


def optimizer_bytes(params: int, param_bytes: int, setup: TrainSetup) -> tuple[int, int, int]:
    """(moments, master copy, step temporaries) of AdamW over `params` weights stored in `param_bytes`."""
    if setup.fp32_master:
        return 2 * params * FP32, params * FP32, params * FP32 if setup.foreach else 0
    return 2 * params * param_bytes, 0, params * param_bytes if setup.foreach else 0


def medusa1(shape: Shape, s: TrainSetup) -> Breakdown:
    """Frozen backbone, K fp32 heads (blocks of h + SiLU(W h + b), then an lm_head [V|S, D] unless shared), loss
    Σ λ^k CE_k over the full (or draft) vocabulary, one head's logits at a time (train/medusa1.py, medusa_loss)."""
    d, k = shape.hidden, s.steps
    out = s.draft_vocab or shape.vocab
    head = s.medusa_layers * (d * d + d) + (0 if s.share_lm_head else out * d)
    params = k * head
    n = s.batch * (s.seq - 2)
    tokens = s.batch * s.seq
    moments, master, temp = optimizer_bytes(params, FP32, s)
    # hidden [B, T, D] fp32 and its trained rows [N, D]; per block layer the linear's output and the block's output
    activations = tokens * d * FP32 + n * d * FP32 + k * s.medusa_layers * 2 * n * d * s.act_bytes
    # one log-softmax [N, V] per head; at the last head: the previous head's logits, these logits and their copy for
    # the loss; in the first backward node: the loss's gradient, the log-softmax's and the index's
    logits = (k + 2) * n * out * FP32
    return Breakdown(
        target_weights=shape.params() * s.target_bytes, trained_weights=params * FP32, gradients=params * FP32,
        optimizer_state=moments, master_copy=master, activations=activations, logits=logits, saved_attention=0,
        frozen_forward=frozen_forward_bytes(shape, tokens, s.target_bytes) + tokens * d * FP32,
        first_gradients=head * FP32, optimizer_temp=temp, trained_params=params)


def eagle3_draft_params(shape: Shape, draft_vocab: int, fused_layers: int = 3) -> int:
    """fc [D, F·D], one Llama decoder layer (no bias, for every target family) with 2D-wide q / k / v inputs, four
    norms, lm_head [S, D] (models/eagle3.py)."""
    d, kv = shape.hidden, shape.kv_width
    attention = 2 * d * d + 2 * (2 * d * kv) + d * d
    return fused_layers * d * d + attention + 3 * d * shape.intermediate + 4 * d + draft_vocab * d


def eagle3(shape: Shape, s: TrainSetup) -> Breakdown:
    """The frozen target's features (online: a no-grad forward with its logits' top-k; or a cache), one fp32 draft
    layer unrolled for K TTT steps, a soft-label CE over S per step (train/eagle3.py, eagle3_loss)."""
    d, kv, i, h = shape.hidden, shape.kv_width, shape.intermediate, shape.heads
    b, t, k, a = s.batch, s.seq, s.steps, s.act_bytes
    size = s.draft_vocab or min(EAGLE3_DRAFT_VOCAB, shape.vocab)
    params = eagle3_draft_params(shape, size, s.fused_layers)
    tokens = b * t
    positions = [b * max(0, t - 2 - j) for j in range(k)]  # N_j
    moments, master, temp = optimizer_bytes(params, FP32, s)
    # the features (the cache's or the forward's, as fp32) and their concatenation; fused, embeddings
    features = 2 * s.fused_layers * tokens * d * FP32 + tokens * s.soft_topk * 12
    activations = features + 2 * tokens * d * FP32
    per_step = tokens * (d * FP32 * 6  # shifted embedding, both norms' normalised inputs, post-attention norm's in/out,
                         # the step's output
                         + 2 * d * a  # the q / k / v input [B, T, 2D]
                         + 2 * d * a  # the attention output before and after the reshape for o_proj
                         + 4 * i * a)  # gate, up, act(gate), act·up
    activations += k * per_step + sum(3 * n * d * FP32 for n in positions)  # the scored rows through norm + lm_head
    rows = tokens * (2 * d + 2 * kv) * a + b * h * t * FP32  # q, k, v, output, log-sum-exp
    attention = k * rows
    per_position = {"topk": 2, "full": 2, "none": 1}[s.teacher]  # log-softmax (+ the soft target), per step
    in_flight = {"topk": 3, "full": 3, "none": 2}[s.teacher]
    logits = sum(per_position * n * size * FP32 for n in positions) + in_flight * positions[0] * size * FP32
    frozen = 0
    if s.features == "online":
        frozen = frozen_forward_bytes(shape, tokens, s.target_bytes)
        if s.teacher == "topk":  # logits [B, T, V] in the target's dtype, as fp32, and their softmax
            frozen = max(frozen, tokens * shape.vocab * (s.target_bytes + 2 * FP32))
        frozen += s.fused_layers * tokens * d * (s.target_bytes + FP32)
    if s.teacher == "full":  # train/eagle3_teacher.py: the last hidden state, the distribution over S for every
        # step; while it is built, its chunks beside their concatenation and one chunk's logits [2048, V]
        activations += tokens * d * FP32
        logits += tokens * size * FP32
        frozen = max(frozen, tokens * size * FP32 + LOGITS_ROWS * shape.vocab * (s.target_bytes + 2 * FP32))
    return Breakdown(
        target_weights=shape.params() * s.target_bytes, trained_weights=params * FP32, gradients=params * FP32,
        optimizer_state=moments, master_copy=master, activations=activations, logits=logits, saved_attention=attention,
        frozen_forward=frozen, first_gradients=size * d * FP32, optimizer_temp=temp, trained_params=params)


def lora_params(shape: Shape, rank: int) -> int:
    """peft's all-linear LoRA on every decoder layer: A [r, in] and B [out, r] per projection."""
    d, kv, i = shape.hidden, shape.kv_width, shape.intermediate
    per_layer = (d + d) + 2 * (d + kv) + (d + d) + 2 * (d + i) + (i + d)
    return shape.layers * rank * per_layer


def backbone_activation_bytes(shape: Shape, tokens: int, s: TrainSetup) -> int:
    """What a gradient-carrying forward of the whole target saves per token and layer, in the model's dtype w:
    the norms' fp32 inputs, the q / k / v / o / MLP inputs, rotated q, k, v, the attention output (sdpa: no [T, T]),
    gate / up / act / product; LoRA adds each projection's dropout copy (fp32, peft's adapter dtype) and mask."""
    d, kv, i, w = shape.hidden, shape.kv_width, shape.intermediate, s.target_bytes
    per_token = 2 * d * FP32 + (d + d + d + kv + kv + d + d + d) * w + 4 * i * w
    if s.backbone == "lora":
        per_token += (6 * d + i) * (FP32 + 1)
    return shape.layers * tokens * per_token


def cllm(shape: Shape, s: TrainSetup) -> Breakdown:
    """The target itself trains (LoRA r on all linear layers, or full): a no-grad teacher forward, the student's block
    forward and the AR forward, both kept for one backward (packing: one forward per packed row), the AR logits
    over V (train/cllm.py)."""
    d, v, w = shape.hidden, shape.vocab, s.target_bytes
    tokens = s.batch * s.seq
    if s.backbone == "lora":
        params, param_bytes = lora_params(shape, s.lora_r), FP32
    else:
        params, param_bytes = shape.params(), w
    moments, master, temp = optimizer_bytes(params, param_bytes, s)
    graphs = 1 if s.packing else 2  # packed: one forward gives teacher, student and AR rows
    activations = graphs * backbone_activation_bytes(shape, tokens, s)
    if s.packing:
        activations += s.batch * s.seq * s.seq * w  # the 4-D additive mask [B, 1, T, T]
    block = s.batch * s.block_size * v * FP32 * 5  # teacher, student, their log-softmaxes, the gradient
    ar = tokens * v * (w + 2 * FP32)  # lm_head output, as fp32, the log-softmax saved by the CE
    if s.ar_loss == "kl":
        ar += tokens * v * 3 * FP32  # the reference's logits and log-softmax, the model's log-softmax for the KL
    frozen = frozen_forward_bytes(shape, tokens, w)
    copy = shape.params() * w if s.ar_loss == "kl" and s.backbone == "full" else 0
    return Breakdown(
        target_weights=shape.params() * w + copy, trained_weights=0 if s.backbone == "full" else params * FP32,
        gradients=params * param_bytes, optimizer_state=moments, master_copy=master, activations=activations,
        logits=block + ar, saved_attention=0, frozen_forward=frozen,
        first_gradients=params * param_bytes if s.backbone == "lora" else shape.layer_params() * w,
        optimizer_temp=temp, trained_params=params)


PREDICTORS = {"medusa1": medusa1, "eagle3": eagle3, "cllm": cllm}


def predict(shape: Shape, setup: TrainSetup) -> Breakdown:
    return PREDICTORS[setup.method](shape, setup)


@dataclass(frozen=True)
class FitRow:
    target: str
    method: str
    steps: int
    largest_batch: dict[str, int] = field(default_factory=dict)  # GPU label -> largest fitting batch (0: none)


def largest_batch(shape: Shape, setup: TrainSetup, capacity: int, limit: int = 4096) -> int:
    """The largest B whose predicted peak fits `capacity` bytes (0 when B = 1 does not); peaks grow with B."""
    fits = lambda batch: predict(shape, replace(setup, batch=batch)).peak <= capacity  # noqa: E731
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def fit_table(seq: int = FIT_SEQ, autocast: bool = True) -> list[FitRow]:
    """Medusa-1 (conf/method/medusa1.yaml: 5 heads) and EAGLE-3 (K = 7) on the FIT_TARGETS, per GPU size."""
    rows = []
    for name in FIT_TARGETS:
        for method, steps in (("medusa1", 5), ("eagle3", 7)):
            setup = TrainSetup(method=method, batch=1, seq=seq, steps=steps, autocast=autocast)
            sizes = {label: largest_batch(SHAPES[name], setup, int(gib * GIB * HEADROOM))
                     for label, gib in FIT_GPUS_GIB.items()}
            rows.append(FitRow(name, method, steps, sizes))
    return rows


def setup_fields() -> tuple[str, ...]:
    return tuple(f.name for f in fields(TrainSetup))
