"""The draft-length decision model ("stopper"): from the draft model's confidence at one draft depth it predicts the
probability that the target accepts that draft token, given that it accepted every earlier one (Improving
Multi-candidate Speculative Decoding, Lu et al. 2024; SpecDec++, Huang et al. 2024).

Features of one draft distribution q = softmax(draft logits) at depth d (fp32, temperature 1, whatever the decoding
temperature): entropy of q, its top-1 and top-2 probabilities, and d. A logistic regression (hidden=0) or a one-layer
MLP on standardised features. Saved inside a draft_model checkpoint as `stopper.safetensors` plus the `stopper` entry
of config.json (features, hidden width, the decision threshold chosen at training time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

FEATURES = ("entropy", "top1", "top2", "depth")
STOPPER_FILE = "stopper.safetensors"


def stop_features(logits: torch.Tensor, depth: int) -> torch.Tensor:
    """[..., V] draft logits at draft depth `depth` (1-based) -> [..., len(FEATURES)] fp32 features."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    top = logq.topk(2, dim=-1).values.exp()  # [..., 2]
    entropy = -(logq.exp() * logq).nan_to_num().sum(-1, keepdim=True)  # 0 * -inf terms -> 0
    return torch.cat([entropy, top, torch.full_like(entropy, float(depth))], dim=-1)


class StopperModel(nn.Module):
    """[..., F] features -> [...] logit of P(this draft token is accepted | the earlier ones were)."""

    def __init__(self, hidden: int = 0, mean: torch.Tensor | None = None, std: torch.Tensor | None = None) -> None:
        super().__init__()
        n = len(FEATURES)
        self.hidden = hidden
        self.register_buffer("mean", torch.zeros(n) if mean is None else mean.float().clone())
        self.register_buffer("std", torch.ones(n) if std is None else std.float().clamp(min=1e-6).clone())
        self.net = nn.Linear(n, 1) if hidden == 0 else nn.Sequential(nn.Linear(n, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = (features.float() - self.mean) / self.std
        return self.net(x).squeeze(-1)

    @torch.no_grad()
    def accept_prob(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self(features))


def save_stopper(folder: Path, model: StopperModel) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(folder / STOPPER_FILE))


def stopper_entry(model: StopperModel, threshold: float, max_gamma: int, metrics: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """The `stopper` entry of a draft_model checkpoint's config.json; `max_gamma` (the traces' draft length) is the
    draft length the engine uses with this checkpoint unless a tree is given."""
    return {"path": STOPPER_FILE, "features": list(FEATURES), "hidden": model.hidden, "threshold": float(threshold),
            "max_gamma": int(max_gamma), **({"metrics": metrics} if metrics else {})}


def load_stopper(folder: Path, entry: dict[str, Any]) -> StopperModel:
    """A checkpoint's stopper from its config.json entry; a feature list this version does not compute is an error."""
    if list(entry.get("features", [])) != list(FEATURES):
        raise ValueError(f"{folder}: stopper features {entry.get('features')} differ from this version's {list(FEATURES)}")
    model = StopperModel(int(entry.get("hidden", 0)))
    model.load_state_dict(load_file(str(folder / str(entry.get("path", STOPPER_FILE)))))
    return model.eval()
