"""Report figures: the right bars and lines, non-empty PNG files, clear errors on bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from inference.bench.plots import (  # noqa: E402
    ScalingPoint,
    accept_hist_figure,
    bench_summary_figure,
    data_scaling_figure,
    head_accuracy_figure,
    plot_accept_hist,
    plot_bench_summary,
    plot_head_accuracy,
    read_scaling_points,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bar_heights(ax) -> list[float]:
    return [patch.get_height() for patch in ax.patches]


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def medusa1_metrics(K: int, greedy: bool) -> dict[str, float]:
    """The metric names train.medusa1 evaluation returns (after the Trainer's eval_ prefix)."""
    metrics = {"eval_backbone_top1": 0.6, "eval_backbone_top5": 0.8, "eval_loss": 3.2, "epoch": 1.0}
    for k in range(1, K + 1):
        metrics[f"eval_head{k}_top1"] = 0.5 / k
        metrics[f"eval_head{k}_top5"] = 0.9 / k
        if greedy:
            metrics[f"eval_greedy_head{k}_top1"] = 0.6 / k
            metrics[f"eval_greedy_head{k}_top5"] = 0.95 / k
    return metrics


@pytest.mark.parametrize("greedy", [False, True])
def test_head_accuracy(tmp_path, greedy):
    metrics = medusa1_metrics(K=3, greedy=greedy)
    fig = head_accuracy_figure(metrics)
    axes = fig.axes
    assert len(axes) == (2 if greedy else 1)
    assert sorted(bar_heights(axes[0])) == sorted(metrics[f"eval_head{k}_top{t}"] for k in (1, 2, 3) for t in (1, 5))
    assert [line.get_ydata()[0] for line in axes[0].get_lines()] == [0.6]  # backbone top-1 reference
    if greedy:
        assert sorted(bar_heights(axes[1])) == sorted(metrics[f"eval_greedy_head{k}_top{t}"] for k in (1, 2, 3) for t in (1, 5))
        assert axes[1].get_lines() == []
    assert_png(plot_head_accuracy(metrics, tmp_path / "heads.png"))


def test_head_accuracy_without_prefix_and_errors():
    fig = head_accuracy_figure({"head1_top1": 0.4, "head2_top1": 0.2})
    assert bar_heights(fig.axes[0]) == [0.4, 0.2]
    with pytest.raises(ValueError, match="no per-head accuracy metrics"):
        head_accuracy_figure({"eval_loss": 1.0})


def test_accept_hist(tmp_path):
    lengths = [0, 2, 2, 3, 3, 3, 5]
    fig = accept_hist_figure(lengths)
    (ax,) = fig.axes
    assert bar_heights(ax) == pytest.approx([1 / 7, 0, 2 / 7, 3 / 7, 0, 1 / 7])  # one bar per length 0..5
    assert ax.get_lines()[0].get_xdata()[0] == pytest.approx(sum(lengths) / len(lengths))
    assert_png(plot_accept_hist(lengths, tmp_path / "sub" / "accept.png"))
    with pytest.raises(ValueError, match="empty"):
        accept_hist_figure([])
    with pytest.raises(ValueError, match="non-negative integers, got -1"):
        accept_hist_figure([1, -1])


def test_bench_summary(tmp_path):
    summary = {"writing": {"tau": 2.4, "speedup": 1.8}, "math": {"tau": 3.1, "speedup": 2.2}, "coding": {"tau": 2.9, "speedup": 0.9}}
    fig = bench_summary_figure(summary)
    ax_tau, ax_speed = fig.axes
    assert bar_heights(ax_tau) == [2.4, 3.1, 2.9]
    assert bar_heights(ax_speed) == [1.8, 2.2, 0.9]
    assert [t.get_text() for t in ax_speed.get_xticklabels()] == ["writing", "math", "coding"]
    assert_png(plot_bench_summary(summary, tmp_path / "bench.png"))
    with pytest.raises(ValueError, match=r"summary\['math'\]\['speedup'\]"):
        bench_summary_figure({"math": {"tau": 2.0}})


SCALING_CSV = """series,train_tokens,tau_16,top1_depth1,host
"EAGLE-3, own answers",1000000,1.89,0.43,E
"EAGLE-3, own answers",300000,1.73,0.31,E
Medusa-1,300000,1.58,0.23,D
"""


def test_data_scaling(tmp_path):
    path = tmp_path / "points.csv"
    path.write_text(SCALING_CSV)
    points = read_scaling_points(path)
    assert points[0] == ScalingPoint("EAGLE-3, own answers", 1_000_000, 1.89, 0.43)
    fig = data_scaling_figure(points)
    ax_tau, ax_top1 = fig.axes
    eagle, medusa = ax_tau.get_lines()
    assert list(eagle.get_xdata()) == [300000, 1000000] and list(eagle.get_ydata()) == [1.73, 1.89]  # sorted by tokens
    assert list(medusa.get_ydata()) == [1.58]
    assert list(ax_top1.get_lines()[0].get_ydata()) == [0.31, 0.43]
    assert [t.get_text() for t in ax_tau.get_xticklabels()] == ["0.3M", "0.5M", "1M"]
    assert ax_tau.get_legend() is None and [t.get_text() for t in fig.legends[0].get_texts()] == [
        "EAGLE-3, own answers", "Medusa-1"]  # one legend for both panels, below them


@pytest.mark.parametrize("text, message", [
    ("series,train_tokens,tau_16\nA,1,1.5\n", r"points.csv:1: missing column\(s\) top1_depth1"),
    ("series,train_tokens,tau_16,top1_depth1\nA,1,1.5,0.2\nB,lots,1.5,0.2\n", r"points.csv:3: column train_tokens: expected a int, got 'lots'"),
    ("series,train_tokens,tau_16,top1_depth1\nA,1,1.5,1.2\n", r"points.csv:2: column top1_depth1: 1.2 is outside"),
    ("series,train_tokens,tau_16,top1_depth1\n,1,1.5,0.2\n", r"points.csv:2: column series: empty"),
    ("series,train_tokens,tau_16,top1_depth1\n", r"points.csv: no rows"),
])
def test_data_scaling_bad_rows_name_file_line_and_column(tmp_path, text, message):
    path = tmp_path / "points.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_scaling_points(path)


def test_data_scaling_script_writes_the_docs_figure_from_the_docs_points(tmp_path):
    root = Path(__file__).resolve().parents[1]
    script = [sys.executable, str(root / "scripts" / "plot_data_scaling.py")]
    out = tmp_path / "scaling.png"
    points = read_scaling_points(root / "docs" / "figures" / "data_scaling.csv")
    done = subprocess.run([*script, str(root / "docs" / "figures" / "data_scaling.csv"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"{len(points)} points, {len({p.series for p in points})} series" in done.stdout and len(points) >= 10
    assert_png(out)
    missing = subprocess.run([*script, str(tmp_path / "missing.csv")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "missing.csv" in missing.stderr and missing.stderr.count("\n") == 1
