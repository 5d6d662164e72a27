"""Helpers for the Medusa-2 tests: the composed training config, as `python -m train medusa2 +model=tiny` builds it."""

from __future__ import annotations

from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from train.config import register_configs


def medusa2_config(*overrides: str) -> DictConfig:
    """The full training config for method medusa2 on model "tiny", with Hydra `overrides` applied."""
    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="train", overrides=["method=medusa2", "+model=tiny", "logger=none", "data.self_distill=false", *overrides])
