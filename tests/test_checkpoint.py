"""The drafter checkpoint format: round trip, atomic replacement, clear errors."""

import json
import os

import pytest
import torch
from transformers import LlamaConfig

from models.checkpoint import (
    CheckpointError,
    DrafterMismatchError,
    check_compatible,
    head_vocabulary,
    load_drafter,
    read_drafter_config,
    save_drafter,
)
from models.medusa import MedusaConfig, MedusaHeads


def random_heads(share=False, seed=0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=8, vocab_size=11, share_lm_head=share))
    for p in heads.parameters():
        torch.nn.init.normal_(p)
    return heads


@pytest.mark.parametrize("share", [False, True])
def test_round_trip(tmp_path, share):
    heads = random_heads(share)
    save_drafter(tmp_path / "ckpt", heads, "org/base", extra={"method": "medusa1", "command": "python -m train medusa1"})
    loaded = load_drafter(tmp_path / "ckpt")
    assert loaded.config["drafter_type"] == "medusa"
    assert loaded.config["base_model_name_or_path"] == "org/base"
    assert loaded.config["head_format"] == ("shared_lm_head" if share else "per_head_lm_head")
    assert loaded.heads.config == heads.config
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.heads.state_dict().items()):
        assert torch.equal(a, b), name
    card = (tmp_path / "ckpt" / "README.md").read_text()
    assert "org/base" in card and "python -m train medusa1" in card


def test_overwrite_keeps_other_files_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "run"
    target.mkdir()
    (target / "train.log").write_text("log")
    save_drafter(target, random_heads(seed=1), "a")
    save_drafter(target, random_heads(seed=2), "b")
    assert (target / "train.log").read_text() == "log"
    assert read_drafter_config(target)["base_model_name_or_path"] == "b"
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_failed_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "run"
    save_drafter(target, random_heads(seed=1), "first")

    def boom(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("models.checkpoint.save_file", boom)
    with pytest.raises(CheckpointError, match="No space"):  # a storage failure is a one-line user error
        save_drafter(target, random_heads(seed=2), "second")
    assert read_drafter_config(target)["base_model_name_or_path"] == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_torn_checkpoint_is_refused(tmp_path):
    target = tmp_path / "run"
    save_drafter(target, random_heads(), "a")
    os.remove(target / "config.json")
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_drafter(target)


def test_corrupted_weights_and_config(tmp_path):
    target = tmp_path / "run"
    save_drafter(target, random_heads(), "a")
    (target / "drafter.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="drafter.safetensors: unreadable"):
        load_drafter(target)
    (target / "config.json").write_text('{"drafter_type": "medusa", "num_he')
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        load_drafter(target)


def test_shape_mismatch_names_the_file(tmp_path):
    target = tmp_path / "run"
    save_drafter(target, random_heads(), "a")
    config = json.loads((target / "config.json").read_text())
    config["hidden_size"] = 9
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="do not match config.json"):
        load_drafter(target)


def test_check_compatible():
    config = {"hidden_size": 8, "vocab_size": 11, "base_model_name_or_path": "org/base"}
    check_compatible(config, LlamaConfig(hidden_size=8, vocab_size=11, num_attention_heads=2))
    with pytest.raises(DrafterMismatchError, match="hidden_size=8 does not match .* hidden_size=16"):
        check_compatible(config, LlamaConfig(hidden_size=16, vocab_size=11, num_attention_heads=2))
    with pytest.raises(DrafterMismatchError, match="vocab_size"):
        check_compatible(config, LlamaConfig(hidden_size=8, vocab_size=12, num_attention_heads=2))


def test_token_counts_give_the_head_vocabulary(tmp_path):
    heads = random_heads()
    counts = torch.tensor([0, 5, 2, 9, 5, 0, 1, 0, 0, 3, 0])
    save_drafter(tmp_path / "ckpt", heads, "org/base", token_counts=counts)
    assert head_vocabulary(tmp_path / "ckpt", 4, topk=2).tolist() == [3, 1, 4, 9]  # most frequent first, ties by id
    with pytest.raises(CheckpointError, match="head_vocab=12"):
        head_vocabulary(tmp_path / "ckpt", 12, topk=2)
    with pytest.raises(CheckpointError, match="head_vocab=1"):
        head_vocabulary(tmp_path / "ckpt", 1, topk=2)
    save_drafter(tmp_path / "plain", heads, "org/base")
    with pytest.raises(CheckpointError, match="token_counts.safetensors: missing"):
        head_vocabulary(tmp_path / "plain", 4, topk=2)
    with pytest.raises(CheckpointError, match="expected \\(11,\\)"):
        save_drafter(tmp_path / "bad", heads, "org/base", token_counts=counts[:5])
    assert not (tmp_path / "bad").exists()
