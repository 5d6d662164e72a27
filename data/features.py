"""The feature cache: a frozen target's teacher-forced features, written once, read by drafter trainers.

`python -m train features` (train/features.py) writes a folder; `data.features=DIR` trains from it without a target
forward. Dimension letters: N tokens of a shard, n samples of a shard, D hidden, k soft-label width, B batch, T time.

Layout of DIR:
    manifest.json                 what the cache holds and for which target (`Manifest`); `complete` once every shard is
                                  written
    <split>-<00000>.safetensors   one shard: samples laid end to end (`offsets` [n + 1] cut them apart)
    prompts.json                  chat-formatted first user turns of validation conversations (greedy evaluation)
Tensors of a shard (`SHARD_KEYS`):
    input_ids [N] int32; loss_mask [N] uint8 (token t is a trained label: an assistant token); offsets [n + 1] int64
    hidden [N, D]                 the last layer's post-norm hidden state (what lm_head sees), in the cache dtype
    layer_<i> [N, D]              transformers' hidden_states[i] (0: embeddings, i: after decoder layer i; the last
                                  index, i = num_hidden_layers, is after the final norm, as transformers has it)
    topk_ids [N, k] int32, topk_probs [N, k] fp32, topk_rest [N] fp32   (k > 0 only)
                                  the target's next-token distribution at t (for token t + 1): its k most likely ids,
                                  their probabilities, and the mass left over. Computed where token t + 1 is trained
                                  (where a loss can read it); zero elsewhere.
A shard is written to a temporary name and renamed, so a shard that exists is whole; a killed run resumes at the first
missing one.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from data.atomic import write_file, write_json
from data.chat import IGNORE_INDEX
from data.errors import UsageError

MANIFEST = "manifest.json"
PROMPTS = "prompts.json"
FORMAT_VERSION = 1
STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SHARD = re.compile(r"^(train|validation)-(\d{5})\.safetensors$")


class FeatureCacheError(UsageError):
    """A cache that cannot serve this run: missing, incomplete, or made for another target, tokenizer or layers."""


@dataclass
class Manifest:
    """manifest.json. `target` / `tokenizer` are fingerprints (models.fingerprint), compared whole."""

    target: dict[str, Any]
    tokenizer: str
    hidden_size: int
    vocab_size: int
    layers: list[int]  # extra hidden_states indices stored as layer_<i>
    topk: int
    dtype: str  # storage dtype of hidden / layer_<i>
    recipe: dict[str, Any]  # the data config it was made from (and the data report, when there is one)
    shards: dict[str, int]  # split -> planned shard count
    samples: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    trained_tokens: dict[str, int] = field(default_factory=dict)
    complete: bool = False
    format_version: int = FORMAT_VERSION

    def write(self, folder: Path) -> None:
        write_json(folder / MANIFEST, asdict(self))

    @classmethod
    def read(cls, folder: str | os.PathLike) -> "Manifest":
        path = Path(folder) / MANIFEST
        if not path.is_file():
            raise FeatureCacheError(f"{folder}: not a feature cache (no {MANIFEST}); make one with "
                                    f"`python -m train features +model=<name> data=<recipe> output_dir={folder}`")
        try:
            raw = json.loads(path.read_text())
            manifest = cls(**raw)
        except (json.JSONDecodeError, TypeError) as e:
            raise FeatureCacheError(f"{path}: unreadable manifest ({e})") from None
        if manifest.format_version != FORMAT_VERSION:
            raise FeatureCacheError(f"{path}: cache format {manifest.format_version}, this draftsmith reads "
                                    f"{FORMAT_VERSION}; extract it again")
        return manifest

    def bytes_per_token(self) -> int:
        """Disk a stored token takes (shard tensors only)."""
        width = STORAGE_DTYPES[self.dtype].itemsize * self.hidden_size * (1 + len(self.layers))
        return width + 4 + 1 + (self.topk * 8 + 4 if self.topk else 0)

    def mismatch(self, other: "Manifest", counts: bool = True) -> str | None:
        """Why a cache described by `self` cannot be continued or read as `other` (the run's), or None. With
        counts=False the recipe's data config is compared but not what the data build counted (a run that has not
        built its data yet)."""
        if not same_target(self.target, other.target):
            return (f"it was made for another target ({_describe(self.target)}; this run: "
                    f"{_describe(other.target)})")
        if self.tokenizer != other.tokenizer:
            return "it was made with another tokenizer or chat template"
        for key in ("layers", "topk", "dtype"):
            if getattr(self, key) != getattr(other, key):
                return f"it holds features.{key}={getattr(self, key)}, this run asks for {getattr(other, key)}"
        if (self.recipe if counts else self.recipe.get("data")) != (other.recipe if counts else other.recipe.get("data")):
            return "it was made from other data (the data config or its files changed)"
        return None


def _describe(fingerprint: dict[str, Any]) -> str:
    return f"{fingerprint.get('model_type', '?')}, {fingerprint.get('path', '?')}, weights {fingerprint.get('weights', '?')[:12]}"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.safetensors"


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write a shard under a temporary name and rename it (data.atomic): a shard file that exists is complete."""
    write_file(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp)))


