"""EAGLE-3 drafts for every target family: the draft layer is a Llama layer whatever the target (what vLLM, SGLang and
SpecForge load as LlamaForCausalLMEagle3), so each family trains, exports, imports back and serves losslessly.

Tiny random targets (vocab 100, hidden 32, 4 layers, fused hidden_states 1, 2, 3) of each family transformers has:
Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k norm), Gemma, Gemma 2 and Gemma 3 (scaled embeddings, (1 + w)
norms, gelu MLP, sliding windows; Gemma 3 one rope per layer type). For each: 3 training steps through the trainer's
own code (train/eagle3.py Method: build, forward_loss) lower the loss; export -> import gives the same weights, the
same logits and the target's own config back; a reader written to vLLM's spec (tests/test_eagle3_interop.py) computes
our logits from the exported folder; the engine's greedy output with the imported drafter is plain greedy's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GemmaConfig, LlamaConfig,
                          MistralConfig, Qwen2Config, Qwen3Config)

from inference.drafters.eagle3 import Eagle3Drafter
from inference.engine.loop import DecodeConfig, generate
from inference.engine.tree import build_tree
from models.convert import main as convert_main
from models.eagle3 import (Eagle3Config, Eagle3Draft, draft_rope, load_eagle3, norm_gain, read_eagle3_config,
                           save_eagle3, token_lookup)
from models.eagle3_interop import foreign_config
from tests.test_config import composed
from tests.test_eagle3_interop import D, V, as_specforge, rewrite, target_logits, vllm_reference_logits
from tests.test_lookahead import repetitive_prompts
from train.eagle3 import Method

pytestmark = pytest.mark.usefixtures("single_thread")

N, LAYERS, S = 4, (1, 2, 3), 64  # target depth, fused hidden_states, draft vocabulary (d2t / t2d exported)
FAMILIES = {  # family: (config class, its own keys)
    "llama": (LlamaConfig, {}),
    "mistral": (MistralConfig, {"sliding_window": 256}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {}),
    "gemma": (GemmaConfig, {"tie_word_embeddings": True}),
    "gemma2": (Gemma2Config, {"tie_word_embeddings": True, "sliding_window": 64}),
    "gemma3": (Gemma3TextConfig, {"tie_word_embeddings": True, "sliding_window": 64}),
}
TREE = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]


def target_config(family: str):
    cls, own = FAMILIES[family]
    common = dict(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=N, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=512, initializer_range=0.2, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return cls(**{**common, **own})


def build_target(family: str, seed: int = 0) -> torch.nn.Module:
    """A random target in fp32; Gemma 2 has no sdpa attention in transformers."""
    torch.manual_seed(seed)
    attn = "eager" if family == "gemma2" else "sdpa"
    return AutoModelForCausalLM.from_config(target_config(family), attn_implementation=attn).eval()


def trained_draft(family: str, tmp_path: Path) -> tuple[torch.nn.Module, torch.nn.Module, Path, list[float]]:
    """(target, draft, the target's config folder, the 3 losses): train/eagle3.py's Method composed from the
    shipped config, built over the target (draft vocabulary: the batch's most frequent labels), 3 AdamW steps of
    forward_loss on one batch of 2 x 24 tokens (the target's features and top-k soft labels computed online)."""
    target = build_target(family)
    model_dir = tmp_path / f"{family}-target"
    target.config.save_pretrained(model_dir)
    cfg = composed("method=eagle3", "+model=tiny", f"model.path={model_dir}", "method.layers=[1,2,3]",
                   "method.ttt_steps=3", f"method.draft_vocab={S}", "logger=none")
    method = Method(cfg)
    ids = torch.randint(3, V, (2, 24), generator=torch.Generator().manual_seed(1))
    method.label_counts = torch.bincount(ids.flatten(), minlength=V)
    module = method.build(target, None)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    optimizer = torch.optim.AdamW(module.draft.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = method.forward_loss(module, batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return target, module.draft.eval().requires_grad_(False), model_dir, losses


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_trains_exports_imports_and_serves_losslessly(tmp_path, family):
    target, draft, model_dir, losses = trained_draft(family, tmp_path)
    assert losses[-1] < losses[0], losses  # the trainer's steps train the draft
    layer = draft.midlayer
    assert type(layer).__name__ == "LlamaDecoderLayer" and layer.self_attn.q_proj.bias is None
    assert not hasattr(layer.self_attn, "q_norm") and layer.mlp.act_fn.__class__.__name__ == "SiLUActivation"
    assert draft.config.layers == LAYERS and draft.config.target["model_type"] == target.config.model_type

    ours = save_eagle3(tmp_path / "ours", draft, str(model_dir))
    assert convert_main(["eagle3-export", str(ours), str(tmp_path / "exported")]) == 0
    exported = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert (exported["model_type"], exported["hidden_act"], exported["attention_bias"]) == ("llama", "silu", False)
    assert (exported["head_dim"], exported["num_key_value_heads"], exported["draft_vocab_size"]) == (8, 2, S)
    weights = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert not any(k.endswith(".bias") or "q_norm" in k for k in weights)
    torch.testing.assert_close(vllm_reference_logits(tmp_path / "exported"), target_logits(draft), rtol=1e-5,
                               atol=1e-5)

    assert convert_main(["eagle3-import", str(tmp_path / "exported"), str(tmp_path / "back")]) == 0
    back = load_eagle3(tmp_path / "back", target_vocab_size=V)
    assert back.config.target == read_eagle3_config(ours).target  # the target's own config: vocabulary, family
    assert torch.equal(target_logits(back), target_logits(draft))
    specforge = rewrite(tmp_path / "exported", config=as_specforge)  # no draftsmith key: the target from --base
    assert convert_main(["eagle3-import", str(specforge), str(tmp_path / "based"), "--base", str(model_dir)]) == 0
    based = load_eagle3(tmp_path / "based")
    assert based.config.target["model_type"] == target.config.model_type and based.config.layers == LAYERS
    assert torch.equal(target_logits(based), target_logits(draft))

    ids = torch.tensor([p[:6] for p in repetitive_prompts(6, 2)]) % V
    config = DecodeConfig(max_new_tokens=16)
    plain = generate(target, ids, None, config).sequences
    drafter = Eagle3Drafter(back, build_tree(TREE, num_heads=3, topk=2), target.get_input_embeddings())
    served = generate(target, ids, drafter, config)
    assert served.sequences == plain
    assert served.stats.mean_accepted > 0  # drafts were accepted: the equality is not the trivial one


@pytest.mark.parametrize("family", ["llama", "gemma", "gemma2", "gemma3"])
def test_the_draft_reads_the_targets_table_and_final_norm(family):
    """Servers share the target's embedding TABLE with the draft (Gemma's sqrt(D) scaling lives in its embedding
    module's forward, not in the table), so the draft reads rows of the table; the draft's final norm, a Llama RMSNorm
    (x / rms(x) * w) initialised from the target's, computes the target's own final norm (Gemma's x / rms(x) *
    (1 + w))."""
    target = build_target(family)
    embedding = target.get_input_embeddings()
    ids = torch.tensor([[3, 7, 11]])
    assert torch.equal(token_lookup(embedding)(ids), embedding.weight[ids])
    scaled = family.startswith("gemma")
    assert torch.equal(embedding(ids), embedding.weight[ids]) != scaled  # only Gemma's module scales its rows
    draft = Eagle3Draft(Eagle3Config(target=target.config.to_dict(), layers=LAYERS, draft_vocab_size=S))
    with torch.no_grad():
        target.model.norm.weight.normal_(0.0, 0.5)
        draft.norm.weight.copy_(norm_gain(target.model.norm, D))
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(draft.norm(x), target.model.norm(x), rtol=1e-6, atol=1e-6)


def test_rope_follows_the_target_in_every_spelling():
    """transformers 5's rope_parameters, the older rope_theta / rope_scaling, and Gemma 3's rope per layer type (the
    draft layer attends to every position: the full-attention one); exported both ways (vLLM on transformers 4 and
    SpecForge read rope_theta / rope_scaling)."""
    llama31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    target = LlamaConfig(**{k: v for k, v in target_config("llama").to_dict().items()
                            if k not in ("rope_parameters", "transformers_version")}, rope_parameters=llama31)
    assert draft_rope(target.to_dict()) == llama31
    legacy = {"rope_theta": 500000.0, "rope_scaling": {k: v for k, v in llama31.items() if k != "rope_theta"}}
    assert draft_rope(legacy) == llama31
    assert draft_rope({})["rope_theta"] == 10000.0
    gemma3 = target_config("gemma3").to_dict()
    assert draft_rope(gemma3) == gemma3["rope_parameters"]["full_attention"]
    exported = foreign_config(Eagle3Config(target=target.to_dict(), layers=LAYERS, draft_vocab_size=S),
                              torch.float32, {}, "config.json")
    assert exported["rope_parameters"] == llama31 and exported["rope_theta"] == 500000.0
    assert exported["rope_scaling"] == {k: v for k, v in llama31.items() if k != "rope_theta"}
