"""`python scripts/bench_suite.py PLAN.yaml`: every method of a plan side by side on one target, in one run.

A plan (conf/bench/<target>.yaml) names the flags `python -m inference bench` takes: `common` ones for every method,
`baselines` run once on the plain target and shared (ar, hf, hf_pld, hf_assisted), and one entry per method:

    common: --base smollm2 --dtype bf16 --max-new-tokens 128 --questions mt_bench,gsm8k:40,humaneval:40
    baselines: {run: [ar, hf, hf_pld, hf_assisted], args: --assistant outputs/distill/smollm2-ee8}
    methods:
      medusa1: {args: --drafter outputs/medusa1/smollm2 --tree outputs/trees/smollm2-medusa1.json}
      prompt_lookup: {args: --drafter prompt_lookup, versus: [hf_pld]}
      cllm: {args: --drafter outputs/cllm/smollm2, own_ar: true, categories: [gsm8k]}

Every method and baseline stays loaded, and they take turns question by question (the order rotates), so a drift of
the machine's speed shifts all of them alike and every ratio comes from the same run. `own_ar: true` adds the
method's own plain loop (for methods that change the target's weights: Medusa-2, CLLM); that loop is then its `ar`
reference for speed and greedy identity, while `hf` stays the original target's `generate` (same architecture, same
cost per token). `categories` restricts a method to some question categories (e.g. gsm8k). `versus` adds columns
(default: ar and hf). `label` names the row in scripts/results_table.py's table. Everything in the plan is checked
before any model loads.

Output in --out: <method>/summary.json and answers (the `bench` format, one per method), suite.json, table.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from data.atomic import write_text
from data.errors import UsageError
from inference.api import Engine
from inference.bench.bandwidth import read_bandwidth, weight_bytes
from inference.bench.methods import BASELINES, EngineRunner, Runner, Sampling, build_runners
from inference.bench.prompt_sets import Question, load_questions
from inference.bench.run import (WARMUP_TOKENS, add_bench_args, answer, answer_record, check_bench_args, greedy_judge,
                                 hf_options, progress_bar, run_config, warm_up)
from inference.bench.stats import Answer, bandwidth_floor, format_table, summarize
from inference.engine.drafter import NoDrafter
from inference.session import Parser, check_model_args, encode_messages, one_line, open_session

@dataclass
class MethodEntry:
    """The schema of one `methods.<name>` entry of a plan file (a bare string is its `args`)."""

    args: list[str] = field(default_factory=list)
    own_ar: bool = False
    categories: list[str] = field(default_factory=list)
    versus: list[str] = field(default_factory=lambda: ["ar", "hf"])
    label: str = ""  # how a results table names the row (default: the entry's name)


@dataclass
class BaselinesEntry:
    run: list[str] = field(default_factory=lambda: ["ar", "hf"])
    args: list[str] = field(default_factory=list)


@dataclass
class PlanFile:
    """The schema of a plan file (OmegaConf refuses unknown keys and wrong types)."""

    common: list[str] = field(default_factory=list)
    baselines: BaselinesEntry = field(default_factory=BaselinesEntry)
    methods: dict[str, MethodEntry] = field(default_factory=dict)


@dataclass(frozen=True)
class MethodPlan:
    name: str
    args: tuple[str, ...]  # `bench` flags of this method, after the plan's common ones
    own_ar: bool = False  # also time the method's own target with no drafter (it changed the weights)
    categories: tuple[str, ...] = ()  # empty: every question
    versus: tuple[str, ...] = ("ar", "hf")  # baselines shown as speedup columns
    label: str = ""  # the results table's name for the row ("": the name)


@dataclass(frozen=True)
class Plan:
    path: Path
    common: tuple[str, ...]
    baselines: tuple[str, ...]  # run once on the plain target
    baseline_args: tuple[str, ...]
    methods: tuple[MethodPlan, ...]


def _spelled_out(raw: dict[str, Any]) -> dict[str, Any]:
    """The plan's short forms in the schema's types: a string of flags split as a shell would, a string of names as a
    comma list, a method given as a string as its args; no flags, no categories or no baselines section (null) as
    none."""

    def flags(value: Any) -> Any:
        return [] if value is None else shlex.split(value) if isinstance(value, str) else value

    def names(value: Any) -> Any:
        return [v for v in value.split(",") if v] if isinstance(value, str) else value

    def entry(value: Any, short: dict[str, Any]) -> Any:
        return {k: short[k](v) if k in short else v for k, v in value.items()} if isinstance(value, dict) else value

    method = {"args": flags, "categories": lambda v: [] if v is None else names(v), "versus": names}
    spelled = entry(raw, {"common": flags, "baselines": lambda v: entry({} if v is None else v,
                                                                        {"run": names, "args": flags})})
    if isinstance(spelled.get("methods"), dict):
        spelled["methods"] = {name: entry({"args": e} if isinstance(e, str) else e, method)
                              for name, e in spelled["methods"].items()}
    return spelled


def _checked(path: Path, spelled: dict[str, Any]) -> PlanFile:
    """The plan merged into the `PlanFile` schema; OmegaConf's refusal as one line: the file, the key, the reason.
    Merged section by section: OmegaConf names no key when a whole section has the wrong shape."""
    plan, section = OmegaConf.structured(PlanFile), ""
    try:
        for section, value in spelled.items():
            plan = OmegaConf.merge(plan, {section: value})
        return OmegaConf.to_object(plan)
    except OmegaConfBaseException as e:
        if isinstance(e, ConfigKeyError) and is_dataclass(e.object_type):
            reason = f"unknown key (keys: {', '.join(f.name for f in fields(e.object_type))})"
        else:
            reason = str(e.msg).splitlines()[0]
        raise UsageError(f"{path}: {e.full_key or section}: {reason}") from None


def read_plan(path: str | Path) -> Plan:
    """The plan file, every key checked (types and keys by the `PlanFile` schema, the rest here); errors are one
    line naming the file and key."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: plan file not found")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8-sig"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{path}{line}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: expected a mapping with keys {', '.join(f.name for f in fields(PlanFile))}")
    plan = _checked(path, _spelled_out(raw))
    baselines = plan.baselines.run
    if any(b not in BASELINES for b in baselines) or len(set(baselines)) != len(baselines):
        raise UsageError(f"{path}: baselines.run: distinct names from {', '.join(BASELINES)}, got {baselines}")
    if not plan.methods:
        raise UsageError(f"{path}: methods: expected a mapping of method name -> {{args: ...}}")
    methods = []
    for name, entry in plan.methods.items():
        where = f"{path}: methods.{name}"
        if not name.replace("_", "").replace("-", "").isalnum():
            raise UsageError(f"{where}: a method name is letters, digits, '-' and '_'")
        if name in BASELINES:
            raise UsageError(f"{where}: the name is a baseline's; pick another")
        missing = [v for v in entry.versus if v not in baselines and not (v == "ar" and entry.own_ar)]
        if missing:
            raise UsageError(f"{where}.versus: {missing[0]!r} is not in baselines.run {baselines}")
        methods.append(MethodPlan(name, tuple(entry.args), entry.own_ar, tuple(entry.categories), tuple(entry.versus),
                                  entry.label))
    return Plan(path, tuple(plan.common), tuple(baselines), tuple(plan.baselines.args), tuple(methods))


