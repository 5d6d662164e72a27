"""Chat SFT datasets: config -> conversations -> encoded samples ({"input_ids", "labels"}), optionally packed.

Records. format=builtin asks data.stdlib_chat for "train" / "validation". Otherwise `path` is read (hub ids with
split `cfg.split`, "id@split" overrides; `recover_truncated`, `require_user_first`: see data.readers), and with
`dedupe` repeated records are dropped (data.curation).

Splits. Validation is `validation_path` when set (hub ids: split "validation"), else the records whose hash (sha256 of
"<seed>:<key>") falls below `validation_fraction`, the key being the record's conversation (its "id" without a
trailing "_<part>": the parts of one ShareGPT conversation stay together) or, for a record without an id, its index:
the same records for the same seed whatever the machine or the order of calls. With `decontaminate`, train
conversations that ask an evaluation prompt are dropped (data.curation). A split that ends up empty is None
(validation) or an error (train). `max_samples` keeps the first N records of each split, after the split.
`max_tokens` (train only) then keeps a seeded sample: conversations in a shuffled order until their encoded tokens
reach the budget, kept in file order. What became of the records and the splits' sizes: `SplitDatasets.report`.

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
import random
import re
import sys
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch.utils.data

from data.chat import IGNORE_INDEX, Conversation, EncodedChat, encode_chat, encode_text
from data.curation import decontaminate, dedupe
from data.eval_sets import eval_prompts
from data.readers import DataError, ReadResult, RecordStats, read_conversations
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
    recover_truncated: bool  # keep the complete records of a .json list cut off at its end
    require_user_first: bool  # drop (not trim) conversations whose assistant speaks first
    dedupe: bool  # drop records repeating an earlier id or conversation
    decontaminate: bool  # drop train conversations that ask an evaluation prompt
    max_tokens: int | None  # token budget of the train split


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
    "labels" list; a dataset with a `labels()` method, such as a feature cache's, yields them without its features)."""
    rows = dataset.labels() if callable(getattr(dataset, "labels", None)) else (
        dataset[i]["labels"] for i in range(len(dataset)))
    labels = torch.cat([torch.as_tensor(row, dtype=torch.int64) for row in rows])
    return torch.bincount(labels[labels != IGNORE_INDEX])


@dataclass(frozen=True)
class SplitStats:
    """One encoded split's size."""

    conversations: int  # conversations encoded into it (after max_samples, max_tokens and the drops below)
    samples: int  # dataset items: one per conversation, or packed blocks
    tokens: int  # input tokens
    trained_tokens: int  # labels that train (assistant tokens; every token but bos for format=text)
    dropped: int  # conversations the chat template rejected (on_error=skip) or with no trained token in max_length


@dataclass(frozen=True)
class DataReport:
    """What build_datasets made; `dataclasses.asdict(report)` is its JSON form (e.g. for a manifest)."""

    records: RecordStats  # data.path's records (format=builtin: the train corpus's), read to kept
    train: SplitStats
    validation: SplitStats | None


@dataclass(frozen=True)
class SplitDatasets:
    train: EncodedDataset
    validation: EncodedDataset | None  # None when the config yields no validation records
    report: DataReport | None = None  # set by build_datasets


def build_datasets(cfg: DataConfigLike, tokenizer) -> SplitDatasets:
    """Encoded (and, with cfg.packing, packed) train and validation datasets, with their report (logged: one line on
    the records, one on the train split); raises DataError on bad data."""
    splits: dict[str, tuple[EncodedDataset, SplitStats] | None] = {}
    loaded = _load_splits(cfg, SPLITS)
    for split, records in loaded.items():
        budget = cfg.max_tokens if split == "train" else None
        splits[split] = None if records is None else _encode_split(cfg, tokenizer, records, budget)
    (train, train_stats), validation = splits["train"], splits["validation"]
    report = DataReport(loaded["train"].stats, train_stats, None if validation is None else validation[1])
    log.info("data %s: %s", cfg.name, report.records.summary())
    log.info("data %s: train %d conversations, %d tokens (%d trained); validation %d conversations",
             cfg.name, train_stats.conversations, train_stats.tokens, train_stats.trained_tokens,
             0 if validation is None else validation[1].conversations)
    return SplitDatasets(train=train, validation=None if validation is None else validation[0], report=report)


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


def in_validation(key: int | str, seed: int, fraction: float) -> bool:
    """Whether the record with split key `key` (its index, or its conversation id: see `split_key`) goes to the
    validation split: a seeded hash, stable across runs and machines."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_key(record_id: str | None, index: int) -> int | str:
    """What the split hashes: the record's conversation (its id without a trailing "_<part>"), else its index."""
    return index if record_id is None else re.sub(r"_\d+$", "", record_id)


def _load_splits(cfg: DataConfigLike, splits: tuple[str, ...]) -> dict[str, ReadResult | None]:
    """The requested splits' records (curated, system prompt applied, max_samples kept); each source is read once.
    The train split's `stats` count data.path's records from read to kept."""
    _check_config(cfg)
    main = None  # cfg.path, read on first use
    out: dict[str, ReadResult | None] = {}
    for split in splits:
        if cfg.format == "builtin":
            result = _builtin(split)
        elif split == "validation" and cfg.validation_path is not None:
            result = _read(cfg, cfg.validation_path, "validation")
        else:
            main = main or _read(cfg, cfg.path, cfg.split)
            result = main if cfg.validation_path is not None else _hash_split(cfg, main, split)
        if split == "train" and cfg.decontaminate:
            result = decontaminate(result, eval_prompts())
        if not result.conversations and split == "train":
            raise DataError(f"{cfg.path or cfg.format}: no training records left after the validation split"
                            f"{' and decontamination' if cfg.decontaminate else ''}")
        kept = result.select(range(min(len(result.conversations), cfg.max_samples or sys.maxsize)))
        kept = replace(kept, conversations=[_with_system(c, cfg) for c in kept.conversations])
        out[split] = kept if kept.conversations else None
    return out