def remove_partial_shards(folder: Path) -> int:
    """Delete temporaries a killed run left behind; returns how many."""
    stale = list(folder.glob(".*.safetensors.tmp-*"))
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def same_target(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two target fingerprints name the same weights and config (wherever the folder lives)."""
    return (a.get("config"), a.get("weights")) == (b.get("config"), b.get("weights"))


def check_cache(folder: str | os.PathLike, target: dict[str, Any] | None = None, tokenizer: str | None = None,
                need_layers: Sequence[int] = (), need_topk: bool = False, key: str = "data.features") -> Manifest:
    """The manifest of a complete cache that serves this run; FeatureCacheError (one line, naming `key`=folder, or
    the folder alone when `key` is empty) otherwise. `target` / `tokenizer`: the run's own fingerprints
    (models.fingerprint), when it has them."""
    where = f"{key}={folder}" if key else str(folder)
    manifest = Manifest.read(folder)
    if not manifest.complete:
        raise FeatureCacheError(f"{where}: the feature cache is incomplete (extraction was stopped); "
                                f"rerun the same `python -m train features ...` command to finish it")
    if target is not None and not same_target(manifest.target, target):
        raise FeatureCacheError(f"{where}: made for another target ({_describe(manifest.target)}; "
                                f"this run: {_describe(target)})")
    if tokenizer is not None and manifest.tokenizer != tokenizer:
        raise FeatureCacheError(f"{where}: made with another tokenizer or chat template")
    missing = sorted(set(need_layers) - set(manifest.layers))
    if missing:
        raise FeatureCacheError(f"{where}: holds layers {manifest.layers}, this run needs {missing} too (it reads "
                                f"layers {sorted(set(need_layers))}); extract them with `python -m train features` "
                                f"method.layers={sorted(set(manifest.layers) | set(need_layers))}")
    if need_topk and not manifest.topk:
        raise FeatureCacheError(f"{where}: holds no soft labels (features.topk=0); this run needs them")
    return manifest


class FeatureDataset(torch.utils.data.Dataset):
    """The samples of one split of a cache; item i holds input_ids / labels [T] and the stored features [T, ...] of
    one sample (hidden and soft labels as fp32 tensors). Shards are memory-mapped: an item reads only its rows."""

    def __init__(self, folder: str | os.PathLike, split: str, layers: Sequence[int] = (), topk: bool = False):
        self.folder = Path(folder)
        self.split = split
        self.keys = ["hidden", *(f"layer_{i}" for i in layers)] + (["topk_ids", "topk_probs"] if topk else [])
        self.index: list[tuple[str, int, int]] = []  # (shard file, start, end) per sample
        shards = sorted(p.name for p in self.folder.iterdir() if (m := _SHARD.match(p.name)) and m[1] == split)
        for name in shards:
            with safe_open(str(self.folder / name), framework="pt") as f:
                offsets = f.get_tensor("offsets").tolist()
            self.index.extend((name, a, b) for a, b in zip(offsets[:-1], offsets[1:]))
        self._handles: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.index)

    @property
    def tokens(self) -> int:
        return sum(b - a for _, a, b in self.index)

    def sample(self, max_tokens: int, seed: int) -> "FeatureDataset":
        """A seeded random sample of whole samples, taken until their tokens reach `max_tokens` (data.max_tokens
        on a cache: the same budget a recipe applies to text)."""
        order = torch.randperm(len(self.index), generator=torch.Generator().manual_seed(seed)).tolist()
        kept, tokens = [], 0
        for i in order:
            if tokens >= max_tokens:
                break
            kept.append(self.index[i])
            tokens += self.index[i][2] - self.index[i][1]
        subset = object.__new__(FeatureDataset)
        subset.__dict__.update(self.__getstate__())
        subset.index = kept
        return subset

    def _open(self, name: str):
        if name not in self._handles:
            self._handles[name] = safe_open(str(self.folder / name), framework="pt")
        return self._handles[name]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        name, a, b = self.index[i]
        f = self._open(name)
        ids = f.get_slice("input_ids")[a:b].long()
        mask = f.get_slice("loss_mask")[a:b].bool()
        item = {"input_ids": ids, "labels": torch.where(mask, ids, torch.full_like(ids, IGNORE_INDEX))}
        for key in self.keys:
            value = f.get_slice(key)[a:b]
            item[key] = value.long() if key == "topk_ids" else value.float()
        return item

    def ids_and_labels(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each sample's (input_ids, labels) [T] (no features read)."""
        for name, a, b in self.index:
            f = self._open(name)
            ids = f.get_slice("input_ids")[a:b].long()
            yield ids, torch.where(f.get_slice("loss_mask")[a:b].bool(), ids, torch.full_like(ids, IGNORE_INDEX))

    def labels(self) -> Iterator[torch.Tensor]:
        """Each sample's labels [T] (no features read)."""
        for _, labels in self.ids_and_labels():
            yield labels

    def __getstate__(self):  # DataLoader workers reopen the shards themselves
        return {**self.__dict__, "_handles": {}}


@dataclass(frozen=True)
class FeatureCollator:
    """Right-pads FeatureDataset items: input_ids / attention_mask / labels [B, T] as ChatCollator does, and every
    feature tensor to [B, T, ...] with zeros (pad positions have no label, so no loss reads them)."""

    pad_token_id: int

    def __call__(self, items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        width = max(len(item["input_ids"]) for item in items)
        out: dict[str, torch.Tensor] = {}
        for key, value in items[0].items():
            fill = self.pad_token_id if key == "input_ids" else IGNORE_INDEX if key == "labels" else 0
            batch = value.new_full((len(items), width, *value.shape[1:]), fill)
            for b, item in enumerate(items):
                batch[b, : len(item[key])] = item[key]
            out[key] = batch
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for b, item in enumerate(items):
            mask[b, : len(item["input_ids"])] = 1
        out["attention_mask"] = mask
        return out


def read_prompts(folder: str | os.PathLike) -> list[list[int]]:
    path = Path(folder) / PROMPTS
    return json.loads(path.read_text()) if path.is_file() else []
