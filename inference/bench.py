"""`python -m inference bench`: speed of a drafter against plain decoding of the same model, measured in one run.

Methods, run in turn on every question (rotating which goes first, after a warm-up, so background load hits all alike):
    drafter  the engine with the chosen drafter
    ar       the same engine loop with NoDrafter (plain greedy / sampling, one token per target forward)
    hf       Hugging Face `model.generate` on the same model object
Questions are MT-bench / Spec-Bench records {question_id, category, turns}. Multi-turn (--turns all) feeds each method
its own previous answer. Each method's answers are written in the Medusa / Spec-Bench answer format
({question_id, category, answer_id, model_id, choices: [{index, turns, new_tokens, idxs, wall_time, accept_lengths}],
tstamp}); idxs = target forwards per turn (prefill included), accept_lengths = tokens committed per decoding step.

Summary definitions:
    tau                new tokens / target forwards (1.0 for plain decoding)
    speedup            tokens/s of the main method / tokens/s of a baseline (ar, else hf)
    ideal speedup      tau x t_AR_step / t_tree_forward: the speedup if drafting, verification and cache surgery were
                       free (t_AR_step: mean wall time of one plain step; t_tree_forward: mean target forward over
                       the draft tree)
    engine efficiency  speedup vs ar / ideal speedup
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from inference.benchstats import Answer, TurnResult, format_table, summarize
from inference.cli import (UsageError, add_model_args, add_sampling_args, check_sampling, encode_messages,
                           open_session)
from inference.devices import input_device
from inference.drafters import NoDrafter

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench" / "question.jsonl"  # ../shared
BASELINES = ("ar", "hf")
WARMUP_TOKENS = 32


@dataclass(frozen=True)
class Question:
    question_id: Any
    category: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int
    top_p: float
    acceptance: str


def read_questions(path: str | os.PathLike) -> list[Question]:
    """MT-bench / Spec-Bench question.jsonl; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: question file not found (expected JSONL of {{question_id, category, turns}}; "
                         "pass --questions)")
    questions = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8-sig").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or "question_id" not in record:
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


class EngineRunner:
    """A method that decodes with an inference Engine (drafter or NoDrafter)."""

    def __init__(self, engine: Any, sampling: Sampling) -> None:
        self.engine, self.sampling = engine, sampling

    def __call__(self, prompt_ids: list[int], max_new_tokens: int, seed: int) -> TurnResult:
        s = self.sampling
        start = time.perf_counter()
        out = self.engine.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=s.temperature,
                                   top_k=s.top_k, top_p=s.top_p, acceptance=s.acceptance, seed=seed)
        wall = time.perf_counter() - start
        stats = out.stats
        return TurnResult(tuple(out.sequences[0]), "", wall, stats.target_forwards,
                          tuple(step[0] for step in stats.accepted), stats.times)


class HFRunner:
    """Hugging Face `generate` on the target (greedy at temperature 0, else sampling with the same filters)."""

    def __init__(self, model: torch.nn.Module, eos_ids: Sequence[int], pad_id: int | None, sampling: Sampling) -> None:
        self.model, self.eos_ids, self.pad_id, self.sampling = model, list(eos_ids), pad_id, sampling

    def __call__(self, prompt_ids: list[int], max_new_tokens: int, seed: int) -> TurnResult:
        s = self.sampling
        ids = torch.tensor([prompt_ids], device=input_device(self.model))
        kwargs: dict[str, Any] = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        if s.temperature > 0:
            kwargs = {"do_sample": True, "temperature": s.temperature, "top_k": s.top_k or None, "top_p": s.top_p}
            torch.manual_seed(seed)
        start = time.perf_counter()
        out = self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=None,
            eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id, **kwargs,
        )
        tokens = out[0, len(prompt_ids):].tolist()
        wall = time.perf_counter() - start
        end = next((i + 1 for i, t in enumerate(tokens) if t in self.eos_ids), len(tokens))
        tokens = tokens[:end]
        return TurnResult(tuple(tokens), "", wall, len(tokens), (0,) * max(len(tokens) - 1, 0), None)


