"""What a training method contributes (train/<name>.py): the `TrainMethod` protocol and the optional capabilities the
shared task (train.task) looks for. Everything else is shared; the task stays free of method branches.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from omegaconf import DictConfig
from torch import nn

from data.datasets import label_counts


@dataclass(frozen=True)
class StepOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # detached scalars, averaged between log lines


class TrainMethod(Protocol):
    """What a method contributes; everything else is shared."""

    def build(self, target: nn.Module, tokenizer: Any) -> nn.Module: ...

    def forward_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> StepOutput: ...

    def evaluate(self, model: nn.Module, batches: Any, tokenizer: Any, prompts: list[list[int]]) -> dict[str, float]: ...

    def save(self, model: nn.Module, output_dir: Path, tokenizer: Any, extra: dict[str, Any]) -> None: ...

    def report(self, metrics: dict[str, float]) -> str: ...

    def param_groups(self, model: nn.Module, learning_rate: float) -> list[dict[str, Any]] | None:
        """Optimizer parameter groups (e.g. a learning-rate multiplier for heads); None: one group of all trainable
        parameters, as HF Trainer builds it."""
        ...

    def load(self, model: nn.Module, checkpoint_dir: Path) -> None: ...


@runtime_checkable
class ProvidesData(Protocol):
    """A method trained on its own sample shape (e.g. cllm's Jacobi trajectories) instead of `data`'s chat samples."""

    def datasets(self, tokenizer: Any) -> Any:
        """An object with .train and .validation (None when empty), like data.datasets.SplitDatasets."""
        ...

    def collator(self, tokenizer: Any) -> Callable[[list[dict]], dict[str, torch.Tensor]]: ...


@runtime_checkable
class CountsLabels(Protocol):
    """A method whose checkpoint records how often each token is a trained label in its train split (Medusa heads:
    inference's head_vocab shortlist). Called once with the final train dataset, before `build`."""

    def count_labels(self, dataset: Any) -> None: ...


class TokenCounts:
    """CountsLabels for a method with a draft vocabulary: the train labels' token frequencies (the S most frequent
    make the vocabulary), saved with the drafter as token_counts [V]."""

    label_counts: torch.Tensor | None = None  # [<= V] from count_labels

    def count_labels(self, dataset: Any) -> None:
        self.label_counts = label_counts(dataset)

    def token_counts(self, vocab_size: int) -> torch.Tensor | None:
        """[V] int64, zero past the largest label seen; None before count_labels."""
        if self.label_counts is None:
            return None
        counts = self.label_counts[:vocab_size]
        return torch.cat([counts, counts.new_zeros(vocab_size - len(counts))])


@runtime_checkable
class ChecksInputs(Protocol):
    """A method whose inputs span several files (a draft model against the target, heads against the base): checked
    from the files, before any model loads or any data is generated."""

    def check_inputs(self, tokenizer: Any) -> None: ...


@runtime_checkable
class ReadsFeatures(Protocol):
    """A method that says which stored features of a cache it reads (data.features)."""

    def feature_needs(self) -> tuple[list[int], bool]:
        """(hidden_states indices it reads, whether it reads soft labels)."""
        ...


@runtime_checkable
class Standalone(Protocol):
    """A method that runs its own loop (e.g. the stopper's trace collection and L-BFGS fit), not the HF Trainer."""

    def run(self, cfg: DictConfig) -> dict[str, float]: ...


def load_method(cfg: DictConfig) -> TrainMethod:
    module = importlib.import_module(f"train.{cfg.method.name}")
    return module.Method(cfg)
