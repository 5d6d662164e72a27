"""The models draftsmith provides itself, located by name, and the settings every loader shares.

`BUILTINS` maps each built-in name to the function that gives its directory: the tiny models (models.tiny), found
where their build left them, and the SmolLM2-135M-Instruct chat model, converted from a GGUF once on first use
(models.smollm2). None takes a string to parse: models.refs turns "builtin:<name>" into a BuiltinRef (refusing
unknown names) and calls BUILTINS[name]. Building a tiny model is training (train/tiny_build.py), which models/ never
runs: locating one that was never built fails at once, with one line naming the step that builds it
(`python scripts/build_tiny_models.py`, or any `python -m train` command that uses it).
"""

from __future__ import annotations

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


def locate_tiny(name: str) -> Path:
    """The directory of the built tiny model `name` (a key of tiny.BUILTIN_MODELS). ModelLoadError when it was never
    built (or by an older recipe): building takes minutes of training, which is not a loader's to start."""
    if not tiny.is_built(name):
        raise ModelLoadError(f"builtin:{name} is not built: run `{tiny.BUILD_COMMAND}` once ({tiny.BUILD_TIME}), or "
                             f"any `python -m train` command that uses it (e.g. +model=tiny, or tiny-draft as "
                             f"method.draft), which builds it first")
    return tiny.model_dir(name)


def build_smollm2() -> Path:
    """SmolLM2-135M-Instruct's directory: the hub cache's snapshot, else converted once from its GGUF."""
    try:
        return smollm2.ensure_smollm2()
    except smollm2.SourceUnavailable as e:
        raise ModelLoadError(str(e)) from None


BUILTINS: dict[str, Callable[[], Path]] = {
    **{name: partial(locate_tiny, name) for name in tiny.BUILTIN_MODELS},
    smollm2.NAME: build_smollm2,
}