Runner = Callable[[list[int], int, int], TurnResult]


def answer(runner: Runner, question: Question, num_turns: int, encode: Callable, decode: Callable,
           max_new_tokens: int, seed: int) -> Answer:
    """All turns of one question; turn j sees the method's own answers to the turns before it."""
    messages: list[dict[str, str]] = []
    turns = []
    for j, user in enumerate(question.turns[:num_turns]):
        messages.append({"role": "user", "content": user})
        result = runner(encode(messages), max_new_tokens, seed + j)
        text = decode(result.tokens).strip()
        messages.append({"role": "assistant", "content": text})
        turns.append(TurnResult(result.tokens, text, result.wall_time, result.target_forwards, result.accepted,
                                result.times))
    return Answer(question.question_id, question.category, tuple(turns))


def answer_record(a: Answer, model_id: str) -> dict[str, Any]:
    """One line of a Medusa / Spec-Bench answer file."""
    choice = {
        "index": 0,
        "turns": [t.text for t in a.turns],
        "new_tokens": [len(t.tokens) for t in a.turns],
        "idxs": [t.target_forwards for t in a.turns],
        "wall_time": [t.wall_time for t in a.turns],
        "accept_lengths": [n + 1 for t in a.turns for n in t.accepted],
    }
    return {"question_id": a.question_id, "category": a.category, "answer_id": uuid.uuid4().hex,
            "model_id": model_id, "choices": [choice], "tstamp": time.time()}


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0] + " Greedy by default; answers + summary.json land in --out."
    add_model_args(p)
    add_sampling_args(p, max_new_tokens=256)
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="question JSONL (default: MT-bench, "
                   "../shared/data/mt_bench/question.jsonl next to the repository)")
    p.add_argument("--turns", choices=("first", "all"), default="first",
                   help="all: later turns see the method's own previous answers")
    p.add_argument("--limit", type=int, help="only the first N questions")
    p.add_argument("--out", default="bench_results", help="folder for <model_id>.jsonl answers and summary.json")
    p.add_argument("--model-id", help="model_id of the main method's answers (default: from the drafter / base)")
    p.add_argument("--baselines", default="ar,hf", help="comma list of ar (our loop, NoDrafter), hf (HF generate)")
    p.add_argument("--baseline-only", action="store_true", help="run only the baselines (no drafter)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up generations per method before timing")
    p.add_argument("--plot", metavar="DIR", help="write head_accuracy.png, accept_hist.png, bench_summary.png")
    p.set_defaults(func=run_bench_command)


def _slug(name: str) -> str:
    return Path(name.rstrip("/")).name.replace(":", "-") or "model"


def run_bench_command(args: argparse.Namespace) -> int:
    check_sampling(args)
    baselines = [b for b in args.baselines.split(",") if b]
    if any(b not in BASELINES for b in baselines) or len(set(baselines)) != len(baselines):
        raise UsageError(f"--baselines {args.baselines!r}: a comma list of distinct names from {', '.join(BASELINES)}")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'draftsmith[plots]'") from None
    questions = read_questions(args.questions)[: args.limit]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    session = open_session(args)
    with_drafter = not args.baseline_only and (session.drafter_name != "none")
    names = (["drafter"] if with_drafter else []) + baselines
    if not names:
        raise UsageError("nothing to run: --baseline-only (or --drafter none) with --baselines empty")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.acceptance)
    runners = build_runners(session, names, sampling)
    base_id = _slug(session.base)
    model_ids = {"drafter": _slug(session.drafter_name), "ar": f"{base_id}-ar", "hf": f"{base_id}-hf"}
    if args.model_id:
        model_ids[names[0]] = args.model_id
    answers = run_all(session, runners, questions, args)
    summary = summarize(answers, names[0], greedy=args.temperature == 0)
    summary["config"] = {
        "questions": str(args.questions), "num_questions": len(questions), "turns": args.turns,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
        "top_p": args.top_p, "acceptance": args.acceptance, "base": session.base, "drafter": session.drafter_name,
        "head_vocab": args.head_vocab,
        "tree_nodes": getattr(session.engine.tree, "num_nodes", None),
        "dtype": str(session.engine.model.dtype).removeprefix("torch."), "device": str(session.engine.device),
        "threads": torch.get_num_threads(), "model_ids": {n: model_ids[n] for n in names},
    }
    for name in names:
        lines = "".join(json.dumps(answer_record(a, model_ids[name])) + "\n" for a in answers[name])
        write_atomic(out_dir / f"{model_ids[name]}.jsonl", lines)
    write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(format_table(summary))
    print(f"answers and summary.json written to {out_dir}")
    if args.plot:
        for path in write_plots(Path(args.plot), summary, answers[names[0]], session.drafter_config):
            print(f"plot: {path}")
    return 0


