"""Checkpoint conversion commands.

    python -m models.convert medusa-import SRC DST [--num-heads N] [--vocab-size V] [--base-model NAME]
        original FasterDecoding/Medusa heads (medusa_lm_head.safetensors or .pt + config.json) -> draftsmith checkpoint
    python -m models.convert vllm-export SRC DST [--base-model NAME]
        draftsmith (or original-Medusa) checkpoint -> vLLM's Medusa layout (config.json + model.safetensors)
    python -m models.convert eagle3-export SRC DST
        draftsmith eagle3 checkpoint -> the LlamaForCausalLMEagle3 folder vLLM, SGLang and SpecForge load
    python -m models.convert eagle3-import SRC DST [--base MODEL]
        such a folder (e.g. trained by SpecForge) -> draftsmith eagle3 checkpoint; MODEL is the target (its depth, and
        a check of vocab_size / hidden_size), needed unless SRC was exported by draftsmith

Errors print one line naming the file or option and exit with status 2; nothing is left half-written.
"""

from __future__ import annotations

import argparse
import sys

from models.eagle3_interop import export_eagle3, import_eagle3
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
    e3x = sub.add_parser("eagle3-export", help="draftsmith eagle3 checkpoint -> vLLM / SGLang / SpecForge layout")
    e3x.add_argument("src", help="draftsmith eagle3 checkpoint directory")
    e3x.add_argument("dst", help="output directory (config.json + model.safetensors)")
    e3i = sub.add_parser("eagle3-import", help="vLLM / SGLang / SpecForge EAGLE-3 draft -> draftsmith checkpoint")
    e3i.add_argument("src", help="directory with config.json (LlamaForCausalLMEagle3) and model.safetensors")
    e3i.add_argument("dst", help="output draftsmith checkpoint directory")
    e3i.add_argument("--base", "--base-model", dest="base",
                     help="the target model (folder or hub id, read offline): its depth, vocab_size and hidden_size")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "medusa-import":
            out = convert_medusa(args.src, args.dst, args.num_heads, args.vocab_size, args.base_model)
        elif args.command == "vllm-export":
            out = export_vllm(args.src, args.dst, args.base_model)
        elif args.command == "eagle3-export":
            out = export_eagle3(args.src, args.dst)
        else:
            out = import_eagle3(args.src, args.dst, args.base)
    except (ValueError, OSError) as e:  # CheckpointError, DrafterMismatchError, ModelLoadError, Eagle3ConfigError
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
