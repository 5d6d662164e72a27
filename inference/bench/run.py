"""`python -m inference bench`: speed of a drafter against plain decoding of the same model, measured in one run.

Methods (inference.bench.methods), run in turn on every question (rotating which goes first, after a warm-up, so
background load hits all alike):
    drafter      the engine with the chosen drafter
    ar           the same engine loop with NoDrafter (plain greedy / sampling, one token per target forward)
    hf           Hugging Face `model.generate` on the same model object
    hf_pld       HF prompt lookup decoding, `generate(prompt_lookup_num_tokens=N)` (greedy only)
    hf_assisted  HF assisted generation with the same draft model as our draft-model drafter (greedy only)
Questions are MT-bench / Spec-Bench records {question_id, category, turns}, or named prompt sets
(inference.bench.prompt_sets: mt_bench, gsm8k, humaneval). Multi-turn (--turns all) feeds each method its own previous
answer. Each method's answers are written in the Medusa / Spec-Bench answer format ({question_id, category,
answer_id, model_id, choices: [{index, turns, new_tokens, idxs, wall_time, accept_lengths}], tstamp}); idxs = target
forwards per turn (prefill included), accept_lengths = tokens committed per decoding step (engine methods and hf).

Summary definitions:
    tau                new tokens / target forwards (1.0 for plain decoding)
    speedup            tokens/s of the main method / tokens/s of a baseline, one per baseline
    ideal speedup      tau x t_AR_step / t_tree_forward: the speedup if drafting, verification and cache surgery were
                       free (t_AR_step: mean wall time of one plain step; t_tree_forward: mean target forward over
                       the draft tree)
    engine efficiency  speedup vs ar / ideal speedup
    greedy identity    each method's turns against ar's (else hf's): identical, verified near tie or mismatch.
                       A differing turn is rerun in float64, teacher-forced over the method's output: a near tie
                       when at the first differing token both tokens, and after it every token of the method, lie
                       within a stated tolerance of float64's greedy choice (TIE_ULPS x the run dtype's unit
                       roundoff x max|logit|, inference.bench.greedy_ties). "lossless" only with no mismatch; each
                       mismatch is named with its question, turn and float64 gap (a likely engine bug)
    bandwidth floor    weight bytes / measured read bandwidth: the least time a plain step can take
                       (inference.bench.bandwidth)
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from data.atomic import write_text
from data.errors import UsageError
from data.extras import require
from data.paths import check_writable_dir
from inference.bench.bandwidth import host_info, read_bandwidth, weight_bytes
from inference.bench.greedy_ties import Fp64Judge
from inference.bench.methods import (BASELINES, GREEDY_ONLY, HFOptions, Runner, Sampling, assisted_settings,
                                     build_runners, pld_defaults)
from inference.bench.prompt_sets import PROMPT_SETS, Question, load_questions
from inference.bench.stats import Answer, TurnResult, bandwidth_floor, format_table, summarize
from inference.drafters.draft_model import DraftModelDrafter
from inference.drafters.options import OPTIONAL
from inference.drafters.registry import names_draft_model
from inference.session import (add_model_args, add_sampling_args, check_sampling, encode_messages,
                               open_session)
from models import smollm2
from models.draft_model import load_draft_model
from models.refs import BuiltinRef, model_settings

WARMUP_TOKENS = 32
PROGRESS_INTERVAL_S = 10.0  # a progress line at least this often when stderr is not a terminal


def answer(runner: Runner, question: Question, num_turns: int, encode: Callable, decode: Callable,
           max_new_tokens: int, seed: int) -> Answer:
    """All turns of one question; turn j sees the method's own answers to the turns before it."""
    messages: list[dict[str, str]] = []
    turns = []
    for j, user in enumerate(question.turns[:num_turns]):
        messages.append({"role": "user", "content": user})
        prompt = encode(messages)
        result = runner(prompt, max_new_tokens, seed + j)
        text = decode(result.tokens).strip()
        messages.append({"role": "assistant", "content": text})
        turns.append(TurnResult(result.tokens, text, result.wall_time, result.target_forwards, result.accepted,
                                result.times, tuple(prompt)))
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


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0] + " Greedy by default; answers + summary.json land in --out."
    add_model_args(p)
    add_sampling_args(p, max_new_tokens=256)
    p.add_argument("--questions", default="mt_bench",
                   help=f"question JSONL, or a comma list of prompt sets {', '.join(PROMPT_SETS)} with optional "
                        f"counts (mt_bench,gsm8k:40,humaneval:40: the first N of each) read from $DRAFTSMITH_DATA "
                        f"(default: ../shared/data next to the repository); default: all of mt_bench")
    p.add_argument("--turns", choices=("first", "all"), default="first",
                   help="all: later turns see the method's own previous answers")
    p.add_argument("--limit", type=int, help="only the first N questions")
    p.add_argument("--out", default="bench_results", help="folder for <model_id>.jsonl answers and summary.json")
    p.add_argument("--model-id", help="model_id of the main method's answers (default: from the drafter / base)")
    p.add_argument("--baselines", default="ar,hf",
                   help="comma list of ar (our loop, NoDrafter), hf (HF generate), hf_pld (HF prompt lookup "
                        "decoding), hf_assisted (HF assisted generation with the draft model), llama_cpp (llama.cpp's "
                        "plain decoding of a GGUF file, --gguf); the last three are greedy only")
    p.add_argument("--pld-tokens", type=int, metavar="N",
                   help="hf_pld: prompt_lookup_num_tokens (default: our prompt_lookup drafter's draft length)")
    p.add_argument("--assistant", metavar="PATH",
                   help="hf_assisted: the draft model (causal LM dir, builtin:<name> or draft_model checkpoint) "
                        "when --drafter is not one")
    p.add_argument("--gguf", metavar="FILE",
                   help="llama_cpp: the GGUF file (default for --base smollm2: the Q4_1 file the builtin smollm2 is "
                        "dequantised from, the same weights)")
    p.add_argument("--baseline-only", action="store_true", help="run only the baselines (no drafter)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up generations per method before timing")
    p.add_argument("--plot", metavar="DIR", help="write head_accuracy.png, accept_hist.png, bench_summary.png")
    p.set_defaults(func=run_bench_command)


