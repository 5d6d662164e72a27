"""Kill `python -m train medusa1` with SIGKILL at random moments, resume with resume_from_checkpoint=auto until it
finishes, and compare the final heads with an uninterrupted run of the same seed.

    python scripts/fault_inject.py [--kills 6] [--steps 40] [--save-steps 4] [--seed 0] [--workdir DIR] [--keep]

Everything runs offline on a tiny random Llama saved to the work folder (tests/model_support.save_tiny_model), with
one CPU thread per run so the uninterrupted and the resumed runs do the same float operations in the same order.
Kill moments alternate between
    random   a random moment inside a random step still to come (forward, optimizer, logging or saving), and
    save     once a checkpoint is being written (an atomic-write temporary folder exists, or a checkpoint-N folder
             has no complete trainer_state.json yet, see train.resume.checkpoint_problem): at once, or up to 0.1 s
             later (while Trainer writes the optimizer, scheduler, RNG and trainer state).
Prints one line per launch (what was killed, what the disk held, which checkpoint the next launch resumed from) and
a report: kills, resumes, torn checkpoints seen, max |Δ| between the final heads. Exit code 0 iff bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = "the quick brown fox jumps over lazy dog hello world have a nice day what is two plus three".split()
POLL_S = 0.002


@dataclass(frozen=True)
class Launch:
    mode: str  # random | save | none (left to finish)
    seconds: float
    killed: bool
    resumed_from: str | None  # the checkpoint this launch resumed from (None: from scratch)
    checkpoints: dict[str, str | None]  # at the end of the launch: checkpoint-N -> why it is torn (None: complete)
    temporaries: int  # atomic-write temporary folders at the end of the launch

    def on_disk(self) -> str:
        parts = [f"{name} {'ok' if why is None else 'TORN (' + why + ')'}" for name, why in self.checkpoints.items()]
        if self.temporaries:
            parts.append(f"{self.temporaries} temporary folder(s) of an interrupted atomic write")
        return ", ".join(parts) or "no checkpoint"


def prepare(work: Path, seed: int) -> tuple[Path, Path]:
    import torch

    from tests.model_support import save_tiny_model

    g = torch.Generator().manual_seed(seed)
    pick = lambda n: " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())  # noqa: E731
    records = [{"conversations": [{"from": "human", "value": pick(6)}, {"from": "gpt", "value": pick(14)}]}
               for _ in range(48)]
    data = work / "chats.json"
    data.write_text(json.dumps(records))
    return save_tiny_model(work / "model", seed=seed), data


def command(model: Path, data: Path, out: Path, args: argparse.Namespace, resume: bool) -> list[str]:
    return [
        sys.executable, "-m", "train", "medusa1", "+model=tiny", f"model.path={model}", "model.dtype=fp32", "data.self_distill=false",
        "data=sharegpt", f"data.path={data}", "data.max_length=64", "data.validation_fraction=0",
        f"training.max_steps={args.steps}", f"training.save_steps={args.save_steps}", "training.save_total_limit=2",
        "training.per_device_train_batch_size=4", "training.logging_steps=1", "method.num_heads=3",
        "eval.greedy_prompts=0", "logger=none", f"seed={args.seed}", f"output_dir={out}",
        *(["training.resume_from_checkpoint=auto"] if resume else []),
    ]


def environment() -> dict[str, str]:
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    return {**os.environ, **offline, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def checkpoints(out: Path) -> dict[str, str | None]:
    """checkpoint-N -> why it is torn (None: complete), in step order."""
    from train.resume import checkpoint_problem  # deferred: heavy; main() imports it before any timing

    found = [p for p in (out / "checkpoints").glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
    return {p.name: checkpoint_problem(p) for p in sorted(found, key=lambda p: int(p.name.split("-")[1]))}


def temporaries(out: Path) -> int:
    return len(list((out / "checkpoints").glob(".*.tmp-*"))) + len(list(out.parent.glob(f".{out.name}.tmp-*")))


def saving(out: Path, torn_at_start: set[str]) -> bool:
    """A checkpoint is being written (or rotated away) right now: the window in which a kill tears it. Torn
    checkpoints a previous kill left behind do not count until this launch rewrites them (through a temporary)."""
    if temporaries(out):
        return True
    return any(why is not None and name not in torn_at_start for name, why in checkpoints(out).items())


def progress(log: Path, steps: int) -> int | None:
    """The step the Trainer's progress bar ("k/<steps> [") last showed; None before training starts."""
    found = re.findall(rf"(\d+)/{steps} \[", log.read_text(errors="replace")) if log.is_file() else []
    return int(found[-1]) if found else None


