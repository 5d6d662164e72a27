"""Figures for reports: per-head accuracy, accepted-length histogram, benchmark summary, τ against train tokens.

Needs matplotlib (`pip install 'draftsmith[plots]'`). Figures are built as `matplotlib.figure.Figure` objects, without
pyplot, so no global figure state or GUI backend is involved. Each `*_figure` function builds the figure (inspectable
in tests); each `plot_*` function builds it and writes it to `path` (format from the suffix, e.g. .png).
"""

from __future__ import annotations

import csv
import math
import numbers
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from data.atomic import write_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Metric names written by train.medusa1 (with the Trainer's "eval_" prefix, or without it).
_HEAD_METRIC = re.compile(r"^(?:eval_)?(greedy_)?head(\d+)_top(1|5)$")
_BACKBONE_METRIC = re.compile(r"^(?:eval_)?backbone_top1$")
SOURCES = {"": "validation data (ground truth)", "greedy_": "target's greedy continuations"}


def new_figure(width: float, height: float) -> "Figure":
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'draftsmith[plots]'") from None
    return Figure(figsize=(width, height), layout="constrained")


def save(fig: "Figure", path: str | os.PathLike) -> Path:
    """`fig` written to `path` atomically (data.atomic: a killed or failed write leaves no half image), in the format
    its suffix names (PNG when it has none)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, lambda tmp: fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".") or "png"))
    return path


def head_accuracies(metrics: Mapping[str, Any]) -> dict[str, dict[int, dict[int, float]]]:
    """{source prefix ("" or "greedy_"): {head k: {1: top-1, 5: top-5}}} from evaluation metrics."""
    table: dict[str, dict[int, dict[int, float]]] = {}
    for name, value in metrics.items():
        match = _HEAD_METRIC.match(name)
        if match is not None:
            table.setdefault(match[1] or "", {}).setdefault(int(match[2]), {})[int(match[3])] = float(value)
    return table


def head_accuracy_figure(metrics: Mapping[str, Any]) -> "Figure":
    """One panel per data source (ground truth, greedy continuation) present in `metrics`: per head k (predicting
    token t+k+1) a top-1 and a top-5 bar; the backbone's own next-token top-1, when given, as a dashed line."""
    table = head_accuracies(metrics)
    if not table:
        raise ValueError("no per-head accuracy metrics (eval_head{k}_top1 / eval_head{k}_top5) in metrics")
    backbone = next((float(v) for k, v in metrics.items() if _BACKBONE_METRIC.match(k)), None)
    sources = [s for s in SOURCES if s in table]
    fig = new_figure(4.5 * len(sources), 3.6)
    axes = fig.subplots(1, len(sources), sharey=True, squeeze=False)[0]
    width = 0.38
    for ax, source in zip(axes, sources):
        heads = sorted(table[source])
        for offset, topk in ((-width / 2, 1), (width / 2, 5)):
            ks = [k for k in heads if topk in table[source][k]]
            if ks:
                ax.bar([k + offset for k in ks], [table[source][k][topk] for k in ks], width, label=f"top-{topk}")
        if backbone is not None and source == "":
            ax.axhline(backbone, color="black", linestyle="--", linewidth=1, label="backbone top-1 (t+1)")
        ax.set_xticks(heads, [f"{k}\n(t+{k + 1})" for k in heads])
        ax.set_xlabel("head (predicted position)")
        ax.set_ylim(0, 1)
        ax.set_title(SOURCES[source], fontsize=10)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("accuracy")
    return fig


def plot_head_accuracy(metrics: Mapping[str, Any], path: str | os.PathLike) -> Path:
    return save(head_accuracy_figure(metrics), path)


def accept_hist_figure(accepted_lengths: Sequence[int], label: str = "accepted draft tokens per step") -> "Figure":
    """One bar per length from 0 to the maximum (empty lengths included), heights = share of steps; the mean as a
    vertical line. Lengths are non-negative integers, one per decoding step."""
    if not accepted_lengths:
        raise ValueError("accepted_lengths is empty: no decoding steps to plot")
    bad = next((n for n in accepted_lengths if not isinstance(n, numbers.Integral) or n < 0), None)
    if bad is not None:
        raise ValueError(f"accepted_lengths must be non-negative integers, got {bad!r}")
    counts = Counter(int(n) for n in accepted_lengths)
    lengths = list(range(max(counts) + 1))
    mean = sum(accepted_lengths) / len(accepted_lengths)
    fig = new_figure(5, 3.4)
    ax = fig.subplots()
    ax.bar(lengths, [counts[n] / len(accepted_lengths) for n in lengths], 0.8)
    ax.axvline(mean, color="black", linestyle="--", linewidth=1, label=f"mean {mean:.2f}")
    ax.set_xticks(lengths)
    ax.set_xlabel(label)
    ax.set_ylabel("share of steps")
    ax.set_title(f"{len(accepted_lengths)} steps", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def plot_accept_hist(accepted_lengths: Sequence[int], path: str | os.PathLike) -> Path:
    return save(accept_hist_figure(accepted_lengths), path)


def bench_summary_figure(summary: Mapping[str, Mapping[str, float]]) -> "Figure":
    """Two panels over the categories of `summary` ({category: {"tau": ..., "speedup": ...}}, in its order): τ (mean
    tokens per target forward) and wall-clock speedup against the baseline, with 1x marked."""
    if not summary:
        raise ValueError("bench summary is empty")
    values: dict[str, list[float]] = {"tau": [], "speedup": []}
    for category, row in summary.items():
        for key in values:
            value = row.get(key) if isinstance(row, Mapping) else None
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"bench summary[{category!r}][{key!r}]: expected a finite number, got {value!r}")
            values[key].append(float(value))
    categories = list(summary)
    fig = new_figure(max(5.0, 1.1 * len(categories) + 2), 5.2)
    ax_tau, ax_speed = fig.subplots(2, 1, sharex=True)
    for ax, key, title in ((ax_tau, "tau", "τ (tokens per target forward)"), (ax_speed, "speedup", "speedup vs baseline")):
        bars = ax.bar(range(len(categories)), values[key], 0.6)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_ylabel(title, fontsize=9)
        ax.margins(y=0.15)
    ax_tau.axhline(1.0, color="gray", linewidth=0.8)
    ax_speed.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax_speed.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    return fig


def plot_bench_summary(summary: Mapping[str, Mapping[str, float]], path: str | os.PathLike) -> Path:
    return save(bench_summary_figure(summary), path)


@dataclass(frozen=True)
class ScalingPoint:
    """One trained drafter: its series (drafter and data), train tokens, τ with a 16-node tree in the engine and its
    depth-1 (head-1) greedy top-1 on the target's continuations of held-out prompts."""

    series: str
    train_tokens: int
    tau: float
    top1: float


SCALING_COLUMNS = ("series", "train_tokens", "tau_16", "top1_depth1")


def read_scaling_points(path: str | os.PathLike) -> list[ScalingPoint]:
    """The points of a CSV with SCALING_COLUMNS (others, such as host and source, are kept for readers, not read);
    a bad row raises ValueError naming its file, line and column."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in SCALING_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}:1: missing column(s) {', '.join(missing)} (needs {', '.join(SCALING_COLUMNS)})")
        points = [_scaling_point(row, f"{path}:{reader.line_num}") for row in reader]
    if not points:
        raise ValueError(f"{path}: no rows")
    return points


def _scaling_point(row: Mapping[str, str], where: str) -> ScalingPoint:
    def number(column: str, kind: type, low: float, high: float) -> Any:
        text = (row.get(column) or "").strip()
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"{where}: column {column}: expected a {kind.__name__}, got {text!r}") from None
        if not low <= value <= high:
            raise ValueError(f"{where}: column {column}: {value} is outside [{low}, {high}]")
        return value

    series = (row.get("series") or "").strip()
    if not series:
        raise ValueError(f"{where}: column series: empty")
    return ScalingPoint(series, number("train_tokens", int, 1, math.inf), number("tau_16", float, 1.0, 1e3),
                        number("top1_depth1", float, 0.0, 1.0))


def data_scaling_figure(points: Sequence[ScalingPoint]) -> "Figure":
    """Two panels against train tokens (log scale), one line per series in order of first appearance: τ at 16 nodes
    and depth-1 greedy top-1, each point labelled with its value; the legend below both."""
    if not points:
        raise ValueError("no data-scaling points")
    series: dict[str, list[ScalingPoint]] = {}
    for point in points:
        series.setdefault(point.series, []).append(point)
    from matplotlib.ticker import NullFormatter  # deferred: matplotlib, an optional extra (new_figure says so)

    fig = new_figure(9.0, 3.8 + 0.18 * ((len(series) + 2) // 3))
    low, high = min(p.train_tokens for p in points), max(p.train_tokens for p in points)
    ticks = [t for t in (m * 10**e for e in range(3, 13) for m in (1, 2, 3, 5)) if low / 1.2 <= t <= high * 1.2]
    ax_tau, ax_top1 = fig.subplots(1, 2)
    for ax, key, title in ((ax_tau, "tau", "τ, 16-node tree (engine)"), (ax_top1, "top1", "depth-1 greedy top-1")):
        for name, rows in series.items():
            rows = sorted(rows, key=lambda p: p.train_tokens)
            xs, ys = [p.train_tokens for p in rows], [getattr(p, key) for p in rows]
            ax.plot(xs, ys, marker="o", label=name)
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7)
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t / 1e6:g}M" for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("train tokens")
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.15)
    fig.legend(*ax_tau.get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=7)  # clear of points
    return fig


def plot_data_scaling(points: Sequence[ScalingPoint], path: str | os.PathLike) -> Path:
    return save(data_scaling_figure(points), path)
