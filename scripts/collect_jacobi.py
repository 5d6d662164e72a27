"""Thin launcher: Jacobi trajectories for CLLM (logic: inference/collect/jacobi_trajectories.py).

    python scripts/collect_jacobi.py --model tiny --output traj.jsonl [--data default] [--block-size 16] [data.path=...]
    torchrun --nproc_per_node 8 scripts/collect_jacobi.py --model vicuna7b --output traj.jsonl ...   (one GPU a rank)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.collect.jacobi_trajectories import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
