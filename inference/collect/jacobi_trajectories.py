"""The Jacobi-trajectory collector for CLLM: the target's block-Jacobi iterations on a data config's prompts, written
in data.jacobi's JSONL format. Its twin, the self-distillation collector, is inference.collect.self_distill.

    python scripts/collect_jacobi.py --model tiny --output traj.jsonl [--data default] [--block-size 16] [data.path=...]
    torchrun --nproc_per_node 8 scripts/collect_jacobi.py --model vicuna7b --output traj.jsonl ...
    (also `python -m inference.collect.jacobi_trajectories ...`)

Runs on `--device` (default: the rank's GPU when CUDA is available, else the CPU) in `--dtype` (default: bf16 on a
GPU, fp32 on the CPU), `--batch-size` prompts at a time, longest first. Under a launcher (RANK / WORLD_SIZE) the ranks
share the prompts through files beside --output (inference.collect.shared): rank r writes `<stem>.rank{r:03d}.jsonl`,
and rank 0, once every prompt is there, merges them into --output in prompt order and removes them. Resumable under
any world size: prompts in --output or in any rank file are skipped. Dimension letters: B batch, T time, N block size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from data.collate import left_pad
from data.config import load_data_config
from data.errors import UsageError
from data.jacobi import PromptSample, prompt_samples, trajectory_record
from inference.collect.shared import (
    POLL_SECONDS, RankFiles, World, claim, merge, rank_device, share, wait_until_done)
from inference.drafters.jacobi import INITS, JacobiOptions, jacobi_blocks
from models.backbone import eos_token_ids
from models.builtin import DTYPES
from models.loading import check_device, load_target, load_tokenizer
from models.refs import model_settings


@dataclass(frozen=True)
class Collected:
    written: int  # records this rank wrote
    tokens: int  # answer tokens in them (the fixed points kept)
    seconds: float  # spent writing them (the model's forwards and the file)
    merged: int | None  # records rank 0 added to the output (None: another rank, which does not merge)


def rank_files(output: Path) -> RankFiles:
    """`<stem>.rank{NNN}.jsonl` beside `output`."""
    return RankFiles(output.parent, prefix=f"{output.stem}.")


def write_trajectories(model: Any, samples: Sequence[PromptSample], path: Path, options: JacobiOptions,
                       num_blocks: int, batch_size: int, pad_token_id: int, eos: tuple[int, ...], max_repeat: int,
                       progress: bool) -> tuple[int, int]:
    """Append the block-Jacobi trajectories (inference.drafters.jacobi.jacobi_blocks) of `samples` to `path`,
    `batch_size` prompts per left-padded batch, longest prompt first (a batch of about one length wastes little on
    padding). Returns (records, answer tokens) written."""
    order = sorted(samples, key=lambda s: -len(s.prompt_ids))
    device = model.get_input_embeddings().weight.device
    written = tokens = 0
    if not order:
        return 0, 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f, tqdm(total=len(order), desc="jacobi", unit="prompt", disable=not progress) as bar:
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            ids, mask = left_pad([s.prompt_ids for s in batch], pad_token_id)  # [B, T] each

            def show(j: int, iterations: int) -> None:  # one line per block: a batch takes minutes on a CPU
                bar.set_postfix_str(f"batch block {j + 1}/{num_blocks}: {iterations} iterations", refresh=True)

            trajectories = jacobi_blocks(model, ids.to(device), mask.to(device), options, num_blocks, pad_token_id,
                                         eos, on_block=show)
            for sample, row in zip(batch, trajectories):
                record = trajectory_record(sample, [block.states for block in row], options.block_size,
                                           options.init, max_repeat)
                f.write(json.dumps(record) + "\n")
                written += 1
                tokens += sum(len(block["states"][-1]) for block in record["blocks"])
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
    return written, tokens


def collect(model: Any, samples: Sequence[PromptSample], output: Path, options: JacobiOptions, num_blocks: int,
            batch_size: int = 8, pad_token_id: int = 0, eos_token_ids: tuple[int, ...] = (), max_repeat: int = 16,
            progress: bool = True, world: World = World(), poll: float = POLL_SECONDS) -> Collected:
    """This rank's share of the samples not yet collected (in `output` or a rank file beside it) into its rank file;
    rank 0 then waits for every rank's share (polling the files) and merges them into `output`."""
    files = rank_files(output)
    ids = [s.id for s in samples]
    done = claim(files, world, also=[output])
    mine = [samples[i] for i in share(ids, world, done)]
    start = time.perf_counter()
    written, tokens = write_trajectories(model, mine, files.records(world.rank), options, num_blocks, batch_size,
                                         pad_token_id, eos_token_ids, max_repeat, progress)
    seconds = time.perf_counter() - start
    if world.rank != 0:
        return Collected(written, tokens, seconds, None)
    wait_until_done(files, ids, also=[output], poll=poll)
    return Collected(written, tokens, seconds, merge(files, output, ids))


