"""Chat SFT datasets: config -> conversations -> encoded samples ({"input_ids", "labels"}), optionally packed.

Splits. format=builtin asks data.stdlib_chat for "train" / "validation". Otherwise `path` is read (hub ids with
split `cfg.split`, "id@split" overrides); validation is `validation_path` when set (hub ids: split "validation"),
else the records whose index hash (sha256 of "<seed>:<index>") falls below `validation_fraction`: the same records
for the same seed whatever the machine or the order of calls. A split that ends up empty is None (validation) or an
error (train). `max_samples` keeps the first N records of each split, after the split.

Encoding. Chat formats go through data.chat.encode_chat (assistant-only labels, truncated to max_length);
format=text goes through data.chat.encode_text (no template, every token trained). `system_prompt` is prepended to
conversations that have no system message (not to text). Samples whose labels are all masked after truncation are
dropped and counted (without packing).

Packing (packing=True). Samples are encoded untruncated, concatenated in order and cut into blocks of exactly
max_length tokens (the last block may be shorter); a long sample continues in the next block rather than losing its
tail; blocks without a trained token are dropped. Attention is NOT masked across samples inside a block and
positions are not reset: the usual "group texts" trade-off, fine for drafter training.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Any, Protocol

import torch.utils.data

from data.chat import IGNORE_INDEX, Conversation, EncodedChat, encode_chat, encode_text
from data.readers import DataError, ReadResult, read_conversations
from data.templates import ChatTemplateError, resolve_template

log = logging.getLogger(__name__)

SPLITS = ("train", "validation")


class DataConfigLike(Protocol):
    """The `data` config group (schema: train/config.py); any object with these attributes works."""

    name: str
    format: str  # builtin | sharegpt | alpaca | gsm8k | text
    path: str | None
    split: str
    validation_path: str | None
    validation_fraction: float
    max_length: int
    packing: bool
    on_error: str  # raise | skip
    max_samples: int | None
    chat_template: str | None
    system_prompt: str | None
    text_field: str
    seed: int


class EncodedDataset(torch.utils.data.Dataset):
    """A list of encoded samples; item i is {"input_ids": list[int], "labels": list[int]}."""

    def __init__(self, samples: list[EncodedChat]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        sample = self.samples[i]
        return {"input_ids": sample.input_ids, "labels": sample.labels}


def label_counts(dataset: Any) -> torch.Tensor:
    """[largest label + 1] int64: how often each token id is a trained label (not -100) in `dataset` (items with a
    "labels" list)."""
    labels = torch.tensor([t for i in range(len(dataset)) for t in dataset[i]["labels"]], dtype=torch.int64)
    return torch.bincount(labels[labels != IGNORE_INDEX])


@dataclass(frozen=True)
class SplitDatasets:
    train: EncodedDataset
    validation: EncodedDataset | None  # None when the config yields no validation records


def build_datasets(cfg: DataConfigLike, tokenizer) -> SplitDatasets:
    """Encoded (and, with cfg.packing, packed) train and validation datasets; raises DataError on bad data."""
    splits: dict[str, EncodedDataset | None] = {}
    for split, records in _load_splits(cfg, SPLITS).items():
        if records is None:
            splits[split] = None
        elif cfg.packing:  # encode whole samples, then cut: long samples continue in the next block
            blocks = pack(_encode_all(cfg, tokenizer, records, max_length=sys.maxsize), cfg.max_length)
            splits[split] = EncodedDataset([b for b in blocks if b.num_trained])  # prompt-only blocks carry no loss
        else:
            splits[split] = EncodedDataset(_encode_all(cfg, tokenizer, records, max_length=cfg.max_length))
    return SplitDatasets(train=splits["train"], validation=splits["validation"])


def load_conversations(cfg: DataConfigLike, split: str) -> list[Conversation]:
    """The conversations of one split ("train" | "validation"), as build_datasets sees them (e.g. for eval prompts).

    Returns [] for a validation split that the config leaves empty.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    records = _load_splits(cfg, (split,))[split]
    return [] if records is None else records.conversations


def pack(samples: list[EncodedChat], max_length: int) -> list[EncodedChat]:
    """Concatenate samples in order and cut into max_length blocks (last one may be shorter); see module docstring."""
    ids = [t for s in samples for t in s.input_ids]
    labels = [t for s in samples for t in s.labels]
    return [
        EncodedChat(input_ids=ids[i : i + max_length], labels=labels[i : i + max_length])
        for i in range(0, len(ids), max_length)
    ]


