"""Original-Medusa import and vLLM export: the heads' logits are identical at every stage.

Each case writes a checkpoint in the original repository's layout from random heads built here the way the reference
builds them (a ModuleList of Sequential(ResBlock x L, Linear)), then compares, on the same hidden states:
reference → import_medusa → load_heads(original dir) → draftsmith checkpoint → vLLM layout read back by a loader
written here to vLLM's Medusa spec.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from models.checkpoint import CheckpointError, load_drafter, read_drafter_config, save_drafter
from models.convert import main as convert_main
from models.interop import convert_medusa, export_vllm, import_medusa, load_heads
from models.medusa import MedusaConfig, MedusaHeads
from tests.data_support import tiny_tokenizer
from tests.model_support import save_tiny_model

D = 32


class OriginalResBlock(nn.Module):
    """The reference ResBlock's parameter names and math: x + SiLU(linear(x))."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def original_heads(K: int, L: int, V: int, shared: bool, repeat_block: bool, seed: int = 0) -> nn.ModuleList:
    """The reference's `medusa_head`; repeat_block=True reproduces its `[ResBlock(d)] * L` (one block, L times)."""
    torch.manual_seed(seed)
    heads = []
    for _ in range(K):
        blocks = [OriginalResBlock(D)] * L if repeat_block else [OriginalResBlock(D) for _ in range(L)]
        projection = [] if shared else [nn.Linear(D, V, bias=False)]
        heads.append(nn.Sequential(*blocks, *projection))
    for p in nn.ModuleList(heads).parameters():
        nn.init.normal_(p, std=0.5)
    return nn.ModuleList(heads)


