"""Train Medusa-1 heads with FasterDecoding's own trainer (PyPI `medusa-llm` 0.1, medusa/train/train.py) on the
same tokens and loss masks as our medusa1 trainer, and serve them in our engine.

    python scripts/peer_medusa_train.py convert --cache features/smollm2-self --model builtin:smollm2 \
        --out outputs/peers/smollm2-medusa [--epochs 1] [--lr 1e-3] [--heads 3] [--batch-size 8]
        writes <out>/rows.pt (the cache's train split: input_ids, and labels = input_ids where the cache's loss mask
        is set, else -100) and prints the commands that train the heads in medusa-llm's venv, import them
        (`python -m models.convert medusa-import`) and bench them beside ours.
    $DRAFTSMITH_PEERS/medusa-venv/bin/python scripts/peer_medusa_train.py train --rows <out>/rows.pt \
        --model DIR --out DIR --lr 1e-3 --epochs 1 [--heads 3] [--batch-size 8] [--threads 2]
        runs in medusa-llm's venv and imports nothing from draftsmith: the package's MedusaModel (a ResBlock and a
        full-vocabulary linear per head, initialised from lm_head) and CustomizedTrainer (per-head hard-label CE,
        heads weighted equally) with its README's schedule (cosine, warmup ratio 0.1, weight decay 0, bf16 weights).

What differs from `python medusa/train/train.py` and why (printed by `train`):
    data        its `preprocess` formats ShareGPT with FastChat's Vicuna template and masks with LLaMA-tokenizer
                offsets; the rows here are already tokenized with the target's own chat template and our loss
                mask, so both trainers see the same labels (its loss is unchanged)
    padding     each batch is right-padded to its longest row, not to model_max_length (padded labels are -100
                in both, so the loss is the same; only the wasted compute differs)
    tokenizer   MedusaModel loads the tokenizer of `base_model_name_or_path` (default lmsys/vicuna-7b-v1.3, a hub
                download); it is given the target's folder as transformers 4.34 reads it (scripts/peer_medusa.py
                prepare_base)

Venv (once): python -m venv $DRAFTSMITH_PEERS/medusa-venv && $DRAFTSMITH_PEERS/medusa-venv/bin/pip install
    torch==2.13.0 medusa-llm==0.1 transformers==4.34.1 accelerate==0.24.1 fschat==0.2.36 sentencepiece protobuf
Errors print one line naming the file or option and exit with status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(os.environ.get("DRAFTSMITH_PEERS") or Path.home() / ".cache" / "draftsmith" / "peers")
IGNORE = -100


class Refused(Exception):
    """Bad input: one line, exit status 2."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/peer_medusa_train.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="a feature cache -> rows medusa-llm's trainer reads, and the commands")
    c.add_argument("--cache", required=True, help="a complete `python -m train features` folder")
    c.add_argument("--model", required=True, help="the target the cache was made with (builtin:smollm2, a folder)")
    c.add_argument("--out", required=True)
    for q in (c, t := sub.add_parser("train", help="(medusa-llm's venv) train heads on rows.pt")):
        q.add_argument("--epochs", type=float, default=1.0)
        q.add_argument("--lr", type=float, default=1e-3, help="medusa-llm's README: 1e-3")
        q.add_argument("--heads", type=int, default=3)
        q.add_argument("--batch-size", type=int, default=8)
    c.add_argument("--medusa-python", default=str(PEERS / "medusa-venv" / "bin" / "python"))
    t.add_argument("--rows", required=True)
    t.add_argument("--model", required=True, help="the target's folder")
    t.add_argument("--out", required=True, help="writes medusa_lm_head.pt and config.json (MedusaConfig) here")
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--seed", type=int, default=0)
    return p