def launch(cmd: list[str], log: Path, out: Path, mode: str, steps: int, step_seconds: float,
           rng: random.Random) -> Launch:
    """Run `cmd`; kill it per `mode` (random | save | none). Raises if it fails by itself."""
    started = time.monotonic()
    torn_at_start = {name for name, why in checkpoints(out).items() if why is not None}
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, env=environment())
    target, kill_at = None, None
    save_delay = rng.choice([0.0, rng.uniform(0.0, 0.1)])  # the save's first write, or later in it (optimizer, state)
    while proc.poll() is None:
        now, step = time.monotonic(), progress(log, steps)
        if mode == "random" and step is not None:
            # A random step still to come, then a random moment inside it (forward, optimizer, logging or saving).
            target = target if target is not None else rng.randint(step + 1, max(step + 1, steps))
            if kill_at is None and step >= target:
                kill_at = now + rng.uniform(0.0, step_seconds)
            if kill_at is not None and now >= kill_at:
                break
        if mode == "save" and kill_at is None and step is not None and saving(out, torn_at_start):
            kill_at = now + save_delay  # checked only once training started: stale temporaries are gone by then
        if mode == "save" and kill_at is not None and now >= kill_at:
            break
        time.sleep(POLL_S if mode == "save" else 0.01)
    killed = proc.poll() is None
    if killed:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    text = log.read_text(errors="replace")
    if not killed and proc.returncode != 0:
        raise SystemExit(f"launch failed by itself (exit {proc.returncode}); log {log}:\n{text[-3000:]}")
    resumed = re.search(r"(?<!not )resuming from (\S+)", text)
    resumed_from = Path(resumed.group(1)).name if resumed else None
    return Launch(mode, time.monotonic() - started, killed, resumed_from, checkpoints(out), temporaries(out))


def timed_reference(cmd: list[str], log: Path, steps: int) -> tuple[float, float]:
    """Run to completion; return (seconds to the first progress line, seconds of training after it)."""
    started = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, env=environment())
    first = None
    while proc.poll() is None:
        if first is None and progress(log, steps) is not None:
            first = time.monotonic() - started
        time.sleep(0.05)
    if proc.returncode != 0:
        raise SystemExit(f"reference run failed (exit {proc.returncode}); log {log}:\n{log.read_text()[-3000:]}")
    total = time.monotonic() - started
    return first or total, total - (first or total)


def compare(reference: Path, resumed: Path) -> tuple[float, bool]:
    from safetensors.torch import load_file

    a, b = load_file(reference / "drafter.safetensors"), load_file(resumed / "drafter.safetensors")
    if a.keys() != b.keys():
        raise SystemExit(f"different tensors: {sorted(a.keys() ^ b.keys())}")
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    return diff, all(a[k].equal(b[k]) for k in a)


def losses(out: Path, steps: int) -> list[float]:
    state = json.loads((out / "checkpoints" / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    return [e["loss"] for e in state["log_history"] if "loss" in e]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=6, help="SIGKILLs to deliver before letting the run finish")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="training seed; also seeds the kill moments")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)
    if args.steps % args.save_steps:
        parser.error("--steps must be a multiple of --save-steps (the last checkpoint is compared)")

    work = args.workdir or Path(tempfile.mkdtemp(prefix="draftsmith-fault-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    model, data = prepare(work, args.seed)
    import train.task  # noqa: F401  # deferred: heavy; imported now so that it does not delay a launch's kill
    reference, faulty = work / "reference", work / "faulty"
    cmd = command(model, data, reference, args, resume=False)
    startup, train_seconds = timed_reference(cmd, work / "reference.log", args.steps)
    print(f"reference: {args.steps} steps, startup {startup:.1f}s, training {train_seconds:.1f}s", flush=True)

    launches: list[Launch] = []
    while True:
        mode = ("random", "save")[len(launches) % 2] if len(launches) < args.kills else "none"
        cmd = command(model, data, faulty, args, resume=True)
        step_seconds = train_seconds / args.steps
        result = launch(cmd, work / f"launch-{len(launches)}.log", faulty, mode, args.steps, step_seconds, rng)
        launches.append(result)
        what = "KILLED" if result.killed else "finished"
        print(f"launch {len(launches)}: kill mode {mode:6} {what} after {result.seconds:5.1f}s; resumed from "
              f"{result.resumed_from or 'scratch'}; on disk: {result.on_disk()}", flush=True)
        if not result.killed and (faulty / "config.json").is_file():
            break

    diff, identical = compare(reference, faulty)
    same_losses = losses(reference, args.steps) == losses(faulty, args.steps)
    torn = sum(any(why is not None for why in r.checkpoints.values()) or r.temporaries > 0 for r in launches if r.killed)
    # Each launch resumed from a checkpoint that the previous launch had left complete (never a torn one).
    sound = all(later.resumed_from is None or earlier.checkpoints.get(later.resumed_from, "absent") is None
                for earlier, later in zip(launches, launches[1:]))
    leftovers = list((faulty / "checkpoints").glob(".*.tmp-*"))
    print("\nfault injection report")
    print(f"  kills: {sum(r.killed for r in launches)} ({sum(r.killed and r.mode == 'save' for r in launches)} during a "
          f"save), launches: {len(launches)}, resumes from a checkpoint: {sum(bool(r.resumed_from) for r in launches)}")
    print(f"  kills that left a torn checkpoint or a temporary folder: {torn}; every resume used a complete one: {sound}")
    print(f"  leftover temporary folders after the final run: {len(leftovers)}")
    print(f"  per-step loss log equal to the uninterrupted run's: {same_losses}")
    print(f"  final heads: max |diff| = {diff:.3g}; bit-identical: {identical}")
    if not args.keep and args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"  work folder: {work}")
    return 0 if identical and same_losses and sound else 1


if __name__ == "__main__":
    raise SystemExit(main())
