"""Model names draftsmith resolves itself, and the settings every loader shares.

"builtin:<name>" names a model draftsmith provides: the tiny models it builds offline (models.tiny) and the
SmolLM2-135M-Instruct chat model it converts from a GGUF once (models.smollm2). "early_exit:<model>:<N>" (the first
N layers of <model>, models.early_exit) is resolved one level up, in models.loading, because cutting a model needs
this module's resolution of <model> first. Building is an explicit step (`python scripts/build_tiny_models.py`);
resolving a built-in name that was never built runs that step once, after saying so on stderr.
"""

from __future__ import annotations

import sys
from importlib import resources
from typing import Any

import torch
from omegaconf import OmegaConf

from data.errors import UsageError
from models import smollm2, tiny

BUILTIN_PREFIX = "builtin:"
EARLY_EXIT_PREFIX = "early_exit:"
MODEL_PREFIXES = (BUILTIN_PREFIX, EARLY_EXIT_PREFIX)  # model names draftsmith resolves itself (not paths or hub ids)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
QUANTIZATIONS = (None, "none", "nf4")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")  # any one will do
TOKENIZER_COPY_FILES = (  # every file a tokenizer may consist of: what copying one takes
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
)


class ModelLoadError(UsageError):
    """The model could not be found or loaded; the message names the path and the reason."""


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def model_settings(name: str) -> dict[str, Any]:
    """A conf/model/<name>.yaml's path, dtype and chat_template (`builtin:<name>` reads conf/model/<name>.yaml when
    that file's path is the same builtin); anything else (a directory, hub id, other builtin) as a path with no
    settings. The one place command-line tools turn `--model vicuna7b` / `--base tiny` into a model."""
    builtin = name.startswith(BUILTIN_PREFIX)
    conf = resources.files("conf").joinpath("model", f"{name.removeprefix(BUILTIN_PREFIX)}.yaml")
    if (not builtin and "/" in name) or not conf.is_file():
        return {"path": name, "dtype": None, "chat_template": None}
    c = OmegaConf.load(str(conf))
    model = c.model if "model" in c else c  # tiny.yaml is a global package: its model keys sit under `model`
    if builtin and str(model.path) != name:
        return {"path": name, "dtype": None, "chat_template": None}
    return {"path": str(model.path), "dtype": model.get("dtype"), "chat_template": model.get("chat_template")}


def resolve_builtin(name_or_path: str) -> str:
    """The directory of "builtin:<name>"; any other string unchanged. SmolLM2 is found in the hub cache or converted
    once from its GGUF; a tiny model that was never built is built here, once, after a line on stderr naming the
    explicit build step (tokenizer, pretraining and chat fine-tuning: minutes, not seconds)."""
    if not name_or_path.startswith(BUILTIN_PREFIX):
        return name_or_path
    name = name_or_path[len(BUILTIN_PREFIX):]
    if name == smollm2.NAME:
        try:
            return str(smollm2.ensure_smollm2())
        except smollm2.SourceUnavailable as e:
            raise ModelLoadError(str(e)) from None
    if name not in tiny.BUILTIN_MODELS:
        choices = ", ".join(BUILTIN_PREFIX + n for n in (*tiny.BUILTIN_MODELS, smollm2.NAME))
        raise ModelLoadError(f"unknown built-in model {name_or_path!r}; choose one of {choices}")
    if not tiny.is_built(name):
        print(f"{name_or_path} is not built yet: building it now, once (about 13 minutes on 2 CPU cores; "
              f"`python scripts/build_tiny_models.py` is the same step on its own)", file=sys.stderr, flush=True)
    return str(tiny.ensure_built(name))