def _slug(name: str) -> str:
    return Path(name.rstrip("/")).name.replace(":", "-") or "model"


def check_bench_args(args: argparse.Namespace) -> list[str]:
    """Everything about the bench options that can fail before a model loads; returns the baselines."""
    check_sampling(args)
    baselines = [b for b in args.baselines.split(",") if b]
    if any(b not in BASELINES for b in baselines) or len(set(baselines)) != len(baselines):
        raise UsageError(f"--baselines {args.baselines!r}: a comma list of distinct names from {', '.join(BASELINES)}")
    greedy_only = [b for b in baselines if b in GREEDY_ONLY]
    if greedy_only and args.temperature > 0:
        raise UsageError(f"--baselines {greedy_only[0]} is greedy only; drop it or use --temperature 0")
    if args.pld_tokens is not None and ("hf_pld" not in baselines or args.pld_tokens < 1):
        raise UsageError(f"--pld-tokens {args.pld_tokens}: needs hf_pld in --baselines and a value >= 1")
    if args.assistant is not None:
        if "hf_assisted" not in baselines:
            raise UsageError("--assistant applies to --baselines hf_assisted")
        if names_draft_model(args.drafter):
            raise UsageError(f"--assistant: --drafter {args.drafter} is a draft model already and hf_assisted "
                             f"uses it; drop --assistant")
        if not names_draft_model(args.assistant):
            raise UsageError(f"--assistant {args.assistant}: not a causal LM directory, builtin:<name> or "
                             f"draft_model checkpoint")
    elif "hf_assisted" in baselines and not names_draft_model(args.drafter):
        raise UsageError(f"--baselines hf_assisted needs a draft model: --drafter {args.drafter or 'none'} is not "
                         f"one; name one with --assistant PATH")
    if "llama_cpp" in baselines:
        require("llama_cpp", "--baselines llama_cpp (pip install llama-cpp-python)")
        if args.base is not None:
            gguf_for(args.base, args.gguf)  # a base without a GGUF of its own is refused here, before any load
    elif args.gguf is not None:
        raise UsageError("--gguf applies to --baselines llama_cpp")
    if args.gguf is not None and not Path(args.gguf).is_file():
        raise UsageError(f"--gguf {args.gguf}: no such file")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.plot:
        require("matplotlib", "--plot")  # found, not imported: that waits for the plots
    return baselines


def hf_options(session: Any, args: argparse.Namespace, names: Sequence[str]) -> HFOptions:
    """hf_pld's lookup settings and hf_assisted's draft model (the drafter's own, else --assistant's)."""
    tokens, ngram = pld_defaults(session.engine.drafter)
    assistant = None
    if "hf_assisted" in names:
        drafter = session.engine.drafter
        assistant = drafter.model if isinstance(drafter, DraftModelDrafter) else \
            load_draft_model(args.assistant, session.engine.model, session.engine.device)
    return HFOptions(args.pld_tokens or tokens, ngram, assistant,
                     gguf_for(session.base, getattr(args, "gguf", None)) if "llama_cpp" in names else None)


