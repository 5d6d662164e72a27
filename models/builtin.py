"""The models draftsmith provides itself, built by name, and the settings every loader shares.

`BUILDERS` maps each built-in name to the step that makes it: the tiny models it builds offline (models.tiny) and the
SmolLM2-135M-Instruct chat model it converts from a GGUF once (models.smollm2). A builder takes no string to parse:
models.refs turns "builtin:<name>" into a BuiltinRef (refusing unknown names) and calls BUILDERS[name]. Building is
an explicit step (`python scripts/build_tiny_models.py`); locating a tiny model that was never built runs that step
once, after saying so on stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from data.errors import UsageError
from models import smollm2, tiny

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
QUANTIZATIONS = (None, "none", "nf4")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")  # any one will do
TOKENIZER_COPY_FILES = (  # every file a tokenizer may consist of: what copying one takes
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
)
# Every `from_pretrained` of a causal LM passes these. With the `kernels` package installed (transformers >= 5.2x
# requires it), transformers swaps layers for kernels it fetches from the Hugging Face Hub while loading, by default:
# on a GPU without network that load fails ("could not verify publisher trust status", seen on an H200), and online it
# replaces the stock modules whose numerics the engine's exactness tests pin. draftsmith serves stock modules; its own
# kernels are inference.kernels'.
STOCK_MODULES = {"use_kernels": False}


class ModelLoadError(UsageError):
    """The model could not be found or loaded; the message names the path and the reason."""


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def has_tokenizer(folder: str | Path) -> bool:
    """Whether a model folder holds tokenizer files (any of TOKENIZER_FILES); a bare folder has weights and config
    only."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def build_tiny(name: str) -> Path:
    """The directory of tiny model `name` (a key of tiny.BUILTIN_MODELS), built here, once, when it never was, after a
    line on stderr naming the explicit build step (tokenizer, pretraining and chat fine-tuning: minutes, not
    seconds)."""
    if not tiny.is_built(name):
        print(f"builtin:{name} is not built yet: building it now, once (about 13 minutes on 2 CPU cores; "
              f"`python scripts/build_tiny_models.py` is the same step on its own)", file=sys.stderr, flush=True)
    return tiny.ensure_built(name)


def build_smollm2() -> Path:
    """SmolLM2-135M-Instruct's directory: the hub cache's snapshot, else converted once from its GGUF."""
    try:
        return smollm2.ensure_smollm2()
    except smollm2.SourceUnavailable as e:
        raise ModelLoadError(str(e)) from None


BUILDERS: dict[str, Callable[[], Path]] = {
    **{name: partial(build_tiny, name) for name in tiny.BUILTIN_MODELS},
    smollm2.NAME: build_smollm2,
}