def convert(args: argparse.Namespace) -> None:
    from data.features import FeatureDataset  # deferred: draftsmith is importable only in our environment, not
    from models.refs import locate  # deferred: in medusa-llm's venv, where `train` runs
    from train.peer_formats import check_cache_for_peers  # deferred: as above

    check_cache_for_peers(args.cache)
    model_dir = locate(args.model)
    out = Path(args.out)
    rows = [{"input_ids": ids.to(torch.int32), "labels": labels.to(torch.int32)}
            for ids, labels in FeatureDataset(args.cache, "train").ids_and_labels()]  # no features read
    out.mkdir(parents=True, exist_ok=True)
    torch.save(rows, out / "rows.pt")
    tokens = sum(int((r["labels"] != IGNORE).sum()) for r in rows)
    print(f"{out / 'rows.pt'}: {len(rows)} rows, {tokens} trained labels", file=sys.stderr)
    tag = f"lr{args.lr:g}"
    heads = out / f"medusa-llm-{tag}"
    py = sys.executable
    steps = [
        [args.medusa_python, "scripts/peer_medusa_train.py", "train", "--rows", str(out / "rows.pt"), "--model",
         str(model_dir), "--out", str(heads), "--lr", f"{args.lr:g}", "--epochs", f"{args.epochs:g}",
         "--heads", str(args.heads), "--batch-size", str(args.batch_size)],
        [py, "-m", "models.convert", "medusa-import", str(heads), str(out / f"{heads.name}-draft"),
         "--base-model", str(model_dir)],
    ]
    for step in steps:
        print(shlex.join(step))


def train(args: argparse.Namespace) -> None:
    import transformers  # medusa-llm's venv: its transformers 4.34, not ours
    from medusa.model.medusa_model import MedusaConfig, MedusaModel
    from medusa.train.train import CustomizedTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_medusa import prepare_base  # noqa: E402  (standalone, imports nothing from draftsmith)

    rows_path, model_dir, out = Path(args.rows), Path(args.model), Path(args.out)
    if not rows_path.is_file():
        raise Refused(f"--rows {rows_path}: not a file (write it with `convert`)")
    if not (model_dir / "config.json").is_file():
        raise Refused(f"--model {model_dir}: no config.json")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    base = out / "base"
    prepare_base(model_dir, base)
    rows = torch.load(rows_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), torch_dtype=torch.bfloat16)
    model.config.use_cache = False
    for p in model.base_model.parameters():
        p.requires_grad = False
    medusa = MedusaModel(model, medusa_num_heads=args.heads, medusa_num_layers=1, base_model_name_or_path=str(base))
    training = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, weight_decay=0.0, warmup_ratio=0.1, lr_scheduler_type="cosine", bf16=True,
        logging_steps=10, save_strategy="no", report_to=[], seed=args.seed, use_cpu=True,
        dataloader_num_workers=0, remove_unused_columns=False)
    trainer = CustomizedTrainer(model=medusa, args=training, train_dataset=rows, data_collator=pad_right)
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    out.mkdir(parents=True, exist_ok=True)
    torch.save(medusa.medusa_head.state_dict(), out / "medusa_lm_head.pt")
    MedusaConfig(medusa_num_heads=args.heads, medusa_num_layers=1,
                 base_model_name_or_path=str(model_dir)).save_pretrained(str(out))
    tokens = sum(len(r["input_ids"]) for r in rows) * args.epochs
    summary = {"seconds": round(seconds, 1), "train_tokens_per_second": round(tokens / seconds, 1), "lr": args.lr,
               "epochs": args.epochs, "heads": args.heads, "batch_size": args.batch_size,
               "changed": ["data: pre-tokenized rows (the target's chat template, our loss mask), not FastChat's "
                           "Vicuna preprocess", "padding: per batch, not to model_max_length",
                           f"tokenizer: MedusaModel given {base}"]}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


def pad_right(batch: list[dict]) -> dict[str, torch.Tensor]:
    """input_ids / labels / attention_mask [B, T], right-padded to the longest row (pad id 0, label -100)."""
    width = max(len(r["input_ids"]) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, r in enumerate(batch):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = r["input_ids"].long(), r["labels"].long(), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "train":
        try:
            train(args)
        except Refused as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from data.errors import UsageError  # deferred: draftsmith is importable only in our environment

    try:
        convert(args)
    except UsageError as e:  # a cache, model or option that cannot serve (feature cache, model refs: one line each)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
