"""The Jacobi-trajectory collector for CLLM: the target's block-Jacobi iterations on a data config's prompts, written
in data.jacobi's JSONL format. Its twin, the self-distillation collector, is inference.collect.self_distill.

    python -m data.jacobi --model tiny --output traj.jsonl [--data default] [--block-size 16] [data.path=... ...]
    (also `python scripts/collect_jacobi.py ...`)

Resumable: ids already in the output are skipped. Dimension letters: B batch, T time, N block size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from tqdm.auto import tqdm

from data.collate import left_pad
from data.config import load_data_config
from data.errors import UsageError
from data.jacobi import PromptSample, done_ids, prompt_samples, trajectory_record
from inference.drafters.jacobi import INITS, JacobiOptions, jacobi_blocks
from models.backbone import eos_token_ids
from models.loading import load_target, load_tokenizer
from models.refs import model_settings


def collect(model: Any, samples: Sequence[PromptSample], output: Path, options: Any, num_blocks: int,
            batch_size: int = 8, pad_token_id: int = 0, eos_token_ids: tuple[int, ...] = (), max_repeat: int = 16,
            progress: bool = True) -> int:
    """Record block-Jacobi trajectories (inference.drafters.jacobi.jacobi_blocks) of every sample not yet in `output`,
    `batch_size` prompts per batch (left-padded); appends one line per prompt. Returns the records written."""
    done = done_ids(output)
    todo = [s for s in samples if s.id not in done]
    device = model.get_input_embeddings().weight.device
    written = 0
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "a") as f, tqdm(total=len(samples), initial=len(samples) - len(todo), desc="jacobi",
                                      unit="prompt", disable=not progress) as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            ids, mask = left_pad([s.prompt_ids for s in batch], pad_token_id)  # [B, T] each

            def show(j: int, iterations: int) -> None:  # one line per block: a batch takes minutes on a CPU
                bar.set_postfix_str(f"batch block {j + 1}/{num_blocks}: {iterations} iterations", refresh=True)

            trajectories = jacobi_blocks(model, ids.to(device), mask.to(device), options, num_blocks, pad_token_id,
                                         eos_token_ids, on_block=show)
            for sample, row in zip(batch, trajectories):
                blocks = [block.states for block in row]
                record = trajectory_record(sample, blocks, options.block_size, options.init, max_repeat)
                f.write(json.dumps(record) + "\n")
                written += 1
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
    return written


def data_overrides(overrides: Sequence[str]) -> list[str]:
    """`data.key=value` command-line words -> `key=value` overrides of the data config."""
    for o in overrides:
        if not o.startswith("data.") or "=" not in o:
            raise UsageError(f"{o!r}: overrides look like data.<key>=<value>")
    return [o[len("data."):] for o in overrides]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.jacobi", description=__doc__.split("\n\n")[0])
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
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="data.key=value")
    args = parser.parse_args(argv)
    try:
        options = JacobiOptions(block_size=args.block_size, init=args.init, seed=args.seed)
        cfg = load_data_config(args.data, data_overrides(args.overrides))
        path = model_settings(args.model).ref
        tokenizer = load_tokenizer(path, cfg.chat_template)
        samples = prompt_samples(cfg, tokenizer, args.split, args.max_prompts)
        model = load_target(path, dtype=args.dtype)
        written = collect(model, samples, args.output, options, -(-args.max_new_tokens // args.block_size),
                          args.batch_size, tokenizer.pad_token_id or 0, eos_token_ids(model), args.max_repeat)
    except (ValueError, OSError) as e:  # UsageErrors (data, model, config) are ValueErrors
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    print(f"{written} new records -> {args.output}")
    return 0
