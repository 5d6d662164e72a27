"""One on-disk format for every drafter.

A drafter checkpoint is a directory:
    config.json            {"drafter_type", "draftsmith_version", "base_model_name_or_path", ...type-specific keys}
    drafter.safetensors    the drafter's weights (safetensors only: no pickle)
    token_counts.safetensors  optional (Medusa trainers write it): "counts" [V], how often each token was a trained
                           label in the training data; `load(head_vocab=S)` drafts from the S most frequent
    tokenizer files        when a tokenizer was given
    README.md              model card (models.model_card: base model, method, data, steps, metrics, command)
    draft/                 drafter_type "draft_model": the draft causal LM (`save_pretrained`), config.json
                           "draft_model": {"path": "draft"}; written by `save_draft_model`. Tensors the draft shares
                           with its target (an early-exit draft's frozen embeddings and lm_head) are left out and
                           listed in "draft_model": {"shared_with_target": {name: fingerprint}}; loading takes the
                           target's own (models.shared_tensors), so neither the file nor the served draft holds a copy
    adapter/ | backbone/   optional fine-tuned backbone (Medusa-2), named by config.json "backbone":
                           {"format": "lora_adapter", "path": "adapter"}  a peft LoRA adapter for the base model, or
                           {"format": "merged", "path": "backbone"}       a full `save_pretrained` model + tokenizer.
                           `load_drafter_target` loads the target either way (the base model when there is none).

Every drafter type is written by one writer, `write_checkpoint`: it owns what all checkpoints share (the config.json
skeleton, the refusal of non-finite weights, tokenizer files, the model card, the backbone subfolder, config.json last)
and each `save_*` function only describes its own files as a `Payload`. Writes are atomic at the checkpoint level
(`atomic_write_dir`): files are written to a temporary sibling directory and moved in with config.json last;
config.json is absent while files are swapped, so a reader never loads a torn checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from data.atomic import staged_dir
from data.errors import UsageError
from models.loading import load_target
from models.medusa import MedusaConfig, MedusaHeads, check_vocab_ids
from models.model_card import model_card
from models.refs import ModelRef
from models.shared_tensors import DrafterMismatchError, shared_with_target
from models.stopper import save_stopper

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "drafter.safetensors"
TOKEN_COUNTS_NAME = "token_counts.safetensors"
HEAD_FORMATS = {False: "per_head_lm_head", True: "shared_lm_head"}
BACKBONE_DIRS = {"lora_adapter": "adapter", "merged": "backbone"}  # config.json "backbone.format" -> subfolder
DRAFT_MODEL_DIR = "draft"  # drafter_type "draft_model": the draft causal LM's subfolder
SHARED_KEY = "shared_with_target"  # draft_model: the tensors left out, taken from the target (models.shared_tensors)


class CheckpointError(UsageError):
    """A drafter checkpoint is missing, torn, or malformed."""


@dataclass(frozen=True)
class BackboneWriter:
    """A fine-tuned backbone saved with the drafter. `write(folder)` fills an empty folder: a peft adapter
    (`save_pretrained` of a PeftModel) for format "lora_adapter", a full `save_pretrained` model for "merged".
    `module`, when given, is the backbone whose parameters `write` stores: they are checked finite before anything
    is written."""

    format: str
    write: Callable[[Path], None]
    module: torch.nn.Module | None = None

    def __post_init__(self) -> None:
        if self.format not in BACKBONE_DIRS:
            raise ValueError(f"backbone format must be one of {', '.join(BACKBONE_DIRS)}, got {self.format!r}")


@dataclass(frozen=True)
class LoadedDrafter:
    config: dict[str, Any]
    heads: MedusaHeads


def draftsmith_version() -> str:
    try:
        return metadata.version("draftsmith")
    except metadata.PackageNotFoundError:
        return "0.0.0+local"


def medusa_config_dict(config: MedusaConfig) -> dict[str, Any]:
    return {
        "drafter_type": "medusa",
        "num_heads": config.num_heads,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "head_format": HEAD_FORMATS[config.share_lm_head],
        **({} if config.draft_vocab_size is None else {"draft_vocab_size": config.draft_vocab_size}),
    }


def _write_nothing(folder: Path) -> None:
    """The payload of a drafter whose weights are all in the backbone subfolder (CLLM)."""


@dataclass(frozen=True)
class Payload:
    """What one drafter type adds to the layout every checkpoint shares (see `write_checkpoint`)."""

    drafter_type: str
    config: dict[str, Any] = field(default_factory=dict)  # type-specific config.json keys
    weights: Mapping[str, torch.Tensor] = field(default_factory=dict)  # what it stores; non-finite ones are refused
    write: Callable[[Path], None] = _write_nothing  # writes the type's own files into the (temporary) checkpoint folder
    tokenizer_dirs: tuple[str, ...] = ()  # subfolders that get the tokenizer files too (the top level always does)


def write_checkpoint(
    output_dir: str | os.PathLike,
    base_model_name_or_path: str,
    payload: Payload,
    tokenizer: Any = None,
    extra: dict[str, Any] | None = None,
    backbone: BackboneWriter | None = None,
) -> Path:
    """Write a draftsmith checkpoint at `output_dir`, atomically (`atomic_write_dir`), and return its path.

    Before anything is written: CheckpointError when a tensor of `payload.weights` or a parameter of
    `backbone.module` is non-finite. Then, in a temporary folder: the payload's files, the tokenizer files (top level
    and `payload.tokenizer_dirs`), the backbone subfolder, README.md (model card), config.json last. config.json is
    `payload.config` plus the skeleton every type shares: drafter_type, base_model_name_or_path, draftsmith_version,
    "training" (`extra`, when given) and "backbone" ({"format", "path"}, when given); skeleton keys win over the
    payload's. A storage failure is a CheckpointError; on any failure `output_dir` keeps its previous checkpoint.
    """
    output_dir = Path(output_dir)
    refuse_non_finite(output_dir, payload.weights)
    if backbone is not None and backbone.module is not None:
        refuse_non_finite(output_dir, dict(backbone.module.named_parameters()))
    config = {
        **payload.config,
        "drafter_type": payload.drafter_type,
        "base_model_name_or_path": base_model_name_or_path,
        "draftsmith_version": draftsmith_version(),
    }
    if extra:
        config["training"] = extra
    if backbone is not None:
        config["backbone"] = {"format": backbone.format, "path": BACKBONE_DIRS[backbone.format]}

    def write(tmp: Path) -> None:
        payload.write(tmp)
        if tokenizer is not None:
            for folder in (*payload.tokenizer_dirs, "."):
                tokenizer.save_pretrained(str(tmp / folder))
        if backbone is not None:
            folder = tmp / BACKBONE_DIRS[backbone.format]
            folder.mkdir()
            backbone.write(folder)
        (tmp / "README.md").write_text(model_card(config))
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    atomic_write_dir(output_dir, write)
    return output_dir


def refuse_non_finite(output_dir: Path, weights: Mapping[str, torch.Tensor]) -> None:
    """CheckpointError naming the first non-finite floating-point tensors (NaN/inf from a diverged run): a checkpoint
    that loads fine and drafts garbage is worse than none. Tensors on the meta device (offloaded) hold no values."""
    bad = [name for name, t in weights.items()
           if t.is_floating_point() and t.device.type != "meta" and not torch.isfinite(t).all()]
    if bad:
        raise CheckpointError(f"{output_dir}: refusing to save non-finite weights ({', '.join(bad[:3])})")


def save_drafter(
    output_dir: str | os.PathLike,
    heads: MedusaHeads,
    base_model_name_or_path: str,
    tokenizer: Any = None,
    extra: dict[str, Any] | None = None,
    backbone: BackboneWriter | None = None,
    token_counts: torch.Tensor | None = None,
) -> Path:
    """Write `heads` as a draftsmith checkpoint at `output_dir`, atomically. `extra` lands in config.json under
    "training" and feeds the model card; `backbone` (Medusa-2) adds the fine-tuned backbone's subfolder;
    `token_counts` [V] (training label frequencies) becomes token_counts.safetensors. Returns the checkpoint path."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in heads.state_dict().items()}
    if token_counts is not None and token_counts.shape != (heads.config.vocab_size,):
        raise CheckpointError(f"{output_dir}: token_counts has shape {tuple(token_counts.shape)}, expected "
                              f"({heads.config.vocab_size},)")

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "drafter_type": "medusa"})
        if token_counts is not None:
            save_file({"counts": token_counts.detach().to("cpu", torch.int64).contiguous()},
                      str(tmp / TOKEN_COUNTS_NAME), metadata={"format": "pt"})

    payload = Payload("medusa", medusa_config_dict(heads.config), tensors, write)
    return write_checkpoint(output_dir, base_model_name_or_path, payload, tokenizer, extra, backbone)