def bench_namespace(plan: Plan, flags: Sequence[str], where: str) -> argparse.Namespace:
    """`python -m inference bench` options for one method (the plan's common flags, then its own)."""
    parser = Parser(prog="python -m inference bench")
    add_bench_args(parser)
    args, unknown = parser.parse_known_args([*plan.common, *flags])
    if unknown:
        raise UsageError(f"{plan.path}: {where}: {unknown[0]!r} is not an option of `python -m inference bench`")
    try:
        check_bench_args(args)
    except UsageError as e:
        raise UsageError(f"{plan.path}: {where}: {e}") from None
    return args


def select(plan: Plan, only: Sequence[str]) -> Plan:
    names = [m.name for m in plan.methods]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise UsageError(f"--only {unknown[0]}: not a method of {plan.path} ({', '.join(names)})")
    if not only:
        return plan
    return Plan(plan.path, plan.common, plan.baselines, plan.baseline_args,
                tuple(m for m in plan.methods if m.name in only))


@dataclass
class Entry:
    """One timed method of the run: its runner and the session whose tokenizer encodes its prompts."""

    label: str
    runner: Runner
    session: Any
    categories: tuple[str, ...] = ()

    def takes(self, q: Question) -> bool:
        return not self.categories or q.category in self.categories


@dataclass
class Loaded:
    base: Any  # the plain target's session
    base_args: argparse.Namespace
    entries: list[Entry] = field(default_factory=list)
    sessions: dict[str, Any] = field(default_factory=dict)  # method -> session
    method_args: dict[str, argparse.Namespace] = field(default_factory=dict)


