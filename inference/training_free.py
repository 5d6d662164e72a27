"""Drafters by name: no checkpoint, any base model, options as text (the registry `load` and the CLI read).

    load("prompt_lookup", base=...)
    load("lookahead:draft_nodes=31,branch_length=10", base=...)
    load("jacobi:n=32,init=pad", base=...)           # Jacobi decoding of the target itself
    python -m inference generate --drafter lookahead --drafter-option draft_nodes=31 ...

Specs are parsed once (inference.drafter_spec). lookahead's and prompt_lookup's option names are their constructor
keywords, values converted to the type of the keyword's default; jacobi takes n (block size), init and seed.
Checkpoint drafters (a config.json naming a drafter_type) are inference.api.DRAFTER_BUILDERS.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable, Mapping

import torch

from data.errors import UsageError
from inference.drafter_spec import DrafterSpec
from inference.drafters import Drafter
from inference.jacobi import JacobiDrafter, JacobiOptions
from inference.lookahead import LookaheadDrafter
from inference.prompt_lookup import PromptLookupDrafter

# Drafters whose options are their constructor's keywords.
KEYWORD_DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "lookahead": LookaheadDrafter,
    "prompt_lookup": PromptLookupDrafter,
}


def build_training_free(name: str, options: Mapping[str, str]) -> Drafter:
    """Drafter `name` of KEYWORD_DRAFTERS with `options` (key -> text). Unknown names, unknown keys and unparsable
    values raise UsageError naming the drafter and the key."""
    if name not in KEYWORD_DRAFTERS:
        raise UsageError(f"unknown training-free drafter {name!r} (known: {', '.join(sorted(KEYWORD_DRAFTERS))})")
    params = inspect.signature(KEYWORD_DRAFTERS[name]).parameters
    kwargs = {}
    for key, text in options.items():
        if key not in params:
            raise UsageError(f"{name}: unknown option {key!r} (known: {', '.join(params)})")
        kind = type(params[key].default)
        try:
            kwargs[key] = kind(text)
        except ValueError:
            raise UsageError(f"{name}: option {key} must be {kind.__name__}, got {text!r}") from None
    return KEYWORD_DRAFTERS[name](**kwargs)


def _keyword(spec: DrafterSpec, model: torch.nn.Module | None) -> Drafter:
    return build_training_free(spec.name, dict(spec.options))  # these drafters read only token ids


def _jacobi(spec: DrafterSpec, model: torch.nn.Module | None) -> Drafter:
    pad = 0 if model is None else model.config.pad_token_id or 0
    return JacobiDrafter(JacobiOptions.from_spec(spec), pad_token_id=pad)


NAMED_DRAFTERS: dict[str, Callable[[DrafterSpec, torch.nn.Module | None], Drafter]] = {
    "jacobi": _jacobi,
    **dict.fromkeys(KEYWORD_DRAFTERS, _keyword),
}


def named_spec(text: str | Path | None) -> DrafterSpec | None:
    """The spec when `text` names a registered drafter (and is not an existing path), else None: the one test that
    tells a drafter name from a checkpoint or model path."""
    if not isinstance(text, str) or Path(text).exists():
        return None
    spec = DrafterSpec.parse(text) if text.partition(":")[0] in NAMED_DRAFTERS else None
    return spec


def build_from_spec(spec: str | DrafterSpec, model: torch.nn.Module | None = None) -> Drafter:
    """"name" or "name:key=value,key=value" -> the registered drafter (`model`: the target, for drafters that read
    its config)."""
    spec = DrafterSpec.parse(spec) if isinstance(spec, str) else spec
    if spec.name not in NAMED_DRAFTERS:
        raise UsageError(f"unknown drafter {spec.name!r} (known: {', '.join(sorted(NAMED_DRAFTERS))})")
    return NAMED_DRAFTERS[spec.name](spec, model)
