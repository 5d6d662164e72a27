"""A draftsmith EAGLE-3 feature cache in the formats the reference trainers read, and their drafts back.

SpecForge 0.2.0 (sgl-project/SpecForge) and speculators 0.9.0 (vllm-project/speculators) train EAGLE-3 drafts from
stored target features; written from one cache (data/features.py), all three trainers see the same tokens, loss
masks, fused layers and draft vocabulary, and only the trainer differs. Dimension letters: T tokens of a sample,
D hidden, S draft vocabulary, V target vocabulary.

What each reads (from their 0.2.0 / 0.9.0 wheels):
    SpecForge   a folder of `*.ckpt` files, one `torch.save` dict per sample (runtime/data_plane/offline_reader.py,
                algorithms/eagle3/data.py normalize_offline_sample): input_ids [T] int64, loss_mask [T] int64,
                hidden_state [1, T, D] the target's last hidden state AFTER the final norm (its TargetHead applies only
                lm_head to it), aux_hidden_state [1, T, 3D] the fused layers concatenated low..high. The draft
                vocabulary comes from model.vocab_mapping_path: a `torch.save` of {"d2t": [S] int64, "t2d": [V] bool}
                (modeling/draft/base.py load_vocab_mapping). Its TargetHead finds lm_head through a
                `*.index.json` in the target folder (modeling/target/target_head.py): `specforge_target` writes one.
    speculators an Arrow dataset (datasets.save_to_disk) of input_ids / loss_mask / seq_len rows, and beside it
                hidden_states/hs_<i>.safetensors with token_ids [T] int64 and hidden_states [T, 4, D]: the three fused
                layers, then the last layer BEFORE the final norm (train/data.py ArrowDataset; models/eagle3/core.py
                applies its verifier_norm, then verifier_lm_head). The draft vocabulary: d2t.npy [S] / t2d.npy [V]
                (train/cli.py _load_mappings). Writing Arrow needs `datasets`, which the peer's venv has; this module
                writes rows.jsonl and the peer side turns it into the dataset (`speculators_dataset`).
Both use our d2t / t2d convention (models/eagle3.py: target id = draft id + d2t[draft id], ids ascending), so the
same arrays serve all three trainers.

Norm placement: the cache keeps the last hidden state after the final norm only (`hidden`). speculators is given
x' = hidden / g (g: the final norm's per-channel gain), which the target's final norm maps back onto `hidden`: x' has
RMS sqrt(1 - eps / ms) ~ 1, so norm(x') = hidden * (1 + O(eps)). A gain with a zero entry cannot be inverted and is
refused.

Loss masks pass through unchanged: in all three, loss_mask[t] = 1 where token t is an assistant token (a trained
label); each trainer shifts it as its own loss needs.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from data.errors import UsageError
from data.features import FeatureDataset, Manifest, check_cache
from models.checkpoint import WEIGHTS_NAME, most_frequent
from models.eagle3 import check_maps
from models.eagle3_interop import ARCHITECTURE, sglang_layer_ids

VALIDATION_ROWS = 64  # speculators' held-out rows (its validation loss only)
FUSED = 3  # EAGLE-3 fuses three target layers; both peers assert it
# SpecForge's storage: hidden_state in its TargetHead's dtype (bf16, hard-coded in TargetHead.from_pretrained: an
# fp32 state would not multiply its lm_head), aux_hidden_state in the draft's (model.torch_dtype float32 on a CPU)
SPECFORGE_HIDDEN_DTYPE, SPECFORGE_AUX_DTYPE = torch.bfloat16, torch.float32


class PeerFormatError(UsageError):
    """Input that cannot be converted (one line naming the file or option)."""


@dataclass(frozen=True)
class Sample:
    """One cached sample: input_ids / loss_mask [T], layers [3, T, D] (low..high), hidden [T, D] after the final
    norm, all fp32 except the ids."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    layers: torch.Tensor
    hidden: torch.Tensor


