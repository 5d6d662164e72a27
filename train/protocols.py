"""Protocols a training method may implement beyond train.base.TrainMethod, kept apart from train.base so that the
command-line checks (train.checks) can ask about a method without importing the Trainer machinery."""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch


@runtime_checkable
class ProvidesData(Protocol):
    """A method trained on its own sample shape (e.g. cllm's Jacobi trajectories) instead of `data`'s chat samples."""

    def datasets(self, tokenizer: Any) -> Any:
        """An object with .train and .validation (None when empty), like data.datasets.SplitDatasets."""
        ...

    def collator(self, tokenizer: Any) -> Callable[[list[dict]], dict[str, torch.Tensor]]: ...
