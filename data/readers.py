"""Readers: ShareGPT / Alpaca / GSM8K / JSONL-text records -> `Conversation`s, with per-record error reporting.

Sources (`path`):
    a .jsonl file (one JSON object per line; record number = line number), a .json file holding a JSON list
    (record number = 1-based list index; a .json file whose first character is not "[" is read as JSONL),
    a directory (its *.json / *.jsonl files in name order, or a `datasets.save_to_disk` folder),
    a named source (NAMED_SOURCES: "sharegpt_v3", see data.sharegpt_v3) when no such file or folder exists,
    or, when nothing exists at `path`, a hub dataset loaded with `datasets.load_dataset`, written
    "id[:config][@split]" (e.g. "openai/gsm8k:main@test"; the split defaults to the caller's; offline, this works
    from the local `datasets` cache only).
Files are UTF-8, with or without a byte-order mark, with LF or CRLF line ends.
Every problem names its place as "<file>:<record>: <reason>". A .json list that does not parse fails as a whole,
unless recover_truncated (data.recover_truncated): then a list cut off at its end (a download or a copy stopped
short) keeps its complete records and drops the cut-off one, counted as truncated; damage elsewhere still fails.
on_error="raise" stops at the first bad record; on_error="skip" drops bad records and logs one line per source.
The drops a data key asks for (the cut-off record, conversations the assistant starts under require_user_first) are
not errors: they happen whatever on_error says.
Each dropped record is counted once, under its first fault, in `RecordStats`. A source with no usable record
always raises.

Normal forms:
    sharegpt  {"conversations"|"messages": [{"from"|"role": ..., "value"|"content": str}], "system"?: str,
              "id"?: str} roles human/user -> user, gpt/assistant/chatgpt/model -> assistant, system -> system;
              leading assistant turns (no prompt before them) are dropped, as FastChat does, or, with
              require_user_first, the whole record is (a reply to a prompt that is not there teaches guessing).
    alpaca    {"instruction", "input"?, "output", "system"?, "history"?: [[user, assistant], ...]}
              -> user "instruction\\ninput" (or just the instruction), assistant output.
    gsm8k     {"question", "answer"} -> user question, assistant answer (kept verbatim, calculator marks included).
    text      {text_field: str} -> a single assistant turn holding the text; datasets.py encodes it without a chat
              template so every token trains.
A record's "id" (a string or integer), when it has one, is kept beside its conversation (ShareGPT ids
"<conversation>_<part>" let datasets.py split by conversation and drop repeats).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from data import sharegpt_v3
from data.chat import Conversation
from data.errors import DataError  # noqa: F401 - callers import it from here too
from data.extras import require
from data.locations import written_as_path

log = logging.getLogger(__name__)

FORMATS = ("sharegpt", "alpaca", "gsm8k", "text")
_ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "system": "system",
}


# Sources named by a word rather than a path: name -> a function returning the located file (data.sharegpt_v3).
NAMED_SOURCES: dict[str, Callable[[], sharegpt_v3.Located]] = {sharegpt_v3.NAME: sharegpt_v3.locate}
_SURROGATE = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of a byte that is not UTF-8
_RULE_DROPS = ("truncated", "not_user_first")  # RecordError reasons a data key asked for: never raised
_TRUNCATED_TAIL = 6  # a decode error this close to the end of the text is the text running out (`\uXXX`, `fals`)


class RecordError(ValueError):
    """One record cannot be normalised; the reader adds its file and record number. `reason` is the RecordStats field
    it is counted under."""

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RecordStats:
    """What became of a source's records: read == kept + every drop (a record counts once, under its first fault)."""

    read: int = 0  # records in the source, a cut-off last one included
    kept: int = 0
    empty: int = 0  # nothing to train on: no turns, or no (or a blank) assistant turn
    not_user_first: int = 0  # the assistant speaks first (require_user_first)
    unknown_role: int = 0
    invalid: int = 0  # any other malformed record: JSON, fields, types, non-UTF-8 bytes
    truncated: int = 0  # the record a cut-off JSON list ends in (recover_truncated)
    duplicate: int = 0  # the id or the conversation of an earlier record (data.dedupe; data.curation)
    decontaminated: int = 0  # a train conversation that asks an evaluation prompt (data.decontaminate)

    def dropped(self) -> dict[str, int]:
        """The non-zero drop counts by reason, in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self)[2:] if getattr(self, f.name)}

    def summary(self) -> str:
        """One line: "17672 records read, 10773 kept; dropped: 144 empty, 6358 not user-first, ..."."""
        drops = ", ".join(f"{n} {reason.replace('_', ' ').replace('user first', 'user-first')}"
                          for reason, n in self.dropped().items())
        return f"{self.read} records read, {self.kept} kept; dropped: {drops or 'none'}"


@dataclass(frozen=True)
class RecordRules:
    """How records become conversations, beyond the format (see the module docstring)."""

    text_field: str = "text"
    require_user_first: bool = False


@dataclass(frozen=True)
class ReadResult:
    conversations: list[Conversation]
    sources: list[str]  # "<file>:<record>" of each conversation, for errors found later (e.g. while encoding)
    ids: list[str | None]  # each conversation's record "id", None where it has none
    skipped: int  # bad records dropped by on_error="skip" (not those a data key drops: see _RULE_DROPS)
    first_error: str | None  # "<file>:<record>: <reason>" of the first skipped record
    stats: RecordStats

    def select(self, indices: Iterable[int]) -> ReadResult:
        """The records at `indices`, in that order; the counts are unchanged (the caller updates what it drops)."""
        keep = list(indices)
        return replace(self, conversations=[self.conversations[i] for i in keep],
                       sources=[self.sources[i] for i in keep], ids=[self.ids[i] for i in keep])


def read_conversations(
    path: str | Path,
    fmt: str,
    on_error: str = "raise",
    split: str = "train",
    text_field: str = "text",
    recover_truncated: bool = False,
    require_user_first: bool = False,
) -> ReadResult:
    """All records of `path` normalised to conversations (see module docstring); raises DataError on bad data."""
    if fmt not in FORMATS:
        raise DataError(f"data.format: unknown format {fmt!r}; expected builtin or one of {', '.join(FORMATS)}")
    if on_error not in ("raise", "skip"):
        raise DataError(f"data.on_error must be 'raise' or 'skip', got {on_error!r}")
    normalise, rules = _NORMALISERS[fmt], RecordRules(text_field, require_user_first)
    conversations: list[Conversation] = []
    sources: list[str] = []
    ids: list[str | None] = []
    drops = {f.name: 0 for f in fields(RecordStats)[2:]}
    skipped, first_error = 0, None
    source = str(path)
    for where, record in iter_records(path, split, recover_truncated):
        try:
            if isinstance(record, RecordError):
                raise record
            conversations.append(normalise(record, rules))
            sources.append(where)
            ids.append(_record_id(record))
        except RecordError as err:
            drops[err.reason] += 1
            if err.reason == "truncated":
                log.warning("%s: the list is cut off inside this record: dropped, the records before it kept "
                            "(data.recover_truncated)", where)
            if err.reason in _RULE_DROPS:  # asked for by a data key: dropped and counted, whatever on_error says
                continue
            message = f"{where}: {err}"
            if on_error == "raise":
                raise DataError(message) from None
            skipped += 1
            first_error = first_error or message
    if skipped:
        log.warning("skipped %d bad records in %s (first: %s)", skipped, source, first_error)
    stats = RecordStats(read=len(conversations) + sum(drops.values()), kept=len(conversations), **drops)
    if not conversations:
        if skipped:
            raise DataError(f"{source}: no usable records ({skipped} bad records skipped; first: {first_error})")
        if stats.read:
            raise DataError(f"{source}: no usable records ({stats.summary()})")
        raise DataError(f"{source}: empty dataset (no records)")
    return ReadResult(conversations, sources, ids, skipped, first_error, stats)


def iter_records(path: str | Path, split: str = "train", recover_truncated: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield ("<file>:<record>", record) in source order; an unparsable record is yielded as a RecordError."""
    p = Path(path).expanduser()
    if p.is_file():
        yield from _iter_text(str(p), p.read_bytes(), p.suffix == ".jsonl", recover_truncated)
    elif p.is_dir():
        if (p / "state.json").exists() or (p / "dataset_dict.json").exists():
            yield from _iter_saved_dataset(p, split)
            return
        files = sorted(f for f in p.iterdir() if f.suffix in (".json", ".jsonl") and f.is_file())
        if not files:
            raise DataError(f"{p}: directory holds no .json or .jsonl file")
        for f in files:
            yield from _iter_text(str(f), f.read_bytes(), f.suffix == ".jsonl", recover_truncated)
    elif str(path) in NAMED_SOURCES:
        located = NAMED_SOURCES[str(path)]()
        yield from _iter_text(located.label, located.read_bytes(), located.label.endswith(".jsonl"), recover_truncated)
    elif missing_source(path):
        raise DataError(f"{path}: no such file or directory")
    else:
        yield from _iter_hub(str(path), split)


