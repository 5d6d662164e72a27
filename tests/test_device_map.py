"""The engine on a target split with `device_map` (accelerate dispatch) decodes token for token like the same target
loaded on one device: Medusa tree decoding, plain decoding, seeded sampling, the Python API and the command line.

CPU only: every execution device here is "cpu". What these tests do exercise is the dispatched path itself:
accelerate's hooks on every block (inputs moved to each block's execution device, outputs returned to the caller's),
weights offloaded to disk or to CPU memory that sit on the "meta" device until their block runs (so a weight's
`.device` is not where its block computes), and Medusa heads sharing an offloaded lm_head. They cannot catch a tensor
left on the wrong GPU: on CPU every device is the same one. No multi-GPU machine was available for this suite.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from accelerate import cpu_offload, dispatch_model
from transformers import AutoModelForCausalLM

from inference.api import Engine, load
from inference.cli import main
from inference.engine.devices import input_device, module_device, output_device
from models.checkpoint import save_drafter
from models.loading import ModelLoadError, load_target, resolve_device_map
from models.medusa import MedusaConfig, MedusaHeads
from tests.data_support import tiny_tokenizer
from tests.model_support import tiny_config

pytestmark = pytest.mark.usefixtures("single_thread")
LAYERS = 3
BLOCKS = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(LAYERS)), "model.norm", "model.rotary_emb",
          "lm_head"]
ON_CPU = dict.fromkeys(BLOCKS, "cpu")
# embeddings, the middle layer and lm_head offloaded to disk: their weights are on "meta" between forwards
ON_DISK = {**ON_CPU, "model.embed_tokens": "disk", "model.layers.1": "disk", "lm_head": "disk"}
TREE = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]  # branching: accepted paths like 0 -> 2 need a cache gather
PROMPTS = [[5, 9, 14, 30, 31, 7], [40, 41, 42]]  # ragged: left-padded into a batch of 2
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    """A peaked tiny 3-layer Llama with its tokenizer, and two 3-head Medusa checkpoints for it: own projections
    (copied from lm_head, so they are right when the model repeats itself) and shared-lm_head heads."""
    root = tmp_path_factory.mktemp("device_map")
    tokenizer = tiny_tokenizer()
    config = tiny_config("llama", vocab_size=len(tokenizer), hidden_size=32, layers=LAYERS)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    config.initializer_range = 0.2  # peaked next-token distributions: no near-ties, repetitive greedy text
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    own = MedusaHeads(MedusaConfig(num_heads=3, num_layers=1, hidden_size=32, vocab_size=len(tokenizer)))
    own.init_from_base(model.lm_head)
    shared = MedusaHeads(MedusaConfig(num_heads=3, num_layers=1, hidden_size=32, vocab_size=len(tokenizer),
                                      share_lm_head=True))
    with torch.no_grad():
        for p in shared.parameters():
            torch.nn.init.normal_(p, std=0.02)
    save_drafter(root / "own", own, str(root / "base"), tokenizer=tokenizer)
    save_drafter(root / "shared", shared, str(root / "base"), tokenizer=tokenizer)
    return {"root": root, "base": root / "base", "own": root / "own", "shared": root / "shared"}


def decode(engine: Engine, **sampling) -> list[list[int]]:
    return engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, **sampling).sequences


def record_kept_nodes(monkeypatch) -> list[torch.Tensor]:
    """The `keep` [B, N] node ids of every cache surgery the loop performs from now on."""
    loop = importlib.import_module("inference.engine.loop")  # the loop module
    kept: list[torch.Tensor] = []
    real = loop.keep_nodes

    def keep_nodes(cache, start: int, keep: torch.Tensor, *rest) -> None:
        kept.append(keep.clone())
        real(cache, start, keep, *rest)

    monkeypatch.setattr(loop, "keep_nodes", keep_nodes)
    return kept


def split_load(kind: str, drafter: Path | None, assets: dict[str, Path], tmp_path: Path) -> Engine:
    """An engine whose target is dispatched by accelerate, three ways:
    dispatch  an explicit all-"cpu" map, hooks forced. from_pretrained dispatches only maps naming two devices or
              "disk", and this machine has one device, so accelerate's dispatch_model is called with
              force_hooks=True: the same AlignDevicesHook per block that a two-GPU map installs.
    disk      an explicit map with embeddings, a layer and lm_head on "disk", through load(device_map=...);
              from_pretrained installs the hooks itself.
    cpu       accelerate's cpu_offload: every weight on "meta", copied in from CPU memory for each forward."""
    tree = TREE if drafter is not None else None
    if kind == "dispatch":
        engine = load(drafter, base=str(assets["base"]), dtype="fp32", tree=tree, device_map=ON_CPU)
        dispatch_model(engine.model, ON_CPU, force_hooks=True)
    elif kind == "disk":
        engine = load(drafter, base=str(assets["base"]), dtype="fp32", tree=tree, device_map=ON_DISK,
                      offload_folder=tmp_path / "offload")
        assert engine.model.hf_device_map == ON_DISK
        assert engine.model.get_input_embeddings().weight.device.type == "meta"
        assert engine.model.get_output_embeddings().weight.device.type == "meta"
    else:
        engine = load(drafter, base=str(assets["base"]), dtype="fp32", tree=tree)
        cpu_offload(engine.model, execution_device=torch.device("cpu"))
        assert all(p.device.type == "meta" for p in engine.model.parameters())
    assert engine.model._hf_hook is not None and engine.model.model.layers[0].mlp.down_proj._hf_hook is not None
    assert kind == "cpu" or hasattr(engine.model, "hf_device_map")
    return engine


