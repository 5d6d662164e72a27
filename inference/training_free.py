"""Training-free drafters by name: no checkpoint, any base model, options as text.

    load("prompt_lookup", base=...)                      # inference.api.NAMED_DRAFTERS
    load("lookahead:draft_nodes=31,branch_length=10", base=...)
    python -m inference generate --drafter lookahead --drafter-option draft_nodes=31 ...

Option names are the drafter's constructor keywords; values are converted to the type of the keyword's default.
"""

from __future__ import annotations

import inspect
from typing import Callable, Mapping

import torch

from inference.drafters import Drafter
from inference.lookahead import LookaheadDrafter
from inference.prompt_lookup import PromptLookupDrafter

TRAINING_FREE_DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "lookahead": LookaheadDrafter,
    "prompt_lookup": PromptLookupDrafter,
}


def build_training_free(name: str, options: Mapping[str, str]) -> Drafter:
    """Drafter `name` with `options` (key -> text). Unknown names, unknown keys and unparsable values raise
    ValueError naming the drafter and the key."""
    if name not in TRAINING_FREE_DRAFTERS:
        raise ValueError(f"unknown training-free drafter {name!r} (known: {', '.join(sorted(TRAINING_FREE_DRAFTERS))})")
    params = inspect.signature(TRAINING_FREE_DRAFTERS[name]).parameters
    kwargs = {}
    for key, text in options.items():
        if key not in params:
            raise ValueError(f"{name}: unknown option {key!r} (known: {', '.join(params)})")
        kind = type(params[key].default)
        try:
            kwargs[key] = kind(text)
        except ValueError:
            raise ValueError(f"{name}: option {key} must be {kind.__name__}, got {text!r}") from None
    return TRAINING_FREE_DRAFTERS[name](**kwargs)


def build_from_spec(spec: str, model: torch.nn.Module | None = None) -> Drafter:
    """"name" or "name:key=value,key=value" -> drafter (`model` unused: these drafters read only token ids)."""
    name, _, text = spec.partition(":")
    options = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"drafter spec {spec!r}: expected key=value, got {item!r}")
        options[key] = value
    return build_training_free(name, options)
