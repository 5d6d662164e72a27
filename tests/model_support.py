"""Tiny random causal LMs saved to disk with a tokenizer, for end-to-end runs that load through from_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from tests.data_support import tiny_tokenizer

CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}


def tiny_config(arch: str = "llama", vocab_size: int = 400, hidden_size: int = 32, layers: int = 2):
    return CONFIGS[arch](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def save_tiny_model(path: Path, arch: str = "llama", seed: int = 0, hidden_size: int = 32, layers: int = 2,
                    tied: bool = False, initializer_range: float = 0.02) -> Path:
    """A random model + the tests' chat tokenizer at `path`; eos/pad/bos ids match the tokenizer. A larger
    `initializer_range` (0.2) makes next-token distributions peaked, so greedy answers vary instead of repeating one
    token."""
    tokenizer = tiny_tokenizer()
    config = tiny_config(arch, vocab_size=len(tokenizer), hidden_size=hidden_size, layers=layers)
    config.tie_word_embeddings, config.initializer_range = tied, initializer_range
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
