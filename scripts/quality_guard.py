"""Does a fine-tuned target (a Medusa-2 or CLLM checkpoint) still do its own job? One run, held-out ground truth.

Prints, for the original base model and the checkpoint's fine-tuned backbone on the same validation chats of a data
config: next-token loss / perplexity on the reference answers, and greedy agreement (teacher-forced along the
original's greedy continuations of the validation prompts, the share of positions where both argmaxes agree).

    python scripts/quality_guard.py outputs/cllm/tiny                       # default data: stdlib chats, validation
    python scripts/quality_guard.py outputs/medusa2/vicuna7b --data sharegpt data.path=chats.json --prompts 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_module  # noqa: E402

from data.collate import ChatCollator  # noqa: E402
from data.datasets import build_datasets  # noqa: E402
from models.checkpoint import load_drafter_target, read_drafter_config  # noqa: E402
from models.loading import load_target, load_tokenizer  # noqa: E402
from models.refs import model_settings  # noqa: E402
from train.config import register_configs  # noqa: E402
from train.prompts import prompt_ids  # noqa: E402
from train.quality_guard import greedy_agreement, greedy_reference, lm_quality  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a draftsmith checkpoint that carries a fine-tuned backbone")
    parser.add_argument("--data", default="default", help="conf/data name; override keys as data.key=value")
    parser.add_argument("--prompts", type=int, default=48, help="validation prompts for greedy agreement")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, default=None, help="at most this many validation batches")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 on a shared machine)")
    parser.add_argument("overrides", nargs="*", help="data.key=value")
    args = parser.parse_intermixed_args()  # data.key=value may come after the options
    torch.set_num_threads(args.threads)

    config = read_drafter_config(args.checkpoint)
    if not config.get("backbone"):
        raise SystemExit(f"{args.checkpoint}: no fine-tuned backbone in this checkpoint (nothing to compare)")
    base = config["base_model_name_or_path"]
    settings = model_settings(base)
    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["+model=tiny", f"model.path={settings.path}",
                                                      f"data={args.data}", *args.overrides,
                                                      f"eval.greedy_prompts={args.prompts}"])
    tokenizer = load_tokenizer(settings.ref, cfg.data.chat_template)
    validation = build_datasets(cfg.data, tokenizer).validation
    if validation is None:
        raise SystemExit(f"data={args.data}: no validation split")
    collate = ChatCollator(tokenizer.pad_token_id)
    starts = range(0, len(validation), 8)[: args.batches]  # collate only the batches scored
    batches = [collate([validation[j] for j in range(i, min(i + 8, len(validation)))]) for i in starts]
    original = load_target(settings.ref, dtype=args.dtype)
    tuned = load_drafter_target(args.checkpoint, base, dtype=args.dtype)
    before, after = (lm_quality(model, tqdm(batches, desc=f"perplexity, {name}", unit="batch"))
                     for name, model in (("original", original), ("fine-tuned", tuned)))
    prompts = prompt_ids(cfg, tokenizer)
    print(f"greedy agreement: the original answers {len(prompts)} prompts ({args.new_tokens} tokens each), then the "
          f"fine-tuned model is scored along them", file=sys.stderr, flush=True)
    reference = greedy_reference(original, prompts, tokenizer, args.new_tokens, 8)
    hits, total = greedy_agreement(tuned, reference)
    print(f"{args.checkpoint} vs {base} on {before.tokens} validation answer tokens ({args.data})")
    print(f"  perplexity  original {before.perplexity:.3f}   fine-tuned {after.perplexity:.3f}   "
          f"({after.perplexity / before.perplexity - 1:+.2%})")
    print(f"  greedy agreement with the original: {hits / max(total, 1):.3f} over {total} positions")


if __name__ == "__main__":
    main()
