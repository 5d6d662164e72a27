"""Medusa heads in and out of other projects' layouts: the original repository's checkpoints in and out (`export_medusa`,
for running the heads in FasterDecoding's own engine), vLLM's layout out.

Dimension letters: K heads, L residual blocks per head, D hidden, V vocab.

Original layout (FasterDecoding/Medusa, `MedusaModel.medusa_head`: a ModuleList of one Sequential per head, each
L ResBlocks then an optional bias-free vocab projection). File `medusa_lm_head.safetensors`, or the legacy pickle
`medusa_lm_head.pt`; keys relative to that ModuleList, optionally prefixed "medusa_head.":
    {k}.{j}.linear.weight [D, D], {k}.{j}.linear.bias [D]    ResBlock j of head k, j < L: h + SiLU(W h + b)
    {k}.{L}.weight [V, D]                                     head k's vocab projection; absent from "version 2"
                                                              heads, which reuse the base model's lm_head
`config.json` may state medusa_num_heads, medusa_num_layers and base_model_name_or_path; the counts are read from
the weights and must agree with the config where it states them. The reference builds its blocks as
`[ResBlock(d)] * L`, so for L > 1 a head's blocks share one weight that the file repeats under every j; importing
gives every block its own copy of the same values, which computes the same function.

vLLM layout (vllm/model_executor/models/medusa.py, vllm/transformers_utils/configs/medusa.py):
    config.json        model_type "medusa", architectures ["MedusaModel"], hidden_size, vocab_size, num_heads,
                       num_hidden_layers, truncated_vocab_size, medusa_fc_bias (the blocks' Linear carries a bias
                       only when true), original_lm_head (true: one lm head shared by every head)
    model.safetensors  blocks.{k}.layers.{j}.weight [D, D], blocks.{k}.layers.{j}.bias [D],
                       lm_heads.{k}.weight [V, D] (with original_lm_head: lm_heads.0.weight only)
vLLM's config loader renames every key holding "num" and "heads" to num_heads ("num" and "layers" to
num_hidden_layers), so the exported config holds no other such key.

An imported checkpoint is a draftsmith one: `convert_medusa` writes it through models.checkpoint's one writer
(`save_drafter`). The exports write foreign layouts: they share only its atomic primitive, `atomic_write_dir`
(config.json last), not its config skeleton or model card.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from models.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    LoadedDrafter,
    atomic_write_dir,
    check_compatible,
    load_drafter,
    medusa_config_dict,
    read_drafter_config,
    read_json_object,
    save_drafter,
)
from models.builtin import TOKENIZER_COPY_FILES
from models.loading import load_target
from models.refs import locate
from models.medusa import MedusaConfig, MedusaHeads

MEDUSA_WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")  # preferred first
VLLM_WEIGHTS_NAME = "model.safetensors"
SOURCE_FORMAT = "FasterDecoding/Medusa"
_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")
_PREFIX = "medusa_head."  # keys of the whole MedusaModel state dict


@dataclass(frozen=True)
class MedusaLayout:
    """What the weights of an original-Medusa checkpoint say about its heads."""

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int | None  # None when the heads reuse the base lm_head (no projection in the file)
    dtype: torch.dtype

    @property
    def share_lm_head(self) -> bool:
        return self.vocab_size is None


def medusa_weights_file(path: str | os.PathLike) -> Path | None:
    path = Path(path)
    return next((path / name for name in MEDUSA_WEIGHT_FILES if (path / name).is_file()), None)


def is_medusa_dir(path: str | os.PathLike) -> bool:
    """True for a directory holding medusa_lm_head.* and no draftsmith config.json (one without "drafter_type")."""
    path = Path(path)
    if not path.is_dir() or medusa_weights_file(path) is None:
        return False
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return True
    return not (isinstance(config, dict) and "drafter_type" in config)


def read_medusa_state(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of medusa_lm_head.safetensors, or of medusa_lm_head.pt read without executing pickled code."""
    try:
        if file.suffix == ".safetensors":
            state = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except (SafetensorError, pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{file}: unreadable ({first})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{file}: expected a state dict of tensors, got {type(state).__name__}")
    return state


def infer_layout(state: dict[str, torch.Tensor], file: Path) -> MedusaLayout:
    """Read K, L, D, V and the layout from the keys and shapes; raise CheckpointError naming the first bad key."""
    blocks: dict[int, set[int]] = {}
    projections: dict[int, int] = {}
    for key in state:
        match = _KEY.match(key)
        if match is None:
            raise CheckpointError(f"{file}: unexpected key {key!r}; not an original Medusa head checkpoint")
        k, j, leaf = int(match[1]), int(match[2]), match[3]
        if leaf == "weight":
            projections[k] = j
        else:
            blocks.setdefault(k, set()).add(j)
    head_ids = sorted(set(blocks) | set(projections))
    if not head_ids:
        raise CheckpointError(f"{file}: holds no Medusa head weights")
    if head_ids != list(range(len(head_ids))):
        raise CheckpointError(f"{file}: head indices {head_ids} are not 0..{len(head_ids) - 1}")
    num_layers = len(blocks.get(0, ()))
    for k in head_ids:
        if blocks.get(k, set()) != set(range(num_layers)):
            raise CheckpointError(f"{file}: head {k} has blocks {sorted(blocks.get(k, ()))}, head 0 has 0..{num_layers - 1}")
        if (k in projections) != (0 in projections) or projections.get(k, num_layers) != num_layers:
            raise CheckpointError(f"{file}: head {k}'s vocab projection differs from head 0's (expected "
                                  f"'{{k}}.{num_layers}.weight' on every head or on none)")
    hidden_size = state["0.0.linear.weight" if num_layers else "0.0.weight"].shape[1]
    vocab_size = state[f"0.{num_layers}.weight"].shape[0] if 0 in projections else None
    expected = {"linear.weight": (hidden_size, hidden_size), "linear.bias": (hidden_size,), "weight": (vocab_size, hidden_size)}
    for key, tensor in state.items():
        leaf = _KEY.match(key)[3]
        if tuple(tensor.shape) != expected[leaf] or not tensor.is_floating_point():
            raise CheckpointError(f"{file}: {key!r} has shape {tuple(tensor.shape)} {tensor.dtype}, expected {expected[leaf]}")
    return MedusaLayout(len(head_ids), num_layers, hidden_size, vocab_size, next(iter(state.values())).dtype)


def import_medusa(
    path: str | os.PathLike, num_heads: int | None = None, vocab_size: int | None = None
) -> tuple[MedusaHeads, str | None]:
    """Heads from an original-Medusa directory, in the source dtype, plus its base_model_name_or_path (None if unstated).

    `num_heads` keeps the first n heads (the reference's `medusa_num_heads` override). `vocab_size` is needed only
    for heads that reuse the base lm_head; it defaults to config.json's vocab_size, then to the base model's config
    when that is available offline.
    """
    path = Path(path)
    file = medusa_weights_file(path)
    if file is None:
        raise CheckpointError(f"{path}: no {' or '.join(MEDUSA_WEIGHT_FILES)}; not an original Medusa checkpoint")
    config = read_medusa_config(path)
    state = {key.removeprefix(_PREFIX): t for key, t in read_medusa_state(file).items()}
    layout = infer_layout(state, file)
    config_file = path / CONFIG_NAME
    stated_layers = config.get("medusa_num_layers")
    if stated_layers is not None and int(stated_layers) != layout.num_layers:
        raise CheckpointError(f"{config_file}: medusa_num_layers={stated_layers} but {file.name} holds {layout.num_layers} blocks per head")
    if num_heads is None:
        stated_heads = config.get("medusa_num_heads")
        if stated_heads is not None and int(stated_heads) != layout.num_heads:
            raise CheckpointError(
                f"{config_file}: medusa_num_heads={stated_heads} but {file.name} holds {layout.num_heads} heads; "
                "pass num_heads (--num-heads) to keep the first n"
            )
        num_heads = layout.num_heads
    if not 1 <= num_heads <= layout.num_heads:
        raise CheckpointError(f"num_heads={num_heads}: {file} holds {layout.num_heads} heads")
    if "hidden_size" in config and int(config["hidden_size"]) != layout.hidden_size:
        raise CheckpointError(f"{config_file}: hidden_size={config['hidden_size']} but {file.name} has D={layout.hidden_size}")
    base = config.get("base_model_name_or_path")
    if vocab_size is not None and layout.vocab_size is not None and vocab_size != layout.vocab_size:
        raise CheckpointError(f"vocab_size={vocab_size}: the heads in {file} project onto V={layout.vocab_size}")
    if layout.share_lm_head:
        vocab_size = vocab_size or config.get("vocab_size") or base_vocab_size(base)
        if not vocab_size:
            raise CheckpointError(
                f"{file}: heads reuse the base lm_head and neither {config_file} (vocab_size) nor the base model "
                f"{base!r} (offline) gives the vocabulary size; pass vocab_size (--vocab-size)"
            )
    heads = MedusaHeads(MedusaConfig(
        num_heads=num_heads,
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        vocab_size=int(layout.vocab_size or vocab_size),
        share_lm_head=layout.share_lm_head,
    )).to(layout.dtype)
    with torch.no_grad():
        for k, head in enumerate(heads.heads):
            for j, block in enumerate(head.blocks):
                block.linear.weight.copy_(state[f"{k}.{j}.linear.weight"])
                block.linear.bias.copy_(state[f"{k}.{j}.linear.bias"])
            if head.lm_head is not None:
                head.lm_head.weight.copy_(state[f"{k}.{layout.num_layers}.weight"])
    return heads, base


def read_medusa_config(path: Path) -> dict[str, Any]:
    """config.json of an original-Medusa directory; {} when absent (a bare weights file)."""
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        return {}
    return read_json_object(config_file)


def base_vocab_size(base: str | None) -> int | None:
    """The base model's vocabulary size from its config, without network access; None when unavailable."""
    if not base:
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(locate(base), local_files_only=True)
    except (OSError, ValueError, ImportError):  # not local, not cached (ModelLoadError is a ValueError), no builder
        return None
    return getattr(config.get_text_config(), "vocab_size", None)


def load_heads(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
               ) -> LoadedDrafter:
    """Medusa heads from an original-Medusa directory (medusa_lm_head.*) or a draftsmith checkpoint."""
    if is_medusa_dir(path):
        return load_medusa_dir(path, device, dtype)
    return load_drafter(path, device, dtype)


def load_medusa_dir(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> LoadedDrafter:
    """An original-Medusa directory as a LoadedDrafter (see `load_heads`)."""
    heads, base = import_medusa(path)
    config = {**medusa_config_dict(heads.config), "base_model_name_or_path": base, "source_format": SOURCE_FORMAT}
    heads.to(device=device, dtype=dtype)
    heads.eval().requires_grad_(False)
    return LoadedDrafter(config=config, heads=heads)


class _CopiedTokenizerFiles:
    """Stands in for a tokenizer in save_drafter: `save_pretrained` copies the source's tokenizer files, so they land
    inside the atomic write without being parsed."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files

    def save_pretrained(self, directory: str) -> None:
        for file in self.files:
            shutil.copy2(file, Path(directory) / file.name)


def convert_medusa(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    num_heads: int | None = None,
    vocab_size: int | None = None,
    base_model: str | None = None,
) -> Path:
    """Write the original-Medusa checkpoint `src` as a draftsmith checkpoint at `dst` (atomic; tokenizer files are
    copied). `base_model` overrides or supplies base_model_name_or_path."""
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: destination must differ from the source directory")
    heads, base = import_medusa(src, num_heads=num_heads, vocab_size=vocab_size)
    base = base_model or base
    if not base:
        raise CheckpointError(f"{src / CONFIG_NAME}: no base_model_name_or_path; pass base_model (--base-model)")
    tokenizer_files = [src / name for name in TOKENIZER_COPY_FILES if (src / name).is_file()]
    extra = {"method": "medusa (imported)", "source_format": SOURCE_FORMAT, "source": str(src)}
    return save_drafter(dst, heads, base, tokenizer=_CopiedTokenizerFiles(tokenizer_files) if tokenizer_files else None, extra=extra)


def vllm_config(heads: MedusaHeads, base_model_name_or_path: str | None) -> dict[str, Any]:
    config = heads.config
    dtype = next(heads.parameters()).dtype
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "truncated_vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "medusa_fc_bias": True,
        "original_lm_head": config.share_lm_head,
        "max_paths": 64,
        "topk": 10,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "base_model_name_or_path": base_model_name_or_path,
    }


def vllm_state(heads: MedusaHeads, base_lm_head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The weights under vLLM's names. Heads that reuse the base lm_head need its weight [V, D] as `base_lm_head`."""
    state: dict[str, torch.Tensor] = {}
    for k, head in enumerate(heads.heads):
        for j, block in enumerate(head.blocks):
            state[f"blocks.{k}.layers.{j}.weight"] = block.linear.weight
            state[f"blocks.{k}.layers.{j}.bias"] = block.linear.bias
        if head.lm_head is not None:
            state[f"lm_heads.{k}.weight"] = head.lm_head.weight
    if heads.config.share_lm_head:
        if base_lm_head is None:
            raise ValueError("these heads reuse the base lm_head; pass its weight as base_lm_head")
        state["lm_heads.0.weight"] = base_lm_head.to(next(heads.parameters()).dtype)
    return {name: t.detach().to("cpu").contiguous() for name, t in state.items()}


def base_lm_head_weight(base_model: str, heads: MedusaHeads, drafter_config: dict[str, Any]) -> torch.Tensor:
    """The base model's output-embedding weight [V, D], after checking that the heads fit the model."""
    dtype = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[next(heads.parameters()).dtype]
    model = load_target(base_model, dtype=dtype)
    check_compatible(drafter_config, model.config)
    return model.get_output_embeddings().weight.detach()


def stored_dtype(path: Path) -> torch.dtype | None:
    """The dtype of a draftsmith checkpoint's stored weights (load_drafter builds fp32 heads unless told); None for
    an original-Medusa directory, whose import keeps the source dtype itself."""
    weights = path / WEIGHTS_NAME
    if is_medusa_dir(path) or not weights.is_file():
        return None
    try:
        with safe_open(str(weights), framework="pt") as f:
            first = next(iter(f.keys()), None)
            return f.get_tensor(first).dtype if first is not None else None
    except (SafetensorError, OSError):
        return None  # load_drafter reports the unreadable file


def check_vllm_exportable(src: str | os.PathLike) -> None:
    """CheckpointError (one line) when the drafter at `src` has no vLLM Medusa layout, read from its config alone (no
    weights load). vLLM's Medusa maps a truncated vocabulary (`token_map`) only onto one lm_head shared by all heads
    (`original_lm_head`); heads that each project onto their own draft vocabulary cannot be written that way."""
    if is_medusa_dir(src):
        return
    size = read_drafter_config(src).get("draft_vocab_size")
    if size is not None:
        raise CheckpointError(f"{src}: heads with a draft vocabulary (draft_vocab_size={size}) have no vLLM layout "
                              f"(vLLM truncates the vocabulary of one shared lm_head only); train with "
                              f"method.draft_vocab=null to serve the heads in vLLM")


def export_vllm(src: str | os.PathLike, dst: str | os.PathLike, base_model: str | None = None) -> Path:
    """Write the drafter at `src` (draftsmith or original-Medusa directory) in vLLM's Medusa layout at `dst`
    (atomic, config.json last). Heads that reuse the base lm_head embed its weight, read from `base_model`
    (default: the checkpoint's base_model_name_or_path)."""
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: destination must differ from the source directory")
    check_vllm_exportable(src)
    loaded = load_heads(src, dtype=stored_dtype(src))
    base = base_model or loaded.config.get("base_model_name_or_path")
    base_lm_head = None
    if loaded.heads.config.share_lm_head:
        if not base:
            raise CheckpointError(f"{src}: heads reuse the base lm_head and no base model is known; pass base_model (--base-model)")
        base_lm_head = base_lm_head_weight(base, loaded.heads, loaded.config)
    state = vllm_state(loaded.heads, base_lm_head)
    config = vllm_config(loaded.heads, base)

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / VLLM_WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    atomic_write_dir(dst, write)
    return dst


def medusa_state(heads: MedusaHeads, base_lm_head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The weights under the original layout's keys, every head with its own vocab projection: heads that reuse the
    base lm_head get a copy of `base_lm_head` [V, D] (the original `MedusaModel` builds one projection per head, so
    this is the only layout every version of its loader reads the same way)."""
    config = heads.config
    if config.share_lm_head and base_lm_head is None:
        raise ValueError("these heads reuse the base lm_head; pass its weight as base_lm_head")
    dtype = next(heads.parameters()).dtype
    state: dict[str, torch.Tensor] = {}
    for k, head in enumerate(heads.heads):
        for j, block in enumerate(head.blocks):
            state[f"{k}.{j}.linear.weight"] = block.linear.weight
            state[f"{k}.{j}.linear.bias"] = block.linear.bias
        projection = head.lm_head.weight if head.lm_head is not None else base_lm_head
        state[f"{k}.{config.num_layers}.weight"] = projection.to(dtype)
    # clone: torch.save would otherwise store one shared storage for the K copies of the lm_head
    return {name: t.detach().to("cpu").clone().contiguous() for name, t in state.items()}


def check_medusa_blocks_repeatable(heads: MedusaHeads, src: Path) -> None:
    """The original builds a head's L blocks as `[ResBlock(d)] * L` (one shared weight): heads whose blocks differ
    cannot be expressed in its layout."""
    for k, head in enumerate(heads.heads):
        first = head.blocks[0] if len(head.blocks) else None
        for j, block in enumerate(list(head.blocks)[1:], start=1):
            same = all(torch.equal(a, b) for a, b in zip(first.parameters(), block.parameters()))
            if not same:
                raise CheckpointError(f"{src}: head {k} block {j} differs from block 0; FasterDecoding/Medusa shares "
                                      f"one block weight per head (num_layers > 1 is not expressible)")


def export_medusa(src: str | os.PathLike, dst: str | os.PathLike, base_model: str | None = None,
                  base_model_name_or_path: str | None = None) -> Path:
    """Write the drafter at `src` in FasterDecoding/Medusa's layout at `dst` (atomic, config.json last):
    `medusa_lm_head.pt` (a pickled state dict of tensors, the file the original loader reads) and `config.json`
    with medusa_num_heads, medusa_num_layers, base_model_name_or_path, hidden_size and vocab_size. Heads that reuse
    the base lm_head get a copy of it each, read from `base_model` (default: the checkpoint's
    base_model_name_or_path). `base_model_name_or_path` is what config.json names as the base (default: the
    checkpoint's); the original's loader opens it with `from_pretrained`, so give it a Hugging Face folder there."""
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: destination must differ from the source directory")
    loaded = load_drafter(src, dtype=stored_dtype(src))
    heads = loaded.heads
    if heads.vocab_ids is not None:
        raise CheckpointError(f"{src}: heads with a draft vocabulary (draft_vocab_size="
                              f"{heads.config.draft_vocab_size}) have no FasterDecoding/Medusa layout; train without "
                              f"method.draft_vocab to export")
    check_medusa_blocks_repeatable(heads, src)
    base = base_model or loaded.config.get("base_model_name_or_path")
    base_lm_head = None
    if heads.config.share_lm_head:
        if not base:
            raise CheckpointError(f"{src}: heads reuse the base lm_head and no base model is known; pass base_model")
        base_lm_head = base_lm_head_weight(base, heads, loaded.config)
    state = medusa_state(heads, base_lm_head)
    config = {
        "medusa_num_heads": heads.config.num_heads,
        "medusa_num_layers": heads.config.num_layers,
        "base_model_name_or_path": base_model_name_or_path or loaded.config.get("base_model_name_or_path"),
        "hidden_size": heads.config.hidden_size,
        "vocab_size": heads.config.vocab_size,
    }

    def write(tmp: Path) -> None:
        torch.save(state, tmp / MEDUSA_WEIGHT_FILES[1])
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    atomic_write_dir(dst, write)
    return dst