def data_overrides(overrides: Sequence[str]) -> list[str]:
    """`data.key=value` command-line words -> `key=value` overrides of the data config."""
    for o in overrides:
        if not o.startswith("data.") or "=" not in o:
            raise UsageError(f"{o!r}: overrides look like data.<key>=<value>")
    return [o[len("data."):] for o in overrides]


def placement(device: str | None, dtype: str | None) -> tuple[torch.device, str]:
    """(--device, --dtype) checked, with their defaults: bf16 on an accelerator, fp32 on the CPU. UsageError or
    ModelLoadError (one line) for a dtype or a device this machine does not have."""
    placed = check_device(device or rank_device())
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return placed, dtype or ("fp32" if placed.type == "cpu" else "bf16")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python scripts/collect_jacobi.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="conf/model name, model directory or builtin:<name>")
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--data", default="default", help="conf/data name; override keys as data.key=value")
    parser.add_argument("--split", default="train", choices=("train", "validation"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--init", default="random", choices=INITS)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="rounded up to whole blocks")
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-repeat", type=int, default=16, help="drop from a run this long of one token (0: off)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the rank's GPU, else cpu)")
    parser.add_argument("--dtype", default=None, help=f"{' | '.join(DTYPES)} (default: bf16 on a GPU, fp32 on cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="data.key=value")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        world = World.from_env()
        if args.batch_size < 1:
            raise UsageError(f"--batch-size {args.batch_size}: must be >= 1")
        device, dtype = placement(args.device, args.dtype)
        options = JacobiOptions(block_size=args.block_size, init=args.init, seed=args.seed)
        cfg = load_data_config(args.data, data_overrides(args.overrides))
        path = model_settings(args.model).ref
        tokenizer = load_tokenizer(path, cfg.chat_template)
        samples = prompt_samples(cfg, tokenizer, args.split, args.max_prompts)
        model = load_target(path, dtype=dtype).to(device)
        result = collect(model, samples, args.output, options, -(-args.max_new_tokens // args.block_size),
                         args.batch_size, tokenizer.pad_token_id or 0, eos_token_ids(model), args.max_repeat,
                         world=world)
    except (ValueError, OSError) as e:  # UsageErrors (data, model, config) and ModelLoadErrors are ValueErrors
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    per_second = result.tokens / max(result.seconds, 1e-9)
    rate = f"{result.tokens} answer tokens in {result.seconds:.1f} s ({per_second:.0f}/s)"
    if result.merged is None:
        print(f"rank {world.rank}: {result.written} new records -> {rank_files(args.output).records(world.rank)} "
              f"(rank 0 merges them into {args.output}); {rate}")
    else:
        print(f"{result.written} new records -> {args.output}"
              + (f" ({result.merged} merged from {world.size} ranks)" if world.size > 1 else "") + f"; {rate}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
