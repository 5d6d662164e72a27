"""Readers: ShareGPT / Alpaca / GSM8K / JSONL-text records -> `Conversation`s, with per-record error reporting.

Sources (`path`):
    a .jsonl file (one JSON object per line; record number = line number), a .json file holding a JSON list
    (record number = 1-based list index; a .json file whose first character is not "[" is read as JSONL),
    a directory (its *.json / *.jsonl files in name order, or a `datasets.save_to_disk` folder),
    or, when nothing exists at `path`, a hub dataset loaded with `datasets.load_dataset`, written
    "id[:config][@split]" (e.g. "openai/gsm8k:main@test"; the split defaults to the caller's; offline, this works
    from the local `datasets` cache only).
Files are UTF-8, with or without a byte-order mark, with LF or CRLF line ends.
Every problem names its place as "<file>:<record>: <reason>" (a .json list that does not parse fails as a whole).
on_error="raise" stops at the first bad record; on_error="skip" drops bad records and logs one line per source.
A source with no usable record always raises.

Normal forms:
    sharegpt  {"conversations"|"messages": [{"from"|"role": ..., "value"|"content": str}], "system"?: str}
              roles human/user -> user, gpt/assistant/chatgpt/model -> assistant, system -> system; leading
              assistant turns (no prompt before them) are dropped, as FastChat does.
    alpaca    {"instruction", "input"?, "output", "system"?, "history"?: [[user, assistant], ...]}
              -> user "instruction\\ninput" (or just the instruction), assistant output.
    gsm8k     {"question", "answer"} -> user question, assistant answer (kept verbatim, calculator marks included).
    text      {text_field: str} -> a single assistant turn holding the text; datasets.py encodes it without a chat
              template so every token trains.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.chat import Conversation
from data.errors import UsageError

log = logging.getLogger(__name__)

FORMATS = ("sharegpt", "alpaca", "gsm8k", "text")
_ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "system": "system",
}


class DataError(UsageError):
    """Bad input data; the message starts with "<file>:<record>:" (or "<file>:" for whole-file problems)."""


class RecordError(ValueError):
    """One record cannot be normalised; the reader adds its file and record number."""


@dataclass(frozen=True)
class ReadResult:
    conversations: list[Conversation]
    sources: list[str]  # "<file>:<record>" of each conversation, for errors found later (e.g. while encoding)
    skipped: int
    first_error: str | None  # "<file>:<record>: <reason>" of the first skipped record


def read_conversations(
    path: str | Path,
    fmt: str,
    on_error: str = "raise",
    split: str = "train",
    text_field: str = "text",
) -> ReadResult:
    """All records of `path` normalised to conversations (see module docstring); raises DataError on bad data."""
    if fmt not in FORMATS:
        raise DataError(f"data.format: unknown format {fmt!r}; expected builtin or one of {', '.join(FORMATS)}")
    if on_error not in ("raise", "skip"):
        raise DataError(f"data.on_error must be 'raise' or 'skip', got {on_error!r}")
    normalise = _NORMALISERS[fmt]
    conversations: list[Conversation] = []
    sources: list[str] = []
    skipped, first_error = 0, None
    source = str(path)
    for where, record in iter_records(path, split):
        try:
            if isinstance(record, RecordError):
                raise record
            conversations.append(normalise(record, text_field))
            sources.append(where)
        except RecordError as err:
            message = f"{where}: {err}"
            if on_error == "raise":
                raise DataError(message) from None
            skipped += 1
            first_error = first_error or message
    if skipped:
        log.warning("skipped %d bad records in %s (first: %s)", skipped, source, first_error)
    if not conversations:
        if skipped:
            raise DataError(f"{source}: no usable records ({skipped} bad records skipped; first: {first_error})")
        raise DataError(f"{source}: empty dataset (no records)")
    return ReadResult(conversations=conversations, sources=sources, skipped=skipped, first_error=first_error)


def iter_records(path: str | Path, split: str = "train") -> Iterator[tuple[str, Any]]:
    """Yield ("<file>:<record>", record) in source order; an unparsable record is yielded as a RecordError."""
    p = Path(path).expanduser()
    if p.is_file():
        yield from _iter_file(p)
    elif p.is_dir():
        if (p / "state.json").exists() or (p / "dataset_dict.json").exists():
            yield from _iter_saved_dataset(p, split)
            return
        files = sorted(f for f in p.iterdir() if f.suffix in (".json", ".jsonl") and f.is_file())
        if not files:
            raise DataError(f"{p}: directory holds no .json or .jsonl file")
        for f in files:
            yield from _iter_file(f)
    elif _looks_local(str(path)):
        raise DataError(f"{path}: no such file or directory")
    else:
        yield from _iter_hub(str(path), split)


def _looks_local(path: str) -> bool:
    """A path no hub id can be: absolute/relative/home paths and .json/.jsonl names fail fast instead of retrying."""
    return path.startswith(("/", "./", "../", "~")) or path.endswith((".json", ".jsonl")) or path.count("/") > 1


def _iter_file(path: Path) -> Iterator[tuple[str, Any]]:
    # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first record. surrogateescape
    # keeps invalid bytes as lone surrogates so the bad record, not the whole file, is reported. CRLF line ends
    # leave a "\r" that JSON reads as whitespace.
    text = path.read_bytes().decode("utf-8-sig", errors="surrogateescape")
    if path.suffix != ".jsonl" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: malformed JSON: {err.msg} (column {err.colno})") from None
        for i, record in enumerate(records, start=1):
            yield f"{path}:{i}", _bad_bytes_error(record) or record
        return
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028 / U+0085, which must not end a record.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        if _has_surrogates(line):
            yield f"{path}:{lineno}", RecordError("non-UTF-8 bytes")
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as err:
            yield f"{path}:{lineno}", RecordError(f"malformed JSON line: {err.msg} (column {err.colno})")


def _iter_saved_dataset(path: Path, split: str) -> Iterator[tuple[str, Any]]:
    import datasets  # heavy import, only for this source kind

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path}: no split {split!r}; splits: {', '.join(loaded)}")
        loaded = loaded[split]
    for i, record in enumerate(loaded, start=1):
        yield f"{path}[{split}]:{i}", record


def _iter_hub(name: str, split: str) -> Iterator[tuple[str, Any]]:
    import datasets

    spec, _, explicit_split = name.partition("@")
    split = explicit_split or split
    repo, _, config = spec.partition(":")
    try:
        loaded = datasets.load_dataset(repo, config or None, split=split)
    except Exception as err:  # datasets raises many types (FileNotFoundError, ConnectionError, DatasetNotFoundError)
        raise DataError(
            f"{name}: no such local file or directory, and loading it as a hub dataset (split {split!r}) failed: "
            f"{type(err).__name__}: {err}"
        ) from err
    for i, record in enumerate(loaded, start=1):
        yield f"{name}[{split}]:{i}", record


def _has_surrogates(text: str) -> bool:
    return any("\udc80" <= ch <= "\udcff" for ch in text)


def _bad_bytes_error(value: Any) -> RecordError | None:
    if isinstance(value, str):
        return RecordError("non-UTF-8 bytes") if _has_surrogates(value) else None
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, list):
        for item in value:
            if err := _bad_bytes_error(item):
                return err
    return None


def _field(record: Any, *names: str) -> Any:
    """The first present field among `names` (aliases); RecordError when none is present."""
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {type(record).__name__}")
    for name in names:
        if name in record and record[name] is not None:
            return record[name]
    raise RecordError(f"missing field {' or '.join(repr(n) for n in names)}")


def _string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{what} must be a string, got {type(value).__name__}")
    return value


def _finish(messages: Conversation) -> Conversation:
    """Check the invariants every reader guarantees: a non-empty assistant turn exists, none is blank."""
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no assistant turn")
    for i, m in enumerate(messages, start=1):
        if m["role"] == "assistant" and not m["content"].strip():
            raise RecordError(f"turn {i}: empty assistant turn")
    return messages


def _sharegpt(record: Any, text_field: str) -> Conversation:
    turns = _field(record, "conversations", "messages")
    if not isinstance(turns, list):
        raise RecordError(f"'conversations' must be a list, got {type(turns).__name__}")
    messages: Conversation = []
    if isinstance(record.get("system"), str) and record["system"].strip():
        messages.append({"role": "system", "content": record["system"]})
    for i, turn in enumerate(turns, start=1):
        try:
            raw_role = _field(turn, "from", "role")
            content = _string(_field(turn, "value", "content"), "content")
        except RecordError as err:
            raise RecordError(f"turn {i}: {err}") from None
        role = _ROLE_ALIASES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise RecordError(f"turn {i}: unknown role {raw_role!r}")
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            continue  # a reply with no prompt before it (FastChat drops these too)
        messages.append({"role": role, "content": content})
    return _finish(messages)


def _alpaca(record: Any, text_field: str) -> Conversation:
    instruction = _string(_field(record, "instruction"), "'instruction'")
    output = _string(_field(record, "output"), "'output'")
    extra = _string(record.get("input") or "", "'input'")
    messages: Conversation = []
    if record.get("system"):
        messages.append({"role": "system", "content": _string(record["system"], "'system'")})
    for i, pair in enumerate(record.get("history") or [], start=1):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise RecordError(f"history entry {i} must be a [user, assistant] pair")
        messages.append({"role": "user", "content": _string(pair[0], f"history entry {i} user")})
        messages.append({"role": "assistant", "content": _string(pair[1], f"history entry {i} assistant")})
    messages.append({"role": "user", "content": f"{instruction}\n{extra}" if extra else instruction})
    messages.append({"role": "assistant", "content": output})
    return _finish(messages)


def _gsm8k(record: Any, text_field: str) -> Conversation:
    question = _string(_field(record, "question"), "'question'")
    answer = _string(_field(record, "answer"), "'answer'")
    return _finish([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])


def _text(record: Any, text_field: str) -> Conversation:
    text = _string(_field(record, text_field), repr(text_field))
    if not text.strip():
        raise RecordError(f"empty {text_field!r}")
    return [{"role": "assistant", "content": text}]


_NORMALISERS: dict[str, Callable[[Any, str], Conversation]] = {
    "sharegpt": _sharegpt, "alpaca": _alpaca, "gsm8k": _gsm8k, "text": _text,
}
