"""Is one drafter's τ above another's on the same questions, or is the difference noise? A paired bootstrap.

    python scripts/bench_compare.py outputs/bench/run-a/ours_tree outputs/bench/run-b/medusa_llm_tree

Each argument is a bench answer file (`<method>.jsonl`, written by `python -m inference bench --out DIR` or
`scripts/bench_suite.py`) or the method folder holding it (`<folder>/<folder name>.jsonl`). Both must answer the same
questions (category and question id). A run's τ is its new tokens over its target forwards, summed over the
questions, as in the bench's summary. The interval resamples the questions with replacement, the same draw for both
runs so that a question's difficulty cancels, and recomputes the difference of the two ratios: `--level` is its
coverage (0.95), `--resamples` the number of draws, `--seed` the draw. Where the interval holds 0, these questions do
not separate the two drafters.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

Key = tuple[str, str]  # (category, question id)
Counts = dict[Key, tuple[int, int]]  # -> (new tokens, target forwards), every turn of the question summed


class CompareError(Exception):
    """An answer file the comparison cannot use; the message names the file (and line)."""


@dataclass(frozen=True)
class Comparison:
    questions: int
    tau_a: float
    tau_b: float
    low: float  # the interval of tau_a - tau_b
    high: float
    level: float
    resamples: int

    @property
    def difference(self) -> float:
        return self.tau_a - self.tau_b


def answer_file(arg: str) -> Path:
    """The answer file an argument names: the file itself, or `<folder>/<folder name>.jsonl`."""
    path = Path(arg)
    if path.is_dir():
        path = path / f"{path.name}.jsonl"
    if not path.is_file():
        raise CompareError(f"{path}: no such answer file")
    return path


def read_counts(path: Path) -> Counts:
    """(new tokens, target forwards) of every question of a bench answer file."""
    counts: Counts = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            choice = record["choices"][0]
            key = (str(record["category"]), str(record["question_id"]))
            tokens, forwards = sum(choice["new_tokens"]), sum(choice["idxs"])
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise CompareError(f"{path}:{number}: not a bench answer record ({type(e).__name__}: {e})") from e
        if forwards <= 0:
            raise CompareError(f"{path}:{number}: question {key[1]} ({key[0]}) has no target forward")
        if key in counts:
            raise CompareError(f"{path}:{number}: question {key[1]} ({key[0]}) appears twice")
        counts[key] = (tokens, forwards)
    if not counts:
        raise CompareError(f"{path}: no answers")
    return counts


def tau(counts: Counts, keys: Sequence[Key]) -> float:
    return sum(counts[k][0] for k in keys) / sum(counts[k][1] for k in keys)


def compare(a: Counts, b: Counts, level: float = 0.95, resamples: int = 10_000, seed: int = 0) -> Comparison:
    """τ of each run and the paired-bootstrap interval of their difference over the shared questions."""
    keys = sorted(a)
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        sample = rng.choices(keys, k=len(keys))
        draws.append(tau(a, sample) - tau(b, sample))
    draws.sort()
    tail = (1 - level) / 2
    low = draws[int(tail * (resamples - 1))]
    high = draws[int(round((1 - tail) * (resamples - 1)))]
    return Comparison(len(keys), tau(a, keys), tau(b, keys), low, high, level, resamples)


def same_questions(a: Counts, b: Counts, path_a: Path, path_b: Path) -> None:
    for counts, path, other in ((a, path_a, b), (b, path_b, a)):
        missing = sorted(set(other) - set(counts))
        if missing:
            category, question = missing[0]
            raise CompareError(f"{path}: no answer to question {question} ({category}), which the other file has "
                               f"({len(missing)} missing in all): compare runs of the same questions")


def report(name_a: str, name_b: str, c: Comparison) -> str:
    verdict = "not separated by these questions" if c.low <= 0 <= c.high else (
        f"{name_a if c.low > 0 else name_b} higher")
    return (f"τ {c.tau_a:.3f} ({name_a}) against {c.tau_b:.3f} ({name_b}) over {c.questions} questions: difference "
            f"{c.difference:+.3f}, {c.level:.0%} paired-bootstrap interval [{c.low:+.3f}, {c.high:+.3f}] "
            f"({c.resamples:,} resamples): {verdict}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("a", help="answer file or method folder of one run")
    parser.add_argument("b", help="answer file or method folder of the other run, on the same questions")
    parser.add_argument("--level", type=float, default=0.95)
    parser.add_argument("--resamples", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if not 0 < args.level < 1:
            raise CompareError(f"--level {args.level}: give a coverage between 0 and 1, e.g. 0.95")
        if args.resamples < 100:
            raise CompareError(f"--resamples {args.resamples}: give at least 100")
        path_a, path_b = answer_file(args.a), answer_file(args.b)
        a, b = read_counts(path_a), read_counts(path_b)
        same_questions(a, b, path_a, path_b)
    except CompareError as e:
        print(f"bench_compare: {e}", file=sys.stderr)
        return 2
    print(report(path_a.stem, path_b.stem, compare(a, b, args.level, args.resamples, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
