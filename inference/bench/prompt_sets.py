"""Benchmark prompts: a question JSONL, or named public prompt sets read from the shared data folder.

`--questions` takes either a file of MT-bench / Spec-Bench records {question_id, category, turns}, or a comma list
of named sets with optional counts, `mt_bench,gsm8k:40,humaneval:40` (the first N records of each, in file order);
`name:N:spread` takes N records evenly spaced over the file instead (`mt_bench:8:spread`: one of each category).
The sets are read from $DRAFTSMITH_DATA, by default the `shared/data` folder next to the repository:
    mt_bench   mt_bench/question.jsonl         MT-bench's 80 two-turn questions, category from the file
    gsm8k      gsm8k/test.jsonl                the "question" field, one turn, category "gsm8k"
    humaneval  humaneval/HumanEval.jsonl.gz    the "prompt" field (a Python signature + docstring) in a user turn
                                               asking to complete the function, category "humaneval"
Every error is one line naming the flag, the set or the file and line.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from data.errors import UsageError
from data.eval_sets import DATA_ENV, DEFAULT_DATA, data_root  # noqa: F401 - the folder is data's (decontamination)


def default_questions() -> Path:
    """MT-bench's question file under the data folder ($DRAFTSMITH_DATA, read when called)."""
    return data_root() / "mt_bench" / "question.jsonl"


HUMANEVAL_TURN = "Complete the following Python function:\n```python\n{prompt}```"


@dataclass(frozen=True)
class Question:
    question_id: Any
    category: str
    turns: tuple[str, ...]


