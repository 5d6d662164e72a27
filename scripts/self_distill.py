"""Self-distillation data for Medusa-2: the target's own answers to a dataset's prompts, as ShareGPT JSONL.

    python scripts/self_distill.py --model vicuna7b --data ../shared/data/fastchat_dummy_conversation/dummy_conversation.json \
        --output distilled.jsonl [--drafter <medusa checkpoint>] [--temperature 0.7]
    python -m train medusa2 +model=vicuna7b data=sharegpt data.path=distilled.jsonl

One GPU a rank: `torchrun --nproc_per_node 8 scripts/self_distill.py ...` shares the prompts (rank files beside
--output, merged into it by rank 0). Resumable under any world size: rerun after an interruption.
Logic: inference/collect/self_distill.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.collect.self_distill import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
