"""Does what draftsmith exports run in vLLM, and decode there as it does in our engine?

    python scripts/serve_check.py --vllm-python /work/vllm-venv/bin/python --drafter outputs/eagle3/tiny \
        --questions mt_bench:8:spread [--base tiny] [--dtype fp32|bf16] [--num-draft 3] [--max-new-tokens 64]

Dimension letters: N draft tokens per step (a chain), P prompts.

1. `plan`: every input checked before any model loads (one line, exit 2 from the script): vLLM's Python, the drafter
   (a draftsmith eagle3 or medusa checkpoint, or a folder `eagle3-export` wrote), the questions, the target's folder.
2. `export_for_vllm`: the checkpoint written in the layout vLLM loads (models.eagle3_interop.export_eagle3: vLLM's
   "eagle3" method; models.interop.export_vllm: its "medusa" method) into a temporary folder; an EAGLE-3 export folder
   is taken as it is and imported back (`import_eagle3`) for our engine.
3. Prompts: each question's first turn through our engine's chat template (`Engine.encode`); both engines get the
   same token ids (vLLM as `prompt_token_ids`), so no template can differ.
4. `run_ours`: greedy through our engine with a chain of N drafts (`--tree chain:N`), one prompt at a time after a
   warm-up; accepted drafts per position from the loop's per-step counts.
5. `run_vllm`: the same through vLLM in its own Python (inference.bench.vllm_worker), the same N
   (`num_speculative_tokens`), accepted drafts per position from vLLM's spec-decode counters.
6. `compare`: per prompt, identical output or the first differing token; per position, vLLM's accepted count against
   ours; mean acceptance length (1 + accepted drafts / drafting steps) and tokens/s of each. A prompt whose outputs
   differ is judged in float64 (inference.bench.greedy_ties, ours the reference): a near tie (both tokens within the
   dtype's rounding of the float64 argmax, and vLLM's later tokens too) or a real mismatch.
Both stop at the target's EOS ids (passed to vLLM as stop_token_ids) and keep that EOS in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from data.errors import UsageError
from inference.api import load
from inference.bench.greedy_ties import Fp64Judge, TieVerdict, first_divergence
from inference.bench.prompt_sets import PROMPT_SETS, Question, load_questions
from inference.bench.stats import accepted_per_position
from inference.session import Parser
from models.backbone import eos_token_ids
from models.checkpoint import CONFIG_NAME, read_drafter_config, read_json_object
from models.eagle3_interop import ARCHITECTURE, export_eagle3, import_eagle3
from models.interop import check_vllm_exportable, export_vllm
from models.refs import locate, model_settings

WORKER = Path(__file__).with_name("vllm_worker.py")
VLLM_METHODS = {"eagle3": "eagle3", "medusa": "medusa"}  # draftsmith drafter_type -> vLLM's speculative method
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}  # GiB of KV cache on a CPU (vLLM's default takes far more)
# vLLM on a CPU binds its model runner's OpenMP threads to cores (VLLM_CPU_OMP_THREADS_BIND; "auto" keeps one core of
# every NUMA node for its scheduler): cores 0..T-1 here, and our engine gets the same T threads.
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
WARMUP_TOKENS = 8
GOAL = 0.02  # per-position accepted counts should agree within this share


@dataclass(frozen=True)
class Plan:
    vllm_python: Path
    drafter: Path  # a draftsmith checkpoint, or an EAGLE-3 export folder (`given_export`)
    drafter_type: str  # "eagle3" | "medusa"
    given_export: bool  # `drafter` is an eagle3-export folder: vLLM loads it as it is
    base: str  # the target as our engine names it (a conf/model name, builtin:..., a folder)
    target_dir: Path  # the target's folder, which vLLM loads
    dtype: str  # "fp32" | "bf16"
    num_draft: int  # N
    max_new_tokens: int
    questions: tuple[Question, ...]
    threads: int  # T, compute threads of each engine
    compile: bool = False  # our engine with --compile (its compile time left out of its tokens/s)


@dataclass(frozen=True)
class Run:
    """One engine's greedy answers to the P prompts."""

    engine: str
    tokens: tuple[tuple[int, ...], ...]  # [P] output ids, EOS included where it stopped there
    wall_s: tuple[float, ...]  # [P] seconds per prompt
    drafts: int  # decoding steps that verified N drafts
    accepted_per_pos: tuple[int, ...]  # [N] steps whose draft at position i (0-based) was accepted

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(sum(self.wall_s), 1e-9)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per drafting step: 1 + accepted drafts per step (vLLM's "mean acceptance length")."""
        return 1.0 + sum(self.accepted_per_pos) / max(self.drafts, 1)


@dataclass(frozen=True)
class Comparison:
    identical: tuple[bool, ...]  # [P]
    first_difference: tuple[int | None, ...]  # [P] index of the first differing token; None where identical
    position_gap: tuple[float, ...]  # [N] (vLLM's accepted count - ours) / ours, 0 where both are 0
    verdicts: tuple[TieVerdict | None, ...] = ()  # [P] float64's ruling where the outputs differ (`judge`)

    @property
    def near_ties(self) -> int:
        return sum(1 for v in self.verdicts if v is not None and v.near_tie)

    @property
    def all_identical(self) -> bool:
        return all(self.identical)

    @property
    def within_goal(self) -> bool:
        return all(abs(g) <= GOAL for g in self.position_gap)


# -- 1. plan -----------------------------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python scripts/serve_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True, help="the Python of an environment with vLLM installed")
    p.add_argument("--drafter", required=True,
                   help="a draftsmith eagle3 or medusa checkpoint (exported here), or an eagle3-export folder")
    p.add_argument("--questions", required=True,
                   help=f"question JSONL, or prompt sets ({', '.join(PROMPT_SETS)}[:N[:spread]]); first turns")
    p.add_argument("--base", help="the target (default: the drafter's base_model_name_or_path)")
    p.add_argument("--dtype", choices=tuple(VLLM_DTYPES), default="fp32")
    p.add_argument("--num-draft", type=int, default=3, help="draft tokens per step, a chain in both engines")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1,
                   help="compute threads of each engine (vLLM's bound to cores 0..T-1); default 1, what vLLM's own "
                        "binding leaves a 2-core host after reserving a core for its scheduler")
    p.add_argument("--compile", action="store_true",
                   help="our engine compiles its step (and the draft's on a GPU), as vLLM does; compile time excluded")
    p.add_argument("--out", help="also write the figures and every answer's ids to this JSON file")
    return p


