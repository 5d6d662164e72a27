"""A small causal LM as a drafter, on the files' side: which names are plain causal LMs, the vocabulary checks a
draft model must pass against its target (from the loaded models, or from their files before either loads), the
stopper a draft_model checkpoint carries, and loading the draft LM beside its target. The drafting algorithm is
inference.drafters.draft_model's; trainers (distill, stopper) use these checks before any model loads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.checkpoint import CONFIG_NAME, DrafterMismatchError, draft_model_folder, read_drafter_config, shared_spec
from models.loading import DTYPES, has_tokenizer, load_target, model_config
from models.quiet import quiet_transformers
from models.refs import BuiltinRef, EarlyExitRef, LocalRef, ModelRef, locate, model_settings
from models.shared_tensors import attach_shared
from models.stopper import StopperModel, load_stopper


def check_vocab(draft: nn.Module, target: nn.Module) -> None:
    """Raise DrafterMismatchError unless draft and target score the same vocabulary (same logit width)."""
    dv, tv = draft.get_output_embeddings().weight.shape[0], target.get_output_embeddings().weight.shape[0]
    if dv != tv:
        name = getattr(draft.config, "_name_or_path", "the draft model")
        raise DrafterMismatchError(
            f"draft model {name} has a vocabulary of {dv} tokens but the target "
            f"{getattr(target.config, '_name_or_path', '')} has {tv}; a draft model must share the target's tokenizer"
        )


def check_vocab_files(draft: str, target: str, target_tokenizer: Any, setting: str, trust_remote_code: bool = False
                      ) -> None:
    """`check_vocab` from the two models' files, before either loads: the vocabulary sizes in their config.json, and,
    when the draft has tokenizer files, its token -> id map against `target_tokenizer` (None: sizes only) over the
    ids the models score. DrafterMismatchError naming `setting` (the key that chose the draft) when they differ."""
    draft_vocab = model_config(draft, trust_remote_code).get_text_config().vocab_size
    target_vocab = model_config(target, trust_remote_code).get_text_config().vocab_size
    if draft_vocab != target_vocab:
        raise DrafterMismatchError(
            f"{setting}: the draft model has a vocabulary of {draft_vocab} tokens but the target {target} has "
            f"{target_vocab}; a draft model must share the target's tokenizer")
    folder = locate(draft)
    if target_tokenizer is None or not has_tokenizer(folder):
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    ours, theirs = ({t: i for t, i in tok.get_vocab().items() if i < target_vocab}
                    for tok in (tokenizer, target_tokenizer))
    if ours != theirs:
        token = min(t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t))
        draft_id, target_id = (f"id {v[token]}" if token in v else "absent" for v in (ours, theirs))
        raise DrafterMismatchError(
            f"{setting}: the draft model's tokenizer differs from the target's (token {token!r}: {draft_id} in the "
            f"draft's, {target_id} in the target's); a draft model must share the target's tokenizer")


def is_plain_model(model: str | os.PathLike | ModelRef) -> bool:
    """True for a model draftsmith makes ("builtin:<name>", "early_exit:<model>:<N>", or a conf/model name of one)
    or a directory holding a Hugging Face model (config.json without drafter_type); the name is read by
    models.refs."""
    ref = model_settings(model).ref
    if isinstance(ref, (BuiltinRef, EarlyExitRef)):
        return True
    if not isinstance(ref, LocalRef):  # a hub id: its snapshot folder is what callers hold (models.refs.locate)
        return False
    config = ref.path / CONFIG_NAME
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and "drafter_type" not in data and "model_type" in data


def checkpoint_stopper(path: str | os.PathLike) -> tuple[StopperModel | None, dict[str, Any]]:
    """The stopper a draft_model checkpoint carries (from `python -m train stopper`) and its config.json entry
    (threshold, max_gamma, ...); (None, {}) when it has none."""
    if is_plain_model(path):
        return None, {}
    entry = read_drafter_config(path).get("stopper")
    if not isinstance(entry, dict):
        return None, {}
    return load_stopper(Path(path), entry), entry


def load_draft_model(path: str | os.PathLike, target: nn.Module, device: torch.device) -> nn.Module:
    """The causal LM of a draft_model checkpoint or a plain causal LM (a directory, "builtin:<name>" or
    "early_exit:<model>:<N>"), in the target's dtype on `device`, its vocabulary checked against the target's. The
    tensors a checkpoint shares with its target (models.checkpoint.shared_spec) become the target's own. A model
    config name ("smollm2-draft", conf/model) means its model, as everywhere a drafter is named."""
    ref = model_settings(path).ref
    made = isinstance(ref, (BuiltinRef, EarlyExitRef))  # built when it loads, not here
    folder = None if made else locate(ref)  # a hub id: its snapshot, by models.refs' one hub policy
    plain = made or is_plain_model(folder)
    source = ref if plain else str(draft_model_folder(folder))
    shared = {} if plain else shared_spec(folder)
    dtype = target.get_input_embeddings().weight.dtype
    name = next((k for k, v in DTYPES.items() if v == dtype), "fp32")
    with quiet_transformers(bool(shared)):  # the shared tensors are missing from the files on purpose
        draft = load_target(source, dtype=name).to(device)
    if plain and getattr(draft.config, "draftsmith_shared_with_target", None):
        raise DrafterMismatchError(f"{ref}: this draft model stores no {', '.join(draft.config.draftsmith_shared_with_target)}"
                                   f" (its target's): load the checkpoint folder above it, not its draft/ folder")
    attach_shared(draft, target, shared, str(ref))
    check_vocab(draft, target)
    return draft