@pytest.mark.parametrize("kind", ["dispatch", "disk", "cpu"])
@pytest.mark.parametrize("heads", ["own", "shared"])
def test_split_target_decodes_like_one_device(assets, tmp_path, monkeypatch, kind, heads):
    kept = record_kept_nodes(monkeypatch)
    reference = load(assets[heads], dtype="fp32", tree=TREE)
    plain = load(base=str(assets["base"]), dtype="fp32")
    expected = decode(plain)
    medusa = reference.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert medusa.sequences == expected  # lossless on one device: the baseline the split target must match

    split = split_load(kind, assets[heads], assets, tmp_path)
    assert split.device == torch.device("cpu")
    kept.clear()
    out = split.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert out.sequences == expected
    assert out.stats.accepted == medusa.stats.accepted  # the same drafts were accepted at every step
    assert next(split.drafter.heads.parameters()).device == output_device(split.model)
    if heads == "own":  # drafts were accepted, off the first-rank chain too: the split cache was gathered, not cropped
        assert out.stats.mean_accepted > 0
        assert any(bool((k != torch.arange(k.shape[1])).any()) for k in kept)
    assert decode(split, temperature=0.9, top_k=20, seed=7) == decode(reference, temperature=0.9, top_k=20, seed=7)


@pytest.mark.parametrize("kind", ["dispatch", "disk", "cpu"])
def test_split_target_without_drafter_decodes_like_one_device(assets, tmp_path, kind):
    expected = decode(load(base=str(assets["base"]), dtype="fp32"))
    split = split_load(kind, None, assets, tmp_path)
    assert decode(split) == expected
    assert split.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS, ignore_eos=True).sequences[0] == expected[0]


def test_device_map_strategy_auto_decodes_like_one_device(assets):
    """"auto" on a CPU-only machine maps the whole model to "cpu": the string path of load(device_map=)."""
    expected = decode(load(assets["own"], dtype="fp32", tree=TREE))
    assert decode(load(assets["own"], dtype="fp32", tree=TREE, device_map="auto")) == expected


def test_devices_follow_the_hooks_not_the_meta_weights(assets, tmp_path):
    model = load_target(str(assets["base"]), dtype="fp32", device_map=ON_DISK, offload_folder=tmp_path / "off")
    q_proj = model.model.layers[1].self_attn.q_proj
    assert q_proj.weight.device.type == "meta"
    assert input_device(model) == output_device(model) == module_device(model, q_proj) == torch.device("cpu")
    plain = load_target(str(assets["base"]), dtype="fp32")
    assert input_device(plain) == torch.device("cpu")
    with pytest.raises(ValueError, match="not a submodule"):
        module_device(plain, torch.nn.Linear(2, 2, device="meta"))


def test_resolve_device_map_forms(tmp_path):
    assert resolve_device_map(None) is None and resolve_device_map("auto") == "auto"
    assert resolve_device_map("balanced_low_0") == "balanced_low_0" and resolve_device_map("cpu") == "cpu"
    assert resolve_device_map(1) == 1
    assert resolve_device_map('{"model.layers.0": 0, "lm_head": "disk"}') == {"model.layers.0": 0, "lm_head": "disk"}
    path = tmp_path / "map.json"
    path.write_text(json.dumps(ON_DISK))
    assert resolve_device_map(str(path)) == ON_DISK == resolve_device_map(path)
    with pytest.raises(ValueError, match="not a device"):
        resolve_device_map("autoo")
    with pytest.raises(ValueError, match=r"'lm_head': expected a GPU index"):
        resolve_device_map({"lm_head": 1.5})
    with pytest.raises(ValueError, match=r"'model': a GPU index must be >= 0"):
        resolve_device_map({"model": -1})
    with pytest.raises(ValueError, match="non-empty object"):
        resolve_device_map("{}")
    with pytest.raises(ValueError, match="not a valid JSON object"):
        resolve_device_map("{model: 0}")
    with pytest.raises(ModelLoadError, match="cannot read"):
        resolve_device_map(str(tmp_path / "missing.json"))


def test_load_refuses_disk_without_offload_folder_and_device_map_with_tp_plan(assets):
    with pytest.raises(ValueError, match=r"puts model\.embed_tokens, model\.layers\.1, lm_head on \"disk\""):
        load_target(str(assets["base"]), dtype="fp32", device_map=ON_DISK)
    with pytest.raises(ValueError, match="device_map and tp_plan are exclusive"):
        load(base=str(assets["base"]), dtype="fp32", device_map="auto", tp_plan="auto")
    with pytest.raises(ValueError, match="compile runs on one device: drop it with device_map or tp_plan"):
        load(base=str(assets["base"]), dtype="fp32", device_map="auto", compile=True)


def test_cli_device_map_file_decodes_like_one_device(assets, tmp_path, capsys):
    map_file = tmp_path / "map.json"
    map_file.write_text(json.dumps(ON_DISK))
    common = ["generate", "--drafter", str(assets["own"]), "--tree", "chain:3", "--dtype", "fp32", "--json",
              "--raw", "--prompt", "hello world, hello there", "--max-new-tokens", "16", "--ignore-eos"]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--device-map", str(map_file), "--offload-folder", str(tmp_path / "off")]) == 0
    split = json.loads(capsys.readouterr().out)
    assert split["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 16
    assert main([*common, "--device-map", str(map_file), "--device", "cpu"]) == 2
    assert "--device and --device-map are exclusive" in capsys.readouterr().err
    assert main([*common, "--device-map", str(map_file)]) == 2  # "disk" entries without --offload-folder
    assert 'on "disk": pass offload_folder' in capsys.readouterr().err
