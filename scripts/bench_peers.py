"""Side by side with the peers: our engine against FasterDecoding's Medusa, Hugging Face assisted generation and
prompt-lookup decoding (and EAGLE where a fair run is possible), on one target, one prompt set, one run.

    OMP_NUM_THREADS=1 python scripts/bench_peers.py --heads outputs/medusa1/smollm2-shared --out outputs/peers

Every method decodes the same chat-formatted prompts greedily to the same number of new tokens, with the same
threads and dtype; the methods take turns prompt by prompt (who goes first rotates). The peers that need other
library versions run in their own virtual environment, created once under --venv-dir with the versions they pin
(installed from PyPI; torch pinned to this machine's release so no CUDA build is pulled), each as a long-lived
subprocess (scripts/peer_medusa.py) that answers prompt ids with token ids and timings over JSON lines:
    medusa       medusa-llm's engine with our Medusa heads (--heads, a full-vocabulary checkpoint) exported to its
                 layout (models.interop.export_medusa), on the cartesian tree --medusa-choices; our engine runs the
                 same heads on the same tree; plain greedy of that stack = its transformers' generate
    hf_assisted  transformers' generate(assistant_model=draft) vs our draft-model decoding with the same --draft
    hf_pld       transformers' generate(prompt_lookup_num_tokens=..) vs our prompt_lookup, same draft length/n-gram
                 (the HF rows run in this process: they are part of the transformers we use)
    eagle        not run: see EAGLE_REASON
Output: the table (inference.bench.peers.format_table), the per-step breakdown, versions and runtime patches, and
<out>/peers.json (the record; `--from-record <out>/peers.json` prints its table again without running anything).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from dataclasses import replace
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import transformers  # noqa: E402

from data.atomic import write_text  # noqa: E402
from data.errors import UsageError  # noqa: E402
from inference.api import Engine, attach, load  # noqa: E402
from inference.bench.greedy_ties import Fp64Judge, first_divergence  # noqa: E402
from inference.bench.methods import HFRunner, Sampling, assisted_settings, pld_defaults  # noqa: E402
from inference.bench.peers import (METHODS, PeerBenchError, cartesian_choices, cartesian_paths,  # noqa: E402
                                  format_breakdown, format_table)
from inference.bench.prompt_sets import is_set_spec, load_questions, parse_sets  # noqa: E402
from inference.drafters.prompt_lookup import PromptLookupDrafter  # noqa: E402
from inference.drafters.registry import CLI, LoadOptions, build_from_spec, resolve  # noqa: E402
from inference.engine.drafter import NoDrafter  # noqa: E402
from inference.engine.tree import TreeError, read_tree_file  # noqa: E402
from inference.session import Session, encode_messages  # noqa: E402
from models.backbone import eos_token_ids  # noqa: E402
from models.interop import export_medusa  # noqa: E402
from models.loading import load_tokenizer  # noqa: E402
from models.refs import locate, model_settings  # noqa: E402

PEERS = ("medusa", "hf_assisted", "hf_pld", "eagle")
PEER_PINS = {  # what each peer's environment gets; medusa-llm 0.1 pins nothing itself (see README)
    "medusa": ("torch==2.13.0", "medusa-llm==0.1", "transformers==4.34.1", "accelerate==0.24.1"),
}
EAGLE_REASON = ("eagle-llm 1.2.1 decodes only with a trained EAGLE draft head for the target "
                "(EaModel.from_pretrained(base_model_path, ea_model_path): a one-layer autoregressive head over the "
                "target's features); none exists for SmolLM2 and training one is out of this bench's scope, and an "
                "untrained head would measure nothing fair")
WARMUP_TOKENS = 8
DRAFT_NAMING = replace(CLI, drafter="--draft")  # registry errors name this script's flags
Turn = dict[str, Any]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="builtin:smollm2", help="the target (default builtin:smollm2)")
    p.add_argument("--heads", help="draftsmith Medusa heads over the full vocabulary (e.g. trained with "
                                   "method.share_lm_head=true); needed for --peers medusa")
    p.add_argument("--medusa-choices", default="1,3,2,1",
                   help="medusa-llm's cartesian tree [1,k_1..k_H], one k per head (default 1,3,2,1: 15 nodes + root)")
    p.add_argument("--tree", help="our tree JSON instead of --medusa-choices (must be a full cartesian tree)")
    p.add_argument("--draft", default="early_exit:smollm2:8",
                   help="the draft model for hf_assisted and ours (dir, builtin:<name>, early_exit:<model>:<N>, or "
                        "a draft_model checkpoint)")
    p.add_argument("--draft-stop", help="our draft-model decoding's stop policy (inference.drafters.draft_stop: fixed, "
                                        "confidence:<t>, learned[:<t>]); default: the engine's (fixed, 4 tokens). "
                                        "confidence:0.4 is the rule of HF assisted generation's default")
    p.add_argument("--prompts", default="mt_bench:8", help="prompt sets as in `inference bench --questions`")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--no-cpu-kernel", action="store_true",
                   help="our engine on stock PyTorch linears (default: its CPU kernel; inference.kernels.cpu_linear)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {', '.join(PEERS)}")
    p.add_argument("--warmup", type=int, default=1, help="warm-up generations per method before timing")
    p.add_argument("--venv-dir", default=str(Path.home() / ".cache" / "draftsmith" / "peers"))
    p.add_argument("--out", default="outputs/peers", help="folder for peers.json and peers.md")
    p.add_argument("--from-record", metavar="JSON", help="print the table of a recorded run and exit")
    return p.parse_args(argv)


def fail(message: str) -> SystemExit:
    print(f"bench_peers: {message}", file=sys.stderr)
    return SystemExit(2)


def check_args(args: argparse.Namespace) -> tuple[list[str], list[int] | None]:
    """Everything that can fail before a model loads or a venv is made; returns (peers, medusa choices)."""
    peers = [x for x in args.peers.split(",") if x]
    if not peers or any(x not in PEERS for x in peers) or len(set(peers)) != len(peers):
        raise fail(f"--peers {args.peers!r}: a comma list of distinct names from {', '.join(PEERS)}")
    for name in ("max_new_tokens", "threads"):
        if getattr(args, name) < 1:
            raise fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise fail(f"--warmup must be >= 0, got {args.warmup}")
    choices = None
    if "medusa" in peers:
        choices = medusa_choices(args)
        heads = check_heads(args.heads)
        if len(choices) - 1 != heads:
            raise fail(f"--medusa-choices {choices}: one k per head after the leading 1; {args.heads} has {heads} heads")
    if "hf_assisted" in peers:
        try:
            draft = resolve(args.draft, args.base, DRAFT_NAMING)
        except UsageError as e:
            raise fail(str(e)) from None
        if draft.type != "draft_model":
            raise fail(f"--draft {args.draft}: not a causal LM directory, builtin:<name>, early_exit:<model>:<N> or "
                       f"draft_model checkpoint")
        try:
            draft.check(LoadOptions(draft_stop=args.draft_stop), DRAFT_NAMING)  # `learned` needs its stopper
        except UsageError as e:
            raise fail(f"--draft-stop: {e}") from None
    if is_set_spec(args.prompts):
        try:
            parse_sets(args.prompts)
        except UsageError as e:
            raise fail(f"--prompts: {e}") from None
    elif not Path(args.prompts).is_file():
        raise fail(f"--prompts {args.prompts}: no such question file and not a prompt-set spec")
    return peers, choices


def medusa_choices(args: argparse.Namespace) -> list[int]:
    try:
        if args.tree:
            try:
                return cartesian_choices(read_tree_file(args.tree))
            except TreeError as e:
                raise fail(f"--tree: {e}") from None
        parts = [x.strip() for x in args.medusa_choices.split(",")]
        if not all(x.isdigit() for x in parts):
            raise fail(f"--medusa-choices {args.medusa_choices!r}: expected integers like 1,3,2,1")
        choices = [int(x) for x in parts]
        cartesian_paths(choices)
        return choices
    except PeerBenchError as e:
        raise fail(f"--{'tree' if args.tree else 'medusa-choices'}: {e}") from None


def check_heads(path: str | None) -> int:
    """The head count of a full-vocabulary draftsmith Medusa checkpoint (else one line and exit)."""
    if not path:
        raise fail("--peers medusa needs --heads (a draftsmith Medusa checkpoint over the full vocabulary)")
    config_file = Path(path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise fail(f"--heads {path}: cannot read {config_file} ({e})") from None
    if config.get("drafter_type") != "medusa":
        raise fail(f"{config_file}: drafter_type {config.get('drafter_type')!r}, expected 'medusa'")
    if config.get("draft_vocab_size") is not None:
        raise fail(f"{config_file}: draft_vocab_size={config['draft_vocab_size']}; Medusa's engine needs heads over "
                   f"the full vocabulary (train without method.draft_vocab, e.g. method.share_lm_head=true)")
    return int(config["num_heads"])


# --- peer environments -------------------------------------------------------------------------------------------

def ensure_venv(root: Path, peer: str) -> Path:
    """The python of <root>/<peer>, created and filled with PEER_PINS[peer] on first use (a stamp records them)."""
    env, pins = root / peer, list(PEER_PINS[peer])
    python, stamp = env / "bin" / "python", env / "draftsmith-pins.json"
    if python.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == pins:
        print(f"[{peer}] venv {env} ready ({' '.join(pins)})", file=sys.stderr, flush=True)
        return python
    print(f"[{peer}] creating venv {env} with {' '.join(pins)} (pip output follows)", file=sys.stderr, flush=True)
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    done = subprocess.run([str(python), "-m", "pip", "install", *pins], stdout=sys.stderr, stderr=sys.stderr)
    if done.returncode != 0:
        raise fail(f"[{peer}] pip install {' '.join(pins)} into {env} failed (exit {done.returncode}); see above")
    stamp.write_text(json.dumps(pins))
    return python


class PeerProcess:
    """A driver running in a peer's venv: JSON lines in, JSON lines out, alive for the whole run."""

    def __init__(self, python: Path, driver: Path, threads: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": ""}
        self.proc = subprocess.Popen([str(python), str(driver)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=sys.stderr, text=True, env=env)

    def call(self, **request: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer driver exited (code {self.proc.wait()}) on {request['cmd']}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(reply.get("error", "unknown error"))
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(cmd="quit")
            except (RuntimeError, BrokenPipeError):
                pass
            self.proc.wait(timeout=30)


def start_medusa(args: argparse.Namespace, choices: list[int], record: dict[str, Any]) -> PeerProcess | None:
    """Export the heads to Medusa's layout next to the venv, start the driver, load the model there."""
    python = ensure_venv(Path(args.venv_dir), "medusa")
    work = Path(args.venv_dir) / "medusa-work" / Path(args.heads).resolve().name
    print(f"[medusa] exporting {args.heads} to {work / 'heads'} (medusa_lm_head.pt)", file=sys.stderr, flush=True)
    export_medusa(args.heads, work / "heads", base_model=args.base, base_model_name_or_path=str(work / "base"))
    peer = PeerProcess(python, REPO / "scripts" / "peer_medusa.py", args.threads)
    print("[medusa] loading medusa-llm's engine in its venv", file=sys.stderr, flush=True)
    try:
        reply = peer.call(cmd="init", model_dir=str(locate(args.base)), work_dir=str(work),
                          heads_dir=str(work / "heads"), choices=choices, dtype=args.dtype, threads=args.threads)
    except RuntimeError as e:
        record["unavailable"]["medusa"] = f"medusa-llm failed to load: {e}"
        peer.close()
        return None
    record["versions"]["medusa"] = reply["versions"]
    record["patches"]["medusa"] = reply["patches"]
    return peer


# --- our side ----------------------------------------------------------------------------------------------------

def our_versions() -> dict[str, str]:
    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "draftsmith": version("draftsmith")}


def engine_turn(engine: Any, cpu_kernel: bool) -> Callable[[list[int], int], Turn]:
    engine.cpu_kernel = cpu_kernel

    def run(prompt: list[int], max_new: int) -> Turn:
        start = time.perf_counter()
        out = engine.generate(prompt, max_new_tokens=max_new, temperature=0.0)
        wall = time.perf_counter() - start
        s = out.stats
        return {"tokens": list(out.sequences[0]), "wall": wall, "forwards": s.target_forwards,
                "accepted": [step[0] for step in s.accepted], "times": dict(vars(s.times))}
    return run


def hf_turn(runner: Any) -> Callable[[list[int], int], Turn]:
    def run(prompt: list[int], max_new: int) -> Turn:
        r = runner(prompt, max_new, 0)
        return {"tokens": list(r.tokens), "wall": r.wall_time, "forwards": r.target_forwards,
                "accepted": list(r.accepted), "times": None}
    return run


def peer_turn(peer: PeerProcess, method: str) -> Callable[[list[int], int], Turn]:
    def run(prompt: list[int], max_new: int) -> Turn:
        reply = peer.call(cmd="generate", method=method, prompt=prompt, max_new_tokens=max_new)
        return {k: reply[k] for k in ("tokens", "wall", "forwards", "accepted", "times")}
    return run


def build_ours(args: argparse.Namespace, peers: list[str], choices: list[int] | None, record: dict[str, Any]
               ) -> tuple[dict[str, Callable], Any]:
    """Our methods and the HF ones, on one target object; returns (runners, session)."""
    settings = model_settings(args.base)
    engine = load(None, base=settings.path, dtype=args.dtype)
    model = engine.model
    tokenizer = load_tokenizer(settings.ref)
    session = Session(engine, tokenizer, settings.chat_template, args.base, "none", None)
    eos, pad = eos_token_ids(model), tokenizer.pad_token_id
    greedy = Sampling(0.0, 0, 1.0, "greedy")
    kernel = not args.no_cpu_kernel  # ours only: the HF runners call the model's own generate, stock
    runners: dict[str, Callable] = {"ar": engine_turn(Engine(model, NoDrafter()), kernel),
                                    "hf": hf_turn(HFRunner(model, eos, pad, greedy))}
    if "medusa" in peers:
        ours = attach(resolve(args.heads, args.base), model, LoadOptions(tree=cartesian_paths(choices)))
        drafter = ours.drafter
        runners["ours_medusa"] = engine_turn(ours, kernel)
        record["config"]["tree_nodes"] = drafter.tree.num_nodes if hasattr(drafter, "tree") else None
    if "hf_assisted" in peers:
        ours = attach(resolve(args.draft, args.base), model, LoadOptions(draft_stop=args.draft_stop))
        drafter = ours.drafter
        runners["hf_assisted"] = hf_turn(HFRunner(model, eos, pad, greedy, {"assistant_model": drafter.model}))
        runners["ours_draft"] = engine_turn(ours, kernel)
        record["config"]["hf_assisted"] = {"draft": args.draft, **assisted_settings(drafter.model)}
    if "hf_pld" in peers:
        pld = build_from_spec("prompt_lookup", model)
        tokens, ngram = pld_defaults(pld if isinstance(pld, PromptLookupDrafter) else None)
        runners["hf_pld"] = hf_turn(HFRunner(model, eos, pad, greedy, {"prompt_lookup_num_tokens": tokens,
                                                                       "max_matching_ngram_size": ngram}))
        runners["ours_pld"] = engine_turn(Engine(model, pld), kernel)
        record["config"]["prompt_lookup"] = {"num_draft": tokens, "max_ngram": ngram}
    return runners, session


def order_methods(runners: dict[str, Callable]) -> dict[str, Callable]:
    return {name: runners[name] for name in METHODS if name in runners}


def run(args: argparse.Namespace) -> int:
    peers, choices = check_args(args)
    torch.set_num_threads(args.threads)
    questions, _ = load_questions(args.prompts)
    record: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "config": {"base": args.base, "prompts": args.prompts, "num_prompts": len(questions),
                   "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "threads": args.threads,
                   "heads": args.heads, "medusa_choices": choices, "draft": args.draft, "draft_stop": args.draft_stop,
                   "peers": peers, "cpu_kernel": not args.no_cpu_kernel},
        "versions": {"ours": our_versions()}, "patches": {}, "unavailable": {}, "methods": {},
    }
    if "eagle" in peers:
        record["unavailable"]["eagle"] = EAGLE_REASON
    medusa = start_medusa(args, choices, record) if "medusa" in peers else None
    try:
        print("[ours] loading the target and the drafters", file=sys.stderr, flush=True)
        runners, session = build_ours(args, peers, choices, record)
        if medusa is not None:
            runners["medusa_greedy"] = peer_turn(medusa, "greedy")
            runners["medusa"] = peer_turn(medusa, "medusa")
        runners = order_methods(runners)
        prompts = [encode_messages(session, [{"role": "user", "content": q.turns[0]}]) for q in questions]
        record["prompts"] = prompts
        record["methods"] = alternate(runners, prompts, args)
        print("[ours] judging every divergence from our plain greedy in float64", file=sys.stderr, flush=True)
        record["divergences"] = judge_divergences(record, session.engine.model)
    finally:
        if medusa is not None:
            medusa.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "peers.json", json.dumps(record, indent=1) + "\n")
    report = render(record)
    write_text(out / "peers.md", report + "\n")
    print(report)
    print(f"record written to {out / 'peers.json'}", file=sys.stderr)
    return 0