def missing_source(path: str | Path) -> bool:
    """Whether `path` can only name a local file or folder (not a named source or a hub dataset id) and none is
    there: what iter_records refuses; training asks it before anything loads (train.checks)."""
    text = str(path)
    return not Path(text).expanduser().exists() and text not in NAMED_SOURCES and _looks_local(text)


def _looks_local(path: str) -> bool:
    """A path no hub dataset id can be (data.locations' rule, or a .json/.jsonl file name): it fails fast instead of
    retrying the hub."""
    return written_as_path(path) or path.endswith((".json", ".jsonl"))


def _iter_text(name: str, data: bytes, jsonl: bool, recover_truncated: bool) -> Iterator[tuple[str, Any]]:
    """The records of one file's bytes (`name` labels them): a JSON list unless `jsonl` or not starting with "[",
    else JSON lines."""
    # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first record. surrogateescape
    # keeps invalid bytes as lone surrogates so the bad record, not the whole file, is reported. CRLF line ends
    # leave a "\r" that JSON reads as whitespace.
    text = data.decode("utf-8-sig", errors="surrogateescape")
    if not jsonl and text.lstrip().startswith("["):
        records = _recover_list(name, text) if recover_truncated else _json_list(name, text)
        if not _has_surrogates(text):  # one scan of the text instead of one per string of every record
            yield from records
            return
        for where, record in records:
            yield where, (_bad_bytes_error(record) or record) if not isinstance(record, RecordError) else record
        return
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028 / U+0085, which must not end a record.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        if _has_surrogates(line):
            yield f"{name}:{lineno}", RecordError("non-UTF-8 bytes")
            continue
        try:
            yield f"{name}:{lineno}", json.loads(line)
        except json.JSONDecodeError as err:
            yield f"{name}:{lineno}", RecordError(f"malformed JSON line: {err.msg} (column {err.colno})")


