"""The GPU check (issue #19): one command, one JSON + a short text report in --out.

    python scripts/gpu_check.py --out gpu_check                       # the run: one CUDA GPU (scripts/gpu_check.md)
    python scripts/gpu_check.py --out gpu_check --sections recipes    # the real trainers on Llama-3.1-8B's shapes
    python scripts/gpu_check.py --out gpu_check --tiny outputs/gpu_bundle            # ... plus section `tiny`
    python scripts/gpu_check.py --out /tmp/dry --device cpu --small   # the CPU dry run (tests/test_gpu_check.py)
    python scripts/gpu_check.py --pack-tiny outputs/gpu_bundle --tiny-drafter outputs/medusa1/tiny  # before travel
    python scripts/gpu_check.py --pack-smollm2 outputs/gpu_smollm2     # section smollm2's parts, one call's each

Sections, on a random Llama of Llama-2-7B's shapes (random weights: the shapes decide memory and time; recipes: its
own shapes):
    train   a medusa1 step (5 heads, conf/method/medusa1.yaml) with a bf16 backbone: tokens/s against the frozen
            forward alone, with fp32 heads (the default) and with bf16 autocast (training.bf16=true), next to the
            README's bound B / (B + 3H); peak GPU memory of a step (3 heads sharing the lm_head, the README's memory
            setup)
    nf4     the same, the backbone loaded in NF4 through models.loading.load_target; its peak memory over bf16's
    engine  the target in bf16: forward + greedy verify cost t(K) for K = 1, 16, 32, 64, 128 nodes, the heads' draft
            time, plain and K-node tree decoding with per-phase times (draft, forward, verify, cache, other), the
            engine efficiency; greedy identity of the trees vs our plain loop vs Hugging Face `generate`, each
            first divergence re-run in fp32 (fp64 on a CPU) and counted as a near tie or a real mismatch
            (inference.bench.greedy_ties)
    compiled the static cache and compiled step (CUDA graphs) on Llama-3.1-8B's shapes against the eager engine and
            the memory floor: plain and 8/15-drafted-node steps; decoding (plain, a random EAGLE-3)
            tokens/s, draft ms, compile seconds; fp32 identity (scripts/gpu_check_compiled.py)
    drafters every drafter kind through the public API (`inference.load`) on the device, fp32 with TF32 off, on a small
            random Llama: Medusa heads, EAGLE-3 (static and dynamic tree) and a draft model saved as checkpoints,
            prompt lookup, lookahead and Jacobi by name; a left-padded batch decoded greedily must equal plain greedy
            decoding token for token (fp32: no near ties allowed), and seeded sampling must run
    tiny    `python -m inference bench` of the tiny target's Medusa-1 heads (README setup: MT-bench first turns, 128
            new tokens, greedy, fp32), from a bundle made by --pack-tiny; skipped, with the reason, without one
    smollm2 `python -m inference bench` of the CPU recipe's EAGLE-3 drafter on the builtin smollm2 (the README table's
            16 questions, 128 new tokens, bf16) against our plain loop and HF `generate`, eager and --compile, from
            the parts --pack-smollm2 made (scripts/gpu_check_bundles.py); skipped without --smollm2
    recipes the real commands as subprocesses on a random target of --recipe-shape saved first (Llama-3.1-8B's on a
            GPU): `python -m train medusa1` and `python -m train eagle3` with self-distillation on the bundled corpus,
            then their exports (`python -m models.convert vllm-export` / `eagle3-export`), and CLLM's trajectory
            collection and LoRA training (scripts/collect_jacobi.py, `python -m train cllm`); per command wall time,
            tokens/s and peak memory beside train/memory_model.py's prediction (scripts/gpu_check_recipes.py)
A section that fails records its error and the run goes on; the exit status is then 1. Bad arguments end with one line
and exit status 2 before any model is built. --small shrinks every shape and count (a smoke test, on CPU or GPU).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import platform
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # gpu_check_*, however this file was started

from gpu_check_bundles import (  # noqa: E402
    SMOLLM2_QUESTIONS, TINY_FILES, pack, smollm2_missing, smollm2_section, tiny_section)
from gpu_check_compiled import compiled_section  # noqa: E402
from gpu_check_drafters import drafters_section  # noqa: E402
from gpu_check_recipes import RECIPE_SHAPES, recipes_section  # noqa: E402
from train.memory_model import SHAPES, Shape  # noqa: E402  (the standard library only)

SECTIONS = ("train", "nf4", "engine", "compiled", "drafters", "tiny", "smollm2", "recipes")
COMPILED_SHAPE = SHAPES["llama3_1_8b"]  # section compiled's target: issue #62's goals are stated for 8B
# What the sections import (transformers and its own dependencies, omegaconf, hydra-core, accelerate): tried after the
# argument checks, so a machine that lacks a package says so in one line before any model is built.
REQUIRED = ("transformers", "train.medusa1_cost", "inference.bench.engine_check", "inference.cli")
JSON_NAME, REPORT_NAME = "gpu_check.json", "gpu_check.txt"


@dataclass(frozen=True)
class Plan:
    """Shapes and counts of one run."""

    hidden: int
    layers: int
    attention_heads: int
    intermediate: int
    vocab: int
    batch: int  # training batches: batch x seq random tokens, `steps` of them, timed `rounds` times
    seq: int
    steps: int
    rounds: int
    prompts: int  # engine: random prompts of prompt_len tokens, new_tokens greedy tokens each
    prompt_len: int
    new_tokens: int
    context: int  # cached tokens under the timed tree forwards
    reps: int  # timed repetitions per t(K) and head-cost point (median kept)
    tiny_limit: int | None  # MT-bench questions for `tiny` (None: all 80)
    tiny_new_tokens: int
    drafter_prompts: tuple[int, ...] = (23, 9, 40, 16)  # section drafters: prompt lengths (a left-padded batch)
    drafter_new_tokens: int = 48
    drafter_vocab: int = 512
    tree_sizes: tuple[int, ...] = (16, 32, 64, 128)
    medusa_heads: int = 5
    memory_heads: int = 3


FULL = Plan(hidden=4096, layers=32, attention_heads=32, intermediate=11008, vocab=32000, batch=4, seq=512, steps=4,
            rounds=3, prompts=4, prompt_len=128, new_tokens=64, context=256, reps=10, tiny_limit=None,
            tiny_new_tokens=128)
SMALL = Plan(hidden=64, layers=2, attention_heads=4, intermediate=192, vocab=512, batch=2, seq=32, steps=2, rounds=1,
             prompts=2, prompt_len=16, new_tokens=12, context=32, reps=2, tiny_limit=2, tiny_new_tokens=16,
             drafter_prompts=(11, 7), drafter_new_tokens=12)


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class Progress:
    """'[  12.3 s] message' lines; while a step stays silent, its name is repeated every `every` seconds."""

    def __init__(self, every: float = 10.0) -> None:
        self.start = self.last = time.perf_counter()
        self.every, self.current = every, "starting"
        threading.Thread(target=self._beat, daemon=True).start()

    def say(self, message: str) -> None:
        self.current = message
        self._print(message)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def _print(self, message: str) -> None:
        self.last = time.perf_counter()
        print(f"[{self.last - self.start:7.1f} s] {message}", flush=True)

    def _beat(self) -> None:
        while True:
            time.sleep(1.0)
            if time.perf_counter() - self.last >= self.every:
                self._print(f"... still working (last: {self.current})")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for gpu_check.json and gpu_check.txt (created; its parent must exist)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes and counts: the dry run")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--tiny", help="bundle folder from --pack-tiny (section tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipe-shape", help=f"section recipes: one of {', '.join(RECIPE_SHAPES)} (default: llama3_1_8b "
                   "on a GPU, llama_1_7b on a CPU, small with --small)")
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--smollm2", help="folder from --pack-smollm2, every part carried (section smollm2)")
    p.add_argument("--pack-tiny", metavar="DIR", help="copy what section tiny needs into DIR (a new folder) and exit")
    p.add_argument("--tiny-drafter", default="outputs/medusa1/tiny", help="with --pack-tiny: the medusa1 checkpoint")
    p.add_argument("--pack-smollm2", metavar="DIR", help="write section smollm2's parts into DIR (new) and exit")
    p.add_argument("--smollm2-drafter", default="outputs/eagle3/smollm2-self-2ep",
                   help="with --pack-smollm2: the EAGLE-3 checkpoint")
    p.add_argument("--questions", help="with --pack-tiny: MT-bench question.jsonl (default: ../shared/data/mt_bench); "
                   f"with --pack-smollm2: a file or prompt sets (default {SMOLLM2_QUESTIONS})")
    p.error = fail  # one line, exit status 2
    return p.parse_args(argv)


def check_device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        fail(f"--device {text}: not a device (cpu, cuda, cuda:N)")
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        fail(f"--device {text}: choose cpu or cuda[:N]")
    if not torch.cuda.is_available():
        fail(f"--device {text}: no CUDA device visible to torch {torch.__version__} (CUDA build: "
             f"{torch.version.cuda or 'none'})")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        fail(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device("cuda", index)


def check_args(args: argparse.Namespace) -> tuple[Path, torch.device, tuple[str, ...], Path | None, Path | None]:
    """Everything that can be wrong with the command line or this machine, before any model is built: the cheap
    checks first, then the imports the sections need."""
    if args.out is None:
        fail("--out is required (a folder for gpu_check.json and gpu_check.txt)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        fail(f"--out {out}: exists and is not a folder")
    if not out.parent.is_dir():
        fail(f"--out {out}: parent folder {out.parent} does not exist")
    sections = tuple(s for s in args.sections.split(",") if s)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        fail(f"--sections {args.sections!r}: a comma list of {', '.join(SECTIONS)}")
    device = check_device(args.device)
    bundle = None
    if args.tiny is not None:
        bundle = Path(args.tiny)
        missing = [f for f in TINY_FILES if not (bundle / f).is_file()]
        if missing:
            fail(f"--tiny {bundle}: no {missing[0]} (make the bundle with --pack-tiny)")
    smollm2 = None if args.smollm2 is None else Path(args.smollm2)
    if smollm2 is not None and "smollm2" in sections and (missing := smollm2_missing(smollm2)) is not None:
        fail(f"--smollm2 {smollm2}: {missing}")
    if args.recipe_shape is not None and args.recipe_shape not in RECIPE_SHAPES:
        fail(f"--recipe-shape {args.recipe_shape}: one of {', '.join(RECIPE_SHAPES)}")
    if args.threads is not None and args.threads < 1:
        fail(f"--threads must be >= 1, got {args.threads}")
    for name in REQUIRED + (("gguf",) if smollm2 is not None and "smollm2" in sections else ()):  # converts smollm2
        try:
            importlib.import_module(name)
        except ImportError as e:
            fail(f"cannot import {name} ({e}); scripts/gpu_check.md says which wheels to carry")
    return out, device, sections, bundle, smollm2


def nf4_unavailable() -> str | None:
    """Why the NF4 section cannot run here, or None."""
    try:
        importlib.import_module("bitsandbytes")
    except (ImportError, RuntimeError, OSError) as e:  # absent, or its native library does not load
        return f"bitsandbytes cannot be imported ({type(e).__name__}: {e})"
    return None


def random_target(plan: Plan, device: torch.device, seed: int) -> torch.nn.Module:
    """A frozen bf16 Llama of the plan's shapes, initialised on `device` (no CPU copy of 7B weights). No EOS id:
    every method then decodes the same number of tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=plan.vocab, hidden_size=plan.hidden, intermediate_size=plan.intermediate,
                         num_hidden_layers=plan.layers, num_attention_heads=plan.attention_heads,
                         num_key_value_heads=plan.attention_heads, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def train_section(target: torch.nn.Module, plan: Plan, baseline: int, seed: int,
                  variants: dict[str, torch.dtype | None]) -> dict:
    """Memory of the README's memory setup (3 heads sharing the lm_head, 2 steps), throughput of medusa1's defaults."""
    from train.medusa1_cost import StepSetup, memory_figures, throughput_figures  # deferred: after the package checks

    memory = StepSetup(plan.memory_heads, plan.batch, plan.seq, steps=2, share_lm_head=True)
    speed = StepSetup(plan.medusa_heads, plan.batch, plan.seq, plan.steps)
    return {"memory": memory_figures(target, memory, baseline, seed),
            "throughput": throughput_figures(target, speed, plan.rounds, variants, seed)}


