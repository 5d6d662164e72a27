"""The built-in tiny models, `tiny` (target) and `tiny-draft` (~10x smaller draft): their names and where a finished
build lives. models/ only finds and loads them; building them (a tokenizer, pretraining, chat fine-tuning) is training,
in train/tiny_build.py, run by BUILD_COMMAND or by a `python -m train` command that uses them.

Cache layout (root: data.cache.cache_root(): $DRAFTSMITH_CACHE, else platformdirs.user_cache_dir("draftsmith")):
    <root>/models/<name>/   save_pretrained (safetensors) + tokenizer + build_info.json
A build counts iff its directory holds models.buildcache's completion marker stamped with FORMAT_VERSION: the builder
moves it in whole (models.buildcache.atomic_dir), so readers never see half a build, and a build of an older recipe
counts as not built.
"""

from __future__ import annotations

from pathlib import Path

from models.buildcache import cache_root, is_complete

BUILTIN_MODELS = ("tiny", "tiny-draft")
# The recipe's version (train/tiny_build.py); 2: recipe of session 2 (smaller batches, more steps). Older builds are
# not built, so the next build replaces them.
FORMAT_VERSION = 2
BUILD_COMMAND = "python scripts/build_tiny_models.py"
BUILD_TIME = "about 13 minutes on 2 CPU cores"  # both models and their tokenizer (docs/results.md: tiny 633 s)


def models_dir(cache_dir: Path | None = None) -> Path:
    """<root>/models, where the built-in models and their shared tokenizer live (`cache_dir` overrides the root)."""
    return (cache_root() if cache_dir is None else Path(cache_dir)) / "models"


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """The directory model `name` is built into (built or not)."""
    check_name(name)
    return models_dir(cache_dir) / name


def is_built(name: str, cache_dir: Path | None = None) -> bool:
    """Whether model `name` is complete in the cache, built by the current recipe (FORMAT_VERSION)."""
    return is_complete(model_dir(name, cache_dir), FORMAT_VERSION)


def check_name(name: str) -> None:
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {', '.join(BUILTIN_MODELS)}")
