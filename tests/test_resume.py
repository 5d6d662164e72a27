"""Resume exactness: a run interrupted after a checkpoint and resumed with resume_from_checkpoint=auto ends with the
same heads, bit for bit, as the uninterrupted run; torn checkpoints are never resumed from.

The interruption here is a copy of the uninterrupted run's early checkpoint (what a killed run leaves behind) next to
a torn later one; scripts/fault_inject.py does the same with real SIGKILLs at random moments.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from safetensors.torch import load_file

from tests.model_support import save_tiny_model
from train.config import register_configs
from train.resume import checkpoint_problem, resolve_resume
from train.task import run
from tests.data_support import random_chats, write_sharegpt



@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("resume")
    return save_tiny_model(root / "model"), write_sharegpt(root / "chats.json", random_chats(10), ids=False)


METHODS = {"medusa1": ("method.num_heads=2",), "eagle3": ("method.ttt_steps=2", "method.draft_vocab=40")}


def configure(model: Path, data: Path, out: Path, *overrides: str, method: str = "medusa1"):
    """7 steps of 4 samples over 10 records (3 steps per epoch): the run crosses epoch boundaries, so the data order
    must survive too, and ends mid-epoch."""
    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="train", overrides=[
            f"method={method}", *METHODS[method], "+model=tiny", f"model.path={model}", "model.dtype=fp32", "data=sharegpt", "data.self_distill=false",
            f"data.path={data}", "data.max_length=48", "data.validation_fraction=0", "training.max_steps=7",
            "training.save_steps=2", "training.save_total_limit=null", "training.per_device_train_batch_size=4",
            "training.logging_steps=1", "eval.greedy_prompts=0", "logger=none",
            f"output_dir={out}", *overrides,
        ])


def heads(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "drafter.safetensors")


def losses(checkpoint: Path) -> dict[int, float]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_interrupted_then_resumed_equals_uninterrupted(inputs, tmp_path, caplog, single_thread, method):
    caplog.set_level(logging.INFO, logger="draftsmith")
    model, data = inputs
    config = functools.partial(configure, method=method)
    full = tmp_path / "full"
    run(config(model, data, full))
    done = full / "checkpoints"

    # HF Trainer writes trainer_state.json after everything else in a checkpoint: checkpoint_problem relies on it.
    for checkpoint in done.glob("checkpoint-*"):
        written_last = (checkpoint / "trainer_state.json").stat().st_mtime_ns
        assert all(f.stat().st_mtime_ns <= written_last for f in checkpoint.iterdir()), checkpoint

    # What a run killed while saving step 4 leaves: checkpoint-2 complete, checkpoint-4 without trainer_state.json.
    resumed = tmp_path / "resumed"
    shutil.copytree(done / "checkpoint-2", resumed / "checkpoints" / "checkpoint-2")
    shutil.copytree(done / "checkpoint-4", resumed / "checkpoints" / "checkpoint-4")
    (resumed / "checkpoints" / "checkpoint-4" / "trainer_state.json").unlink()
    run(config(model, data, resumed, "training.resume_from_checkpoint=auto"))

    assert f"not resuming from {resumed / 'checkpoints' / 'checkpoint-4'}" in caplog.text
    assert f"resuming from {resumed / 'checkpoints' / 'checkpoint-2'}" in caplog.text
    assert "training: 5 steps," in caplog.text  # its throughput counts the steps it trained, not the checkpoint's
    expected, got = heads(full), heads(resumed)
    assert any(not torch.equal(expected[k], heads(done / "checkpoint-2")[k]) for k in expected)  # it trained on
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    final = resumed / "checkpoints" / "checkpoint-7"
    assert checkpoint_problem(final) is None and checkpoint_problem(resumed / "checkpoints" / "checkpoint-4") is None
    assert losses(final) == losses(done / "checkpoint-7")  # the same batches, in the same order, after the resume

    # Killed after the last checkpoint (e.g. during the final save): resuming trains no step past max_steps.
    (resumed / "config.json").unlink()
    run(config(model, data, resumed, "training.resume_from_checkpoint=auto"))
    assert sorted(p.name for p in (resumed / "checkpoints").glob("checkpoint-*"))[-1] == "checkpoint-7"
    training = json.loads((resumed / "config.json").read_text())["training"]
    assert training["global_step"] == 7
    assert training["throughput"]["steps"] == 0 and training["throughput"]["tokens"] == 0  # nothing trained here
    assert all(torch.equal(expected[k], heads(resumed)[k]) for k in expected)


def _checkpoint(root: Path, step: int, config: bool = True, state: str | None = '{"global_step": 0}') -> Path:
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if config:
        (path / "config.json").write_text('{"drafter_type": "medusa"}')
    if state is not None:
        (path / "trainer_state.json").write_text(state)
    return path


def test_auto_resume_skips_torn_checkpoints(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    _checkpoint(folder, 2)
    complete = _checkpoint(folder, 4)
    _checkpoint(folder, 6, state=None)  # killed before Trainer wrote its state
    _checkpoint(folder, 8, state='{"global_step": 8, "log_hist')  # killed while writing it
    _checkpoint(folder, 10, config=False)  # killed while the weights were being moved in
    _checkpoint(folder, 12, state='{"log_history": []}')
    stale = [folder / ".checkpoint-14.tmp-x1y2", tmp_path / ".run.tmp-a1b2"]  # killed atomic writes
    kept = tmp_path / ".other-run.tmp-c3d4"  # another output's
    for path in (*stale, kept):
        path.mkdir()
    assert resolve_resume("auto", folder) == str(complete)
    assert not any(p.exists() for p in stale) and kept.exists()
    assert resolve_resume("none", folder) is None and resolve_resume(None, folder) is None


def test_auto_resume_without_checkpoints_starts_fresh(tmp_path):
    assert resolve_resume("auto", tmp_path / "never-created") is None
    _checkpoint(tmp_path, 3, state=None)
    assert resolve_resume("auto", tmp_path) is None
