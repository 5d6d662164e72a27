"""Predicted peak training memory per GPU (train/memory_model.py), the largest batch that fits, measured peaks.

    python scripts/train_memory.py --target vicuna7b --batch 4 --seq 2048 --ttt-steps 7 --method eagle3
    python scripts/train_memory.py --target path/to/config.json --batch 8 --seq 2048 --ttt-steps 5 --method medusa1
    python scripts/train_memory.py --fit                       # largest batch at T = 2,048 on 40 / 80 / 141 GB GPUs
    python scripts/train_memory.py --measure --shape hidden=512,layers=4,heads=8,intermediate=1408,vocab=8192 \
        --method medusa1,eagle3 --batch 2 --seq 512,1024 --ttt-steps 3,7 --dtype fp32     # measured vs predicted

--batch, --seq, --ttt-steps and --method take comma lists: one prediction (or measurement) per combination.
--ttt-steps is K: Medusa's heads, EAGLE-3's unrolled steps (CLLM ignores it). Bad input ends with one line naming
the file, model or option, and exit status 2, before any model is built.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.memory_model import (  # noqa: E402
    DTYPE_BYTES, FIT_GPUS_GIB, FIT_SEQ, GIB, HEADROOM, METHODS, MemoryModelError, Shape, TrainSetup, fit_table,
    parse_shape_spec, predict, resolve_shape)


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="config.json (or its folder) or a model name (vicuna7b, llama3_1_8b, ...)")
    p.add_argument("--shape",
                   help="instead of --target: hidden=,layers=,heads=,intermediate=,vocab=[,kv_heads=,tied=]")
    p.add_argument("--method", default="medusa1", help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--batch", default="1", help="rows per GPU (comma list)")
    p.add_argument("--seq", default=str(FIT_SEQ), help="tokens per row (comma list)")
    p.add_argument("--ttt-steps", default="5", help="K: Medusa heads / EAGLE-3 TTT steps (comma list)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES), help="the target's weights (model.dtype)")
    p.add_argument("--no-autocast", action="store_true",
                   help="training.bf16=false (fp32 activations in the trained modules)")
    p.add_argument("--features", default="online", choices=("online", "cache"), help="eagle3: data.features or not")
    p.add_argument("--teacher", default="topk", choices=("topk", "full", "none"), help="eagle3: method.teacher "
                   "(none: method.soft_labels=0)")
    p.add_argument("--draft-vocab", type=int, help="method.draft_vocab (eagle3 default: min(32000, V))")
    p.add_argument("--share-lm-head", action="store_true", help="medusa1: method.share_lm_head=true")
    p.add_argument("--backbone", default="lora", choices=("lora", "full"), help="cllm: method.backbone")
    p.add_argument("--lora-r", type=int, default=32, help="cllm: method.lora_r")
    p.add_argument("--ar-loss", default="ce", choices=("ce", "kl"), help="cllm: method.ar_loss")
    p.add_argument("--packing", action="store_true", help="cllm: method.packing=true")
    p.add_argument("--fp32-master", action="store_true", help="an fp32 master copy of the trained weights (DeepSpeed)")
    p.add_argument("--fit", action="store_true", help="the largest batch per GPU size (medusa1 K=5, eagle3 K=7)")
    p.add_argument("--measure", action="store_true", help="run real steps of a random Llama and measure the peak")
    p.add_argument("--device", default="cpu", help="with --measure: cpu or cuda")
    p.error = fail  # one line, exit status 2
    return p.parse_args(argv)


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        fail(f"{flag} {text!r}: a comma list of integers")
    if not values or any(v < 1 for v in values):
        fail(f"{flag} {text!r}: every value must be a positive integer")
    return values


def parse_shape(text: str) -> Shape:
    try:
        return parse_shape_spec(text)
    except MemoryModelError as err:
        fail(str(err))


def setups(args: argparse.Namespace) -> list[TrainSetup]:
    methods = [m for m in args.method.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        fail(f"--method {args.method!r}: a comma list of {', '.join(METHODS)}")
    combos = itertools.product(methods, int_list(args.batch, "--batch"), int_list(args.seq, "--seq"),
                               int_list(args.ttt_steps, "--ttt-steps"))
    common = dict(target_bytes=DTYPE_BYTES[args.dtype], autocast=not args.no_autocast, fp32_master=args.fp32_master,
                  share_lm_head=args.share_lm_head, teacher=args.teacher, draft_vocab=args.draft_vocab,
                  features=args.features, backbone=args.backbone, lora_r=args.lora_r, ar_loss=args.ar_loss,
                  packing=args.packing)
    try:
        return [TrainSetup(method=m, batch=b, seq=t, steps=k, **common) for m, b, t, k in combos]
    except MemoryModelError as e:
        fail(str(e))


def gib(n: int) -> str:
    return f"{n / GIB:8.2f} GiB"


def print_prediction(shape: Shape, setup: TrainSetup) -> None:
    b = predict(shape, setup)
    print(f"{shape.name}: {setup.method}, B={setup.batch}, T={setup.seq}, K={setup.steps}, target "
          f"{shape.params() / 1e9:.2f}B params; trained {b.trained_params / 1e6:.1f}M params")
    for name, value in b.rows():
        print(f"  {name:18}{gib(value)}")
    print(f"  {'peak':18}{gib(b.peak)}   (at the {b.peak_phase}; fits a GPU with {b.peak / HEADROOM / GIB:.1f} GiB at "
          f"{HEADROOM:.0%} usable)")


def print_fit() -> None:
    labels = list(FIT_GPUS_GIB)
    print(f"largest batch per GPU at T = {FIT_SEQ:,} (bf16 target, training.bf16 autocast, {HEADROOM:.0%} of memory)")
    print(f"{'target':14}{'method':16}" + "".join(f"{label:>8}" for label in labels))
    for row in fit_table():
        method = f"{row.method} K={row.steps}"
        print(f"{row.target:14}{method:16}" + "".join(f"{row.largest_batch[label]:8d}" for label in labels))


def run_measure(shape: Shape, plan: list[TrainSetup], device: str) -> None:
    from train.memory_measure import MEASURED_METHODS, measure  # deferred: imports torch and the trainers

    bad = [s.method for s in plan if s.method not in MEASURED_METHODS]
    if bad:
        fail(f"--measure: {bad[0]} is not measured (one of {', '.join(MEASURED_METHODS)})")
    print(f"{shape.name}: {shape.params() / 1e9:.2f}B params; bytes above the loaded model at the peak of 2 steps on "
          f"{device}")
    print(f"{'method':9}{'B':>3}{'T':>6}{'K':>3}{'measured':>14}{'predicted':>14}{'error':>8}{'seconds':>9}")
    for setup in plan:
        m = measure(shape, setup, device)
        k = "-" if setup.method == "cllm" else setup.steps  # CLLM has no heads or TTT steps
        print(f"{setup.method:9}{setup.batch:3d}{setup.seq:6d}{k:>3}{gib(m.measured):>14}"
              f"{gib(m.predicted):>14}{m.error:+8.1%}{m.seconds:9.1f}", flush=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.fit:
        print_fit()
        return 0
    if (args.target is None) == (args.shape is None):
        fail("give one of --target (a config.json or model name) or --shape")
    if args.shape is not None:
        shape = parse_shape(args.shape)
    else:
        try:
            shape = resolve_shape(args.target, ROOT / "conf" / "model")
        except MemoryModelError as e:
            fail(str(e))
    plan = setups(args)
    if not args.measure:
        for setup in plan:
            print_prediction(shape, setup)
        return 0
    if args.device.split(":")[0] not in ("cpu", "cuda"):
        fail(f"--device {args.device}: cpu or cuda[:N]")
    if args.device == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # see train/memory_measure.py
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    run_measure(shape, plan, args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