def _json_list(name: str, text: str) -> Iterator[tuple[str, Any]]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{name}:{err.lineno}: malformed JSON: {err.msg} (column {err.colno})") from None
    for i, record in enumerate(records, start=1):
        yield f"{name}:{i}", record


def _recover_list(name: str, text: str) -> Iterator[tuple[str, Any]]:
    """A JSON list decoded item by item: a list cut off at its end yields its complete records, then the cut-off one
    (if any) as a RecordError(reason="truncated"); any other damage raises DataError naming the line."""
    decoder = json.JSONDecoder()
    pos, count = _skip_space(text, text.index("[") + 1), 0
    while pos < len(text) and text[pos] != "]":
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if not (err.msg.startswith("Unterminated string") or len(text[err.pos:].rstrip()) <= _TRUNCATED_TAIL):
                raise DataError(f"{name}:{err.lineno}: malformed JSON: {err.msg} (column {err.colno}; "
                                f"data.recover_truncated only recovers a list cut off at its end)") from None
            yield f"{name}:{count + 1}", RecordError("cut off at the end of the file", reason="truncated")
            return
        count += 1
        yield f"{name}:{count}", record
        pos = _skip_space(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_space(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            line = text.count("\n", 0, pos) + 1
            raise DataError(f"{name}:{line}: malformed JSON: expecting ',' or ']' after record {count}")
    if pos >= len(text):
        log.warning("%s: the JSON list ends without ']' after record %d (cut off between records; all kept)",
                    name, count)
    elif text[pos + 1:].strip():
        line = text.count("\n", 0, pos + 1) + 1
        raise DataError(f"{name}:{line}: malformed JSON: extra data after the list")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _iter_saved_dataset(path: Path, split: str) -> Iterator[tuple[str, Any]]:
    require("datasets", f"data.path={path} (a datasets.save_to_disk folder)")
    import datasets  # heavy import, only for this source kind

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path}: no split {split!r}; splits: {', '.join(loaded)}")
        loaded = loaded[split]
    for i, record in enumerate(loaded, start=1):
        yield f"{path}[{split}]:{i}", record


def _iter_hub(name: str, split: str) -> Iterator[tuple[str, Any]]:
    require("datasets", f"data.path={name} (a hub dataset)")
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
    return _SURROGATE.search(text) is not None


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


def _record_id(record: Any) -> str | None:
    value = record.get("id") if isinstance(record, dict) else None
    return str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None


def _finish(messages: Conversation) -> Conversation:
    """Check the invariants every reader guarantees: a non-empty assistant turn exists, none is blank."""
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no assistant turn", reason="empty")
    for i, m in enumerate(messages, start=1):
        if m["role"] == "assistant" and not m["content"].strip():
            raise RecordError(f"turn {i}: empty assistant turn", reason="empty")
    return messages


def _sharegpt(record: Any, rules: RecordRules) -> Conversation:
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
            raise RecordError(f"turn {i}: unknown role {raw_role!r}", reason="unknown_role")
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            if rules.require_user_first:
                raise RecordError(f"turn {i}: the assistant speaks before any user turn (data.require_user_first)",
                                  reason="not_user_first")
            continue  # a reply with no prompt before it (FastChat drops these too)
        messages.append({"role": role, "content": content})
    return _finish(messages)


def _alpaca(record: Any, rules: RecordRules) -> Conversation:
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


def _gsm8k(record: Any, rules: RecordRules) -> Conversation:
    question = _string(_field(record, "question"), "'question'")
    answer = _string(_field(record, "answer"), "'answer'")
    return _finish([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])


def _text(record: Any, rules: RecordRules) -> Conversation:
    text = _string(_field(record, rules.text_field), repr(rules.text_field))
    if not text.strip():
        raise RecordError(f"empty {rules.text_field!r}", reason="empty")
    return [{"role": "assistant", "content": text}]


_NORMALISERS: dict[str, Callable[[Any, RecordRules], Conversation]] = {
    "sharegpt": _sharegpt, "alpaca": _alpaca, "gsm8k": _gsm8k, "text": _text,
}