def build_runners(session: Any, names: Sequence[str], sampling: Sampling) -> dict[str, Runner]:
    from inference.api import Engine, _eos_ids

    model = session.engine.model
    made: dict[str, Runner] = {}
    for name in names:
        if name == "drafter":
            made[name] = EngineRunner(session.engine, sampling)
        elif name == "ar":
            made[name] = EngineRunner(Engine(model, NoDrafter()), sampling)
        else:
            made[name] = HFRunner(model, _eos_ids(model), session.tokenizer.pad_token_id, sampling)
    return made


def run_all(session: Any, runners: dict[str, Runner], questions: list[Question], args: argparse.Namespace
            ) -> dict[str, list[Answer]]:
    from tqdm.auto import tqdm

    def encode(messages: list[dict[str, str]]) -> list[int]:
        return encode_messages(session, messages)

    def decode(ids: Sequence[int]) -> str:
        return session.tokenizer.decode(list(ids), skip_special_tokens=True)

    num_turns = 1 if args.turns == "first" else max(len(q.turns) for q in questions)
    warm_ids = encode([{"role": "user", "content": questions[0].turns[0]}])
    for runner in runners.values():
        for i in range(args.warmup):
            runner(warm_ids, min(WARMUP_TOKENS, args.max_new_tokens), args.seed + i)
    answers: dict[str, list[Answer]] = {name: [] for name in runners}
    order = list(runners)
    for qi, question in enumerate(tqdm(questions, desc="bench", unit="question", disable=None)):
        for name in order[qi % len(order):] + order[: qi % len(order)]:  # rotate who goes first
            answers[name].append(answer(runners[name], question, num_turns, encode, decode, args.max_new_tokens,
                                        args.seed + 1000 * qi))
    return answers


def write_plots(folder: Path, summary: dict[str, Any], main_answers: list[Answer],
                drafter_config: dict[str, Any] | None) -> list[Path]:
    """The three report figures (each skipped, with a note, when its data is absent)."""
    from inference.plots import head_accuracies, plot_accept_hist, plot_bench_summary, plot_head_accuracy

    written = []
    metrics = ((drafter_config or {}).get("training") or {}).get("metrics") or {}
    if head_accuracies(metrics):
        written.append(plot_head_accuracy(metrics, folder / "head_accuracy.png"))
    else:
        print("plot: head_accuracy.png skipped (no per-head metrics in the checkpoint's training.metrics)")
    accepted = [n for a in main_answers for t in a.turns for n in t.accepted]
    if summary["main"] == "drafter" and accepted:
        written.append(plot_accept_hist(accepted, folder / "accept_hist.png"))
    else:
        print("plot: accept_hist.png skipped (no drafter steps)")
    per_category = {c: row for c, row in summary["categories"].items() if row.get("speedup") is not None}
    if per_category:
        written.append(plot_bench_summary(per_category, folder / "bench_summary.png"))
    else:
        print("plot: bench_summary.png skipped (no baseline to compute a speedup against)")
    return written
