"""Forward helpers over a stock Hugging Face causal LM. Dimension letters: B batch, T time, D hidden, V vocab."""

from __future__ import annotations

import torch


def eos_token_ids(model: torch.nn.Module) -> tuple[int, ...]:
    """The ids that end a generation: the generation config's eos_token_id, else the model config's (an int, a list
    or None, normalised to a tuple)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def padded_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] 0/1 mask -> [B, T] positions counting only real tokens, so left-padded rows start at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def final_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Post-norm hidden states of the last layer (what lm_head sees): [B, T] -> [B, T, D]. Skips lm_head."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    out = model.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=padded_position_ids(attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state
