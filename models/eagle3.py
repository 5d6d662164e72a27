"""EAGLE-3's draft model (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test") on stock transformers modules.

Dimension letters: B batch, T time, Q queries, S cached slots (or the draft vocabulary where it says so), D hidden,
L fused target layers, V target vocabulary, H attention heads, Hd head width, n unrolled steps.

The target's hidden states at a few layers (low / mid / high: transformers' `hidden_states` numbering, EAGLE-3's
defaults 2, N/2, N-3) are concatenated and fused by `fc` (L*D -> D). One Llama decoder layer (`midlayer`:
transformers' LlamaDecoderLayer, no forked modeling file) reads, at each position, the fused features g_t beside the
embedding of the next token x_{t+1}: its q/k/v projections take the 2D-wide concatenation [input_layernorm(e),
hidden_norm(h)], its residual stream is h. A final `norm` and `lm_head` over a draft vocabulary of S ids score token
t+2.

The layer is Llama's for EVERY target family (what vLLM, SGLang and SpecForge load as LlamaForCausalLMEagle3): the
target's hidden size, heads, KV heads, head width, RMSNorm eps, positions and rope (`draft_rope`), the draft's MLP
width, and none of the target's own layer quirks (Qwen2's q/k/v bias, Qwen3's per-head q/k norm, Gemma's gelu MLP,
(1 + w) norms, sliding windows, soft-capping). Its norms are Llama's RMSNorm, x / rms(x) * w, whatever the target's
are: a target norm copied into the draft goes through `norm_gain` (w for Llama's, 1 + w for Gemma's). The token
embedding it reads is a row of the target's embedding table (`token_lookup`), as the servers share it: Gemma's
sqrt(D) scaling is part of its embedding module's forward, not of the table, so it is not applied.

Offset convention (the only place it is stated): the pair (h at position t, embedding of token t+1) sits at
position id t; its output o_t predicts token t+2. Fed back with the embedding of token t+2 at position id t+1, o_t
predicts token t+3, and so on. At inference the last pair is (target features at the last committed token's parent,
the committed root), so the first draft is the token after the root.

Draft vocabulary (vLLM / SGLang / SpecForge's convention): the S draft ids are the chosen target ids sorted
ascending; `d2t[i]` = target id - i (an offset), `t2d[v]` = whether target id v is a draft id. `vocab_ids` is
`arange(S) + d2t`.

Two forwards share every weight:
    `step`    the stock attention module with a cache and a 4-D additive mask (the engine's tree drafting)
    `unroll`  training-time test: n steps over a whole sequence, each step's outputs fed back as the next step's
              hidden input; step j's query at t attends to step 0's keys at <= t and to its own chain's keys at t
              from steps 1..j (what the chain it stands for sees at inference). `step` over the same inputs gives
              the same outputs (tests/test_eagle3.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)

from models.checkpoint import (CONFIG_NAME, TOKEN_COUNTS_NAME, WEIGHTS_NAME, CheckpointError, DrafterMismatchError,
                               Payload, read_drafter_config, write_checkpoint)
from models.medusa import check_vocab_ids
from models.ttt_attention import ttt_attention


class Eagle3ConfigError(ValueError):
    """An EAGLE-3 config or draft vocabulary that cannot describe a draft model for its target."""


@dataclass(frozen=True)
class Eagle3Config:
    target: dict[str, Any]  # the target's own text config (`to_dict()`): vocabulary, depth, widths, rope, norm eps
    layers: tuple[int, ...]  # fused target hidden_states indices, low to high
    draft_vocab_size: int  # S
    ttt_steps: int = 1  # unrolled steps it was trained with (informs the default tree depth)
    acceptance: list[list[float]] = field(default_factory=list)  # [depth][rank] measured hit rates, when known
    intermediate_size: int | None = None  # the draft layer's MLP width; None: the target's

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        needed = TARGET_KEYS + (("intermediate_size",) if self.intermediate_size is None else ())
        missing = [k for k in needed if self.target.get(k) is None]
        if missing:
            raise Eagle3ConfigError(f"target config has no {', '.join(missing)} (needed to build the draft layer)")
        num_layers = self.target.get("num_hidden_layers")
        if not self.layers or any(not 0 <= i <= num_layers for i in self.layers) or len(set(self.layers)) != len(self.layers):
            raise Eagle3ConfigError(f"layers {list(self.layers)}: need distinct hidden_states indices in "
                                    f"[0, {num_layers}] (the target's num_hidden_layers)")
        if self.intermediate_size is not None and (isinstance(self.intermediate_size, bool)
                                                   or not isinstance(self.intermediate_size, int)
                                                   or self.intermediate_size < 1):
            raise Eagle3ConfigError(f"intermediate_size {self.intermediate_size!r}: must be a positive integer (the "
                                    f"draft layer's MLP width) or null (the target's)")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise Eagle3ConfigError(f"draft_vocab_size {self.draft_vocab_size}: must be in [1, {self.vocab_size}] "
                                    f"(the target's vocabulary)")

    @property
    def hidden_size(self) -> int:
        return int(self.target["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.target["vocab_size"])

    @property
    def mlp_width(self) -> int:
        """The draft layer's MLP width: `intermediate_size`, else the target's."""
        return self.intermediate_size if self.intermediate_size is not None else int(self.target["intermediate_size"])

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "layers": list(self.layers)}

    def layer_settings(self) -> dict[str, Any]:
        """The draft's decoder layer, for any target family: a Llama layer (silu MLP, no bias, no q/k norm, full
        attention) with the target's width, heads, KV heads, head width, RMSNorm eps, positions and rope, and the
        draft's MLP width. LlamaConfig keys; models/eagle3_interop.py writes them as the exported config."""
        t, d = self.target, self.hidden_size
        heads = int(t["num_attention_heads"])
        return {"hidden_size": d, "intermediate_size": self.mlp_width, "num_attention_heads": heads,
                "num_key_value_heads": int(t.get("num_key_value_heads") or heads),
                "head_dim": int(t.get("head_dim") or d // heads), "rms_norm_eps": float(t["rms_norm_eps"]),
                "max_position_embeddings": int(t["max_position_embeddings"]), "rope_parameters": draft_rope(t),
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}

    def layer_config(self, attn_implementation: str = "sdpa") -> LlamaConfig:
        """The one-layer LlamaConfig `midlayer` and its rotary embedding are built from."""
        return LlamaConfig(**self.layer_settings(), num_hidden_layers=1, vocab_size=self.vocab_size,
                           tie_word_embeddings=False, attn_implementation=attn_implementation)


TARGET_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "rms_norm_eps",
               "max_position_embeddings")  # what Eagle3Config reads of its target (and intermediate_size by default)


