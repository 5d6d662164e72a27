"""Build (or rebuild) the built-in tiny models into the draftsmith cache and print how good they are.

    python scripts/build_tiny_models.py [--only tiny|tiny-draft] [--force] [--cache-dir D]

Without --force a model that is already built is only reported. --force rebuilds the selected models; the shared
tokenizer is retrained too only when every model is rebuilt (without --only), since both models depend on it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.tiny import BUILTIN_MODELS, models_dir  # noqa: E402
from train.tiny_build import TOKENIZER_DIR, ensure_built, ensure_tokenizer, load_build_info  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=BUILTIN_MODELS, help="build just this model")
    parser.add_argument("--force", action="store_true", help="rebuild even if already built")
    parser.add_argument("--cache-dir", type=Path, help="cache root (default: $DRAFTSMITH_CACHE or the user cache dir)")
    args = parser.parse_args(argv)
    names = (args.only,) if args.only else BUILTIN_MODELS
    start = time.perf_counter()
    if args.force and args.only is None:
        ensure_tokenizer(models_dir(args.cache_dir) / TOKENIZER_DIR, force=True)
    for name in names:
        path = ensure_built(name, progress=True, cache_dir=args.cache_dir, force=args.force)
        info = load_build_info(path)
        print(f"{name}: {path}")
        print(f"  params {info.params:,}  steps {info.pretrain_steps}+{info.sft_steps}  tokens {info.tokens_seen:,}"
              f"  train {info.seconds:.0f}s wall, {info.tokens_per_second} tok/s")
        print(f"  corpus val loss {info.val_loss:.3f}  top-1 {info.val_top1:.3f}  bits/byte {info.val_bits_per_byte:.3f}"
              f"   chat val loss {info.chat_val_loss:.3f}  top-1 {info.chat_val_top1:.3f}")
        print(f"  prompt: {info.sample_prompt}")
        print("  greedy: " + info.sample_completion.replace("\n", "\n          "))
    print(f"total {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
