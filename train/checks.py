"""Settings whose type is right but whose value is not: a numeric range (train.config.RANGES), a
self-distillation setup that cannot work, an output folder that cannot be written. Each fails in one line naming
the key, before Hydra starts (train.cli) and again in each job of a multirun (train.task), not deep in the run."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from data.errors import UsageError
from data.extras import require
from data.paths import check_writable_dir
from data.readers import missing_source
from train import config as schema


def check_values(cfg: DictConfig, asked: Sequence[str] = ()) -> None:
    """Settings whose type is right but whose value is not (a numeric range of train.config.RANGES, ...; choices are
    Enum-typed in the schema, so composition refuses them): fail here, naming the key, not deep in the run. Run
    before Hydra starts, and again by each job of a multirun. `asked`: the keys the command line set."""
    problem = schema.out_of_range(cfg)
    if problem:
        raise UsageError(problem)
    check_extras(cfg, asked)
    check_features(cfg)
    check_self_distill(cfg)
    check_output_dir(cfg.output_dir)


def check_extras(cfg: DictConfig, asked: Sequence[str] = ()) -> None:
    """The optional packages the settings ask for (data.extras): one line naming the key and the extra to install.
    The default logger (wandb) is the exception: without wandb, a run not asking for it on the command line logs to
    the console (train.logger.configure_logger says so in one line)."""
    if OmegaConf.select(cfg, "model.quantization") == "nf4":
        require("bitsandbytes", "model.quantization=nf4")
    if OmegaConf.select(cfg, "deepspeed.config") is not None:
        require("deepspeed", f"deepspeed={OmegaConf.select(cfg, 'deepspeed.name')}")
    if OmegaConf.select(cfg, "logger.name") == "wandb" and any(k.startswith("logger") for k in asked):
        require("wandb", "logger=wandb")


# Methods that train on their own samples (train.method.ProvidesData: cllm's Jacobi trajectories), so `data`'s
# self-distillation never runs for them. Named here, not found by importing the methods: these checks run before
# Hydra prints a config and must not import the Trainer; tests/test_train_cllm.py checks the list against the classes.
OWN_DATA_METHODS = frozenset({"cllm"})


def brings_own_data(method_name: str) -> bool:
    """Whether a model config's data recipe (+model=smollm2 selects data=instructions with self_distill on) is moot
    for the method, so its settings must not be refused for it."""
    return method_name in OWN_DATA_METHODS


# Methods whose drafter trains from the target's stored features alone (data.features, a `features` cache).
FEATURE_READERS = frozenset({"medusa1", "eagle3"})


def check_features(cfg: DictConfig) -> None:
    """The feature cache: `features` writes one (from the data's text, or from the target's own answers under
    data.self_distill); a FEATURE_READERS method reads one (data.features)."""
    reading = OmegaConf.select(cfg, "data.features")
    self_distill = OmegaConf.select(cfg, "data.self_distill", default=False)
    if cfg.method.name == "features":
        if reading:
            raise UsageError("data.features: the features method writes a cache to output_dir and reads none; "
                             "drop data.features")
        return
    if not reading:
        return
    if cfg.method.name not in FEATURE_READERS:
        raise UsageError(f"data.features: {cfg.method.name} trains from the target's own forward and reads no "
                         f"feature cache (methods that do: {', '.join(sorted(FEATURE_READERS))})")
    if not Path(reading).expanduser().is_dir():
        raise UsageError(f"data.features={reading}: no such directory (make it with `python -m train features "
                         f"+model=<name> data=<recipe> output_dir={reading}`)")
    if self_distill:
        raise UsageError("data.features with data.self_distill=true: the cache holds the text it was made from; "
                         "pass data.self_distill=false (or data=sharegpt_v3)")


def check_data_sources(cfg: DictConfig) -> None:
    """data.path and data.validation_path, where the run reads them: a local file or folder that is not there fails
    when the run starts (train.cli.run_task), before the Trainer is imported or the tokenizer loads, not when the
    config is only printed (`--cfg job`: a model config may name a file the user has yet to fetch).
    data.readers.missing_source: named sources and hub dataset ids pass; what they hold is checked when read."""
    if OmegaConf.select(cfg, "data.features") or brings_own_data(cfg.method.name) \
            or OmegaConf.select(cfg, "data.format") == "builtin":
        return
    for key in ("path", "validation_path"):
        value = OmegaConf.select(cfg, f"data.{key}")
        if value is not None and missing_source(str(value)):
            raise UsageError(f"data.{key}={value}: no such file or directory")


def check_self_distill(cfg: DictConfig) -> None:
    """data.self_distill generates with the target before training: refuse the setups where that cannot work."""
    if not OmegaConf.select(cfg, "data.self_distill", default=False) or brings_own_data(cfg.method.name):
        return
    if cfg.model.quantization == "nf4" and cfg.method.name != "medusa1":
        # Generating through a 4-bit model that is trained afterwards silently kills its gradients on CPU.
        raise UsageError(f"data.self_distill=true with model.quantization=nf4 is only for medusa1 (frozen backbone); "
                         f"for {cfg.method.name} write the data first with scripts/self_distill.py")


def check_output_dir(output_dir: str) -> None:
    """The nearest existing ancestor of output_dir must be a writable directory (a file in the way fails here,
    before Hydra creates the run directory)."""
    check_writable_dir(output_dir, "output_dir")