def check_plan(plan: Plan) -> tuple[argparse.Namespace, dict[str, argparse.Namespace]]:
    """Every method's options and paths, before any model loads."""
    base_flags = [*plan.baseline_args, "--drafter", "none", "--baselines", ",".join(plan.baselines)]
    base_args = bench_namespace(plan, base_flags, "baselines")
    method_args = {}
    for m in plan.methods:
        args = bench_namespace(plan, m.args, f"methods.{m.name}")
        if not args.drafter:  # `--drafter none`, said outright: our plain loop with other options (--no-cpu-kernel)
            raise UsageError(f"{plan.path}: methods.{m.name}: needs --drafter (the baselines run without one; "
                             f"--drafter none for a plain-loop variant)")
        if args.tree and ("/" in args.tree or args.tree.endswith(".json")) and not Path(args.tree).exists():
            raise UsageError(f"{plan.path}: methods.{m.name}: --tree {args.tree}: not found")
        try:
            check_model_args(args)  # the drafter (a path, a spec, a cached hub id) and the options its type takes
        except UsageError as e:
            raise UsageError(f"{plan.path}: methods.{m.name}: {e}") from None
        method_args[m.name] = args
    return base_args, method_args


def load_all(plan: Plan, base_args: argparse.Namespace, method_args: dict[str, argparse.Namespace]) -> Loaded:
    print(f"loading the baselines' target ({base_args.base})", file=sys.stderr, flush=True)
    base = open_session(base_args)
    loaded = Loaded(base, base_args)
    sampling = Sampling.of(base_args)
    for label, runner in build_runners(base, plan.baselines, sampling,
                                       hf_options(base, base_args, plan.baselines)).items():
        loaded.entries.append(Entry(label, runner, base))
    for m in plan.methods:
        print(f"loading {m.name} ({method_args[m.name].drafter})", file=sys.stderr, flush=True)
        session = open_session(method_args[m.name], share=base)  # the baselines' target, when it is the same
        loaded.sessions[m.name], loaded.method_args[m.name] = session, method_args[m.name]
        loaded.entries.append(Entry(m.name, EngineRunner(session.engine, Sampling.of(method_args[m.name])), session,
                                    m.categories))
        if m.own_ar:
            loaded.entries.append(Entry(f"{m.name}.ar", EngineRunner(Engine(session.engine.model, NoDrafter()),
                                                                      sampling), session, m.categories))
    return loaded


def run_questions(loaded: Loaded, questions: list[Question], args: argparse.Namespace
                  ) -> dict[str, dict[int, Answer]]:
    """Every entry answers every question it takes, question by question, the order rotating."""
    for e in loaded.entries:  # warm-up: first calls pay for lazy initialisation
        warm = encode_messages(e.session, [{"role": "user", "content": questions[0].turns[0]}])
        if args.warmup:
            warm_up(e.label, lambda e=e: [e.runner(warm, min(WARMUP_TOKENS, args.max_new_tokens), args.seed + i)
                                          for i in range(args.warmup)], e.runner)
    answers: dict[str, dict[int, Answer]] = {e.label: {} for e in loaded.entries}
    total = sum(e.takes(q) for q in questions for e in loaded.entries)
    progress = progress_bar(total, "bench-suite")
    num_turns = 1 if args.turns == "first" else max(len(q.turns) for q in questions)
    for qi, q in enumerate(questions):
        entries = [e for e in loaded.entries if e.takes(q)]
        shift = qi % len(entries)
        for e in entries[shift:] + entries[:shift]:
            progress.set_postfix_str(f"{e.label} on question {q.question_id}", refresh=False)
            answers[e.label][qi] = answer(
                e.runner, q, num_turns, lambda msgs, s=e.session: encode_messages(s, msgs),
                lambda ids, s=e.session: s.tokenizer.decode(list(ids), skip_special_tokens=True),
                args.max_new_tokens, args.seed + 1000 * qi)
            progress.update(1)
    progress.close()
    return answers