def save_model_drafter(
    output_dir: str | os.PathLike,
    drafter_type: str,
    base_model_name_or_path: str,
    backbone: BackboneWriter,
    settings: dict[str, Any] | None = None,
    tokenizer: Any = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a drafter whose weights ARE the fine-tuned target (CLLM: Jacobi decoding needs no extra module),
    atomically: config.json ({"drafter_type", ..., **settings, "backbone"}), the backbone subfolder, tokenizer files
    and the model card; no drafter.safetensors. `load_drafter_target` loads the model back."""
    payload = Payload(drafter_type, dict(settings or {}))
    return write_checkpoint(output_dir, base_model_name_or_path, payload, tokenizer, extra, backbone)


def atomic_write_dir(target: Path, write: Callable[[Path], None]) -> None:
    """Call write(tmp_dir) on a fresh temporary sibling of `target`, then merge its files into `target` with
    config.json, the checkpoint's completion marker, removed first and moved in last (data.atomic.staged_dir): a
    reader that finds config.json finds a complete checkpoint. Other files already in `target` (Hydra logs, trainer
    checkpoints) are left alone; a subfolder written by `write` replaces the same-named one whole. A storage failure
    (disk full, read-only, a file in the way) raises CheckpointError naming `target` and leaves no temporary
    directory; `target` is created only once everything was written."""
    try:
        with staged_dir(target, marker=CONFIG_NAME) as tmp:
            write(tmp)
    except OSError as e:
        raise CheckpointError(f"{target}: cannot write checkpoint ({e.strerror or e})") from None


def read_json_object(config_file: Path) -> dict[str, Any]:
    """A JSON object from a file; CheckpointError naming the file when it is not valid JSON or not an object."""
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object")
    return raw


def read_drafter_config(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    config_file = path / CONFIG_NAME
    if not path.is_dir():
        raise CheckpointError(f"{path}: drafter checkpoint directory not found")
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing; {path} is not a complete draftsmith checkpoint")
    config = read_json_object(config_file)
    if "drafter_type" not in config:
        raise CheckpointError(f"{config_file}: no 'drafter_type' key; not a draftsmith checkpoint")
    return config


def load_drafter(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> LoadedDrafter:
    """Read a draftsmith checkpoint written by `save_drafter` (models.interop.load_heads also reads the original
    Medusa repository's directories)."""
    path = Path(path)
    config = read_drafter_config(path)
    if config["drafter_type"] != "medusa":
        raise CheckpointError(f"{path / CONFIG_NAME}: drafter_type {config['drafter_type']!r} has no weights loader")
    try:
        medusa_config = MedusaConfig(
            num_heads=int(config["num_heads"]),
            num_layers=int(config["num_layers"]),
            hidden_size=int(config["hidden_size"]),
            vocab_size=int(config["vocab_size"]),
            share_lm_head=config.get("head_format", HEAD_FORMATS[False]) == HEAD_FORMATS[True],
            draft_vocab_size=None if config.get("draft_vocab_size") is None else int(config["draft_vocab_size"]),
        )
    except KeyError as e:
        raise CheckpointError(f"{path / CONFIG_NAME}: missing key {e.args[0]!r}") from None
    except ValueError as e:  # a key out of range (MedusaConfig's checks)
        raise CheckpointError(f"{path / CONFIG_NAME}: {e}") from None
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights}: unreadable safetensors ({e})") from None
    check_draft_vocab(state, medusa_config, weights)
    heads = MedusaHeads(medusa_config)
    try:
        heads.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise CheckpointError(f"{weights}: weights do not match {CONFIG_NAME} ({first})") from None
    heads.to(device=device, dtype=dtype)
    heads.eval().requires_grad_(False)
    return LoadedDrafter(config=config, heads=heads)


def check_draft_vocab(state: Mapping[str, torch.Tensor], config: MedusaConfig, weights: Path) -> None:
    """A Medusa checkpoint's draft vocabulary, at load: `vocab_ids` holds draft_vocab_size distinct ids of the
    vocabulary (`check_vocab_ids`), so a bad list is refused naming the file instead of failing inside an
    index_select at the first draft. CheckpointError (one line)."""
    if config.draft_vocab_size is None:
        return  # an unexpected vocab_ids is reported by load_state_dict
    ids = state.get("vocab_ids")
    if ids is None:
        raise CheckpointError(f"{weights}: no vocab_ids, but {CONFIG_NAME} sets draft_vocab_size="
                              f"{config.draft_vocab_size}")
    check_vocab_ids(ids, config.draft_vocab_size, config.vocab_size, f"{weights}: vocab_ids", CheckpointError)


def read_token_counts(path: str | os.PathLike) -> torch.Tensor:
    """The checkpoint's token_counts.safetensors "counts" [V]; one clear line when it is missing or unreadable."""
    file = Path(path) / TOKEN_COUNTS_NAME
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; head_vocab needs the training data's token counts (medusa1/medusa2 "
                              f"write them; older checkpoints and imported Medusa heads lack them)")
    try:
        return load_file(str(file))["counts"]
    except (SafetensorError, OSError, KeyError) as e:
        raise CheckpointError(f"{file}: unreadable token counts ({e})") from None


