"""Helpers shared by the feature-cache tests (tests/test_features.py, tests/test_features_self_distill.py) and
tests/test_eagle3_teacher.py: a tiny saved target, a chat data file, `python -m train features` run on them, the
module's fp32 cache with k = V soft labels, and a cache's shards read back."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.model_support import save_tiny_model
from tests.data_support import random_chats, write_sharegpt

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / "llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    chats = random_chats(32, user=lambda i: 3 + i % 5, reply=lambda i: 6 + i % 9)
    return write_sharegpt(tmp_path_factory.mktemp("data") / "chats.json", chats)


def run(cmd: list[str], expect_ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    if expect_ok:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def extract(model_dir: Path, data: Path, out: Path, *overrides: str, launcher: tuple[str, ...] = (sys.executable, "-m", "train"),
            expect_ok: bool = True) -> subprocess.CompletedProcess:
    return run([*launcher, "features", "+model=tiny", f"model.path={model_dir}", "model.dtype=fp32", "data=sharegpt",
                "data.self_distill=false", f"data.path={data}", "data.validation_fraction=0.25", "method.dtype=fp32",
                "method.shard_tokens=200", "method.batch_tokens=160", "logger=none", f"output_dir={out}", *overrides],
               expect_ok)


@pytest.fixture(scope="module")
def full_cache(model_dir, data_file, tmp_path_factory) -> Path:
    """fp32 states, the whole vocabulary as soft labels (k = V), two extra layers (the last: after the final norm)."""
    out = tmp_path_factory.mktemp("cache") / "full"
    extract(model_dir, data_file, out, "method.topk=400", "method.layers=[1,2]")
    return out


def shard_tensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    shards = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            shards[path.name] = {k: f.get_tensor(k) for k in f.keys()}
    return shards
