"""Prompts a trainer generates from: the first user turns of a data split, chat-formatted for generation."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from data.chat import encode_prompt, first_user_turn
from data.datasets import load_conversations


def prompt_ids(cfg: DictConfig, tokenizer: Any) -> list[list[int]]:
    """First user turn of validation conversations, formatted for generation (for the greedy-continuation eval)."""
    return first_user_prompts(cfg, tokenizer, "validation", cfg.eval.greedy_prompts)


def first_user_prompts(cfg: DictConfig, tokenizer: Any, split: str, limit: int, shuffle_seed: int | None = None
                       ) -> list[list[int]]:
    """The first user turn of up to `limit` conversations of `split`, chat-formatted with a generation prompt;
    conversations shuffled with `shuffle_seed` first when given."""
    import random

    if limit <= 0:
        return []
    conversations = load_conversations(cfg.data, split)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(conversations)
    prompts = []
    for conv in conversations:
        turn = first_user_turn(conv)
        if turn is None:
            continue
        prompts.append(encode_prompt(tokenizer, turn, chat_template=cfg.data.chat_template))
        if len(prompts) == limit:
            break
    return prompts