def head_vocabulary(path: str | os.PathLike, size: int, topk: int) -> torch.Tensor:
    """The `size` token ids most frequent in the checkpoint's token counts, [size] most frequent first (ties by id);
    one clear line when the counts are missing or `size` does not fit the vocabulary or the tree's top-k."""
    counts = read_token_counts(path)
    if not topk <= size <= len(counts):
        raise CheckpointError(f"head_vocab={size}: choose between the tree's top-k ({topk}) and the vocabulary size "
                              f"({len(counts)})")
    return most_frequent(counts, size)


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """counts [V] -> the `size` most frequent ids [size], most frequent first, ties by id (the order the draft
    vocabulary of training and the head_vocab shortlist of serving share)."""
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    return order[:size]


def check_compatible(drafter_config: dict[str, Any], base_config: Any) -> None:
    """Raise DrafterMismatchError when the drafter was trained for another base (hidden size or vocab)."""
    base_hidden = getattr(base_config, "hidden_size", None)
    base_vocab = getattr(base_config, "vocab_size", None)
    base_name = getattr(base_config, "_name_or_path", "the base model")
    for key, base_value in (("hidden_size", base_hidden), ("vocab_size", base_vocab)):
        if key in drafter_config and base_value is not None and int(drafter_config[key]) != int(base_value):
            raise DrafterMismatchError(
                f"drafter {key}={drafter_config[key]} does not match {base_name} {key}={base_value}; "
                f"the heads were trained for {drafter_config.get('base_model_name_or_path', 'another model')}"
            )