def drafter_kind(folder: Path) -> tuple[str, bool]:
    """(drafter type, is an eagle3-export folder) of `folder`; UsageError (one line) for anything else."""
    config_file = folder / CONFIG_NAME
    if not config_file.is_file():
        raise UsageError(f"--drafter {folder}: no {CONFIG_NAME}; expected a draftsmith eagle3 or medusa checkpoint, "
                         f"or an eagle3-export folder")
    raw = read_json_object(config_file)
    if ARCHITECTURE in (raw.get("architectures") or []):
        return "eagle3", True
    if raw.get("model_type") == "medusa":
        raise UsageError(f"--drafter {folder}: a vLLM Medusa folder; pass the draftsmith checkpoint it was exported "
                         f"from (our engine serves that one)")
    kind = read_drafter_config(folder)["drafter_type"]
    if kind not in VLLM_METHODS:
        raise UsageError(f"--drafter {folder}: drafter_type {kind!r}; vLLM serves {' and '.join(VLLM_METHODS)} "
                         f"drafters exported from draftsmith")
    return kind, False


def base_name(folder: Path, given: str | None) -> str:
    """--base, else the drafter's base_model_name_or_path (an export folder keeps it under "draftsmith")."""
    if given:
        return given
    raw = read_json_object(folder / CONFIG_NAME)
    name = raw.get("base_model_name_or_path") or (raw.get("draftsmith") or {}).get("base_model_name_or_path")
    if not name:
        raise UsageError(f"--drafter {folder}: {CONFIG_NAME} names no base model; pass --base")
    return str(name)