@dataclass(frozen=True)
class FinalNorm:
    """The target's final RMSNorm: per-channel gain g [D] fp32 (Llama's weight; Gemma's 1 + weight) and eps."""

    gain: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.gain

    def prenorm(self, hidden: torch.Tensor) -> torch.Tensor:
        """A state the norm maps back onto `hidden` [..., D] (module docstring)."""
        return hidden.float() / self.gain


# -- the cache ---------------------------------------------------------------------------------------------------------

def fused_of(manifest: Manifest, layers: Sequence[int] | None, where: str) -> tuple[int, ...]:
    """The three hidden_states indices to fuse, low..high: `layers` when given, else the cache's own three."""
    chosen = tuple(sorted(int(i) for i in (layers if layers else manifest.layers)))
    if len(chosen) != FUSED:
        raise PeerFormatError(f"{where}: holds layers {manifest.layers}; name the {FUSED} to fuse with --layers")
    missing = sorted(set(chosen) - set(manifest.layers))
    if missing:
        raise PeerFormatError(f"{where}: holds layers {manifest.layers}, not {missing}")
    return chosen


def samples(folder: str | os.PathLike, layers: tuple[int, ...], limit: int | None = None,
            split: str = "train") -> Iterator[Sample]:
    """A split's samples in cache order (at most `limit`)."""
    data = FeatureDataset(folder, split, layers=layers)
    for i in range(len(data) if limit is None else min(limit, len(data))):
        item = data[i]
        yield Sample(input_ids=item["input_ids"], loss_mask=(item["labels"] != -100).long(),
                     layers=torch.stack([item[f"layer_{j}"] for j in layers]), hidden=item["hidden"])