def save_draft_model(
    output_dir: str | os.PathLike,
    model: Any,
    base_model_name_or_path: str,
    tokenizer: Any = None,
    extra: dict[str, Any] | None = None,
    stopper: Any = None,
    stopper_config: dict[str, Any] | None = None,
    target: Any = None,
) -> Path:
    """Write a draft causal LM (a `PreTrainedModel`) as a drafter_type "draft_model" checkpoint, atomically: the
    model and tokenizer in `draft/`, the tokenizer also at the top level, and optionally its draft-length decision
    model (a models.stopper.StopperModel with its `stopper_entry` config). Refuses non-finite weights. Given the
    `target`, the draft's embedding / lm_head tensors equal to the target's are not written (`shared_with_target`)."""
    state = model.state_dict()
    shared = shared_with_target(model, target) if target is not None else {}
    spec = {"path": DRAFT_MODEL_DIR, "model_type": model.config.model_type, **({SHARED_KEY: shared} if shared else {})}
    config = {"draft_model": spec, "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
              **({"stopper": stopper_config} if stopper is not None else {})}
    weights = {**state, **({f"stopper.{k}": v for k, v in stopper.state_dict().items()} if stopper is not None else {})}

    def write(tmp: Path) -> None:
        if shared:  # marked in draft/config.json too, so loading the bare folder fails instead of drafting garbage
            model.config.draftsmith_shared_with_target = sorted(shared)
            try:
                model.save_pretrained(str(tmp / DRAFT_MODEL_DIR),
                                      state_dict={k: v for k, v in state.items() if k not in shared})
            finally:
                del model.config.draftsmith_shared_with_target
        else:
            model.save_pretrained(str(tmp / DRAFT_MODEL_DIR))
        if stopper is not None:
            save_stopper(tmp, stopper)

    payload = Payload("draft_model", config, weights, write, tokenizer_dirs=(DRAFT_MODEL_DIR,))
    return write_checkpoint(output_dir, base_model_name_or_path, payload, tokenizer, extra)


