"""Every method of a plan side by side on one target, in one run: `python scripts/bench_suite.py conf/bench/smollm2.yaml`.

The logic lives in inference/bench/suite.py (see its docstring for the plan format)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.bench.suite import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