def in_validation(index: int, seed: int, fraction: float) -> bool:
    """Whether record `index` goes to the validation split: a seeded hash, stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _load_splits(cfg: DataConfigLike, splits: tuple[str, ...]) -> dict[str, ReadResult | None]:
    """The requested splits' records (system prompt applied, max_samples kept); each source is read once."""
    if cfg.max_length < 1:
        raise DataError(f"data.max_length must be >= 1, got {cfg.max_length}")
    if cfg.max_samples is not None and cfg.max_samples < 1:
        raise DataError(f"data.max_samples must be >= 1 or null, got {cfg.max_samples}")
    if cfg.format != "builtin" and cfg.path is None:
        raise DataError(f"data.path is required for data.format={cfg.format!r} (config data={cfg.name!r})")
    main = None  # cfg.path, read on first use
    out: dict[str, ReadResult | None] = {}
    for split in splits:
        if cfg.format == "builtin":
            result = _builtin(split)
        elif split == "validation" and cfg.validation_path is not None:
            result = read_conversations(cfg.validation_path, cfg.format, cfg.on_error, "validation", cfg.text_field)
        else:
            main = main or read_conversations(cfg.path, cfg.format, cfg.on_error, cfg.split, cfg.text_field)
            result = main if cfg.validation_path is not None else _hash_split(cfg, main, split)
        if not result.conversations and split == "train":
            raise DataError(f"{cfg.path or cfg.format}: no training records left after the validation split")
        keep = len(result.conversations) if cfg.max_samples is None else cfg.max_samples
        conversations = [_with_system(c, cfg) for c in result.conversations[:keep]]
        kept = ReadResult(conversations, result.sources[:keep], result.skipped, result.first_error)
        out[split] = kept if conversations else None
    return out


def _hash_split(cfg: DataConfigLike, result: ReadResult, split: str) -> ReadResult:
    if not 0.0 <= cfg.validation_fraction < 1.0:
        raise DataError(f"data.validation_fraction must be in [0, 1), got {cfg.validation_fraction}")
    want_validation = split == "validation"
    keep = [
        i for i in range(len(result.conversations))
        if in_validation(i, cfg.seed, cfg.validation_fraction) == want_validation
    ]
    return ReadResult(
        [result.conversations[i] for i in keep], [result.sources[i] for i in keep], result.skipped,
        result.first_error,
    )


def _builtin(split: str) -> ReadResult:
    try:  # imported lazily: every other format works without it
        stdlib_chat = importlib.import_module("data.stdlib_chat")
    except ModuleNotFoundError as err:
        if err.name != "data.stdlib_chat":
            raise
        raise DataError("data.format=builtin: the built-in corpus (data.stdlib_chat) is not installed") from None
    conversations = stdlib_chat.stdlib_conversations(split)
    return ReadResult(conversations, [f"builtin[{split}]:{i}" for i in range(1, len(conversations) + 1)], 0, None)


def _with_system(conversation: Conversation, cfg: DataConfigLike) -> Conversation:
    if not cfg.system_prompt or cfg.format == "text" or (conversation and conversation[0]["role"] == "system"):
        return conversation
    return [{"role": "system", "content": cfg.system_prompt}, *conversation]


def _encode_all(cfg: DataConfigLike, tokenizer, records: ReadResult, max_length: int) -> list[EncodedChat]:
    if cfg.format != "text":
        try:  # a missing/unknown template is a config problem: fail before touching records
            resolve_template(tokenizer, cfg.chat_template)
        except ChatTemplateError as err:
            raise DataError(f"data.chat_template: {err}") from None
    samples: list[EncodedChat] = []
    failed, first_failure, untrained = 0, None, 0
    for where, conversation in zip(records.sources, records.conversations):
        try:
            if cfg.format == "text":
                sample = encode_text(tokenizer, conversation[0]["content"], max_length)
            else:
                sample = encode_chat(tokenizer, conversation, max_length, cfg.chat_template)
        except ChatTemplateError as err:
            if cfg.on_error == "raise":
                raise DataError(f"{where}: {err}") from err
            failed += 1
            first_failure = first_failure or f"{where}: {err}"
            continue
        except ValueError as err:  # invalid message from the builtin corpus
            raise DataError(f"{where}: {err}") from err
        if all(label == IGNORE_INDEX for label in sample.labels):
            untrained += 1
            continue
        samples.append(sample)
    if failed:
        log.warning("skipped %d records the chat template rejected (first: %s)", failed, first_failure)
    if untrained:
        log.warning("dropped %d samples with no assistant token within data.max_length=%d", untrained,
                    cfg.max_length)
    if not samples:
        raise DataError(f"{records.sources[0].rsplit(':', 1)[0]}: no sample has a trained token "
                        f"(data.max_length={cfg.max_length})")
    return samples