def method_summary(m: MethodPlan, loaded: Loaded, answers: dict[str, dict[int, Answer]], read_rate: float
                   ) -> dict[str, Any]:
    """`bench`'s summary for one method over the questions it took: ar is its own loop when own_ar, else the
    shared one; greedy identity against that ar, judged by a float64 rerun of the method's own target."""
    idx = sorted(answers[m.name])
    refs = {b: f"{m.name}.ar" if (b == "ar" and m.own_ar) else b for b in m.versus}
    if "ar" not in refs and "ar" in answers:
        refs = {"ar": "ar", **refs}
    rows = {m.name: [answers[m.name][i] for i in idx], **{b: [answers[src][i] for i in idx] for b, src in refs.items()}}
    args = loaded.method_args[m.name]
    session = loaded.sessions[m.name]
    summary = summarize(rows, m.name, greedy=args.temperature == 0, judge=greedy_judge(args, session.engine.model))
    summary["bandwidth"] = bandwidth_floor(weight_bytes(session.engine.model), read_rate, summary)
    summary["config"] = {"questions": str(args.questions), "num_questions": len(idx),
                         "ar_is_own_loop": m.own_ar, "categories": list(m.categories) or None,
                         "label": m.label or None,
                         **run_config(args, session, {n: n for n in rows})}
    return summary


def provenance(config: dict[str, Any]) -> str:
    """One line under a results table: the host, dtype and threads, the commit and the command that made it."""
    commit = config.get("commit") or "unknown commit"
    if config.get("dirty"):
        commit += " with local changes"
    host = config.get("gpu") or f"{config.get('cpu')} ({config.get('cpu_capability')})"
    return (f"Host: {host}, {config.get('threads')} threads, {config.get('dtype')}; code: {commit}; "
            f"command: `{config.get('command')}`")


