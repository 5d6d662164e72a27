"""Run a module as `python -m <module> <args>` would (or a script, as `python <script> <args>`), then write its peak
memory as JSON (gpu_check's `recipes`).

    python scripts/gpu_check_peak.py PEAK.json -m train medusa1 +model=tiny ...
    python scripts/gpu_check_peak.py PEAK.json scripts/collect_jacobi.py --model ...

PEAK.json: {"peak_rss_bytes": the process's peak resident set, "cuda_peak_bytes": torch.cuda.max_memory_allocated
on the current device, or null where CUDA was never initialised}. Written at exit, whatever the exit status.
"""

from __future__ import annotations

import atexit
import json
import resource
import runpy
import sys
from pathlib import Path


def write_peak(path: Path) -> None:
    cuda = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        cuda = torch.cuda.max_memory_allocated()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    path.write_text(json.dumps({"peak_rss_bytes": rss, "cuda_peak_bytes": cuda}) + "\n")


def main(argv: list[str]) -> None:
    module = len(argv) >= 3 and argv[1] == "-m"
    if not module and not (len(argv) >= 2 and argv[1].endswith(".py")):
        print("usage: gpu_check_peak.py PEAK.json (-m MODULE | SCRIPT.py) [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    atexit.register(write_peak, Path(argv[0]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if module:
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
