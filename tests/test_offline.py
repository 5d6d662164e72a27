"""Security and offline guarantees: the suite cannot reach the network, remote code stays off unless asked for,
drafter checkpoints hold no pickle."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import yaml

from tests.conftest import OFFLINE_ENV, NetworkAccessError

ROOT = Path(__file__).resolve().parents[1]


def test_hub_libraries_run_offline():
    import datasets.config
    import huggingface_hub.constants

    assert {k: os.environ.get(k) for k in OFFLINE_ENV} == OFFLINE_ENV
    assert huggingface_hub.constants.is_offline_mode()  # read once at import: conftest set it before that
    assert datasets.config.HF_HUB_OFFLINE


def test_non_loopback_connection_fails_the_test(network_attempts):
    with pytest.raises(NetworkAccessError, match="connect to 192.0.2.1:443 blocked"):
        socket.create_connection(("192.0.2.1", 443), timeout=1)  # TEST-NET-1: never routed
    with pytest.raises(NetworkAccessError, match="name lookup of huggingface.co blocked"):
        socket.create_connection(("huggingface.co", 443), timeout=1)
    with pytest.raises(NetworkAccessError):
        socket.socket(socket.AF_INET6).connect_ex(("2001:db8::1", 80, 0, 0))
    # Recorded even when a library swallows the exception: the autouse fixture then fails the test.
    assert network_attempts == ["connect to 192.0.2.1:443", "name lookup of huggingface.co", "connect to 2001:db8::1:80"]
    network_attempts.clear()  # provoked on purpose


def test_a_swallowed_attempt_still_fails_the_test(tmp_path: Path):
    """A library that catches the guard's exception (here: `except Exception`) cannot hide the attempt."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import socket\n"
        "def test_swallows():\n"
        "    try:\n"
        "        socket.create_connection(('192.0.2.1', 80), timeout=1)\n"
        "    except Exception:\n"
        "        pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider", str(probe)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 1, result.stdout[-2000:]
    assert "test tried to reach the network: connect to 192.0.2.1:80" in result.stdout


def test_loopback_stays_allowed():
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname(), timeout=5):
            conn, _ = server.accept()
            conn.close()


def test_hub_lookup_fails_without_touching_the_network(network_attempts):
    from transformers import AutoConfig

    with pytest.raises(OSError):
        AutoConfig.from_pretrained("draftsmith-tests/no-such-model")
    assert network_attempts == []


def test_remote_code_is_off_unless_set():
    import inspect

    from inference.api import load
    from models.loading import load_target, load_tokenizer
    from train.config import ModelConfig

    assert ModelConfig.trust_remote_code is False
    for fn in (load_target, load_tokenizer, load):
        assert inspect.signature(fn).parameters["trust_remote_code"].default is False
    for path in resources.files("conf").joinpath("model").iterdir():
        if path.name.endswith(".yaml"):
            assert yaml.safe_load(path.read_text()).get("trust_remote_code", False) is False, path.name


def test_loaders_keep_stock_modules_and_fetch_no_hub_kernels(tmp_path: Path, monkeypatch):
    """transformers kernelizes every from_pretrained by default when the `kernels` package is installed: on a GPU that
    fetches layers from the Hub (offline: the load fails, as it did on an H200) and swaps out the stock modules the
    engine's exactness is tested on. The target loader and the early-exit cut switch it off."""
    from transformers import AutoModelForCausalLM

    from models.early_exit import build_early_exit_draft
    from models.loading import load_target
    from tests.model_support import save_tiny_model

    folder = save_tiny_model(tmp_path / "model")
    assert AutoModelForCausalLM.from_pretrained(folder).use_kernels  # the library's default: what is switched off
    assert load_target(str(folder), dtype="fp32").use_kernels is False
    seen = []
    original = AutoModelForCausalLM.from_pretrained.__func__
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **kw: seen.append(kw.get("use_kernels")) or original(cls, *a, **kw)))
    build_early_exit_draft(folder, 1, tmp_path / "cut")
    assert seen == [False]


def test_drafter_checkpoint_is_safetensors_only(tmp_path: Path):
    import torch

    from models.checkpoint import save_drafter
    from models.medusa import MedusaConfig, MedusaHeads
    from tests.data_support import tiny_tokenizer

    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=32, vocab_size=400))
    torch.nn.init.normal_(heads.heads[0].lm_head.weight)
    out = save_drafter(tmp_path / "heads", heads, "base", tokenizer=tiny_tokenizer())
    pickles = [p.name for p in out.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt")]
    assert pickles == [] and (out / "drafter.safetensors").is_file()
