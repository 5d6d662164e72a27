"""The public evaluation prompts (the benchmark's sets), seen from the training side: no train conversation may ask one.

The sets live in $DRAFTSMITH_DATA, by default the `shared/data` folder next to the repository
(inference.bench.prompt_sets reads the benchmark prompts from the same place). A train conversation is contaminated when
its first user turn, normalised (casefolded, whitespace runs made one space, stripped), matches the first turn of a
set's prompt:
    mt_bench   mt_bench/question.jsonl        "turns"[0]   equal
    gsm8k      gsm8k/test.jsonl               "question"   equal
    humaneval  humaneval/HumanEval.jsonl.gz   "prompt"     contained (users wrap the function in their own words)
An absent folder, or a set's absent file, is skipped with one log line; a file that is there but unreadable is a
DataError naming it and the line.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from data.errors import DataError

log = logging.getLogger(__name__)

DATA_ENV = "DRAFTSMITH_DATA"
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # ../shared/data beside the repository


@dataclass(frozen=True)
class EvalSet:
    name: str
    file: str  # relative to data_root()
    field: str  # the record's first-turn text: a string field, or the first item of a list field
    contained: bool  # match when the prompt is inside the user turn, not only equal to it


EVAL_SETS = (
    EvalSet("mt_bench", "mt_bench/question.jsonl", "turns", contained=False),
    EvalSet("gsm8k", "gsm8k/test.jsonl", "question", contained=False),
    EvalSet("humaneval", "humaneval/HumanEval.jsonl.gz", "prompt", contained=True),
)


@dataclass(frozen=True)
class EvalPrompts:
    """Normalised first turns of the sets found (`sets`: their names), by match rule."""

    equal: frozenset[str]
    contained: tuple[str, ...]
    sets: tuple[str, ...]

    def matches(self, user_turn: str) -> bool:
        """Whether `user_turn` (raw text) asks one of the prompts."""
        text = normalise(user_turn)
        return text in self.equal or any(prompt in text for prompt in self.contained)


def data_root() -> Path:
    """$DRAFTSMITH_DATA, else ../shared/data beside the repository."""
    value = os.environ.get(DATA_ENV)
    return Path(value) if value else DEFAULT_DATA


def normalise(text: str) -> str:
    return " ".join(text.casefold().split())


def eval_prompts(root: Path | None = None) -> EvalPrompts:
    """The first turns of every set in EVAL_SETS under `root` (default data_root()); absent sets are logged, skipped."""
    root = data_root() if root is None else Path(root)
    equal: set[str] = set()
    contained: list[str] = []
    found: list[str] = []
    if not root.is_dir():
        log.warning("decontamination skipped: no evaluation sets folder %s (set $%s)", root, DATA_ENV)
        return EvalPrompts(frozenset(), (), ())
    for spec in EVAL_SETS:
        path = root / spec.file
        if not path.is_file():
            log.warning("decontamination: %s not found, %s prompts not checked", path, spec.name)
            continue
        turns = {normalise(t) for t in _first_turns(path, spec.field)} - {""}
        if spec.contained:
            contained.extend(sorted(turns))
        else:
            equal |= turns
        found.append(spec.name)
    return EvalPrompts(frozenset(equal), tuple(contained), tuple(found))


def _first_turns(path: Path, field: str) -> list[str]:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        lines = raw.decode("utf-8-sig").split("\n")
    except (OSError, EOFError, UnicodeDecodeError) as err:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path}: unreadable evaluation set ({err})") from None
    turns = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line).get(field)
        except (json.JSONDecodeError, AttributeError):
            raise DataError(f"{path}:{lineno}: expected a JSON object with {field!r}") from None
        value = value[0] if isinstance(value, list) and value else value
        if not isinstance(value, str):
            raise DataError(f"{path}:{lineno}: {field!r} must be a string (or a list of strings)")
        turns.append(value)
    return turns