def max_drafts(folder: Path, kind: str, given_export: bool) -> int | None:
    """The most draft tokens a chain can take: Medusa's head count; None for EAGLE-3 (its draft recurs)."""
    if kind != "medusa" or given_export:
        return None
    return int(read_drafter_config(folder)["num_heads"])


def plan(args: argparse.Namespace) -> Plan:
    python = Path(args.vllm_python)
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise UsageError(f"--vllm-python {python}: not an executable file (the python of vLLM's environment)")
    if args.num_draft < 1:
        raise UsageError(f"--num-draft must be >= 1, got {args.num_draft}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 1 <= args.threads <= (os.cpu_count() or 1):
        raise UsageError(f"--threads must be in [1, {os.cpu_count()}] (this host's cores), got {args.threads}")
    drafter = Path(args.drafter)
    if not drafter.is_dir():
        raise UsageError(f"--drafter {drafter}: no such folder")
    kind, given_export = drafter_kind(drafter)
    if kind == "medusa":
        check_vllm_exportable(drafter)  # before any model loads
    limit = max_drafts(drafter, kind, given_export)
    if limit is not None and args.num_draft > limit:
        raise UsageError(f"--num-draft {args.num_draft}: {drafter} has {limit} Medusa heads (one draft each)")
    if args.out and not Path(args.out).parent.is_dir():
        raise UsageError(f"--out {args.out}: folder {Path(args.out).parent} does not exist")
    questions, _ = load_questions(args.questions)
    base = base_name(drafter, args.base)
    target_dir = locate(model_settings(base).ref)  # a built-in model not yet built: its one line, before any load
    return Plan(python, drafter, kind, given_export, base, Path(target_dir), args.dtype, args.num_draft,
                args.max_new_tokens, tuple(questions), args.threads, args.compile)


# -- 2. export ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Folders:
    ours: Path  # the draftsmith checkpoint our engine serves
    vllm: Path  # the folder vLLM loads as the speculative model


def export_for_vllm(p: Plan, scratch: Path) -> Folders:
    """Each engine's drafter folder; exports into (or imports from an export into) `scratch`."""
    if p.given_export:
        return Folders(ours=import_eagle3(p.drafter, scratch / "imported", str(p.target_dir)), vllm=p.drafter)
    if p.drafter_type == "eagle3":
        return Folders(ours=p.drafter, vllm=export_eagle3(p.drafter, scratch / "eagle3-export"))
    return Folders(ours=p.drafter, vllm=export_vllm(p.drafter, scratch / "vllm-export", p.base))


# -- 4. our engine -----------------------------------------------------------------------------------------------------

def run_ours(p: Plan, folders: Folders) -> tuple[Run, list[list[int]], Any]:
    """(our Run, the prompts' ids, the engine)."""
    torch.set_num_threads(p.threads)
    engine = load(str(folders.ours), base=p.base, dtype=p.dtype, tree=f"chain:{p.num_draft}", compile=p.compile)
    prompts = [engine.encode(q.turns[0]) for q in p.questions]
    engine.generate_ids(prompts[0], max_new_tokens=WARMUP_TOKENS)
    tokens, walls, steps = [], [], []
    for ids in prompts:
        start = time.perf_counter()
        out = engine.generate_ids(ids, max_new_tokens=p.max_new_tokens)
        walls.append(time.perf_counter() - start - out.stats.times.compile)  # a new shape's compilation left out
        tokens.append(tuple(out.sequences[0]))
        steps.extend(step[0] for step in out.stats.accepted if step[0] >= 0)
    run = Run("draftsmith", tuple(tokens), tuple(walls), len(steps), accepted_per_position(steps, p.num_draft))
    return run, prompts, engine


# -- 5. vLLM -----------------------------------------------------------------------------------------------------------

def vllm_request(p: Plan, folders: Folders, prompts: list[list[int]], eos: Sequence[int]) -> dict[str, Any]:
    config = read_json_object(p.target_dir / CONFIG_NAME)
    longest = max(len(ids) for ids in prompts) + p.max_new_tokens + p.num_draft + 1
    limit = int(config.get("max_position_embeddings") or longest)
    return {"target": str(p.target_dir), "drafter": str(folders.vllm), "method": VLLM_METHODS[p.drafter_type],
            "num_draft": p.num_draft, "dtype": VLLM_DTYPES[p.dtype], "max_new_tokens": p.max_new_tokens,
            "max_model_len": min(longest, limit), "stop_token_ids": list(eos), "prompts": prompts}


def run_vllm(p: Plan, request: dict[str, Any], scratch: Path) -> tuple[Run, str]:
    """(vLLM's Run, its version), from the worker run by `p.vllm_python`; RuntimeError with the worker's last error
    line when it fails."""
    request_file, result_file = scratch / "request.json", scratch / "result.json"
    request_file.write_text(json.dumps(request))
    env = {**os.environ, **VLLM_ENV, THREADS_BIND: f"0-{p.threads - 1}" if p.threads > 1 else "0"}
    done = subprocess.run([str(p.vllm_python), str(WORKER), str(request_file), str(result_file)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0 or not result_file.is_file():
        raise RuntimeError(f"vLLM worker failed (exit {done.returncode}): {last_error(done.stdout)}")
    return parse_vllm_result(json.loads(result_file.read_text()), p.num_draft)


def last_error(log: str) -> str:
    """The line of a worker's log that says what went wrong: the last exception line, else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or line.startswith("AssertionError")]
    return (errors or lines or ["no output"])[-1]


def parse_vllm_result(result: dict[str, Any], num_draft: int) -> tuple[Run, str]:
    counts = result["counts"]
    per_pos = tuple(int(c) for c in counts["num_accepted_tokens_per_pos"][:num_draft])
    answers = result["answers"]
    run = Run("vllm", tuple(tuple(a["tokens"]) for a in answers), tuple(float(a["wall_s"]) for a in answers),
              int(counts["num_drafts"]), per_pos)
    return run, str(result["vllm_version"])


# -- 6. compare --------------------------------------------------------------------------------------------------------

def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (the shorter one's length if one extends the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def relative_gap(theirs: int, ours: int) -> float:
    if ours == 0:
        return 0.0 if theirs == 0 else float("inf")
    return (theirs - ours) / ours


def compare(ours: Run, theirs: Run, verdicts: Sequence[TieVerdict | None] = ()) -> Comparison:
    if len(ours.tokens) != len(theirs.tokens) or len(ours.accepted_per_pos) != len(theirs.accepted_per_pos):
        raise ValueError(f"runs differ in shape: {len(ours.tokens)} vs {len(theirs.tokens)} prompts, "
                         f"{len(ours.accepted_per_pos)} vs {len(theirs.accepted_per_pos)} draft positions")
    firsts = tuple(first_difference(a, b) for a, b in zip(ours.tokens, theirs.tokens))
    gaps = tuple(relative_gap(t, o) for t, o in zip(theirs.accepted_per_pos, ours.accepted_per_pos))
    return Comparison(tuple(f is None for f in firsts), firsts, gaps, tuple(verdicts))


def judge(model: Any, prompts: Sequence[Sequence[int]], ours: Run, theirs: Run) -> list[TieVerdict | None]:
    """[P] float64's ruling on each prompt whose outputs differ (ours the reference, vLLM's checked); None where
    they agree. A float64 copy of the target is made only when some output differs."""
    rule = Fp64Judge(model)
    divergences = [first_divergence(ids, a, b) for ids, a, b in zip(prompts, ours.tokens, theirs.tokens)]
    return [None if d is None else rule(d) for d in divergences]


def verdict_text(first: int | None, v: TieVerdict | None) -> str:
    if first is None:
        return "identical"
    if v is None:
        return f"DIFFER at token {first}"
    if v.near_tie:
        return f"differ at token {first}: a near tie in float64 (gap {v.gap:.2g}, tolerance {v.tolerance:.2g})"
    where = v.failed_at if v.failed_at is not None else first
    return f"MISMATCH at token {first}: token {where} lies beyond float64's rounding tolerance"


def report(p: Plan, ours: Run, theirs: Run, c: Comparison, version: str, decode: Any) -> list[str]:
    """The printed lines: per prompt, then per position, then the totals."""
    lines = [f"serve check: {p.drafter_type} drafter {p.drafter} on {p.base}, {p.dtype}, chain of {p.num_draft} "
             f"drafts, greedy, max {p.max_new_tokens} new tokens, {p.threads} thread(s) each"
             f"{', ours compiled' if p.compile else ''}; vLLM {version}"]
    verdicts = c.verdicts or (None,) * len(c.identical)
    for q, a, b, first, v in zip(p.questions, ours.tokens, theirs.tokens, c.first_difference, verdicts):
        verdict = verdict_text(first, v)
        lines.append(f"  prompt {q.question_id}: {len(a)} / {len(b)} tokens (ours / vLLM): {verdict}")
        if first is not None:
            lines.append(f"    ours: {decode(a[first:first + 12])!r}  vLLM: {decode(b[first:first + 12])!r}")
    lines.append(f"answers identical: {sum(c.identical)} of {len(c.identical)}"
                 f"{f'; {c.near_ties} more differ at a float64 near tie' if c.near_ties else ''}")
    lines.append("accepted drafts per position (ours / vLLM / gap): " + ", ".join(
        f"{i + 1}: {o} / {t} / {g:+.1%}" for i, (o, t, g)
        in enumerate(zip(ours.accepted_per_pos, theirs.accepted_per_pos, c.position_gap))))
    lines.append(f"drafting steps: {ours.drafts} / {theirs.drafts}; within {GOAL:.0%} at every position: "
                 f"{'yes' if c.within_goal else 'no'}")
    for run in (ours, theirs):
        lines.append(f"{run.engine:>10}: mean acceptance length {run.mean_acceptance_length:.3f}, "
                     f"{run.new_tokens} tokens in {sum(run.wall_s):.2f} s = {run.tokens_per_s:.1f} tokens/s")
    return lines


def result_record(p: Plan, ours: Run, theirs: Run, c: Comparison, version: str) -> dict[str, Any]:
    plan_fields = {"drafter": str(p.drafter), "drafter_type": p.drafter_type, "base": p.base, "dtype": p.dtype,
                   "num_draft": p.num_draft, "max_new_tokens": p.max_new_tokens, "threads": p.threads,
                   "compile": p.compile, "questions": [q.question_id for q in p.questions]}
    runs = {run.engine: {**asdict(run), "mean_acceptance_length": run.mean_acceptance_length,
                         "tokens_per_s": run.tokens_per_s} for run in (ours, theirs)}
    return {"plan": plan_fields, "vllm_version": version, "runs": runs, "comparison": asdict(c),
            "all_identical": c.all_identical, "near_ties": c.near_ties, "within_goal": c.within_goal}


def check(p: Plan) -> tuple[Run, Run, Comparison, str, Any]:
    """Steps 2-6 for a plan: (ours, vLLM's, the comparison, vLLM's version, the tokenizer)."""
    with tempfile.TemporaryDirectory(prefix="serve-check-") as tmp:
        scratch = Path(tmp)
        folders = export_for_vllm(p, scratch)
        ours, prompts, engine = run_ours(p, folders)
        request = vllm_request(p, folders, prompts, eos_token_ids(engine.model))
        theirs, version = run_vllm(p, request, scratch)
    verdicts = judge(engine.model, prompts, ours, theirs)
    return ours, theirs, compare(ours, theirs, verdicts), version, engine.tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        p = plan(args)
    except (UsageError, ValueError, OSError) as e:
        print(f"error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}", file=sys.stderr)
        return 2
    ours, theirs, c, version, tokenizer = check(p)
    for line in report(p, ours, theirs, c, version, lambda ids: tokenizer.decode(list(ids))):
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(result_record(p, ours, theirs, c, version), indent=2) + "\n")
    return 0 if c.all_identical else 1
