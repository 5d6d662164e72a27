"""Helpers shared by the bad-input tests (tests/test_bad_inputs.py, tests/test_bad_inputs_entry_points.py): the
corpus folder, a test's workspace, the composed training config, tiny Medusa heads and a saved 2-head run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from models.checkpoint import save_drafter
from models.medusa import MedusaConfig, MedusaHeads
from tests.model_support import save_tiny_model
from train.config import register_configs

CASES_DIR = Path(__file__).parent / "bad_inputs"
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Workspace:
    tmp: Path  # the test's own temporary folder
    model: Path  # a saved tiny random model (shared: copy it before damaging it)


def composed(method: str, *overrides: str):
    """The run's config, as `python -m train <method> +model=tiny <overrides>` composes it."""
    from hydra import compose, initialize_config_module

    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="train", overrides=[f"method={method}", "+model=tiny", *overrides])


def two_head_run(out: Path, *overrides: str) -> Path:
    """An output_dir holding a trainer checkpoint of a 2-head medusa1 run (config `overrides`); returns it."""
    from omegaconf import OmegaConf

    saved = composed("medusa1", "method.num_heads=2", f"output_dir={out}", *overrides)
    checkpoint = save_drafter(out / "checkpoints" / "checkpoint-4", tiny_heads(num_heads=2), saved.model.path,
                              extra={"config": OmegaConf.to_container(saved, resolve=True), "global_step": 4})
    (checkpoint / "trainer_state.json").write_text('{"global_step": 4}')
    return out


def tiny_heads(num_heads: int = 2, hidden_size: int = 32, vocab_size: int = 50) -> MedusaHeads:
    torch.manual_seed(0)
    return MedusaHeads(MedusaConfig(num_heads=num_heads, num_layers=1, hidden_size=hidden_size, vocab_size=vocab_size))


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bad-inputs") / "model")