def gguf_for(base: str, given: str | None) -> str:
    """llama_cpp's GGUF file: --gguf's, else the builtin smollm2's own; UsageError for another base without one."""
    if given is not None:
        return given
    ref = model_settings(base).ref
    if not (isinstance(ref, BuiltinRef) and ref.name == smollm2.NAME):  # only the builtin smollm2 is made from one
        raise UsageError(f"--baselines llama_cpp: --base {base} has no GGUF file of its own; name one with --gguf")
    return str(smollm2.gguf_file())


def run_bench_command(args: argparse.Namespace) -> int:
    baselines = check_bench_args(args)
    questions, prompt_sets = load_questions(args.questions)
    questions = questions[: args.limit]
    out_dir = Path(args.out)
    check_writable_dir(out_dir, "--out")  # created once the models have loaded: a refused run leaves nothing
    if not baselines and (args.baseline_only or (args.drafter or "none") == "none"):
        raise UsageError("nothing to run: --baseline-only (or --drafter none) with --baselines empty")
    session = open_session(args)
    out_dir.mkdir(parents=True, exist_ok=True)
    with_drafter = not args.baseline_only and (session.drafter_name != "none")
    names = (["drafter"] if with_drafter else []) + baselines
    sampling = Sampling.of(args)
    hf = hf_options(session, args, names)
    runners = build_runners(session, names, sampling, hf)
    model, device = session.engine.model, session.engine.device
    read_rate = read_bandwidth(device)
    base_id = _slug(session.base)
    model_ids = {"drafter": _slug(session.drafter_name), **{b: f"{base_id}-{b}" for b in BASELINES}}
    if args.model_id:
        model_ids[names[0]] = args.model_id
    answers = run_all(session, runners, questions, args)
    greedy = args.temperature == 0
    # float64 reruns need a plain copy of the target: not of quantized or device-mapped weights
    judge = greedy_judge(args, model)
    summary = summarize(answers, names[0], greedy=greedy, judge=judge)
    summary["bandwidth"] = bandwidth_floor(weight_bytes(model), read_rate, summary)
    summary["config"] = {
        "questions": str(args.questions), "prompt_sets": prompt_sets, "num_questions": len(questions),
        **run_config(args, session, {n: model_ids[n] for n in names}),
        "fp64_reruns": None if judge is None else judge.reruns,
    }
    if "hf_pld" in names:
        summary["config"]["hf_pld"] = {"prompt_lookup_num_tokens": hf.pld_tokens,
                                       "max_matching_ngram_size": hf.pld_ngram}
    if "hf_assisted" in names:
        summary["config"]["hf_assisted"] = {"assistant": args.assistant or session.drafter_name,
                                            **assisted_settings(hf.assistant)}
    for name in names:
        lines = "".join(json.dumps(answer_record(a, model_ids[name])) + "\n" for a in answers[name])
        write_text(out_dir / f"{model_ids[name]}.jsonl", lines)
    write_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(format_table(summary))
    print(f"answers and summary.json written to {out_dir}")
    if args.plot:
        for path in write_plots(Path(args.plot), summary, answers[names[0]], session.drafter_config):
            print(f"plot: {path}")
    return 0


def greedy_judge(args: argparse.Namespace, model: torch.nn.Module) -> Fp64Judge | None:
    """The float64 judge of greedy divergences, when the run is greedy and its target can be copied to float64
    (not quantized or device-mapped weights); else None (every divergence then counts as a mismatch, not judged)."""
    fp64 = args.temperature == 0 and args.quantization == "none" and args.device_map is None
    return Fp64Judge(model) if fp64 else None


def run_config(args: argparse.Namespace, session: Any, model_ids: dict[str, str]) -> dict[str, Any]:
    """What was run, and on what, for summary.json's config."""
    model, device = session.engine.model, session.engine.device
    return {
        "turns": args.turns, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "top_k": args.top_k, "top_p": args.top_p, "acceptance": args.acceptance, "base": session.base,
        "drafter": session.drafter_name,
        **{name: getattr(args, name) for name in OPTIONAL if name not in ("tree", "draft_stop")},  # the load options
        "tree_nodes": getattr(session.engine.tree, "num_nodes", None),
        "dtype": str(model.dtype).removeprefix("torch."), "device": str(device),
        "threads": torch.get_num_threads(), **host_info(device), "model_ids": model_ids,
        "command": command_line(), **code_version(),
    }


def command_line() -> str:
    """The command as it was typed: `python -m inference bench ...` for the package, `python <script> ...` else."""
    program = Path(sys.argv[0])
    head = ["python", "-m", program.parent.name] if program.name == "__main__.py" else ["python", sys.argv[0]]
    return shlex.join([*head, *sys.argv[1:]])


