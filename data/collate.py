"""Batch collation for {"input_ids", "labels"} samples (B batch, T time)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from data.chat import IGNORE_INDEX


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int, device: torch.device | str | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of any lengths as one left-padded batch for generation: (input_ids, attention_mask), each [B, T] with
    T the longest row; pads sit on the left so every row's next token lands in the same last column."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad_token_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    return ids, mask


def length_batches(lengths: Sequence[int], max_rows: int, extra: int = 0, max_padding: float = 0.25
                   ) -> list[list[int]]:
    """Row indices grouped into left-padded batches of rows of about one length: longest first, a batch takes the next
    row while it has fewer than `max_rows` rows and its padding stays at most `max_padding` of its padded tokens.
    Each row counts its length + `extra` (tokens to be generated after the prompt, which pad nothing). One long prompt
    among short ones then runs alone instead of padding a whole batch to its length. Deterministic in the lengths."""
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows}: a batch needs at least one row")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    real = 0  # tokens of the rows in `current`, extra included
    for i in order:
        size = lengths[i] + extra
        if current:
            padded = (len(current) + 1) * (lengths[current[0]] + extra)  # the first (longest) row sets the width
            if len(current) == max_rows or padded - (real + size) > max_padding * padded:
                batches.append(current)
                current, real = [], 0
        current.append(i)
        real += size
    if current:
        batches.append(current)
    return batches


@dataclass(frozen=True)
class ChatCollator:
    """Right-pads a list of samples into LongTensors input_ids / attention_mask / labels, each [B, T].

    T is the longest sample, rounded up to `pad_to_multiple_of` when set. Pad positions hold `pad_token_id` in
    input_ids, 0 in attention_mask and IGNORE_INDEX in labels. Samples without "labels" are trained everywhere
    (labels = input_ids).
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, samples: Sequence[dict]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("ChatCollator got an empty batch")
        ids = [_as_list(s["input_ids"]) for s in samples]
        labels = [_as_list(s["labels"]) if "labels" in s else ids[i] for i, s in enumerate(samples)]
        for i, (x, y) in enumerate(zip(ids, labels)):
            if len(x) != len(y):
                raise ValueError(f"sample {i}: {len(x)} input_ids but {len(y)} labels")
        width = max(len(x) for x in ids)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch_ids = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)  # [B, T]
        batch_labels = torch.full((len(ids), width), IGNORE_INDEX, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((len(ids), width), dtype=torch.long)  # [B, T]
        for b, (x, y) in enumerate(zip(ids, labels)):
            batch_ids[b, : len(x)] = torch.tensor(x, dtype=torch.long)
            batch_labels[b, : len(y)] = torch.tensor(y, dtype=torch.long)
            attention_mask[b, : len(x)] = 1
        return {"input_ids": batch_ids, "attention_mask": attention_mask, "labels": batch_labels}


def _as_list(values) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)