def draft_rope(target: dict[str, Any]) -> dict[str, Any]:
    """The draft layer's rope as transformers 5's rope_parameters ({"rope_type", "rope_theta", scaling keys}), from a
    config dict that states rope_parameters (transformers 5) or rope_theta / rope_scaling (older configs). A target
    with one rope per layer type (Gemma 3: sliding and full attention) gives its full-attention one: the draft layer
    attends to every position."""
    parameters = target.get("rope_parameters")
    if isinstance(parameters, dict) and parameters:
        if all(isinstance(v, dict) for v in parameters.values()):
            parameters = parameters.get("full_attention") or next(iter(parameters.values()))
        return {"rope_type": "default", **parameters}
    scaling = dict(target.get("rope_scaling") or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    return {"rope_theta": target.get("rope_theta") or 10000.0, "rope_type": kind, **scaling}


@torch.no_grad()
def norm_gain(norm: nn.Module, width: int) -> torch.Tensor:
    """[D] fp32: the per-channel gain an RMSNorm-style module multiplies its normalised input by (`weight` for Llama's
    RMSNorm, `1 + weight` for Gemma's), read off its output for a constant input, whose RMS normalisation is 1 to
    fp32 precision (eps / 1e8 ~ 1e-14). A draft's Llama norm holding it computes the target's norm."""
    device = next(norm.parameters()).device
    return norm(torch.full((width,), 1e4, device=device)).float()


def token_lookup(embedding: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Token ids [...] -> [..., D], what the draft reads for a token: a row of the target's input-embedding table, as
    vLLM, SGLang and SpecForge share it. An embedding module whose forward scales the row (Gemma's, by sqrt(D)) is
    looked up as a plain nn.Embedding; a plain one is returned as it is."""
    if not isinstance(embedding, nn.Embedding) or type(embedding).forward is nn.Embedding.forward:
        return embedding
    return functools.partial(nn.Embedding.forward, embedding)


def default_layers(num_hidden_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / mid / high taps in hidden_states numbering: after decoder layers 2, N/2 and N-3."""
    n = num_hidden_layers
    return tuple(sorted({min(2, n), max(n // 2, 1), max(n - 3, 1)}))  # a shallow target has fewer distinct taps


def fused_layers(setting: Sequence[int] | None, num_hidden_layers: int) -> tuple[int, ...]:
    """A `method.layers` setting resolved for a target of `num_hidden_layers`: null gives EAGLE-3's
    `default_layers` (a 30-layer SmolLM2: 2, 15, 27; 32 layers: 2, 16, 29), a list is taken as it is."""
    return default_layers(num_hidden_layers) if setting is None else tuple(int(i) for i in setting)


def target_text_config(target: nn.Module) -> dict[str, Any]:
    config = target.config.get_text_config()
    return config.to_dict()


class Eagle3Draft(nn.Module):
    """fc, midlayer (a Llama decoder layer with 2D-wide, bias-free q/k/v), norm, lm_head [S, D]; buffers d2t [S],
    t2d [V]. Weight names are the ones vLLM and SGLang load."""

    def __init__(self, config: Eagle3Config, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        self.config = config
        layer = config.layer_config(attn_implementation)
        d, layers = config.hidden_size, len(config.layers)
        self.fc = nn.Linear(layers * d, d, bias=False)
        self.midlayer = LlamaDecoderLayer(layer, layer_idx=0)
        attn = self.midlayer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, nn.Linear(2 * d, getattr(attn, name).out_features, bias=False))
        self.midlayer.hidden_norm = LlamaRMSNorm(d, eps=layer.rms_norm_eps)
        self.norm = LlamaRMSNorm(d, eps=layer.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=layer)
        self._rotary = apply_rotary_pos_emb
        vocab = torch.arange(config.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, vocab, True))

    # -- draft vocabulary -------------------------------------------------------------------------------------------

    @property
    def vocab_ids(self) -> torch.Tensor:
        """[S] the target id of each draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, ids: torch.Tensor | Sequence[int]) -> None:
        """Draft over these S target ids (any order: stored sorted, as the d2t / t2d convention requires)."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().sort().values
        check_vocab_ids(ids, self.config.draft_vocab_size, self.config.vocab_size, error=Eagle3ConfigError)
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_().index_fill_(0, ids.to(self.t2d.device), True)

    def draft_index(self, target_ids: torch.Tensor, missing: int = -1) -> torch.Tensor:
        """Target ids [...] -> draft ids [...]; ids outside the draft vocabulary become `missing`."""
        position = torch.cumsum(self.t2d.long(), 0) - 1  # [V] draft id of each kept target id
        safe = target_ids.clamp(0, len(self.t2d) - 1)
        return torch.where(self.t2d[safe] & (target_ids >= 0), position[safe], torch.full_like(target_ids, missing))

    @torch.no_grad()
    def init_as_target_head(self) -> None:
        """Start as the target's own next-token predictor (with `lm_head` and `norm` copied from the target): `fc` passes
        the highest fused layer through and the layer adds nothing (o_proj and down_proj zero), so the first draft is
        what the target's upper layers already say and training learns the shift by one token (Medusa's
        init_from_lm_head, for a feature drafter)."""
        d = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, -d:] = torch.eye(d)
        self.midlayer.self_attn.o_proj.weight.zero_()
        self.midlayer.mlp.down_proj.weight.zero_()

    # -- forwards ---------------------------------------------------------------------------------------------------

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., L*D] concatenated target layers (in `config.layers` order) -> [..., D]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] midlayer outputs -> [..., S] draft-vocabulary logits."""
        return self.lm_head(self.norm(hidden))

    def _inputs(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        layer = self.midlayer
        return torch.cat([layer.input_layernorm(embeds.to(hidden.dtype)), layer.hidden_norm(hidden)], dim=-1)

    def _mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        layer = self.midlayer
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def step(self, hidden: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None, cache: Any) -> torch.Tensor:
        """One pass of the decoder layer over Q new pairs after the cache: hidden [B, Q, D] (fused target features or
        earlier outputs), embeds [B, Q, D] (of the token after each), position_ids [B, Q], attention_mask an additive
        [B, 1, Q, S + Q] mask (None only for one query, or Q causal ones over an empty cache: the attention module is
        called directly, so nothing builds a causal mask) -> outputs [B, Q, D]. Appends Q cache slots."""
        x = self._inputs(hidden, embeds)  # [B, Q, 2D]
        cos_sin = self.rotary_emb(hidden, position_ids)
        attn, _ = self.midlayer.self_attn(hidden_states=x, position_embeddings=cos_sin, attention_mask=attention_mask,
                                          cache=cache)
        return self._mlp(hidden + attn)

    def unroll(self, hidden: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over right-padded sequences: hidden [B, T, D] fused target features, embeds [B, T, D]
        the embeddings of x_0 .. x_{T-1} -> `steps` outputs [B, T, D]; output j at t predicts token t + 2 + j.
        Step j reads the embedding of x_{t+1+j} (zeros past the end: those positions have no label)."""
        b, t, _ = hidden.shape
        positions = torch.arange(t, device=hidden.device)[None].expand(b, t)
        attn = self.midlayer.self_attn
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs = []
        for j in range(steps):
            shifted = F.pad(embeds[:, 1 + j :], (0, 0, 0, min(1 + j, t)))[:, :t]  # [B, T, D] embedding of x_{t+1+j}
            x = self._inputs(hidden, shifted)  # [B, T, 2D]
            cos, sin = self.rotary_emb(hidden, positions + j)
            q, k, v = _project(attn, x)  # [B, H|Hkv, T, Hd]
            q, k = self._rotary(q, k, cos, sin)
            keys.append(k)
            values.append(v)
            context = ttt_attention(q, keys, values, attn.scaling)  # [B, T, H * Hd]
            hidden = self._mlp(hidden + attn.o_proj(context))
            outputs.append(hidden)
        return outputs


def _project(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stock attention module's projections on x [B, T, 2D] -> q [B, H, T, Hd], k and v [B, Hkv, T, Hd]."""
    b, t, _ = x.shape
    shape = (b, t, -1, attn.head_dim)
    q, k, v = (getattr(attn, f"{n}_proj")(x).view(shape) for n in "qkv")
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def check_maps(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, vocab_size: int, where: str) -> torch.Tensor:
    """Validate a d2t / t2d pair against the sizes; returns the draft vocabulary's target ids [S]. One-line
    Eagle3ConfigError naming `where` for a map of another size, ids out of range, duplicates, or maps that disagree."""
    if d2t.dim() != 1 or d2t.numel() != draft_vocab_size:
        raise Eagle3ConfigError(f"{where}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},) "
                                f"(draft_vocab_size)")
    if t2d.dim() != 1 or t2d.numel() != vocab_size:
        raise Eagle3ConfigError(f"{where}: t2d has shape {tuple(t2d.shape)}, expected ({vocab_size},) (the target's "
                                f"vocab_size)")
    ids = torch.arange(draft_vocab_size) + d2t.long().cpu()
    check_vocab_ids(ids, draft_vocab_size, vocab_size, f"{where}: d2t", Eagle3ConfigError)
    if bool((ids[1:] <= ids[:-1]).any()):
        raise Eagle3ConfigError(f"{where}: d2t does not map draft ids to ascending target ids")
    kept = t2d.cpu().bool().nonzero().flatten()
    if not torch.equal(kept, ids):
        raise Eagle3ConfigError(f"{where}: t2d marks {kept.numel()} target ids that are not d2t's {draft_vocab_size}")
    return ids


# -- checkpoints (the project's format: models.checkpoint.write_checkpoint is the one writer) -----------------------

DRAFTER_TYPE = "eagle3"
CONFIG_KEY = "eagle3"  # config.json key holding Eagle3Config.to_dict()


def saved_state(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores: every parameter, d2t and t2d (the rotary buffers are recomputed)."""
    return {name: t.detach().to("cpu").contiguous() for name, t in draft.state_dict().items()
            if not name.startswith("rotary_emb.")}


def save_eagle3(output_dir: str | os.PathLike, draft: Eagle3Draft, base_model_name_or_path: str, tokenizer: Any = None,
                extra: dict[str, Any] | None = None, token_counts: torch.Tensor | None = None) -> Path:
    """Write `draft` as a draftsmith checkpoint (drafter_type "eagle3"), atomically: config.json {"eagle3": its
    Eagle3Config, "hidden_size", "vocab_size", ...}, drafter.safetensors (`saved_state`), token_counts.safetensors."""

    tensors = saved_state(draft)
    config = draft.config

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "drafter_type": DRAFTER_TYPE})
        if token_counts is not None:
            save_file({"counts": token_counts.detach().to("cpu", torch.int64).contiguous()},
                      str(tmp / TOKEN_COUNTS_NAME), metadata={"format": "pt"})

    settings = {CONFIG_KEY: config.to_dict(), "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                "draft_vocab_size": config.draft_vocab_size}
    return write_checkpoint(output_dir, base_model_name_or_path, Payload(DRAFTER_TYPE, settings, tensors, write),
                            tokenizer, extra)


def read_eagle3_config(path: str | os.PathLike) -> Eagle3Config:
    """The Eagle3Config of an eagle3 checkpoint, from config.json alone; CheckpointError (one line) otherwise."""

    path = Path(path)
    config = read_drafter_config(path)
    if config["drafter_type"] != DRAFTER_TYPE:
        raise CheckpointError(f"{path / CONFIG_NAME}: drafter_type {config['drafter_type']!r} is not {DRAFTER_TYPE!r}")
    raw = config.get(CONFIG_KEY)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path / CONFIG_NAME}: missing the {CONFIG_KEY!r} object")
    try:
        return Eagle3Config(**raw)
    except TypeError as e:
        raise CheckpointError(f"{path / CONFIG_NAME}: {CONFIG_KEY}: {e}") from None
    except Eagle3ConfigError as e:
        raise CheckpointError(f"{path / CONFIG_NAME}: {CONFIG_KEY}: {e}") from None


def check_eagle3_checkpoint(path: str | os.PathLike, target_vocab_size: int | None = None) -> Eagle3Config:
    """Everything about an eagle3 checkpoint that can be refused without building a model: its config, its d2t /
    t2d maps (read alone from the weights file: sizes, range, duplicates, agreement) and, when given, the target's
    vocabulary size. One-line CheckpointError / DrafterMismatchError naming the file."""

    config = read_eagle3_config(path)
    if target_vocab_size is not None and target_vocab_size != config.vocab_size:
        raise DrafterMismatchError(f"{Path(path) / 'config.json'}: this EAGLE-3 draft was trained for a vocabulary of "
                                   f"{config.vocab_size} tokens, the target has {target_vocab_size}")
    weights = Path(path) / WEIGHTS_NAME
    try:
        with safe_open(str(weights), framework="pt") as f:
            names = set(f.keys())
            if not {"d2t", "t2d"} <= names:
                raise CheckpointError(f"{weights}: missing {' and '.join(sorted({'d2t', 't2d'} - names))}")
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights}: unreadable safetensors ({e})") from None
    try:
        check_maps(d2t, t2d, config.draft_vocab_size, config.vocab_size, str(weights))
    except Eagle3ConfigError as e:
        raise CheckpointError(str(e)) from None
    return config


def load_eagle3(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                target_vocab_size: int | None = None) -> Eagle3Draft:
    """An eagle3 checkpoint's draft model, checked (`check_eagle3_checkpoint`) before it is built, in eval mode
    without gradients."""

    config = check_eagle3_checkpoint(path, target_vocab_size)
    weights = Path(path) / WEIGHTS_NAME
    state = load_file(str(weights))
    draft = Eagle3Draft(config)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        what = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(unexpected[:3])}"
        own = any(k.endswith(".bias") or "_norm." in k and "self_attn" in k for k in unexpected)
        hint = ("; it holds its target's own layer (q/k/v bias or q/k norm), the draft layer is a Llama layer for "
                "every target: retrain it") if own else ""
        raise CheckpointError(f"{weights}: weights do not match config.json ({what}){hint}")
    return draft.to(device=device, dtype=dtype).eval().requires_grad_(False)