def nf4_section(path: Path, plan: Plan, device: torch.device, seed: int, bf16: dict | None) -> dict:
    from models.loading import load_target  # deferred: after the package checks

    baseline = allocated(device)
    target = load_target(str(path), dtype="bf16", quantization="nf4", device_map=str(device))
    out = train_section(target, plan, baseline, seed, {"fp32_heads": None})
    memory = out["memory"]
    bf16_peak = ((bf16 or {}).get("memory") or {}).get("peak_mib")
    ratio = memory["peak_mib"] / bf16_peak if memory["peak_mib"] is not None and bf16_peak else None
    return {**out, "nf4_over_bf16_peak": ratio}


def engine_section(model: torch.nn.Module, plan: Plan, device: torch.device, seed: int, progress: Progress) -> dict:
    from inference.bench.engine_check import EngineSetup, check_engine, lm_head_heads  # deferred: after the package checks

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, plan.vocab, (plan.prompt_len,), generator=g).tolist() for _ in range(plan.prompts)]
    hi_dtype = torch.float32 if device.type == "cuda" else torch.float64
    setup = EngineSetup(prompts, plan.new_tokens, plan.tree_sizes, plan.context, plan.reps, hi_dtype, seed)
    return check_engine(model, lm_head_heads(model, plan.medusa_heads), setup, progress.say)


