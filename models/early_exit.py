"""Self-speculative early-exit drafts (LayerSkip, Elhoushi et al. 2024; Draft & Verify, Zhang et al. 2024): the
target's own first N decoder layers, read out through its final norm and lm_head, saved as an ordinary causal LM.

The draft is the target truncated at layer N, nothing else: the target's config with num_hidden_layers=N, its
embeddings, first N layers, final norm and lm_head (tied to the embeddings iff the target's are), its tokenizer, and
early_exit.json (source, layers kept of how many). Nothing is trained or re-initialised; `python -m train distill`
can then fine-tune the copy like any draft model.

`early_exit:<model>:<N>` names such a draft wherever a model name is accepted (`method.draft`, `--drafter`, ...);
models.refs parses it into an EarlyExitRef and locates its source (a conf/model name such as smollm2, builtin:<name>,
a directory, a hub id) before calling `ensure_early_exit`, so nothing here parses a name. The folder is built once
into the draftsmith cache (<root>/models/early_exit/<key>, see models.buildcache), keyed by the source's located
folder, a fingerprint of its weights (file names, sizes, mtimes) and N, so a changed source gets a fresh build.

Generic over Llama/Qwen2/Mistral-like models: any causal LM whose decoder stack is `model.model.layers`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Protocol

import torch

from models.buildcache import atomic_dir, build_lock, cache_root, is_complete
from models.builtin import STOCK_MODULES, ModelLoadError, has_tokenizer, torch_dtype
from models.quiet import quiet_transformers

FORMAT_VERSION = 1
PROVENANCE_FILE = "early_exit.json"
CACHE_SUBDIR = ("models", "early_exit")
WEIGHT_PATTERNS = ("config.json", "*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


class EarlyExitName(Protocol):
    """What this module reads of models.refs.EarlyExitRef (which calls it: importing refs here would close a
    cycle): the source's name and the layer count; str() is the whole early_exit:<model>:<N> name."""

    @property
    def source(self) -> object: ...

    @property
    def layers(self) -> int: ...


