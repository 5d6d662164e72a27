"""Shared fixtures: tiny random decoder LMs (hidden 32, 2 layers, vocab 128, fixed seeds), built offline."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

TINY_ARCHS = ("llama", "qwen2", "mistral")
TINY_VOCAB = 128


def tiny_config(arch: str, vocab_size: int = TINY_VOCAB, hidden_size: int = 32):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # Larger than the 0.02 default so next-token distributions are peaked: argmax gaps then dwarf the float
        # reordering between a tree forward and a plain decode step.
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=256)
    raise ValueError(f"unknown tiny arch {arch!r}")


def build_tiny_lm(arch: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A frozen fp32 tiny random causal LM; the same (arch, seed) always gives the same weights."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval().requires_grad_(False)


@pytest.fixture
def single_thread():
    """Run a test with one intra-op thread (restored after): tiny models gain nothing from more, and on a shared
    machine OpenMP spin-waiting makes multi-threaded tiny forwards many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_lm_factory() -> Callable[..., torch.nn.Module]:
    """`tiny_lm_factory(arch, seed=0, attn_implementation="sdpa")`, cached per arguments for the session."""
    cache: dict[tuple, torch.nn.Module] = {}

    def make(arch: str = "llama", seed: int = 0, attn_implementation: str = "sdpa") -> torch.nn.Module:
        key = (arch, seed, attn_implementation)
        if key not in cache:
            cache[key] = build_tiny_lm(arch, seed, attn_implementation)
        return cache[key]

    return make


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_lm(request, tiny_lm_factory) -> torch.nn.Module:
    """One tiny random model per architecture in TINY_ARCHS."""
    return tiny_lm_factory(request.param)
