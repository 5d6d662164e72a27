"""Optional dependencies: the extra of pyproject.toml that brings each, and the one line that names it when a feature
needs a package that is not installed.

The core install (`pip install -e .`) serves every drafter and trains on one process in full precision; the heavy or
platform-specific packages come with extras. Checks run where a setting is read (a config key, a flag, a data
source), before any model loads, so a missing package costs one line, not a crash halfway through a run. Only
`importlib.util.find_spec` runs here: nothing is imported.
"""

from __future__ import annotations

import importlib.util

from data.errors import UsageError

# module -> the pyproject.toml extra that installs it ([train] brings all four training ones; [dev] all of them)
EXTRA_OF = {
    "bitsandbytes": "qlora",  # 4-bit NF4 targets and backbones (QLoRA, medusa1 on NF4, serving NF4)
    "deepspeed": "deepspeed",  # DeepSpeed ZeRO (conf/deepspeed)
    "wandb": "wandb",  # logger=wandb
    "datasets": "hub",  # hub datasets and `datasets.save_to_disk` folders as data.path
    "matplotlib": "plots",  # bench --plot
    "llama_cpp": "llamacpp",  # bench --baselines llama_cpp (built from source on install: minutes)
}


class MissingExtra(UsageError):
    """A feature was asked for whose optional package is not installed."""


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require(module: str, feature: str) -> None:
    """Raise MissingExtra naming `feature` (the flag or config key that asked for it) and the extra to install."""
    if installed(module):
        return
    extra = EXTRA_OF[module]
    raise MissingExtra(f"{feature} needs {module}, which is not installed: pip install -e '.[{extra}]' in the "
                       f"draftsmith checkout (or pip install {module})")
