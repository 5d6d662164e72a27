"""train/peer_formats.py and scripts/peer_eagle3.py: a feature cache written as SpecForge 0.2.0's and speculators
0.9.0's EAGLE-3 training data. Each format is read back the way the peer reads it (a re-implementation of its
reader, quoted from the wheels): the same tokens, loss masks, fused layers low..high, the final norm on the right
side, and one draft vocabulary for all three trainers. A speculators draft comes back in the layout our
eagle3-import reads, equal tensor for tensor to our own export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from data.datasets import label_counts
from data.features import FeatureDataset, Manifest, shard_name, write_shard
from models.checkpoint import most_frequent
from models.eagle3 import Eagle3Config, Eagle3Draft, load_eagle3, save_eagle3
from models.eagle3_interop import export_eagle3, import_eagle3
from tests.script_support import ROOT, exit_code, load_script
from train import peer_formats as pf

D, V, N_LAYERS, S = 16, 40, 6, 12
LAYERS = [2, 3, 4]
LENGTHS = [5, 7, 4]
EPS = 1e-5


def target_dir(root: Path, gain: torch.Tensor) -> Path:
    """A Llama target folder with tied embeddings: config.json and the weights the converters read."""
    folder = root / "target"
    folder.mkdir()
    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=N_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=EPS, tie_word_embeddings=True)
    (folder / "config.json").write_text(config.to_json_string())
    save_file({"model.norm.weight": gain, "model.embed_tokens.weight": torch.randn(V, D),
               "model.layers.0.input_layernorm.weight": torch.ones(D)}, str(folder / "model.safetensors"))
    return folder


def make_cache(root: Path, gain: torch.Tensor, layers: list[int] = LAYERS) -> Path:
    """A complete one-shard cache: random ids and states, hidden = the final norm of a random pre-norm state."""
    g = torch.Generator().manual_seed(0)
    n = sum(LENGTHS)
    ids = torch.randint(0, V, (n,), generator=g, dtype=torch.int32)
    mask = (torch.rand(n, generator=g) > 0.4).to(torch.uint8)
    pre = torch.randn(n, D, generator=g) * 3
    tensors = {"input_ids": ids, "loss_mask": mask, "offsets": torch.tensor([0, *LENGTHS]).cumsum(0),
               "hidden": pf.FinalNorm(gain, EPS)(pre), **{f"layer_{i}": torch.randn(n, D, generator=g) for i in layers}}
    folder = root / "cache"
    folder.mkdir()
    write_shard(folder / shard_name("train", 0), tensors)
    Manifest(target={"config": "c", "weights": "w"}, tokenizer="t", hidden_size=D, vocab_size=V, layers=layers,
             topk=0, dtype="fp32", recipe={}, shards={"train": 1}, complete=True).write(folder)
    return folder


@pytest.fixture
def gain() -> torch.Tensor:
    return torch.rand(D, generator=torch.Generator().manual_seed(1)) + 0.5


@pytest.fixture
def cache(tmp_path: Path, gain: torch.Tensor) -> Path:
    return make_cache(tmp_path, gain)


def cached(cache: Path) -> list[dict[str, torch.Tensor]]:
    data = FeatureDataset(cache, "train", layers=LAYERS)
    return [data[i] for i in range(len(data))]


# -- the peers' readers, re-implemented from their 0.2.0 / 0.9.0 wheels --------------------------------------------------

def specforge_read(path: Path, max_len: int = 2048) -> dict[str, torch.Tensor]:
    """specforge/runtime/data_plane/feature_store.py load_feature_file, then algorithms/eagle3/data.py
    normalize_offline_sample (which zeroes the last loss position)."""
    raw = torch.load(path, weights_only=False, mmap=True)
    assert set(raw) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}  # offline_reader's keys
    loss_mask = raw["loss_mask"][:max_len].clone().unsqueeze(0)
    loss_mask[0, -1] = 0
    return {"hidden_state": raw["aux_hidden_state"].squeeze(0)[:max_len].unsqueeze(0),
            "target": raw["hidden_state"].squeeze(0)[:max_len].unsqueeze(0),
            "input_ids": raw["input_ids"][:max_len].unsqueeze(0), "loss_mask": loss_mask}


def speculators_read(out: Path, index: int) -> dict[str, torch.Tensor]:
    """speculators/train/data.py ArrowDataset._get_raw_data over hs_connectors' FileTransfer.get_cached, the row
    from rows.jsonl in place of the Arrow dataset it becomes."""
    hs = load_file(str(out / "data" / "hidden_states" / f"hs_{index}.safetensors"))
    row = json.loads((out / "rows.jsonl").read_text().splitlines()[index])
    assert set(hs) == {"token_ids", "hidden_states"}  # check_hidden_states' required keys
    assert hs["token_ids"].tolist() == row["input_ids"] and hs["hidden_states"].shape[0] == row["seq_len"]
    return {"hidden_states": hs["hidden_states"][:, :-1].flatten(1), "input_ids": hs["token_ids"],
            "verifier_last_hidden_states": hs["hidden_states"][:, -1], "loss_mask": torch.tensor(row["loss_mask"])}


# -- the conversions --------------------------------------------------------------------------------------------------

def test_specforge_files_hold_what_its_reader_takes(cache: Path, tmp_path: Path) -> None:
    ids = pf.cache_vocab(cache, S, V)
    counts = pf.write_specforge(cache, tmp_path / "sf", tuple(LAYERS), ids, V)
    files = sorted((tmp_path / "sf" / "data").glob("*.ckpt"))  # list_feature_files: sorted, one per sample
    assert counts == {"samples": 3, "tokens": sum(LENGTHS), "trained_tokens": int(sum(
        (s["labels"] != -100).sum() for s in cached(cache)))}
    for path, item in zip(files, cached(cache), strict=True):
        raw = torch.load(path, weights_only=False)
        t = len(item["input_ids"])
        assert raw["input_ids"].shape == (t,) and raw["input_ids"].dtype == torch.int64
        assert raw["hidden_state"].shape == (1, t, D) and raw["aux_hidden_state"].shape == (1, t, 3 * D)
        read = specforge_read(path)
        assert torch.equal(read["input_ids"][0], item["input_ids"])
        # after the final norm (its TargetHead is lm_head only), in the TargetHead's bf16
        assert read["target"].dtype == torch.bfloat16 and torch.equal(read["target"][0], item["hidden"].bfloat16())
        assert torch.equal(read["hidden_state"][0], torch.cat([item[f"layer_{i}"] for i in LAYERS], -1))  # low..high
        mask = (item["labels"] != -100).long()
        assert torch.equal(raw["loss_mask"], mask)  # token t trained, as in SpecForge's own preprocessing
        assert torch.equal(read["loss_mask"][0, :-1], mask[:-1]) and read["loss_mask"][0, -1] == 0


def test_speculators_files_put_the_last_state_before_the_final_norm(cache: Path, tmp_path: Path,
                                                                      gain: torch.Tensor) -> None:
    norm = pf.FinalNorm(gain, EPS)
    counts = pf.write_speculators(cache, tmp_path / "sp", tuple(LAYERS), pf.cache_vocab(cache, S, V), V, norm)
    # the cache has no validation split: the first sample again is the held-out row, and the ratio keeps 3 to train
    rows = (tmp_path / "sp" / "rows.jsonl").read_text().splitlines()
    assert counts["samples"] == 3 and len(rows) == 4 and rows[3] == rows[0]
    assert int(len(rows) * counts["train_data_ratio"]) == 3  # speculators' split_idx = int(len * train_ratio)
    for i, item in enumerate(cached(cache)):
        read = speculators_read(tmp_path / "sp", i)
        assert torch.equal(read["input_ids"], item["input_ids"])
        assert torch.equal(read["loss_mask"], (item["labels"] != -100).long())
        assert torch.equal(read["hidden_states"], torch.cat([item[f"layer_{j}"] for j in LAYERS], -1))
        # models/eagle3/core.py: targets = verifier_lm_head(verifier_norm(verifier_last_hidden_states))
        assert torch.allclose(norm(read["verifier_last_hidden_states"]), item["hidden"], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(read["verifier_last_hidden_states"], item["hidden"])  # not the post-norm state


def test_one_draft_vocabulary_for_all_three(cache: Path, tmp_path: Path) -> None:
    """train.eagle3's rule (the S most frequent trained labels), in our d2t / t2d convention, in both peers' files."""
    ids = pf.cache_vocab(cache, S, V)
    draft = Eagle3Draft(Eagle3Config(target=LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=32,
                                                        num_hidden_layers=N_LAYERS, num_attention_heads=4,
                                                        num_key_value_heads=2).to_dict(),
                                     layers=tuple(LAYERS), draft_vocab_size=S))
    counts = label_counts(FeatureDataset(cache, "train"))
    draft.set_draft_vocab(most_frequent(torch.cat([counts, counts.new_zeros(V - len(counts))]), S))
    pf.write_specforge(cache, tmp_path / "sf", tuple(LAYERS), ids, V)
    pf.write_speculators(cache, tmp_path / "sp", tuple(LAYERS), ids, V, pf.FinalNorm(torch.ones(D), EPS))
    specforge = torch.load(tmp_path / "sf" / "vocab_mapping.pt")  # modeling/draft/base.py load_vocab_mapping
    d2t = torch.from_numpy(np.load(tmp_path / "sp" / "d2t.npy"))  # train/cli.py _load_mappings
    t2d = torch.from_numpy(np.load(tmp_path / "sp" / "t2d.npy"))
    for maps in ({"d2t": d2t, "t2d": t2d}, specforge):
        assert torch.equal(maps["d2t"], draft.d2t) and torch.equal(maps["t2d"], draft.t2d)
        assert maps["d2t"].dtype == torch.int64 and maps["t2d"].dtype == torch.bool
    assert sorted((torch.arange(S) + d2t).tolist()) == ids.tolist()  # target id = draft id + d2t[draft id]


def test_vocabulary_from_a_checkpoint(tmp_path: Path) -> None:
    text = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=N_LAYERS,
                       num_attention_heads=4, num_key_value_heads=2).to_dict()
    draft = Eagle3Draft(Eagle3Config(target=text, layers=tuple(LAYERS), draft_vocab_size=S))
    chosen = torch.tensor([3, 1, 39, 7, 20, 21, 22, 0, 5, 11, 30, 31])
    draft.set_draft_vocab(chosen)
    save_eagle3(tmp_path / "ckpt", draft, "base")
    assert pf.checkpoint_vocab(tmp_path / "ckpt").tolist() == sorted(chosen.tolist())


def test_final_norm_read_from_the_target(tmp_path: Path, gain: torch.Tensor) -> None:
    norm = pf.final_norm(target_dir(tmp_path, gain))
    assert torch.equal(norm.gain, gain) and norm.eps == EPS  # model.norm.weight, not a layer's norm


def test_refusals(tmp_path: Path, gain: torch.Tensor) -> None:
    zero = gain.clone()
    zero[3] = 0
    with pytest.raises(pf.PeerFormatError, match="zero gains"):
        pf.final_norm(target_dir(tmp_path, zero))
    cache = make_cache(tmp_path, gain, layers=[1, 2, 3, 4])
    manifest = Manifest.read(cache)
    with pytest.raises(pf.PeerFormatError, match="name the 3 to fuse"):
        pf.fused_of(manifest, None, "cache")
    with pytest.raises(pf.PeerFormatError, match=r"not \[5\]"):
        pf.fused_of(manifest, [2, 3, 5], "cache")
    assert pf.fused_of(manifest, [4, 1, 2], "cache") == (1, 2, 4)


def test_target_view_for_specforge(tmp_path: Path, gain: torch.Tensor) -> None:
    """TargetHead.load_weights reads weight_map[lm_head_key] of the folder's one *.index.json; a tied model's
    lm_head is the embedding."""
    view, key = pf.specforge_target(target_dir(tmp_path, gain), tmp_path / "view")
    index = json.loads((view / "model.safetensors.index.json").read_text())
    assert key == "model.embed_tokens.weight" and index["weight_map"][key] == "model.safetensors"
    assert (view / "config.json").is_file() and (view / "model.safetensors").resolve().is_file()


def test_speculators_draft_comes_back_as_our_export(tmp_path: Path) -> None:
    """A speculators save (its Eagle3DraftModel: layers.0.*, plus the verifier's and embedding tensors it keeps)
    of the draft our eagle3-export wrote converts back to the same tensors and layer config."""
    text = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=N_LAYERS,
                       num_attention_heads=4, num_key_value_heads=2).to_dict()
    draft = Eagle3Draft(Eagle3Config(target=text, layers=tuple(LAYERS), draft_vocab_size=S))
    draft.set_draft_vocab(torch.arange(S) * 3)
    save_eagle3(tmp_path / "ckpt", draft, "base")
    ours = export_eagle3(tmp_path / "ckpt", tmp_path / "export")
    exported = load_file(str(ours / "model.safetensors"))
    config = json.loads((ours / "config.json").read_text())
    spec = tmp_path / "speculators"
    spec.mkdir()
    state = {k.replace("midlayer.", "layers.0."): v for k, v in exported.items()}
    state.update({"embed_tokens.weight": torch.randn(V, D), "verifier_lm_head.weight": torch.randn(S, D)})
    save_file(state, str(spec / "model.safetensors"))
    layer = {k: v for k, v in config.items() if k not in ("architectures", "draftsmith", "eagle_config",
                                                           "eagle_aux_hidden_state_layer_ids")}
    (spec / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "transformer_layer_config": layer, "draft_vocab_size": S,
        "eagle_aux_hidden_state_layer_ids": LAYERS, "norm_before_residual": False}))
    back = pf.speculators_to_eagle3(spec, tmp_path / "back")
    returned = load_file(str(back / "model.safetensors"))
    assert set(returned) == set(exported)
    assert all(torch.equal(returned[k], exported[k]) for k in exported)
    got = json.loads((back / "config.json").read_text())
    assert got == {k: v for k, v in config.items() if k != "draftsmith"}
    for bad in ({"norm_output": True}, {"norm_before_fc": True}, {"transformer_layer_config": {
            **layer, "layer_types": ["sliding_attention"]}}):
        (spec / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", **bad}))
        with pytest.raises(pf.PeerFormatError, match="no such norm|sliding-window"):
            pf.speculators_to_eagle3(spec, tmp_path / "refused")


# -- the script -------------------------------------------------------------------------------------------------------

def test_convert_writes_both_and_prints_the_commands(cache: Path, tmp_path: Path, gain: torch.Tensor,
                                                     capsys: pytest.CaptureFixture) -> None:
    script = load_script("peer_eagle3")
    model = target_dir(tmp_path, gain)
    out = tmp_path / "peers"
    assert exit_code(script, ["convert", "--cache", str(cache), "--model", str(model), "--out", str(out),
                              "--draft-vocab", str(S), "--max-samples", "2"]) == 0
    printed = capsys.readouterr().out
    assert len(list((out / "specforge" / "data").glob("*.ckpt"))) == 2
    assert len(list((out / "speculators" / "data" / "hidden_states").glob("hs_*.safetensors"))) == 3  # + 1 held out
    assert "--train-data-ratio 0.8333333333333334" in printed  # (2 + 0.5) / 3: speculators trains on the 2
    run = json.loads((out / "specforge" / "train.yaml").read_text())
    assert run["model"]["aux_hidden_state_layer_ids"] == [i - 1 for i in LAYERS]  # SpecForge: layer outputs
    assert run["model"]["lm_head_key"] == "model.embed_tokens.weight"
    draft = json.loads((out / "specforge" / "draft.json").read_text())
    assert draft["draft_vocab_size"] == S and draft["num_hidden_layers"] == 1 and "draftsmith" not in draft
    assert "--target-layer-ids 2 3 4" in printed and "specforge -- train -c" in printed
    assert "--no-norm-before-fc" in printed and printed.count("models.convert eagle3-import") == 2


def test_convert_refuses_bad_input_in_one_line(cache: Path, tmp_path: Path, gain: torch.Tensor,
                                               capsys: pytest.CaptureFixture) -> None:
    script = load_script("peer_eagle3")
    model = target_dir(tmp_path, gain)
    argv = ["convert", "--model", str(model), "--out", str(tmp_path / "o"), "--draft-vocab", str(S)]
    assert exit_code(script, [*argv, "--cache", str(tmp_path / "nowhere")]) == 2
    assert exit_code(script, [*argv[:-1], str(V + 1), "--cache", str(cache)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(errors) == 2 and "not a feature cache" in errors[0] and "--draft-vocab 41" in errors[1]
    assert not (tmp_path / "o").exists()


# -- the peers themselves (DRAFTSMITH_PEERS=<folder with specforge-venv/ and speculators-venv/>) --------------------------

PEERS = os.environ.get("DRAFTSMITH_PEERS")


def run(argv: list[str], **env: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                                                **env}, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not PEERS or not Path(PEERS, "specforge-venv").is_dir() or not Path(PEERS, "speculators-venv")
                    .is_dir(), reason="DRAFTSMITH_PEERS=<folder> names no specforge-venv / speculators-venv")
def test_both_peers_train_on_the_converted_cache_and_import(tmp_path: Path) -> None:
    """The printed pipeline on a tiny random target: each peer trains an epoch of 3 samples on CPU, exports, and
    our eagle3-import loads the result with the one draft vocabulary."""
    from transformers import LlamaForCausalLM

    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=N_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=EPS, tie_word_embeddings=True,
                         max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "target")
    gain = load_file(str(tmp_path / "target" / "model.safetensors"))["model.norm.weight"]
    cache, out = make_cache(tmp_path, gain), tmp_path / "peers"
    sf_python, sp_python = (str(Path(PEERS, f"{n}-venv", "bin", "python")) for n in ("specforge", "speculators"))
    args = ["--ttt-steps", "2", "--max-length", "64", "--specforge-python", sf_python, "--speculators-python", sp_python]
    run([sys.executable, "scripts/peer_eagle3.py", "convert", "--cache", str(cache), "--model",
         str(tmp_path / "target"), "--out", str(out), "--draft-vocab", str(S), *args])
    driver = str(ROOT / "scripts" / "peer_eagle3_driver.py")
    sf, sp = out / "specforge", out / "speculators"
    run([sf_python, driver, "specforge", "--", "train", "-c", str(sf / "train.yaml")])
    step = sorted((sf / "output").glob("specforge-run-step*"))[-1]
    run([sf_python, driver, "specforge", "--", "export", "--to", "sglang", "--checkpoint", str(step), "--draft-config",
         str(sf / "draft.json"), "--output-dir", str(sf / "export"), "--vocab-mapping", str(sf / "vocab_mapping.pt")])
    run([sp_python, driver, "speculators-dataset", str(sp)])
    script = load_script("peer_eagle3")
    parsed = script.parser().parse_args(["convert", "--cache", str(cache), "--model", "m", "--out", str(out),
                                         "--draft-vocab", str(S), *args])
    run([sp_python, driver, "speculators", "--",
         *script.speculators_args(parsed, tmp_path / "target", sp, tuple(LAYERS), S, 3.5 / 4)])
    assert pf.speculators_to_eagle3(sp / "output" / "0", sp / "export").is_dir()
    d2t = torch.from_numpy(np.load(sp / "d2t.npy"))
    for name in ("specforge", "speculators"):
        imported = import_eagle3(out / name / "export", out / f"{name}-draft", str(tmp_path / "target"))
        draft = load_eagle3(imported)
        assert torch.equal(draft.d2t, d2t) and draft.config.layers == tuple(LAYERS)
