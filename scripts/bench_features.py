"""What a token of training data costs: the feature cache's teacher-forced pass against self-distillation's generation.

Both on the same conversations of a data recipe, with the same target, in one run, alternating rounds:
  features      train.features.forward_features over length-bucketed batches of whole conversations (what
                `python -m train features` runs per batch): tokens/s of conversation tokens
  self-distill  the engine's batched greedy generation of the first assistant turn (what data.self_distill runs,
                inference.collect.self_distill): tokens/s of generated tokens
The ratio is what makes a large cache cheap: a token of features costs 1/ratio of a generated one. --baselines
runs the same generation again without one of the engine's batch savings, and prints each one's ratio to the
engine as it serves:
  stock-cache   a stock transformers DynamicCache (concatenation each step) in place of the engine's slot cache
                (inference.engine.cache.SlotLayer)

    python scripts/bench_features.py --base smollm2 --data sharegpt_v3 [--dtype fp32] [--conversations 64]
    python scripts/bench_features.py --base smollm2 --dtype fp32 --batch-size 32 --baselines stock-cache
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.chat import encode_chat  # noqa: E402
from data.collate import ChatCollator  # noqa: E402
from data.config import load_data_config  # noqa: E402
from data.datasets import load_conversations  # noqa: E402
from data.errors import UsageError  # noqa: E402
from inference.api import Engine  # noqa: E402
from inference.collect.self_distill import SelfDistillConfig, self_distill  # noqa: E402
from inference.engine.drafter import NoDrafter  # noqa: E402
from inference.session import one_line  # noqa: E402
from models.loading import load_target, load_tokenizer  # noqa: E402
from models.refs import model_settings  # noqa: E402
from train.features import LayerTaps, forward_features, plan_shards  # noqa: E402


BASELINES = {"stock-cache": {"slot_cache": False}}  # name -> the Engine settings it changes


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="smollm2", help="conf/model name, builtin:<name>, directory or hub id")
    parser.add_argument("--data", default="sharegpt_v3", help="conf/data recipe")
    parser.add_argument("--dtype", default=None, help="bf16 | fp32 (default: the model config's)")
    parser.add_argument("--conversations", type=int, default=48, help="conversations per method and round")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="features: padded tokens per forward")
    parser.add_argument("--max-length", type=int, default=1024, help="features: tokens per conversation (cut)")
    parser.add_argument("--topk", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=128, help="self-distill: tokens per answer")
    parser.add_argument("--batch-size", type=int, default=16, help="self-distill: answers per batch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baselines", default="",
                        help=f"comma list of {', '.join(BASELINES)}: self-distill again without that saving")
    args = parser.parse_args(argv)
    for flag in ("conversations", "batch_tokens", "max_length", "new_tokens", "batch_size", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    args.baselines = [name for name in args.baselines.split(",") if name]
    unknown = [name for name in args.baselines if name not in BASELINES]
    if unknown:
        parser.error(f"--baselines: unknown {', '.join(unknown)} (known: {', '.join(BASELINES)})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:  # a bad model, recipe or count: one line before the model loads
        settings = model_settings(args.base)
        dtype = args.dtype or settings.dtype or "fp32"
        data = load_data_config(args.data, {"max_length": args.max_length, "self_distill": False})
        tokenizer = load_tokenizer(settings.ref, settings.chat_template)
        conversations = load_conversations(data, "train")[: args.conversations * args.rounds]
        if len(conversations) < args.conversations * args.rounds:
            raise UsageError(f"--data {args.data} has {len(conversations)} train conversations; "
                             f"--conversations x --rounds needs {args.conversations * args.rounds}")
        encoded = [encode_chat(tokenizer, c, args.max_length, settings.chat_template) for c in conversations]
        target = load_target(settings.ref, dtype=dtype)
    except ValueError as err:  # UsageError and the model, data and template errors derived from it
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    train = [{"input_ids": e.input_ids, "labels": e.labels} for e in encoded]
    print(f"{args.base} ({dtype}), {torch.get_num_threads()} threads; {args.conversations} conversations a round",
          file=sys.stderr, flush=True)
    taps = LayerTaps(target, [])
    collate = ChatCollator(tokenizer.pad_token_id)
    engines = {"self-distill": Engine(target, NoDrafter())}
    for name in args.baselines:
        engines[f"self-distill, {name}"] = Engine(target, NoDrafter(), **BASELINES[name])
    rates: dict[str, list[float]] = {"features": [], **{name: [] for name in engines}}
    config = SelfDistillConfig(max_new_tokens=args.new_tokens, batch_size=args.batch_size, max_turns=1,
                               chat_template=settings.chat_template)
    for r in range(args.rounds):
        pick = range(r * args.conversations, (r + 1) * args.conversations)
        samples = [train[i] for i in pick]
        plan = plan_shards("train", [len(s["input_ids"]) for s in samples], args.batch_tokens, sys.maxsize)[0]
        start, tokens = time.perf_counter(), 0
        for batch in plan.batches:
            forward_features(target, collate([samples[i] for i in batch.samples]), taps, args.topk)
            tokens += batch.tokens
        rates["features"].append(tokens / (time.perf_counter() - start))
        report = f"round {r + 1}: features {rates['features'][-1]:,.0f} tok/s ({tokens:,} tokens)"
        for name, engine in list(engines.items())[:: 1 if r % 2 == 0 else -1]:  # alternating which goes first
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "answers.jsonl"
                start = time.perf_counter()
                stats = self_distill(engine, tokenizer, [(f"c{i}", conversations[i]) for i in pick], out, config)
                seconds = time.perf_counter() - start
                generated = sum(len(tokenizer(line).input_ids) for line in _answers(out))
            rates[name].append(generated / seconds)
            report += f", {name} {rates[name][-1]:,.1f} tok/s ({generated:,} tokens, {stats.written} answers)"
        print(report, file=sys.stderr, flush=True)
    f, g = statistics.median(rates["features"]), statistics.median(rates["self-distill"])
    print(f"features {f:,.0f} tok/s, self-distill {g:,.1f} tok/s (medians of {args.rounds}): a cached token costs "
          f"1/{f / g:.1f} of a generated one")
    for name in args.baselines:
        rate = statistics.median(rates[f"self-distill, {name}"])
        print(f"self-distill, {name}: {rate:,.1f} tok/s; the engine as it serves generates {g / rate:.2f}x as fast "
              f"(batches of {args.batch_size})")
    return 0


def _answers(path: Path) -> list[str]:
    import json

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["conversations"][-1]["value"] for row in rows]


if __name__ == "__main__":
    raise SystemExit(main())