def run_section(name: str, results: dict, out: Path, progress: Progress, fn: Callable[[], dict]) -> None:
    """results[name] = fn(), or its error: one section's failure must not lose the others' figures."""
    progress.say(f"{name}: start")
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001  (recorded in the JSON, traceback on stderr, exit status 1)
        traceback.print_exc()
        results[name] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    results["meta"]["section_s"][name] = time.perf_counter() - start
    progress.say(f"{name}: done in {results['meta']['section_s'][name]:.1f} s")
    write(out, results, progress)


def write(out: Path, results: dict, progress: Progress) -> None:
    from data.atomic import write_text  # deferred: after the package checks
    from gpu_check_report import format_report

    results["meta"]["wall_s"] = progress.elapsed()
    bad: list[str] = []
    results = strict_json(results, "", bad)  # a copy: the caller's dict keeps its values
    results["meta"]["nonfinite"] = bad
    for name, text in ((JSON_NAME, json.dumps(results, indent=2, allow_nan=False) + "\n"),
                       (REPORT_NAME, format_report(results) + "\n")):
        write_text(out / name, text)


def strict_json(value: Any, path: str, bad: list[str]) -> Any:
    """`value` with every NaN or infinity replaced by None (strict JSON); their paths are appended to `bad`, which
    the JSON keeps as meta.nonfinite and the report shows."""
    if isinstance(value, float) and not math.isfinite(value):
        bad.append(path)
        return None
    if isinstance(value, dict):
        return {k: strict_json(v, f"{path}.{k}" if path else k, bad) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v, f"{path}[{i}]", bad) for i, v in enumerate(value)]
    return value


