"""Checkpoint conversion commands.

    python -m models.convert medusa-import SRC DST [--num-heads N] [--vocab-size V] [--base-model NAME]
        original FasterDecoding/Medusa heads (medusa_lm_head.safetensors or .pt + config.json) -> draftsmith checkpoint
    python -m models.convert vllm-export SRC DST [--base-model NAME]
        draftsmith (or original-Medusa) checkpoint -> vLLM's Medusa layout (config.json + model.safetensors)

Errors print one line naming the file or option and exit with status 2; nothing is left half-written.
"""

from __future__ import annotations

import argparse
import sys

from models.interop import convert_medusa, export_vllm


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m models.convert", description="Convert drafter checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("medusa-import", help="original Medusa heads -> draftsmith checkpoint")
    imp.add_argument("src", help="directory with medusa_lm_head.safetensors or medusa_lm_head.pt")
    imp.add_argument("dst", help="output draftsmith checkpoint directory")
    imp.add_argument("--num-heads", type=int, help="keep the first N heads (when config.json disagrees with the weights)")
    imp.add_argument("--vocab-size", type=int, help="vocabulary size, for heads that reuse the base lm_head")
    imp.add_argument("--base-model", help="base model name or path (overrides config.json's base_model_name_or_path)")
    exp = sub.add_parser("vllm-export", help="draftsmith checkpoint -> vLLM Medusa layout")
    exp.add_argument("src", help="draftsmith or original-Medusa checkpoint directory")
    exp.add_argument("dst", help="output directory for vLLM")
    exp.add_argument("--base-model", help="base model to read the shared lm_head from (heads that reuse it)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "medusa-import":
            out = convert_medusa(args.src, args.dst, args.num_heads, args.vocab_size, args.base_model)
        else:
            out = export_vllm(args.src, args.dst, args.base_model)
    except (ValueError, OSError) as e:  # CheckpointError, DrafterMismatchError, ModelLoadError are ValueErrors
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