def alternate(runners: dict[str, Callable], prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """Warm every method up, then run prompt by prompt, every method on each, rotating who goes first."""
    names = list(runners)
    for name in names:
        for _ in range(args.warmup):
            print(f"[warm-up] {name}", file=sys.stderr, flush=True)
            runners[name](prompts[0], min(WARMUP_TOKENS, args.max_new_tokens))
    turns: dict[str, list[Turn]] = {n: [] for n in names}
    start = time.monotonic()
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            turn = runners[name](prompt, args.max_new_tokens)
            turns[name].append(turn)
            rate = len(turn["tokens"]) / turn["wall"] if turn["wall"] > 0 else float("nan")
            print(f"[prompt {i + 1}/{len(prompts)}] {name}: {len(turn['tokens'])} tokens, {rate:.2f} tok/s, "
                  f"{time.monotonic() - start:.0f} s elapsed", file=sys.stderr, flush=True)
    return {n: {"turns": t} for n, t in turns.items()}


def judge_divergences(record: dict[str, Any], model: Any) -> dict[str, list[dict[str, Any]]]:
    """Each answer that differs from our plain greedy (ar), judged at its first differing token by the bench's rule
    (inference.bench.greedy_ties: a near tie when, in a float64 rerun, both tokens there and every later token of the
    method lie within the run dtype's stated rounding tolerance of the greedy choice, else a mismatch). The target
    is the same weights in every stack, so our float64 rerun rules on the peers' answers too."""
    judge = Fp64Judge(model)
    reference = record["methods"]["ar"]["turns"]
    found: dict[str, list[dict[str, Any]]] = {}
    for name, method in record["methods"].items():
        if name == "ar":
            continue
        found[name] = []
        for i, (ref, turn) in enumerate(zip(reference, method["turns"])):
            d = first_divergence(record["prompts"][i], ref["tokens"], turn["tokens"])
            if d is None:
                continue
            verdict = judge(d)
            found[name].append({"prompt": i, "index": d.index, "ours": d.left, "method": d.right,
                                "near_tie": verdict.near_tie, "relative_gap": verdict.relative_gap,
                                "failed_at": verdict.failed_at, "failed_by": verdict.failed_by})
    return found


def render(record: dict[str, Any]) -> str:
    c = record["config"]
    lines = [f"command: {record.get('command', '?')}",
             f"target {c['base']}, {c['num_prompts']} prompts ({c['prompts']}), {c['max_new_tokens']} new tokens, "
             f"greedy, {c['dtype']}, {c['threads']} thread(s)", "", format_table(record)]
    breakdown = format_breakdown(record)
    if breakdown:
        lines += ["", "per decoding step (means over the run):", breakdown]
    lines += ["", "versions:"]
    lines += [f"  {stack}: " + ", ".join(f"{k} {v}" for k, v in v.items()) for stack, v in record["versions"].items()]
    for peer, patches in record.get("patches", {}).items():
        lines += [f"runtime patches of {peer}:"] + [f"  - {p}" for p in patches]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_record:
        try:
            record = json.loads(Path(args.from_record).read_text())
            print(render(record))
        except (OSError, json.JSONDecodeError, KeyError, PeerBenchError) as e:
            raise fail(f"--from-record {args.from_record}: {e}") from None
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
