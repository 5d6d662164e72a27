"""The README's results table from bench outputs: one markdown row per `summary.json`.

    python scripts/results_table.py outputs/bench/smollm2-gpu outputs/bench/smollm2-selfdistill/pld8_sg/summary.json

Each argument is a `summary.json` written by `python -m inference bench --out DIR` or `scripts/bench_suite.py` (one
per method, under `<out>/<method>/`), or a folder searched for them. Rows keep the order given (a suite's folder in
its plan's order, another folder's in path order); a row made by the command of the row above says "same run";
columns: method, τ, tok/s, × our plain loop, × Hugging Face `generate`, host (GPU, else CPU and its kernels;
dtype) and the command that made the figures. At most `--max-rows` rows (12): a results table shows the current claims,
not every run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

HEADER = ["method", "τ", "tok/s", "× plain loop", "× HF", "host", "command"]


class TableError(Exception):
    """A path or summary the table cannot use; the message names the file."""


def summary_paths(args: Sequence[str]) -> list[Path]:
    """The summary.json files the arguments name, in order (a folder's, sorted, recursively)."""
    paths: list[Path] = []
    for arg in args:
        path = Path(arg)
        if path.is_dir():
            found = plan_order(path) or sorted(path.rglob("summary.json"))
            if not found:
                raise TableError(f"{path}: no summary.json under this folder")
            paths += found
        elif path.is_file():
            paths.append(path)
        else:
            raise TableError(f"{path}: no such file or folder")
    return paths


def plan_order(folder: Path) -> list[Path]:
    """A bench_suite output's summaries in its plan's order (suite.json lists the methods); [] for other folders."""
    suite = folder / "suite.json"
    if not suite.is_file():
        return []
    try:
        methods = json.loads(suite.read_text())["methods"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise TableError(f"{suite}: not a bench_suite output (no methods)") from None
    return [folder / name / "summary.json" for name in methods if (folder / name / "summary.json").is_file()]


def read_summary(path: Path) -> dict[str, Any]:
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise TableError(f"{path}: not JSON ({err.msg}, line {err.lineno})") from None
    missing = [k for k in ("main", "tau", "tokens_per_s", "config") if k not in summary]
    if missing:
        raise TableError(f"{path}: not a bench summary (no {', '.join(missing)})")
    return summary


def method_name(summary: dict[str, Any]) -> str:
    """A suite's summary is named by its plan entry's label, else the entry; `inference bench`'s main is "drafter":
    name the drafter."""
    config = summary["config"]
    if config.get("label"):
        return config["label"]
    if summary["main"] != "drafter":
        return summary["main"]
    name = str(config.get("drafter") or "drafter")
    if config.get("tree_nodes"):
        name += f", {config['tree_nodes']} nodes"
    return name


def host(config: dict[str, Any]) -> str:
    where = config.get("gpu") or f"{config.get('cpu', 'unknown CPU')} ({config.get('cpu_capability', '?')})"
    return f"{where}, {config.get('dtype', '?')}"


def ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def row(summary: dict[str, Any], command_above: str | None = None) -> str:
    config = summary["config"]
    command = config.get("command") or "—"
    cells = [method_name(summary), f"{summary['tau']:.2f}", f"{summary['tokens_per_s']:.1f}",
             ratio(summary.get("speedup_vs_ar")), ratio(summary.get("speedup_vs_hf")), host(config),
             "same run" if command == command_above else f"`{command}`"]
    return "| " + " | ".join(cells) + " |"


def table(summaries: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    commands = [None] + [s["config"].get("command") for s in summaries]
    return "\n".join(lines + [row(s, above) for s, above in zip(summaries, commands)])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/results_table.py", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="summary.json files or folders holding them")
    p.add_argument("--max-rows", type=int, default=12, help="refuse more rows than this (default 12)")
    args = p.parse_args(argv)
    try:
        paths = summary_paths(args.paths)
        if len(paths) > args.max_rows:
            raise TableError(f"{len(paths)} summaries for at most {args.max_rows} rows: name fewer "
                             f"(or pass --max-rows)")
        summaries = [read_summary(path) for path in paths]
    except TableError as err:
        print(f"results_table: {err}", file=sys.stderr)
        return 2
    print(table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