def read_questions(path: str | os.PathLike) -> list[Question]:
    """MT-bench / Spec-Bench question.jsonl; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: question file not found (expected JSONL of {{question_id, category, turns}}, or "
                         f"a comma list of prompt sets {', '.join(PROMPT_SETS)}[:N]; pass --questions)")
    questions = []
    for lineno, record in _records(path, path.read_text(encoding="utf-8-sig").split("\n")):
        if "question_id" not in record:
            raise UsageError(f"{path}:{lineno}: expected an object with 'question_id', 'category', 'turns'")
        turns = record.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise UsageError(f"{path}:{lineno}: 'turns' must be a non-empty list of non-empty strings")
        category = record.get("category", "default")
        if not isinstance(category, str):
            raise UsageError(f"{path}:{lineno}: 'category' must be a string")
        questions.append(Question(record["question_id"], category, tuple(turns)))
    if not questions:
        raise UsageError(f"{path}: no questions")
    return questions


def _records(path: Path, lines: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, JSON object) for every non-blank line."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise UsageError(f"{path}:{lineno}: expected a JSON object")
        yield lineno, record


def _string_field(path: Path, lineno: int, record: dict[str, Any], key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value:
        raise UsageError(f"{path}:{lineno}: expected an object with a non-empty string {key!r}")
    return value


def _gsm8k(path: Path) -> list[Question]:
    lines = path.read_text(encoding="utf-8-sig").split("\n")
    return [Question(f"gsm8k/{i}", "gsm8k", (_string_field(path, lineno, record, "question"),))
            for i, (lineno, record) in enumerate(_records(path, lines))]


def _humaneval(path: Path) -> list[Question]:
    try:
        with gzip.open(path, "rt", encoding="utf-8-sig") as f:
            lines = f.read().split("\n")
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise UsageError(f"{path}: not a readable gzip file ({e})") from None
    questions = []
    for i, (lineno, record) in enumerate(_records(path, lines)):
        prompt = _string_field(path, lineno, record, "prompt")
        questions.append(Question(record.get("task_id", f"humaneval/{i}"), "humaneval",
                                  (HUMANEVAL_TURN.format(prompt=prompt),)))
    return questions


def _self_instruct(path: Path) -> list[Question]:
    """Self-Instruct's user-oriented instructions: the instruction, then the first instance's input (if any) after a
    blank line, as the one turn; category "self_instruct"."""
    lines = path.read_text(encoding="utf-8-sig").split("\n")
    questions = []
    for i, (lineno, record) in enumerate(_records(path, lines)):
        instruction = _string_field(path, lineno, record, "instruction")
        instances = record.get("instances") or [{}]
        first = instances[0] if isinstance(instances, list) else None
        given = first.get("input", "") if isinstance(first, dict) else None
        if not isinstance(given, str):
            raise UsageError(f"{path}:{lineno}: 'instances' must be a list of objects whose 'input' is a string")
        turn = f"{instruction}\n\n{given}" if given.strip() else instruction
        questions.append(Question(record.get("id", f"self_instruct/{i}"), "self_instruct", (turn,)))
    return questions


PROMPT_SETS: dict[str, tuple[str, Callable[[Path], list[Question]]]] = {
    "mt_bench": ("mt_bench/question.jsonl", read_questions),
    "gsm8k": ("gsm8k/test.jsonl", _gsm8k),
    "humaneval": ("humaneval/HumanEval.jsonl.gz", _humaneval),
    "self_instruct": ("self_instruct_seed/user_oriented_instructions.jsonl", _self_instruct),
}


@dataclass(frozen=True)
class SetSpec:
    name: str
    count: int | None  # None: every record
    spread: bool = False  # count records evenly spaced over the file, not the first ones


def parse_sets(spec: str) -> list[SetSpec]:
    """"mt_bench:8:spread,gsm8k:40" -> [SetSpec("mt_bench", 8, True), SetSpec("gsm8k", 40)]; unknown names, bad counts
    and modifiers raise UsageError."""
    sets: list[SetSpec] = []
    for item in spec.split(","):
        name, colon, rest = item.strip().partition(":")
        count, _, mode = rest.partition(":")
        if name not in PROMPT_SETS:
            raise UsageError(f"--questions {spec}: unknown prompt set {name!r} (known: {', '.join(PROMPT_SETS)}; "
                             f"or pass a question JSONL file)")
        if colon and not (count.isdigit() and int(count) >= 1):
            raise UsageError(f"--questions {spec}: {item!r}: the count after ':' must be a positive integer")
        if mode not in ("", "spread") or rest.endswith(":"):
            raise UsageError(f"--questions {spec}: {item!r}: after the count only ':spread' may follow")
        if name in (s.name for s in sets):
            raise UsageError(f"--questions {spec}: prompt set {name!r} is named twice")
        sets.append(SetSpec(name, int(count) if colon else None, mode == "spread"))
    return sets


def take(found: list[Question], count: int | None, spread: bool) -> list[Question]:
    """The first `count` questions, or `count` evenly spaced ones (index floor(i * len / count))."""
    if count is None:
        return found
    if not spread:
        return found[:count]
    return [found[i * len(found) // count] for i in range(count)]


def is_set_spec(value: str) -> bool:
    """True when --questions names prompt sets rather than a file: a comma list, or a known name (with a count)."""
    if Path(value).is_file():
        return False
    return "," in value or value.partition(":")[0] in PROMPT_SETS


def load_questions(value: str) -> tuple[list[Question], dict[str, int] | None]:
    """--questions: a question file, or prompt sets (then also {set: questions taken}, in order)."""
    if not is_set_spec(value):
        return read_questions(value), None
    root, questions, taken = data_root(), [], {}
    for spec in parse_sets(value):
        name, count = spec.name, spec.count
        path = root / PROMPT_SETS[name][0]
        if not path.is_file():
            raise UsageError(f"--questions {name}: {path} not found (set {DATA_ENV} to the folder holding "
                             f"{PROMPT_SETS[name][0]})")
        found = PROMPT_SETS[name][1](path)
        if count is not None and count > len(found):
            raise UsageError(f"--questions {name}:{count}: {path} has only {len(found)} questions")
        chosen = take(found, count, spec.spread)
        questions.extend(chosen)
        taken[name] = len(chosen)
    return questions, taken