def meta(args: argparse.Namespace, plan: Plan, device: torch.device, sections: tuple[str, ...]) -> dict[str, Any]:
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "command": " ".join([sys.executable, *sys.argv]), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "small": args.small, "sections": list(sections), "seed": args.seed, "threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "versions": {n: version(n) for n in ("transformers", "bitsandbytes", "accelerate", "peft")},
        "plan": asdict(plan), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "section_s": {}, "wall_s": 0.0, "nonfinite": [],
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.pack_tiny is not None or args.pack_smollm2 is not None:
        try:
            print(pack(args))
        except ValueError as e:  # one line naming the flag
            fail(str(e))
        return 0
    out, device, sections, bundle, smollm2 = check_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    plan = SMALL if args.small else FULL
    out.mkdir(exist_ok=True)
    progress = Progress()
    results: dict[str, Any] = {"meta": meta(args, plan, device, sections), **dict.fromkeys(sections)}
    write(out, results, progress)
    nf4_reason = nf4_unavailable() if "nf4" in sections else None
    if {"train", "nf4", "engine"} & set(sections):
        from train.medusa1_cost import release  # deferred: after the package checks

        baseline = allocated(device)
        progress.say(f"building a random Llama (hidden {plan.hidden} x {plan.layers} layers, vocab {plan.vocab}) on "
                     f"{device} in bf16")
        model = random_target(plan, device, args.seed)
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
            if "nf4" in sections and nf4_reason is None:
                progress.say(f"saving it for the NF4 load ({scratch})")
                model.save_pretrained(scratch)
            if "train" in sections:
                run_section("train", results, out, progress, lambda: train_section(
                    model, plan, baseline, args.seed, {"fp32_heads": None, "bf16_autocast": torch.bfloat16}))
            if "engine" in sections:
                run_section("engine", results, out, progress, lambda: engine_section(model, plan, device, args.seed,
                                                                                     progress))
            del model  # the NF4 target loads into the memory the bf16 one held
            release(device)
            if "nf4" in sections and nf4_reason is None:
                run_section("nf4", results, out, progress, lambda: nf4_section(Path(scratch), plan, device, args.seed,
                                                                               results.get("train")))
            elif "nf4" in sections:
                results["nf4"] = {"skipped": nf4_reason}
    if "compiled" in sections:
        shape = COMPILED_SHAPE if not args.small else Shape("small", plan.hidden, plan.layers, plan.attention_heads, 2,
                                                            plan.intermediate, plan.vocab)
        run_section("compiled", results, out, progress, lambda: compiled_section(
            shape, plan.prompts, plan.prompt_len, plan.new_tokens, plan.context, plan.reps, device, args.seed,
            progress.say, out))
    if "drafters" in sections:
        with tempfile.TemporaryDirectory(prefix="gpu_check_drafters_") as scratch:
            run_section("drafters", results, out, progress, lambda: drafters_section(Path(scratch), plan, device,
                                                                                     args.seed, progress.say))
    if "tiny" in sections:
        if bundle is None:
            results["tiny"] = {"skipped": "no --tiny bundle given (make one with --pack-tiny)"}
        else:
            run_section("tiny", results, out, progress, lambda: tiny_section(bundle, out, plan, device))
    if "smollm2" in sections:
        if smollm2 is None:
            results["smollm2"] = {"skipped": "no --smollm2 bundle given (make one with --pack-smollm2)"}
        else:
            run_section("smollm2", results, out, progress, lambda: smollm2_section(smollm2, out, plan, device))
    if "recipes" in sections:
        default = "small" if args.small else "llama3_1_8b" if device.type == "cuda" else "llama_1_7b"
        shape = args.recipe_shape or default
        with tempfile.TemporaryDirectory(prefix="gpu_check_recipes_") as scratch:
            run_section("recipes", results, out, progress, lambda: recipes_section(shape, Path(scratch), out, device,
                                                                                   args.seed, progress.say))
    write(out, results, progress)
    print((out / REPORT_NAME).read_text(), end="")
    failed = [name for name in sections if isinstance(results.get(name), dict) and "error" in results[name]]
    progress.say(f"wrote {out / JSON_NAME} and {out / REPORT_NAME}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
