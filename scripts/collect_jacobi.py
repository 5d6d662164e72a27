"""Thin launcher: `python scripts/collect_jacobi.py --model tiny --output traj.jsonl` == `python -m data.jacobi ...`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.collect.jacobi_trajectories import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
