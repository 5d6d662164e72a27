"""Tensors a draft model shares with its target (an early-exit draft's frozen embeddings and lm_head): finding them,
identifying them across dtypes by a fingerprint, and making the draft use the target's own at load.

A draft_model checkpoint leaves these tensors out and lists them by fingerprint (models.checkpoint: config.json
"draft_model": {"shared_with_target": {name: fingerprint}}, read by `shared_spec`); loading attaches the target's
(`attach_shared`), so neither the file nor the served draft holds a copy.
"""

from __future__ import annotations

from typing import Any

import torch

from data.errors import UsageError


class DrafterMismatchError(UsageError):
    """A drafter checkpoint does not fit the base model it is loaded with."""


SHARED_TOLERANCE = 1e-3  # relative: a bf16 / fp32 copy of the same tensor passes, another model's does not


def fingerprint(tensor: torch.Tensor) -> dict[str, Any]:
    """Shape, sum and sum of |x| in float64: identifies a tensor across dtypes (bf16 rounding moves the sums by far
    less than SHARED_TOLERANCE), cheaply."""
    t = tensor.detach().double()
    return {"shape": list(tensor.shape), "sum": float(t.sum()), "abs_sum": float(t.abs().sum())}


def fingerprint_matches(tensor: torch.Tensor, expected: dict[str, Any]) -> bool:
    got = fingerprint(tensor)
    scale = max(abs(expected["abs_sum"]), 1e-12)
    return (got["shape"] == list(expected["shape"]) and abs(got["abs_sum"] - expected["abs_sum"]) <= SHARED_TOLERANCE * scale
            and abs(got["sum"] - expected["sum"]) <= SHARED_TOLERANCE * scale)


def embedding_names(model: Any) -> list[str]:
    """State-dict names of the model's input embeddings and lm_head weights (both names when they are tied)."""
    wanted = [m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    return [n for n, p in model.named_parameters(remove_duplicate=False) if any(p is w for w in wanted)]


def shared_with_target(draft: Any, target: Any) -> dict[str, dict[str, Any]]:
    """name -> fingerprint of the draft's embedding / lm_head tensors that equal the target's same-named ones (the
    draft's values rounded to the target's dtype): what a checkpoint need not store. Empty for a draft of its own."""
    theirs = dict(target.named_parameters(remove_duplicate=False))
    mine = dict(draft.named_parameters(remove_duplicate=False))
    shared = {}
    for name in embedding_names(draft):
        other = theirs.get(name)
        if other is None or other.shape != mine[name].shape:
            continue
        with torch.no_grad():
            if torch.equal(mine[name].detach().to(other.device, other.dtype), other.detach()):
                shared[name] = fingerprint(mine[name])
    return shared


def attach_shared(draft: Any, target: Any, shared: dict[str, dict[str, Any]], where: str) -> None:
    """Make the draft's `shared` tensors the target's own parameters (the same storage: no copy), after checking each
    against its fingerprint; DrafterMismatchError naming `where` when the target lacks one or holds other values.
    The draft must already be in the target's dtype and on its device."""
    theirs = dict(target.named_parameters(remove_duplicate=False))
    for name, expected in shared.items():
        param = theirs.get(name)
        if param is None or not fingerprint_matches(param, expected):
            why = "has no such tensor" if param is None else "holds other values (another model?)"
            raise DrafterMismatchError(f"{where}: the draft takes {name} from its target, whose {name} {why}")
        module, _, leaf = name.rpartition(".")
        setattr(draft.get_submodule(module), leaf, param)