def shared_spec(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The `shared_with_target` entry of a draft_model checkpoint ({} when it stores every tensor itself)."""
    spec = read_drafter_config(Path(path)).get("draft_model")
    shared = spec.get(SHARED_KEY, {}) if isinstance(spec, dict) else {}
    if not isinstance(shared, dict):
        raise CheckpointError(f"{Path(path) / CONFIG_NAME}: draft_model.{SHARED_KEY} must map names to fingerprints")
    return shared


def draft_model_folder(path: str | os.PathLike) -> Path:
    """The draft causal LM's folder inside a drafter_type "draft_model" checkpoint."""
    path = Path(path)
    config = read_drafter_config(path)
    if config["drafter_type"] != "draft_model":
        raise CheckpointError(f"{path / CONFIG_NAME}: drafter_type {config['drafter_type']!r} is not 'draft_model'")
    spec = config.get("draft_model")
    folder = path / str(spec.get("path", DRAFT_MODEL_DIR) if isinstance(spec, dict) else DRAFT_MODEL_DIR)
    if not (folder / CONFIG_NAME).is_file():
        raise CheckpointError(f"{folder}: missing the draft model (no {CONFIG_NAME}); named by {path / CONFIG_NAME}")
    return folder


def backbone_folder(path: str | os.PathLike) -> tuple[str, Path] | None:
    """(format, folder) of the fine-tuned backbone a checkpoint carries (Medusa-2), or None (Medusa-1 heads only)."""
    path = Path(path)
    spec = read_drafter_config(path).get("backbone")
    if spec is None:
        return None
    fmt = spec.get("format") if isinstance(spec, dict) else None
    if fmt not in BACKBONE_DIRS:
        raise CheckpointError(f"{path / CONFIG_NAME}: backbone.format {fmt!r} is not one of {', '.join(BACKBONE_DIRS)}")
    folder = path / str(spec.get("path", BACKBONE_DIRS[fmt]))
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: missing; {path / CONFIG_NAME} names a {fmt} backbone there")
    return fmt, folder


def load_drafter_target(path: str | os.PathLike, base: str | ModelRef | None = None, **load_kwargs: Any):
    """The target model the drafter at `path` was trained with; `load_kwargs` go to models.loading.load_target.

    No backbone (Medusa-1): the base model (`base`, default the checkpoint's base_model_name_or_path). A "merged"
    backbone: that folder's model (`base` is ignored). A "lora_adapter": the base with the adapter merged in, or, on a
    quantized base, a peft model with the adapter active (merging would round the adapter into 4-bit weights).
    """
    path = Path(path)
    found = backbone_folder(path)
    if found is not None and found[0] == "merged":
        return load_target(str(found[1]), **load_kwargs)
    base = base or read_drafter_config(path).get("base_model_name_or_path")
    if not base:
        raise CheckpointError(f"{path / CONFIG_NAME}: no base_model_name_or_path; pass base=")
    model = load_target(base, **load_kwargs)
    if found is None:
        return model
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, str(found[1]), is_trainable=False)
    if load_kwargs.get("quantization") in (None, "none"):
        model = model.merge_and_unload()
    if load_kwargs.get("frozen", True):
        model.eval().requires_grad_(False)
    return model
