"""builtin:smollm2 (models.smollm2), offline: the converted folder is the GGUF (its weights, logits, tokenizer and
provenance). The GGUF stand-in and the isolation from real caches: tests/smollm2_support.py; where the weights come
from: tests/test_smollm2_sources.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models import smollm2
from tests.smollm2_support import CHAT_TEMPLATE, SPECIAL_TOKENS, assert_same_weights
from tests.smollm2_support import isolated, source  # noqa: F401 (fixtures; isolated is autouse)

TEXTS = ("Hello world, hello draftsmith!", "the lazy target verifies 12345 drafts",
         "<|im_start|>user\nnaïve café ✓ 😀<|im_end|>\n", "  two spaces\tand a tab\n\nnewlines")
IDS = torch.tensor([[1, 17, 42, 299, 5, 2, 128, 64]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def from_gguf(source):
    """(model, tokenizer) as transformers reads the GGUF itself: the reference the conversion must reproduce."""
    _, path = source
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted")
    smollm2.convert_gguf(source[1], out, source="test:tiny.gguf")
    return out


# --- convert_gguf: the folder is the GGUF -----------------------------------------------------------------------------


def test_gguf_fixture_round_trips_through_transformers(source, from_gguf):
    """The stand-in is a faithful llama.cpp file: transformers' GGUF reader gives back the source weights exactly
    (including the q/k un-permutation), so the equivalences below compare real models, not two readings of garbage."""
    assert_same_weights(from_gguf[0], source[0])


def test_converted_folder_loads_without_gguf_and_equals_it(converted, from_gguf, source):
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    plain = AutoModelForCausalLM.from_pretrained(converted).eval()  # no gguf_file: an ordinary HF folder
    assert plain.dtype == torch.float32
    assert getattr(plain.config, "quantization_config", None) is None
    assert plain.get_input_embeddings().weight.data_ptr() == plain.get_output_embeddings().weight.data_ptr()
    assert_same_weights(plain, from_gguf[0])
    assert_same_weights(plain, source[0])
    assert torch.equal(logits(plain), logits(from_gguf[0]))


def test_converted_tokenizer_equals_the_gguf_tokenizer(converted, from_gguf):
    ref = from_gguf[1]
    tok = AutoTokenizer.from_pretrained(converted)
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == ref(text).input_ids, text
        assert tok.decode(ids) == text
    assert len(tok) == len(ref) == 300
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2]
    assert tok("<|im_end|>").input_ids == [2]  # a control token stays whole
    specials = lambda t: (t.bos_token, t.eos_token, t.pad_token, t.unk_token, t.all_special_tokens)  # noqa: E731
    assert specials(tok) == specials(ref)
    assert tok.chat_template == ref.chat_template == CHAT_TEMPLATE
    chat = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "hello draftsmith!"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_conversion_records_provenance_and_shares_files(converted, source):
    provenance = json.loads((converted / "conversion.json").read_text())
    assert provenance == {"source": "test:tiny.gguf", "gguf_file": smollm2.GGUF_FILE, "hub_id": smollm2.HUB_ID,
                          "weights": "GGUF blocks dequantised to fp32"}
    assert {"config.json", "model.safetensors", "tokenizer.json", "conversion.json"} <= {
        f.name for f in converted.iterdir()}
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in converted.iterdir() if f.is_file())
