"""What fits a target's context: prompt plus new tokens against max_position_embeddings, tree positions past the
end, and the sliding window the engine's full-attention cache cannot honour."""

from __future__ import annotations

from typing import Any

import torch


def context_length(config: Any) -> int | None:
    """The positions a target can take: its (text) config's max_position_embeddings; None when it states none or
    there is no config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return int(limit) if limit else None


def check_context(config: Any, prompt_tokens: int, max_new_tokens: int, flag: str = "max_new_tokens",
                  model: str = "the model") -> None:
    """Refuse, in one line naming `flag`, a generation that does not fit the target's context (`config`: the target's
    config, or its config.json read before it loads): the prompt plus max_new_tokens must fit max_position_embeddings.
    Within that, a tree step at the end of the context stays exact: `within_context`."""
    limit = context_length(config)
    if limit is None or prompt_tokens + max_new_tokens <= limit:
        return
    if prompt_tokens >= limit:
        raise ValueError(f"the prompt's {prompt_tokens} tokens fill {model}'s context of {limit} positions "
                         f"(max_position_embeddings): no room for new tokens")
    raise ValueError(f"{flag}={max_new_tokens}: {prompt_tokens} prompt token(s) + {max_new_tokens} new tokens exceed "
                     f"{model}'s context of {limit} positions (max_position_embeddings); at most "
                     f"{limit - prompt_tokens} new tokens fit")


def within_context(positions: torch.Tensor, limit: int | None) -> torch.Tensor:
    """Tree position ids [B, K] with those past the context clamped to its last position; exact. With prompt +
    max_new_tokens within the context (`check_context`), a row with r tokens still to produce reads the outputs of
    its nodes of depth < r only, all below position prompt + max_new_tokens - 1; a node past the context is deeper
    (its token comes after max_new_tokens) or belongs to a finished row riding along, and its key is seen only by
    its own descendants: nothing kept depends on it. Clamping keeps such nodes from indexing a learned position table
    out of range or switching on dynamic RoPE rescaling for the whole forward (which would change kept logits)."""
    return positions if limit is None else positions.clamp(max=limit - 1)


def check_window(model: torch.nn.Module, total_len: int) -> None:
    """The cache here is full-attention; refuse lengths where a sliding-window model would attend differently."""
    window = getattr(model.config, "sliding_window", None)
    layer_types = getattr(model.config, "layer_types", None) or ["sliding_attention"]
    if window and any("sliding" in t for t in layer_types) and total_len > window:
        raise ValueError(
            f"prompt + max_new_tokens = {total_len} exceeds the model's sliding_window={window}; "
            "sliding-window attention is not supported by the tree cache"
        )
