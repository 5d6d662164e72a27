"""What data buys: τ (16-node tree, in the engine) and depth-1 greedy top-1 of each trained drafter against its train
tokens, from a CSV of measured points (docs/figures/data_scaling.csv: each row names the host and the docs section
with the command behind it).

    python scripts/plot_data_scaling.py        # docs/figures/data_scaling.csv -> docs/figures/data_scaling.png
    python scripts/plot_data_scaling.py my_points.csv --out my_points.png

Needs matplotlib (`pip install 'draftsmith[plots]'`). Logic: inference/bench/plots.py.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.bench.plots import SCALING_COLUMNS, plot_data_scaling, read_scaling_points  # noqa: E402

FIGURES = Path(__file__).resolve().parents[1] / "docs" / "figures"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/plot_data_scaling.py", description=__doc__.split("\n\n")[0])
    p.add_argument("points", nargs="?", type=Path, default=FIGURES / "data_scaling.csv",
                   help=f"CSV with columns {', '.join(SCALING_COLUMNS)}")
    p.add_argument("--out", type=Path, default=FIGURES / "data_scaling.png", help="image file (format from suffix)")
    args = p.parse_args(argv)
    try:
        points = read_scaling_points(args.points)
        path = plot_data_scaling(points, args.out)
    except (OSError, ValueError, ImportError) as err:
        where = f"{err.filename}: {err.strerror}" if isinstance(err, OSError) and err.filename else err
        print(f"error: {where}", file=sys.stderr)
        return 2
    print(f"{path}: {len(points)} points, {len({q.series for q in points})} series")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