def code_version() -> dict[str, Any]:
    """The commit the code ran at and whether tracked files had local changes, so a results table can name both;
    None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]

    def git(*argv: str) -> str | None:
        try:
            run = subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return run.stdout.strip() if run.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit or None, "dirty": None if commit is None or dirty is None else bool(dirty)}


def progress_bar(total: int, desc: str, interval: float = PROGRESS_INTERVAL_S) -> tqdm:
    """tqdm over `total` answers on stderr; name the work in progress with `set_postfix_str`. On a terminal, the
    usual bar. On a log (stderr not a TTY), a line "<desc>: 3/5 answers, 00:12 elapsed, ETA 00:08, <work>" at most
    every `interval` seconds from updates, and at least that often while one answer runs (one answer of a slow
    method can take minutes): a daemon thread refreshes the bar until it is closed."""
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit="answer", file=sys.stderr)
    bar = tqdm(total=total, desc=desc, unit="answer", file=sys.stderr, mininterval=interval, position=0,  # no cursor moves
               bar_format="{desc}: {n_fmt}/{total_fmt} {unit}s, {elapsed} elapsed, ETA {remaining}{postfix}")
    threading.Thread(target=_heartbeat, args=(bar, interval), name=f"{desc}-progress", daemon=True).start()
    return bar


@contextmanager
def still_running(label: str, interval: float = PROGRESS_INTERVAL_S) -> Iterator[None]:
    """Within the block, a line "<label>: 20 s elapsed" on stderr every `interval` seconds: one long call (a batch's
    prefill) otherwise prints nothing for minutes."""
    finished = threading.Event()
    start = time.perf_counter()

    def beat() -> None:
        while not finished.wait(interval):
            print(f"{label}: {time.perf_counter() - start:.0f} s elapsed", file=sys.stderr, flush=True)

    threading.Thread(target=beat, name=f"{label}-progress", daemon=True).start()
    try:
        yield
    finally:
        finished.set()


def _heartbeat(bar: tqdm, interval: float) -> None:
    while not bar.disable:  # close() disables the bar
        time.sleep(interval)
        bar.refresh()  # a no-op once the bar is closed


def warm_up(label: str, run: Callable[[], Any], runner: Any = None) -> None:
    """One method's warm-up generations (first calls pay for lazy initialisation), announced: they can take a
    while before the first progress line. A `runner` whose drafter's datastore grows forgets the warm-up's answers
    (they answer the first question: it would draft from its own answer)."""
    print(f"warm-up: {label}", file=sys.stderr, flush=True)
    run()
    store = getattr(getattr(getattr(runner, "engine", None), "drafter", None), "datastore", None)
    if store is not None and store.grows:
        store.forget_served()


def run_all(session: Any, runners: dict[str, Runner], questions: list[Question], args: argparse.Namespace
            ) -> dict[str, list[Answer]]:
    def encode(messages: list[dict[str, str]]) -> list[int]:
        return encode_messages(session, messages)

    def decode(ids: Sequence[int]) -> str:
        return session.tokenizer.decode(list(ids), skip_special_tokens=True)

    num_turns = 1 if args.turns == "first" else max(len(q.turns) for q in questions)
    warm_ids = encode([{"role": "user", "content": questions[0].turns[0]}])
    for name, runner in runners.items():
        if args.warmup:
            warm_up(name, lambda r=runner: [r(warm_ids, min(WARMUP_TOKENS, args.max_new_tokens), args.seed + i)
                                            for i in range(args.warmup)], runner)
    answers: dict[str, list[Answer]] = {name: [] for name in runners}
    order = list(runners)
    progress = progress_bar(len(questions) * len(order), "bench")
    for qi, question in enumerate(questions):
        for name in order[qi % len(order):] + order[: qi % len(order)]:  # rotate who goes first
            progress.set_postfix_str(f"{name} on question {question.question_id}", refresh=False)
            answers[name].append(answer(runners[name], question, num_turns, encode, decode, args.max_new_tokens,
                                        args.seed + 1000 * qi))
            progress.update(1)
    progress.close()
    return answers


def write_plots(folder: Path, summary: dict[str, Any], main_answers: list[Answer],
                drafter_config: dict[str, Any] | None) -> list[Path]:
    """The three report figures (each skipped, with a note, when its data is absent)."""
    from inference.bench.plots import (  # deferred: matplotlib, an optional extra, only with --plot
        head_accuracies, plot_accept_hist, plot_bench_summary, plot_head_accuracy)

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