def cache_vocab(folder: str | os.PathLike, size: int, vocab_size: int) -> torch.Tensor:
    """The draft vocabulary train.eagle3 picks from this cache: the `size` most frequent trained labels of the train
    split (ties by id), as ascending target ids [S]."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    data = FeatureDataset(folder, "train")
    for labels in data.labels():
        kept = labels[labels >= 0]
        counts += torch.bincount(kept, minlength=vocab_size)[:vocab_size]
    return most_frequent(counts, size).sort().values


def checkpoint_vocab(path: str | os.PathLike) -> torch.Tensor:
    """The draft vocabulary of a draftsmith eagle3 checkpoint (its d2t) as ascending target ids [S]."""
    weights = Path(path) / WEIGHTS_NAME
    if not weights.is_file():
        raise PeerFormatError(f"--vocab-from {path}: no {WEIGHTS_NAME} (not a draftsmith checkpoint)")
    with safe_open(str(weights), framework="pt") as f:
        if "d2t" not in f.keys():
            raise PeerFormatError(f"{weights}: no d2t (not an eagle3 checkpoint with a draft vocabulary)")
        d2t = f.get_tensor("d2t").long()
    return torch.arange(len(d2t)) + d2t


def vocab_maps(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending target ids [S] -> (d2t [S] int64 offsets, t2d [V] bool), checked as models.eagle3 checks a draft's."""
    ids = ids.long()
    d2t = ids - torch.arange(len(ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    check_maps(d2t, t2d, len(ids), vocab_size, "draft vocabulary")
    return d2t, t2d


def final_norm(model_dir: str | os.PathLike) -> FinalNorm:
    """The final norm of the target folder `model_dir` (config.json and *.safetensors), read without building it."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    for weights in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(weights), framework="pt") as f:
            names = [k for k in f.keys() if k.endswith("norm.weight") and ".layers." not in k]
            if names:
                weight = f.get_tensor(min(names, key=len)).float()
                break
    else:
        raise PeerFormatError(f"{model_dir}: no final norm weight (model.norm.weight) in its *.safetensors")
    gain = 1.0 + weight if str(text.get("model_type", "")).startswith("gemma") else weight
    if bool((gain == 0).any()):
        raise PeerFormatError(f"{model_dir}: the final norm has zero gains; its input cannot be recovered for "
                              f"speculators")
    return FinalNorm(gain=gain, eps=float(text["rms_norm_eps"]))


# -- writers ------------------------------------------------------------------------------------------------------------

def write_specforge(cache: str | os.PathLike, out: str | os.PathLike, layers: tuple[int, ...], ids: torch.Tensor,
                    vocab_size: int, limit: int | None = None) -> dict[str, Any]:
    """SpecForge's offline files in out/data/<i>.ckpt and out/vocab_mapping.pt; returns counts."""
    out = Path(out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    n = tokens = trained = 0
    for n, s in enumerate(samples(cache, layers, limit), start=1):
        torch.save({"input_ids": s.input_ids.long(), "loss_mask": s.loss_mask.long(),
                    "hidden_state": s.hidden.to(SPECFORGE_HIDDEN_DTYPE).unsqueeze(0),  # [1, T, D]
                    "aux_hidden_state": torch.cat(list(s.layers), -1).to(SPECFORGE_AUX_DTYPE).unsqueeze(0)},  # [1, T, 3D]
                   out / "data" / f"sample_{n - 1:07d}.ckpt")
        tokens += len(s.input_ids)
        trained += int(s.loss_mask.sum())
    d2t, t2d = vocab_maps(ids, vocab_size)
    torch.save({"d2t": d2t, "t2d": t2d}, out / "vocab_mapping.pt")
    return {"samples": n, "tokens": tokens, "trained_tokens": trained}


def write_speculators(cache: str | os.PathLike, out: str | os.PathLike, layers: tuple[int, ...], ids: torch.Tensor,
                      vocab_size: int, norm: FinalNorm, limit: int | None = None) -> dict[str, Any]:
    """speculators' hidden_states/hs_<i>.safetensors, rows.jsonl (for `speculators_dataset`), d2t.npy, t2d.npy.

    speculators trains on the first int(rows * train_data_ratio) rows and validates on the rest, a ratio in (0, 1):
    the rows are the train samples, then the validation split's (at most VALIDATION_ROWS; the first train sample
    again when the cache has none), and the returned `train_data_ratio` makes the train part exactly the train
    samples the other trainers see. Counts (samples, tokens, trained_tokens) are the train part's."""
    out = Path(out)
    (out / "data" / "hidden_states").mkdir(parents=True, exist_ok=True)
    n_train = len(FeatureDataset(cache, "train"))
    n_train = n_train if limit is None else min(n_train, limit)
    has_validation = len(FeatureDataset(cache, "validation")) > 0
    held_out = samples(cache, layers, VALIDATION_ROWS, "validation") if has_validation else samples(cache, layers, 1)
    tokens = trained = rows_written = 0
    with open(out / "rows.jsonl", "w") as rows:
        for i, s in enumerate(itertools.chain(samples(cache, layers, limit), held_out)):
            states = torch.cat([s.layers, norm.prenorm(s.hidden).unsqueeze(0)]).transpose(0, 1)  # [T, 4, D]
            save_file({"token_ids": s.input_ids.long(), "hidden_states": states.contiguous()},
                      str(out / "data" / "hidden_states" / f"hs_{i}.safetensors"))
            rows.write(json.dumps({"input_ids": s.input_ids.tolist(), "loss_mask": s.loss_mask.tolist(),
                                   "seq_len": len(s.input_ids)}) + "\n")
            if i < n_train:
                tokens += len(s.input_ids)
                trained += int(s.loss_mask.sum())
            rows_written = i + 1
    d2t, t2d = vocab_maps(ids, vocab_size)
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    return {"samples": n_train, "tokens": tokens, "trained_tokens": trained,
            "train_data_ratio": (n_train + 0.5) / rows_written}


def speculators_dataset(out: str | os.PathLike) -> Path:
    """Run in speculators' venv (it has `datasets`): out/rows.jsonl -> the Arrow dataset out/data, torch-formatted
    as its preprocessing leaves it. Returns out/data."""
    from datasets import Dataset  # deferred: the peer's dependency, not ours

    out = Path(out)
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list(rows)
    dataset.set_format(type="torch")
    staging = out / "arrow.tmp"
    dataset.save_to_disk(str(staging))
    for path in staging.iterdir():  # beside hidden_states/, which the dataset folder also holds
        path.replace(out / "data" / path.name)
    staging.rmdir()
    return out / "data"


def specforge_target(model_dir: str | os.PathLike, out: str | os.PathLike) -> tuple[Path, str]:
    """A view of the target folder SpecForge's TargetHead loads (links to its files plus the `*.index.json` it
    looks for), and the lm_head key (a tied model's is the embedding). Returns (folder, lm_head key)."""
    model_dir, out = Path(model_dir).resolve(), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for path in sorted(model_dir.iterdir()):
        link = out / path.name
        if not link.exists():
            link.symlink_to(path)
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                weight_map.update(dict.fromkeys(f.keys(), path.name))
    if not any(p.name.endswith(".index.json") for p in model_dir.iterdir()):
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    key = "lm_head.weight" if "lm_head.weight" in weight_map else "model.embed_tokens.weight"
    if key not in weight_map:
        raise PeerFormatError(f"{model_dir}: neither lm_head.weight nor model.embed_tokens.weight in its weights")
    return out, key


# -- back: a speculators checkpoint as the LlamaForCausalLMEagle3 folder our eagle3-import reads -------------------------

SPECULATORS_DROPPED = ("verifier_lm_head.", "verifier_norm.", "embed_tokens.")  # the target's, not the draft's


def speculators_to_eagle3(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """speculators' saved draft (config.json with speculators_model_type eagle3 + model.safetensors, one layer under
    layers.0.*) -> the folder vLLM / SGLang / SpecForge load (midlayer.*; config.json a one-layer Llama config
    naming ARCHITECTURE), which `python -m models.convert eagle3-import dst OUT --base TARGET` reads. A draft with
    norms or a window that layout has no slot for (speculators 0.9.0's defaults: norm_before_fc, norm_before_residual,
    norm_output, a 2048-token sliding window) is refused in one line."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if config.get("speculators_model_type") != "eagle3":
        raise PeerFormatError(f"{src}/config.json: speculators_model_type {config.get('speculators_model_type')!r}, "
                              f"expected 'eagle3'")
    norms = [k for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output") if config.get(k)]
    if norms:
        raise PeerFormatError(f"{src}/config.json: {', '.join(norms)} set; the {ARCHITECTURE} layout (and our "
                              f"engine) has no such norm: train with --no-norm-before-residual --no-norm-before-fc "
                              f"--no-norm-output")
    if "sliding_attention" in config.get("transformer_layer_config", {}).get("layer_types", []):
        raise PeerFormatError(f"{src}/config.json: a sliding-window draft layer; the {ARCHITECTURE} layout has full "
                              f"attention: train with --full-attention-indices 0")
    state = load_file(str(src / "model.safetensors"))
    extra = [k for k in state if k.startswith(("fc_norm.", "input_norm.", "layers.1."))]
    if extra:
        raise PeerFormatError(f"{src}/model.safetensors: {extra[0]} has no slot in the {ARCHITECTURE} layout")
    out = {("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: v for k, v in state.items()
           if not k.startswith(SPECULATORS_DROPPED)}
    layer = dict(config["transformer_layer_config"])
    aux = config.get("eagle_aux_hidden_state_layer_ids")  # speculators' numbering: hidden_states indices
    layer.update(architectures=[ARCHITECTURE], model_type="llama", num_hidden_layers=1,
                 draft_vocab_size=int(config["draft_vocab_size"]), tie_word_embeddings=False,
                 norm_before_residual=False, target_hidden_size=int(layer["hidden_size"]))
    if aux:
        layer["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(tuple(aux)),
                                 "use_aux_hidden_state": True}
        layer["eagle_aux_hidden_state_layer_ids"] = list(aux)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(layer, indent=2))
    return dst


def check_cache_for_peers(folder: str | os.PathLike) -> Manifest:
    """The manifest of a complete cache (one line otherwise, naming the folder)."""
    return check_cache(folder, key="cache")
