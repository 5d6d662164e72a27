"""Training step time against the process count and the DeepSpeed stage, measured in one run.

Runs `python -m train medusa1` once per setup with the same global batch and prints seconds per optimizer step
(HF Trainer's train_runtime / steps, so process start and model loading are excluded) and the ratio to the
one-process run. On a GPU node --nproc is the GPU count; on a CPU machine the processes talk over gloo.

    python scripts/bench_distributed.py --model builtin:tiny [--nproc 2] [--steps 40] [--global-batch 8]
    python scripts/bench_distributed.py --model lmsys/vicuna-7b-v1.3 --dtype bf16 --nproc 8 --global-batch 64 --bf16
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = re.compile(r"'train_runtime': '?([0-9.]+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seconds_per_step(args, nproc: int, deepspeed: str, out: Path) -> float:
    launcher = [sys.executable, "-m", "train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
        "-m", "train"]
    cmd = [*launcher, "medusa1", "+model=tiny", f"model.path={args.model}", f"model.dtype={args.dtype}", "data.self_distill=false",
           f"training.max_steps={args.steps}", f"training.per_device_train_batch_size={args.global_batch // nproc}",
           f"training.save_steps={args.steps * 10}", f"training.bf16={str(args.bf16).lower()}", "eval.greedy_prompts=0",
           "data.validation_fraction=0", "logger=none", f"deepspeed={deepspeed}", f"output_dir={out}", *args.overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    found = RUNTIME.findall(result.stdout + result.stderr)
    if result.returncode != 0 or not found:
        sys.exit(f"{' '.join(cmd)} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    return float(found[-1]) / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--bf16", action="store_true", help="training.bf16=true")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("overrides", nargs="*", help="extra `python -m train` overrides, e.g. data=sharegpt data.path=...")
    args = parser.parse_args()
    if args.global_batch % args.nproc:
        sys.exit(f"--global-batch {args.global_batch} is not divisible by --nproc {args.nproc}")
    setups = [(1, "none"), (args.nproc, "none"), (args.nproc, "zero2"), (args.nproc, "zero3")]
    with tempfile.TemporaryDirectory() as tmp:
        times = {s: seconds_per_step(args, *s, Path(tmp) / f"{s[0]}-{s[1]}") for s in setups}
    base = times[setups[0]]
    print(f"{'processes':>9} {'deepspeed':>9} {'s/step':>9} {'vs 1 process':>13}   (global batch {args.global_batch})")
    for (nproc, ds), t in times.items():
        print(f"{nproc:>9} {ds:>9} {t:>9.4f} {t / base:>12.2f}x")


if __name__ == "__main__":
    main()