def _check_config(cfg: DataConfigLike) -> None:
    if cfg.max_length < 1:
        raise DataError(f"data.max_length must be >= 1, got {cfg.max_length}")
    for key in ("max_samples", "max_tokens"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            raise DataError(f"data.{key} must be >= 1 or null, got {getattr(cfg, key)}")
    if cfg.format != "builtin" and cfg.path is None:
        raise DataError(f"data.path is required for data.format={cfg.format!r} (config data={cfg.name!r})")


def _read(cfg: DataConfigLike, path: str, split: str) -> ReadResult:
    result = read_conversations(path, cfg.format, cfg.on_error, split, cfg.text_field,
                                recover_truncated=cfg.recover_truncated, require_user_first=cfg.require_user_first)
    return dedupe(result) if cfg.dedupe else result


def _hash_split(cfg: DataConfigLike, result: ReadResult, split: str) -> ReadResult:
    if not 0.0 <= cfg.validation_fraction < 1.0:
        raise DataError(f"data.validation_fraction must be in [0, 1), got {cfg.validation_fraction}")
    want_validation = split == "validation"
    return result.select(
        i for i, record_id in enumerate(result.ids)
        if in_validation(split_key(record_id, i), cfg.seed, cfg.validation_fraction) == want_validation
    )


def _builtin(split: str) -> ReadResult:
    try:  # imported lazily: every other format works without it
        stdlib_chat = importlib.import_module("data.stdlib_chat")
    except ModuleNotFoundError as err:
        if err.name != "data.stdlib_chat":
            raise
        raise DataError("data.format=builtin: the built-in corpus (data.stdlib_chat) is not installed") from None
    conversations = stdlib_chat.stdlib_conversations(split)
    n = len(conversations)
    return ReadResult(conversations, [f"builtin[{split}]:{i}" for i in range(1, n + 1)], [None] * n, 0, None,
                      RecordStats(read=n, kept=n))


def _with_system(conversation: Conversation, cfg: DataConfigLike) -> Conversation:
    if not cfg.system_prompt or cfg.format == "text" or (conversation and conversation[0]["role"] == "system"):
        return conversation
    return [{"role": "system", "content": cfg.system_prompt}, *conversation]


def _encode_split(cfg: DataConfigLike, tokenizer, records: ReadResult, max_tokens: int | None
                  ) -> tuple[EncodedDataset, SplitStats]:
    """One split encoded (within `max_tokens` when given) and, with cfg.packing, packed; with its figures."""
    # packing encodes whole samples, then cuts: long samples continue in the next block
    samples, dropped = _encode_all(cfg, tokenizer, records, sys.maxsize if cfg.packing else cfg.max_length, max_tokens)
    items = [b for b in pack(samples, cfg.max_length) if b.num_trained] if cfg.packing else samples  # prompt-only
    stats = SplitStats(conversations=len(samples), samples=len(items),  # blocks carry no loss
                       tokens=sum(len(s.input_ids) for s in items), trained_tokens=sum(s.num_trained for s in items),
                       dropped=dropped)
    return EncodedDataset(items), stats


def _encode_all(cfg: DataConfigLike, tokenizer, records: ReadResult, max_length: int, max_tokens: int | None = None
                ) -> tuple[list[EncodedChat], int]:
    """The records' samples in record order, and how many records gave none. With `max_tokens`, records are taken in
    a seeded shuffled order until the samples hold that many tokens (the one crossing the budget included)."""
    if cfg.format != "text":
        try:  # a missing/unknown template is a config problem: fail before touching records
            resolve_template(tokenizer, cfg.chat_template)
        except ChatTemplateError as err:
            raise DataError(f"data.chat_template: {err}") from None
    order = list(range(len(records.conversations)))
    if max_tokens is not None:  # a sample of the whole file, not its start
        random.Random(cfg.seed).shuffle(order)
    samples: dict[int, EncodedChat] = {}
    failed, first_failure, untrained, tokens = 0, None, 0, 0
    for i in order:
        if max_tokens is not None and tokens >= max_tokens:
            break
        where, conversation = records.sources[i], records.conversations[i]
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
        samples[i] = sample
        tokens += len(sample.input_ids)
    if failed:
        log.warning("skipped %d records the chat template rejected (first: %s)", failed, first_failure)
    if untrained:
        log.warning("dropped %d samples with no assistant token within data.max_length=%d", untrained,
                    cfg.max_length)
    if not samples:
        raise DataError(f"{records.sources[0].rsplit(':', 1)[0]}: no sample has a trained token "
                        f"(data.max_length={cfg.max_length})")
    if max_tokens is not None:
        log.info("data.max_tokens=%d: %d of %d conversations kept, %d tokens (a sample seeded by data.seed=%d)",
                 max_tokens, len(samples), len(order), tokens, cfg.seed)
    return [samples[i] for i in sorted(samples)], failed + untrained