def build_early_exit_draft(source: str | Path, num_layers: int, out_dir: str | Path, dtype: str | None = None,
                           label: str | None = None) -> Path:
    """Write the early-exit draft of the model folder `source` (located by models.refs) to `out_dir`: a Hugging Face
    causal-LM folder holding the model's first `num_layers` decoder layers (see the module docstring). `dtype`
    ("fp32", "bf16", ...) casts the weights; None keeps the model's stored dtype. `label` is how early_exit.json
    and messages name the source (default: the folder). Raises ModelLoadError (one line) for N outside [1, L - 1]
    or a model whose decoder stack is not `.model.layers`."""
    from transformers import AutoModelForCausalLM

    path = str(source)
    label = path if label is None else label
    where = f"early_exit:{label}:{num_layers}"
    config = checked_config(path, num_layers, where)
    total = config.num_hidden_layers
    cut = _truncated_config(config, num_layers)
    _check_layer_stack(cut, where)
    with quiet_transformers():  # the dropped layers are reported as unexpected keys: that is the point
        model, info = AutoModelForCausalLM.from_pretrained(
            path, config=cut, dtype="auto" if dtype is None else torch_dtype(dtype), output_loading_info=True,
            **STOCK_MODULES)
    _check_loaded(info, where)
    model.config.name_or_path = where
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    if Path(path).is_dir() and not has_tokenizer(path):
        tokenizer_copied = False  # a bare model folder (tests' random models): nothing to copy
    else:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(path).save_pretrained(out_dir)
        tokenizer_copied = True
    provenance = {"source": label, "source_path": str(path), "layers_kept": num_layers, "source_layers": total,
                  "tied_embeddings": bool(getattr(cut, "tie_word_embeddings", False)),
                  "tokenizer": tokenizer_copied, "format_version": FORMAT_VERSION}
    (out_dir / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    return out_dir


def checked_config(path: str, num_layers: int, where: str):
    """The source's config, after checking that it can keep `num_layers` of its decoder layers (1 .. L - 1)."""
    from transformers import AutoConfig

    if not Path(path).expanduser().is_dir():  # models.refs located it: a hub model is its snapshot folder too
        raise ModelLoadError(f"{where}: no model folder at {path}")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:  # no such folder or hub id, or no readable config.json
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{where}: cannot read the model's config ({first})") from None
    total = getattr(config, "num_hidden_layers", None)
    if not isinstance(total, int):
        raise ModelLoadError(f"{where}: {type(config).__name__} has no num_hidden_layers; early-exit drafts support "
                             f"Llama/Qwen2/Mistral-like models (a decoder stack at .model.layers)")
    if not 1 <= num_layers <= total - 1:
        raise ModelLoadError(f"{where}: layers must be in [1, {total - 1}] (the model has {total} decoder layers)")
    return config


def ensure_early_exit(ref: EarlyExitName, source: str | Path, cache_dir: Path | None = None, progress: bool = True
                      ) -> Path:
    """The cached folder of the early-exit draft `ref` names, cut from `source` (its source's folder, which
    models.refs.locate found) on first use, under a lock, atomically."""
    name, path = str(ref), str(source)
    checked_config(path, ref.layers, name)  # a bad layer count fails before anything is locked or written
    root = cache_root() if cache_dir is None else Path(cache_dir)
    target = root.joinpath(*CACHE_SUBDIR, cache_key(str(ref.source), path, ref.layers))
    if is_complete(target, FORMAT_VERSION):
        return target
    with build_lock(target.parent, target.name):
        if not is_complete(target, FORMAT_VERSION):  # another process may have built it while we waited
            if progress:
                print(f"building the early-exit draft {name} in {target} (once)", file=sys.stderr, flush=True)
            with atomic_dir(target, FORMAT_VERSION) as tmp:
                build_early_exit_draft(path, ref.layers, tmp, label=str(ref.source))
    return target


def cache_key(source: str, path: str, num_layers: int) -> str:
    """<readable source>-L<N>-<hash of the resolved location, its weights' fingerprint and N>."""
    digest = hashlib.sha256(json.dumps([str(path), _fingerprint(path), num_layers]).encode()).hexdigest()[:12]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", source).strip("_.")[-48:] or "model"
    return f"{readable}-L{num_layers}-{digest}"


def _fingerprint(path: str) -> list:
    """What changes when the source's weights change: its folder's weight files (name, size, mtime). A hub model's
    folder is its snapshot, whose path already names the commit."""
    folder = Path(path).expanduser()
    files = sorted({f for pattern in WEIGHT_PATTERNS for f in folder.glob(pattern) if f.is_file()})
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _truncated_config(config, num_layers: int):
    """A copy of `config` with num_hidden_layers=N and its per-layer lists (layer_types) cut to N."""
    cut = config.__class__.from_dict(config.to_dict())
    cut.num_hidden_layers = num_layers
    if isinstance(getattr(cut, "layer_types", None), list):
        cut.layer_types = cut.layer_types[:num_layers]
    return cut


def _check_layer_stack(config, where: str) -> None:
    """Refuse architectures whose decoder stack is not `.model.layers` (built on the meta device: no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    layers = getattr(getattr(skeleton, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != config.num_hidden_layers:
        raise ModelLoadError(f"{where}: {type(skeleton).__name__} has no decoder stack at .model.layers; early-exit "
                             f"drafts support Llama/Qwen2/Mistral-like models")


def _check_loaded(info: dict, where: str) -> None:
    """Every weight of the cut model came from the source (nothing freshly initialised); what the source has
    beyond it (the dropped layers) is ignored."""
    bad = sorted(map(str, [*(info.get("missing_keys") or ()), *(info.get("mismatched_keys") or ())]))
    if bad:
        raise ModelLoadError(f"{where}: the source's weights do not cover the cut model ({', '.join(bad[:3])})")
