"""The one checkpoint writer (models.checkpoint.write_checkpoint) that save_drafter, save_model_drafter and
save_draft_model call: config skeleton per drafter_type, non-finite refusal on every path, config.json last and
absent after a failure, no temporary directory left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models.checkpoint import (
    CONFIG_NAME,
    BackboneWriter,
    CheckpointError,
    Payload,
    draftsmith_version,
    read_drafter_config,
    save_draft_model,
    save_drafter,
    save_model_drafter,
    write_checkpoint,
)
from models.medusa import MedusaConfig, MedusaHeads
from models.stopper import StopperModel, stopper_entry
from tests.data_support import tiny_tokenizer
from train.medusa2_backbone import backbone_writer

SKELETON = {"drafter_type", "base_model_name_or_path", "draftsmith_version"}
EXTRA = {"method": "unit", "global_step": 3, "command": "python -m train unit"}


def tiny_heads(seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    return MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=32, vocab_size=64))


def tiny_lm(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))


def merged(model: torch.nn.Module) -> BackboneWriter:
    return BackboneWriter("merged", lambda folder: model.save_pretrained(str(folder)), module=model)


def poisoned(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        next(module.parameters()).view(-1)[0] = float("nan")
    return module


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- the config skeleton, for each drafter_type


def check_skeleton(path: Path, drafter_type: str, backbone: str | None) -> dict:
    config = read_drafter_config(path)
    assert SKELETON <= set(config)
    assert config["drafter_type"] == drafter_type
    assert config["base_model_name_or_path"] == "org/base"
    assert config["draftsmith_version"] == draftsmith_version()
    assert config["training"] == EXTRA
    assert config.get("backbone") == (None if backbone is None else {"format": backbone, "path": "backbone"})
    card = (path / "README.md").read_text()
    assert f"# {drafter_type} drafter for org/base" in card and EXTRA["command"] in card
    assert (path / "tokenizer_config.json").is_file()
    return config


def test_skeleton_medusa(tmp_path):
    out = save_drafter(tmp_path / "m", tiny_heads(), "org/base", tokenizer=tiny_tokenizer(vocab_size=300), extra=EXTRA,
                       backbone=merged(tiny_lm()))
    config = check_skeleton(out, "medusa", "merged")
    assert config["num_heads"] == 2 and config["head_format"] == "per_head_lm_head"
    assert (out / "drafter.safetensors").is_file() and (out / "backbone" / CONFIG_NAME).is_file()


def test_skeleton_model_drafter(tmp_path):
    settings = {"block_size": 4, "init": "repeat", "drafter_type": "ignored", "base_model_name_or_path": "ignored"}
    out = save_model_drafter(tmp_path / "c", "cllm", "org/base", merged(tiny_lm()), settings=settings,
                             tokenizer=tiny_tokenizer(vocab_size=300), extra=EXTRA)
    config = check_skeleton(out, "cllm", "merged")  # the skeleton wins over same-named settings
    assert config["block_size"] == 4 and config["init"] == "repeat"
    assert not (out / "drafter.safetensors").exists()


def test_skeleton_draft_model(tmp_path):
    stopper = StopperModel(4)
    out = save_draft_model(tmp_path / "d", tiny_lm(), "org/base", tokenizer=tiny_tokenizer(vocab_size=300),
                           extra=EXTRA, stopper=stopper, stopper_config=stopper_entry(stopper, 0.5, 4))
    config = check_skeleton(out, "draft_model", None)
    assert config["draft_model"] == {"path": "draft", "model_type": "llama"} and config["vocab_size"] == 64
    assert config["stopper"]["max_gamma"] == 4
    assert (out / "draft" / "tokenizer_config.json").is_file()  # payload.tokenizer_dirs


# --- non-finite weights are refused on every path, before anything is written


def test_non_finite_refused_by_save_drafter(tmp_path):
    with pytest.raises(CheckpointError, match="non-finite"):
        save_drafter(tmp_path / "out", poisoned(tiny_heads()), "org/base")
    with pytest.raises(CheckpointError, match="non-finite"):  # a Medusa-2 backbone too
        save_drafter(tmp_path / "out", tiny_heads(), "org/base", backbone=merged(poisoned(tiny_lm())))
    assert list(tmp_path.iterdir()) == []


def test_non_finite_refused_by_save_model_drafter(tmp_path):
    with pytest.raises(CheckpointError, match="non-finite"):
        save_model_drafter(tmp_path / "out", "cllm", "org/base", merged(poisoned(tiny_lm())))
    with pytest.raises(CheckpointError, match="non-finite"):  # the writer the CLLM trainer builds
        save_model_drafter(tmp_path / "out", "cllm", "org/base", backbone_writer(poisoned(tiny_lm()), None))
    assert list(tmp_path.iterdir()) == []


def test_non_finite_refused_by_save_draft_model(tmp_path):
    with pytest.raises(CheckpointError, match="non-finite"):
        save_draft_model(tmp_path / "out", poisoned(tiny_lm()), "org/base")
    stopper = poisoned(StopperModel(4))
    with pytest.raises(CheckpointError, match="non-finite .*stopper"):
        save_draft_model(tmp_path / "out", tiny_lm(), "org/base", stopper=stopper,
                         stopper_config=stopper_entry(stopper, 0.5, 4))
    assert list(tmp_path.iterdir()) == []


# --- atomicity: config.json last, and a failed write changes nothing


def test_config_json_is_removed_first_and_moved_in_last(tmp_path, monkeypatch):
    target = tmp_path / "run"
    save_drafter(target, tiny_heads(seed=1), "org/base", tokenizer=tiny_tokenizer(vocab_size=300))
    real_replace, moved = os.replace, []

    def recording_replace(src, dst):
        if not moved:  # nothing moved yet: the old marker must already be gone
            assert not (target / CONFIG_NAME).exists()
        moved.append(Path(dst).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    save_drafter(target, tiny_heads(seed=2), "org/other", tokenizer=tiny_tokenizer(vocab_size=300))
    assert moved[-1] == CONFIG_NAME and moved.count(CONFIG_NAME) == 1
    assert {"drafter.safetensors", "README.md", "tokenizer_config.json"} <= set(moved[:-1])
    assert read_drafter_config(target)["base_model_name_or_path"] == "org/other"


def test_payload_failure_leaves_target_unchanged(tmp_path):
    target = tmp_path / "run"
    save_drafter(target, tiny_heads(seed=1), "first")
    (target / "train.log").write_text("hydra log")
    before = snapshot(target)

    def half_then_fail(folder: Path) -> None:
        (folder / "drafter.safetensors").write_bytes(b"half")
        raise RuntimeError("payload failed mid-write")

    with pytest.raises(RuntimeError, match="mid-write"):
        write_checkpoint(target, "second", Payload("medusa", write=half_then_fail), extra=EXTRA)
    assert snapshot(target) == before
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no temporary directory left


def test_failure_while_moving_in_leaves_no_config_json(tmp_path, monkeypatch):
    target = tmp_path / "run"
    save_drafter(target, tiny_heads(seed=1), "first")
    real_replace, calls = os.replace, []

    def fail_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_second)
    with pytest.raises(CheckpointError, match="No space left"):
        save_drafter(target, tiny_heads(seed=2), "second", extra=EXTRA)
    assert not (target / CONFIG_NAME).exists()  # torn: readers refuse it instead of loading a mix
    with pytest.raises(CheckpointError, match="config.json: missing"):
        read_drafter_config(target)
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