def suite_table(summaries: dict[str, dict[str, Any]], base_summary: dict[str, Any] | None) -> str:
    """One markdown table: a row per method (speedups over the shared and own baselines), then the categories."""
    cols = sorted({b for s in summaries.values() for b in s["speedup_vs"]}, key=lambda b: (b != "ar", b != "hf", b))
    head = ["method", "questions", "tok/s", "τ"] + [f"× {b}" for b in cols] + ["efficiency", "greedy vs ar"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    configs = [c for c in [*(s.get("config") for s in summaries.values()), (base_summary or {}).get("config")] if c]

    def f(v: float | None, fmt: str = ".2f") -> str:
        return "—" if v is None else format(v, fmt)

    for name, s in summaries.items():
        check = (s.get("greedy_check") or {}).get("methods", {}).get(name)
        ident = "—" if check is None else (f"{check['identical']} same / {check['near_tie']} verified near-tie / "
                                           f"{check['mismatch']} mismatch")
        lines.append("| " + " | ".join([name, str(s["config"]["num_questions"]), f(s["tokens_per_s"], ".1f"),
                                        f(s["tau"])] + [f(s["speedup_vs"].get(b)) for b in cols]
                                       + [f(s.get("engine_efficiency")), ident]) + " |")
    if base_summary is not None:
        for name, row in base_summary["methods"].items():
            lines.append("| " + " | ".join([f"{name} (baseline)", str(row["turns"]), f(row["tokens_per_s"], ".1f"),
                                            f(row["tau"])] + ["" for _ in cols] + ["", ""]) + " |")
    if configs:
        lines += ["", provenance(configs[0])]
    categories = sorted({c for s in summaries.values() for c in s["categories"]})
    lines += ["", "Speedup over HF `generate` per category (τ in brackets):", "",
              "| method | " + " | ".join(categories) + " |", "|" + " --- |" * (len(categories) + 1)]
    for name, s in summaries.items():
        cells = []
        for c in categories:
            row = s["categories"].get(c)
            cells.append("" if row is None else f"{f(row['speedup_vs_hf'])} ({f(row['tau'])})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_suite(plan: Plan, out: Path, limit: int | None = None) -> dict[str, Any]:
    base_args, method_args = check_plan(plan)
    questions, prompt_sets = load_questions(base_args.questions)
    questions = questions[: limit or base_args.limit]
    for m in plan.methods:
        if m.categories and not any(q.category in m.categories for q in questions):
            raise UsageError(f"{plan.path}: methods.{m.name}.categories {list(m.categories)}: no such question in "
                             f"--questions {base_args.questions}")
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_all(plan, base_args, method_args)
    read_rate = read_bandwidth(loaded.base.engine.device)
    start = time.monotonic()
    answers = run_questions(loaded, questions, base_args)
    wall = time.monotonic() - start
    base_rows = {b: [answers[b][i] for i in sorted(answers[b])] for b in plan.baselines}
    base_summary = None
    if base_rows:
        main = plan.baselines[0]
        base_summary = summarize(base_rows, main, greedy=base_args.temperature == 0,
                                 judge=greedy_judge(base_args, loaded.base.engine.model))
    summaries = {}
    for m in plan.methods:
        summaries[m.name] = s = method_summary(m, loaded, answers, read_rate)
        folder = out / m.name
        folder.mkdir(exist_ok=True)
        for label, rows in [(m.name, answers[m.name]), *((b, answers[b]) for b in plan.baselines),
                            *(((f"{m.name}.ar", answers[f"{m.name}.ar"]),) if m.own_ar else ())]:
            keep = [rows[i] for i in sorted(answers[m.name]) if i in rows]
            write_text(folder / f"{label}.jsonl", "".join(json.dumps(answer_record(a, label)) + "\n" for a in keep))
        write_text(folder / "summary.json", json.dumps(s, indent=2) + "\n")
        print(f"\n== {m.name}\n{format_table(s)}", flush=True)
    suite = {"plan": str(plan.path), "questions": base_args.questions, "prompt_sets": prompt_sets,
             "num_questions": len(questions), "wall_time_s": wall, "methods": summaries, "baselines": base_summary,
             "config": run_config(base_args, loaded.base, {b: b for b in plan.baselines})}
    table = suite_table(summaries, base_summary)
    write_text(out / "suite.json", json.dumps(suite, indent=2) + "\n")
    write_text(out / "table.md", table + "\n")
    print("\n" + table)
    print(f"\nper-method summaries, answers, suite.json and table.md written to {out}")
    return suite


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench_suite.py", description=__doc__.split("\n\n")[0])
    p.add_argument("plan", help="plan YAML (conf/bench/<target>.yaml)")
    p.add_argument("--out", default=None, help="output folder (default: outputs/bench/suite-<plan name>)")
    p.add_argument("--only", default="", help="comma list of the plan's methods to run (default: all)")
    p.add_argument("--limit", type=int, help="only the first N questions")
    p.add_argument("--questions", help="replaces the plan's --questions (e.g. mt_bench:8:spread,gsm8k:2)")
    args = p.parse_args(argv)
    try:
        if args.limit is not None and args.limit < 1:
            raise UsageError(f"--limit must be >= 1, got {args.limit}")
        plan = select(read_plan(args.plan), [n for n in args.only.split(",") if n])
        if args.questions:
            plan = replace(plan, common=(*plan.common, "--questions", args.questions))  # argparse: the last one wins
        run_suite(plan, Path(args.out or f"outputs/bench/suite-{Path(args.plan).stem}"), args.limit)
    except UsageError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0
