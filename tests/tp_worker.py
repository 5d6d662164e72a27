"""torchrun worker for tests/test_train_distributed.py: Medusa decoding with the target tensor-parallel.

    torchrun --nproc_per_node=2 -m tests.tp_worker <drafter dir> <base model dir> <out prefix>
Every rank writes the new tokens it decoded to <out prefix>.<rank>.json.
"""

import json
import os
import sys
from pathlib import Path

from inference import load

PROMPT = list(range(5, 25))
NEW_TOKENS = 24


def main(drafter: str, base: str, out: str) -> None:
    engine = load(drafter, base=base, dtype="fp32", tp_plan="auto")
    tokens = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True).sequences[0]
    Path(f"{out}.{os.environ['RANK']}.json").write_text(json.dumps(tokens))


if __name__ == "__main__":
    main(*sys.argv[1:])
