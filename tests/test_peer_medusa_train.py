"""scripts/peer_medusa_train.py: a feature cache as the rows FasterDecoding's Medusa trainer reads (same tokens, same
labels), and, when DRAFTSMITH_PEERS holds medusa-venv, that trainer run on them and its heads imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.features import FeatureDataset
from tests.script_support import ROOT, exit_code, load_script
from tests.test_peer_eagle3 import LENGTHS, make_cache, target_dir

PEERS = os.environ.get("DRAFTSMITH_PEERS")


@pytest.fixture
def gain() -> torch.Tensor:
    return torch.rand(16, generator=torch.Generator().manual_seed(1)) + 0.5


def test_rows_hold_the_caches_tokens_and_trained_labels(tmp_path: Path, gain: torch.Tensor,
                                                       capsys: pytest.CaptureFixture) -> None:
    cache = make_cache(tmp_path, gain)
    out = tmp_path / "medusa"
    script = load_script("peer_medusa_train")
    assert exit_code(script, ["convert", "--cache", str(cache), "--model", str(target_dir(tmp_path, gain)),
                              "--out", str(out), "--lr", "3e-3", "--medusa-python", "/venv/bin/python"]) == 0
    rows = torch.load(out / "rows.pt")
    data = FeatureDataset(cache, "train")
    assert [len(r["input_ids"]) for r in rows] == LENGTHS
    for i, row in enumerate(rows):
        item = data[i]
        assert torch.equal(row["input_ids"].long(), item["input_ids"].long())
        assert torch.equal(row["labels"].long(), item["labels"].long())  # -100 off the loss mask, else the token
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("/venv/bin/python scripts/peer_medusa_train.py train") and "--lr 0.003" in printed[0]
    assert "models.convert medusa-import" in printed[1] and printed[1].endswith(f"--base-model {tmp_path / 'target'}")


def test_convert_refuses_a_missing_cache_in_one_line(tmp_path: Path, gain: torch.Tensor,
                                                     capsys: pytest.CaptureFixture) -> None:
    script = load_script("peer_medusa_train")
    argv = ["convert", "--cache", str(tmp_path / "nowhere"), "--model", str(target_dir(tmp_path, gain)),
            "--out", str(tmp_path / "o")]
    assert exit_code(script, argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(errors) == 1 and "nowhere" in errors[0] and not (tmp_path / "o").exists()


def test_batches_pad_right_with_ignored_labels() -> None:
    script = load_script("peer_medusa_train")
    rows = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([-100, 6, 7])},
            {"input_ids": torch.tensor([8]), "labels": torch.tensor([8])}]
    batch = script.pad_right(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


@pytest.mark.skipif(not PEERS or not Path(PEERS, "medusa-venv").is_dir(),
                    reason="DRAFTSMITH_PEERS=<folder> names no medusa-venv")
def test_medusa_llm_trains_on_the_rows_and_our_import_loads_the_heads(tmp_path: Path) -> None:
    """medusa-llm's MedusaModel and CustomizedTrainer for one epoch of 3 rows on the built-in tiny target (a Llama
    with a tokenizer, which MedusaModel loads), then `models.convert medusa-import`: the draftsmith checkpoint holds
    the heads it trained, tensor for tensor."""
    from safetensors.torch import load_file

    from models.interop import load_heads
    from models.refs import locate

    target = locate("builtin:tiny")
    vocab, hidden = (json.loads((target / "config.json").read_text())[k] for k in ("vocab_size", "hidden_size"))
    gain = torch.rand(16, generator=torch.Generator().manual_seed(1)) + 0.5
    cache, out = make_cache(tmp_path, gain), tmp_path / "medusa"
    python = str(Path(PEERS, "medusa-venv", "bin", "python"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv in (
        [sys.executable, "scripts/peer_medusa_train.py", "convert", "--cache", str(cache), "--model",
         str(target), "--out", str(out), "--heads", "2"],
        [python, "scripts/peer_medusa_train.py", "train", "--rows", str(out / "rows.pt"), "--model",
         str(target), "--out", str(out / "heads"), "--heads", "2", "--batch-size", "2", "--threads", "1"],
        [sys.executable, "-m", "models.convert", "medusa-import", str(out / "heads"), str(out / "draft"),
         "--base-model", str(target)],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    original, imported = load_heads(out / "heads"), load_heads(out / "draft")
    assert imported.heads.config.num_heads == 2 and imported.heads.config.vocab_size == vocab
    mine = imported.heads.state_dict()
    assert all(torch.equal(v.float(), mine[k].float()) for k, v in original.heads.state_dict().items())
    trained = torch.load(out / "heads" / "medusa_lm_head.pt")
    head0 = trained["0.1.weight"].float()  # the full-vocabulary linear, initialised from lm_head, then trained
    weights = load_file(str(target / "model.safetensors"))
    lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()
    assert head0.shape == (vocab, hidden) and not torch.allclose(head0, lm_head)