def write_original(directory: Path, heads: nn.ModuleList, fmt: str, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    state = heads.state_dict()
    if fmt == "safetensors":
        save_file({k: v.clone().contiguous() for k, v in state.items()}, str(directory / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, directory / "medusa_lm_head.pt")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


class VllmResidualBlock(nn.Module):
    """vLLM's ResidualBlock: `layers` Linear(D, D, bias=config.medusa_fc_bias or False); x = x + SiLU(layer(x))."""

    def __init__(self, config: dict, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        bias = config.get("medusa_fc_bias", False)
        self.layers = nn.ModuleList([nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class VllmMedusa(nn.Module):
    """vLLM's Medusa model as its config class and load_weights read a directory (config.json + *.safetensors)."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        config = json.loads((directory / "config.json").read_text())
        for key in list(config):  # vLLM's MedusaConfig.from_pretrained renaming
            if "num" in key and "heads" in key:
                config["num_heads"] = config.pop(key)
            elif "num" in key and "layers" in key:
                config["num_hidden_layers"] = config.pop(key)
        assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
        assert config["truncated_vocab_size"] == config["vocab_size"]  # no token_map
        D, V, K = config["hidden_size"], config["truncated_vocab_size"], config["num_heads"]
        self.blocks = nn.ModuleList([VllmResidualBlock(config, D, config["num_hidden_layers"]) for _ in range(K)])
        self.original_lm_head = config.get("original_lm_head", False)
        if self.original_lm_head:
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_heads = [self.lm_head] * K  # a plain list in vLLM too: one shared head, registered once
        else:
            self.lm_heads = nn.ModuleList([nn.Linear(D, V, bias=False) for _ in range(K)])
        self.load(directory)

    def load(self, directory: Path) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for file in sorted(directory.glob("*.safetensors")):
            for name, tensor in load_file(str(file)).items():
                name = name.replace("medusa_heads.", "")
                if name not in params and self.original_lm_head and name == "lm_heads.0.weight":
                    name = "lm_head.weight"
                if name in params:
                    assert params[name].shape == tensor.shape, name
                    with torch.no_grad():
                        params[name].copy_(tensor)
                    loaded.add(name)
        assert loaded == set(params), f"parameters vLLM would leave uninitialised: {set(params) - loaded}"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([lm_head(block(hidden)) for block, lm_head in zip(self.blocks, self.lm_heads)])


def per_head_logits(heads: MedusaHeads, hidden: torch.Tensor, lm_head: nn.Module | None) -> torch.Tensor:
    """[K, B, T, V], one projection per head as the reference and vLLM compute it (a stacked matmul over all heads
    at once, as MedusaHeads.forward does for shared heads, may round differently)."""
    return torch.stack([heads.head_logits(k, hidden, lm_head) for k in range(heads.config.num_heads)])


CASES = [
    # fmt, K, L, shared lm_head, repeat_block, config states counts, dtype
    pytest.param("safetensors", 3, 1, False, False, True, torch.float32, id="safetensors-per-head-counts"),
    pytest.param("pt", 2, 2, False, True, False, torch.float32, id="pt-per-head-repeated-blocks-no-counts"),
    pytest.param("safetensors", 2, 1, True, False, True, torch.bfloat16, id="safetensors-v2-shared-bf16"),
    pytest.param("pt", 3, 1, True, False, False, torch.float32, id="pt-v2-shared-no-counts"),
    pytest.param("safetensors", 2, 0, False, False, False, torch.float32, id="safetensors-no-blocks"),
]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("base") / "base", hidden_size=D)


@pytest.fixture(scope="module")
def base_lm_head(base_dir) -> nn.Linear:
    from models.loading import load_target

    return load_target(str(base_dir), dtype="fp32").get_output_embeddings()


@pytest.mark.parametrize("fmt,K,L,shared,repeat_block,counts,dtype", CASES)
def test_logits_identical_through_import_and_export(tmp_path, base_dir, base_lm_head, fmt, K, L, shared, repeat_block, counts, dtype):
    V = base_lm_head.weight.shape[0]
    reference = original_heads(K, L, V, shared, repeat_block).to(dtype)
    config = {"base_model_name_or_path": str(base_dir)}
    if counts:
        config.update(medusa_num_heads=K, medusa_num_layers=L)
    src = write_original(tmp_path / "original", reference, fmt, config)
    lm_head = copy.deepcopy(base_lm_head).to(dtype) if shared else None
    hidden = torch.randn(2, 5, D).to(dtype)  # [B, T, D]
    with torch.no_grad():
        expected = torch.stack([(lm_head(h(hidden)) if shared else h(hidden)) for h in reference])  # [K, B, T, V]

        heads, base = import_medusa(src)
        assert base == str(base_dir)
        assert heads.config == MedusaConfig(K, L, D, V, share_lm_head=shared)
        assert next(heads.parameters()).dtype == dtype
        assert torch.equal(per_head_logits(heads, hidden, lm_head), expected)
        torch.testing.assert_close(heads(hidden, lm_head), expected)

        via_hook = load_heads(src)
        assert via_hook.config["head_format"] == ("shared_lm_head" if shared else "per_head_lm_head")
        assert torch.equal(per_head_logits(via_hook.heads, hidden, lm_head), expected)

        convert_medusa(src, tmp_path / "draftsmith")
        converted = load_drafter(tmp_path / "draftsmith", dtype=dtype)
        assert converted.config["base_model_name_or_path"] == str(base_dir)
        assert converted.config["training"]["source_format"] == "FasterDecoding/Medusa"
        assert torch.equal(per_head_logits(converted.heads, hidden, lm_head), expected)

        export_vllm(tmp_path / "draftsmith", tmp_path / "vllm")
        assert {t.dtype for t in load_file(str(tmp_path / "vllm" / "model.safetensors")).values()} == {dtype}
        vllm = VllmMedusa(tmp_path / "vllm").to(dtype)
        assert torch.equal(vllm(hidden), expected)


def test_export_from_draftsmith_trained_heads(tmp_path):
    """Heads saved by training (not imported) export the same way; the vLLM config carries the block bias flag."""
    torch.manual_seed(1)
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=2, hidden_size=D, vocab_size=50))
    for p in heads.parameters():
        nn.init.normal_(p, std=0.5)
    save_drafter(tmp_path / "ckpt", heads, "org/base")
    export_vllm(tmp_path / "ckpt", tmp_path / "vllm")
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["medusa_fc_bias"] is True and config["original_lm_head"] is False
    assert config["num_heads"] == 2 and config["num_hidden_layers"] == 2
    hidden = torch.randn(3, D)
    with torch.no_grad():
        assert torch.equal(VllmMedusa(tmp_path / "vllm")(hidden), heads(hidden))


def test_config_head_count_disagreement_and_override(tmp_path):
    reference = original_heads(K=3, L=1, V=20, shared=False, repeat_block=False)
    src = write_original(tmp_path / "src", reference, "safetensors", {"medusa_num_heads": 2, "medusa_num_layers": 1})
    with pytest.raises(CheckpointError, match=r"config.json: medusa_num_heads=2 but medusa_lm_head.safetensors holds 3 heads"):
        import_medusa(src)
    heads, base = import_medusa(src, num_heads=2)
    assert base is None and heads.config.num_heads == 2
    hidden = torch.randn(4, D)
    with torch.no_grad():
        assert torch.equal(heads(hidden), torch.stack([h(hidden) for h in reference[:2]]))


def test_layer_count_disagreement(tmp_path):
    src = write_original(tmp_path / "src", original_heads(2, 1, 20, False, False), "pt", {"medusa_num_layers": 2})
    with pytest.raises(CheckpointError, match="medusa_num_layers=2 but medusa_lm_head.pt holds 1 blocks"):
        import_medusa(src)


def test_malformed_weights_are_refused(tmp_path):
    state = original_heads(2, 1, 20, False, False).state_dict()
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({**state, "extra.weight": torch.zeros(2)}, str(bad / "medusa_lm_head.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected key 'extra.weight'"):
        import_medusa(bad)
    del state["1.1.weight"]
    save_file(state, str(bad / "medusa_lm_head.safetensors"))
    with pytest.raises(CheckpointError, match="head 1's vocab projection differs"):
        import_medusa(bad)
    (bad / "medusa_lm_head.safetensors").unlink()
    torch.save({"0.0.linear.weight": Path("not a tensor")}, bad / "medusa_lm_head.pt")
    with pytest.raises(CheckpointError, match="medusa_lm_head.pt: unreadable"):
        import_medusa(bad)  # weights_only=True refuses arbitrary pickled objects


def test_shared_heads_need_a_vocab_size(tmp_path):
    src = write_original(tmp_path / "src", original_heads(2, 1, 0, True, False), "safetensors", {"base_model_name_or_path": "org/not-cached"})
    with pytest.raises(CheckpointError, match="pass vocab_size"):
        import_medusa(src)
    heads, _ = import_medusa(src, vocab_size=77)
    assert heads.config.share_lm_head and heads.config.vocab_size == 77


def test_draftsmith_config_wins_over_stray_medusa_file(tmp_path):
    heads = MedusaHeads(MedusaConfig(num_heads=1, num_layers=1, hidden_size=D, vocab_size=9))
    save_drafter(tmp_path / "ckpt", heads, "org/base")
    torch.save({"junk": torch.zeros(1)}, tmp_path / "ckpt" / "medusa_lm_head.pt")
    assert load_drafter(tmp_path / "ckpt").config["base_model_name_or_path"] == "org/base"


def test_cli_converts_and_copies_tokenizer(tmp_path):
    src = write_original(tmp_path / "src", original_heads(2, 1, 20, False, False), "pt", {"base_model_name_or_path": "org/base"})
    tiny_tokenizer().save_pretrained(str(src))
    assert convert_main(["medusa-import", str(src), str(tmp_path / "dst")]) == 0
    assert read_drafter_config(tmp_path / "dst")["num_heads"] == 2
    assert (tmp_path / "dst" / "tokenizer_config.json").is_file()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path / "dst")).eos_token == "</s>"
    assert convert_main(["vllm-export", str(tmp_path / "dst"), str(tmp_path / "vllm")]) == 0
    assert (tmp_path / "vllm" / "model.safetensors").is_file()


def test_cli_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    src = write_original(tmp_path / "src", original_heads(2, 1, 20, False, False), "safetensors", {"medusa_num_heads": 5})
    assert convert_main(["medusa-import", str(src), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "medusa_num_heads=5" in err
    assert not (tmp_path / "dst").exists()
    assert convert_main(["vllm-export", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "missing" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
