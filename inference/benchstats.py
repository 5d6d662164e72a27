"""Benchmark bookkeeping: per-turn results -> summary dict (JSON-ready) -> printed table. No model code.

Definitions (also in inference.bench): tau = new tokens / target forwards (prefill included); speedup = tokens/s of
the main method over a baseline's; ideal speedup = tau x t_AR_step / t_tree_forward; efficiency = speedup vs ar /
ideal speedup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inference.generate import StepTimes

PHASES = ("draft", "forward", "verify", "cache", "other")


@dataclass(frozen=True)
class TurnResult:
    tokens: tuple[int, ...]  # new tokens, trimmed at EOS / max_new_tokens
    text: str
    wall_time: float  # seconds, the whole generate call
    target_forwards: int  # prefill included
    accepted: tuple[int, ...]  # accepted draft tokens per decoding step
    times: StepTimes | None  # per-phase totals (engine methods only)


@dataclass(frozen=True)
class Answer:
    question_id: Any
    category: str
    turns: tuple[TurnResult, ...]


@dataclass
class Totals:
    """Running sums over turns of one method (mutable accumulator, local to `summarize`)."""

    turns: int = 0
    tokens: int = 0
    wall: float = 0.0
    forwards: int = 0
    steps: int = 0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("prefill", *PHASES), 0.0))
    timed: bool = False

    def add(self, turn: TurnResult) -> None:
        self.turns += 1
        self.tokens += len(turn.tokens)
        self.wall += turn.wall_time
        self.forwards += turn.target_forwards
        self.steps += len(turn.accepted)
        if turn.times is not None:
            self.timed = True
            for phase in self.phases:
                self.phases[phase] += getattr(turn.times, phase)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0

    @property
    def tau(self) -> float:
        return self.tokens / max(self.forwards, 1)

    def as_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {"turns": self.turns, "new_tokens": self.tokens, "wall_time_s": self.wall,
                               "tokens_per_s": self.tokens_per_s, "target_forwards": self.forwards, "tau": self.tau}
        if self.timed:
            per_step = {p: self.phases[p] / max(self.steps, 1) * 1e3 for p in PHASES}
            row.update(steps=self.steps, prefill_ms=self.phases["prefill"] / max(self.turns, 1) * 1e3,
                       per_step_ms={**per_step, "total": sum(per_step.values())})
        return row


def _ratio(a: Totals, b: Totals | None) -> float | None:
    return a.tokens_per_s / b.tokens_per_s if b is not None and b.tokens_per_s > 0 else None


def summarize(answers: dict[str, list[Answer]], main: str, greedy: bool) -> dict[str, Any]:
    """Summary of one benchmark run. `answers[method]` lists every question in the same order for every method;
    `main` is the method the summary is about (the others are baselines)."""
    totals = {name: Totals() for name in answers}
    by_category: dict[str, dict[str, Totals]] = {}
    for name, rows in answers.items():
        for a in rows:
            cat = by_category.setdefault(a.category, {n: Totals() for n in answers})[name]
            for turn in a.turns:
                totals[name].add(turn)
                cat.add(turn)
    m = totals[main]
    ar, hf = totals.get("ar") if main != "ar" else None, totals.get("hf") if main != "hf" else None
    summary: dict[str, Any] = {
        "main": main,
        "methods": {name: t.as_dict() for name, t in totals.items()},
        "tau": m.tau,
        "tokens_per_s": m.tokens_per_s,
        "speedup_vs_ar": _ratio(m, ar),
        "speedup_vs_hf": _ratio(m, hf),
        "ar_vs_hf": _ratio(totals["ar"], totals["hf"]) if {"ar", "hf"} <= set(totals) else None,
    }
    summary.update(efficiency(m, ar))
    summary["greedy_check"] = greedy_check(answers, main) if greedy else None
    summary["categories"] = {}
    for category, cat in by_category.items():
        mc = cat[main]
        baseline = cat["ar"] if ar is not None else (cat["hf"] if hf is not None else None)
        summary["categories"][category] = {
            "questions": sum(1 for a in answers[main] if a.category == category),
            "tau": mc.tau,
            "tokens_per_s": mc.tokens_per_s,
            "speedup": _ratio(mc, baseline),
            "speedup_vs_hf": _ratio(mc, cat["hf"] if hf is not None else None),
        }
    return summary


def efficiency(m: Totals, ar: Totals | None) -> dict[str, Any]:
    """Ideal speedup tau x t_AR_step / t_tree_forward and the share of it the engine realises."""
    if ar is None or not (m.timed and ar.timed) or m.steps == 0 or ar.steps == 0:
        return {"ideal_speedup": None, "engine_efficiency": None}
    t_ar_step = sum(ar.phases[p] for p in PHASES) / ar.steps
    t_tree_forward = m.phases["forward"] / m.steps
    if t_tree_forward <= 0:
        return {"ideal_speedup": None, "engine_efficiency": None}
    ideal = m.tau * t_ar_step / t_tree_forward
    speedup = _ratio(m, ar)
    return {"ideal_speedup": ideal, "engine_efficiency": speedup / ideal if speedup is not None else None,
            "t_ar_step_ms": t_ar_step * 1e3, "t_tree_forward_ms": t_tree_forward * 1e3}


def greedy_check(answers: dict[str, list[Answer]], main: str) -> dict[str, Any]:
    """Greedy decoding must not depend on the method: count turns whose tokens differ from each baseline's."""
    check: dict[str, Any] = {"compared_turns": sum(len(a.turns) for a in answers[main])}
    pairs = [(main, b) for b in ("ar", "hf") if b in answers and b != main]
    if main != "ar" and {"ar", "hf"} <= set(answers):
        pairs.append(("ar", "hf"))
    for left, right in pairs:
        bad = [a.question_id for a, b in zip(answers[left], answers[right])
               if [t.tokens for t in a.turns] != [t.tokens for t in b.turns]]
        check[f"mismatches_{left}_vs_{right}"] = sum(
            x.tokens != y.tokens for a, b in zip(answers[left], answers[right]) for x, y in zip(a.turns, b.turns))
        check[f"mismatched_questions_{left}_vs_{right}"] = bad[:10]
    check["identical"] = all(v == 0 for k, v in check.items() if k.startswith("mismatches_"))
    return check


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(summary: dict[str, Any]) -> str:
    """The summary as the plain-text report printed at the end of a run."""
    lines = [f"{'method':10}{'turns':>7}{'tokens':>9}{'wall s':>10}{'tok/s':>9}{'tau':>7}{'forwards':>10}"]
    for name, row in summary["methods"].items():
        lines.append(f"{name:10}{row['turns']:7d}{row['new_tokens']:9d}{row['wall_time_s']:10.2f}"
                     f"{row['tokens_per_s']:9.1f}{row['tau']:7.2f}{row['target_forwards']:10d}")
    ratios = [(f"{summary['main']} vs our AR", summary["speedup_vs_ar"]),
              (f"{summary['main']} vs HF generate", summary["speedup_vs_hf"])]
    if summary["main"] != "ar":
        ratios.append(("our AR vs HF generate", summary["ar_vs_hf"]))
    shown = [f"{label} {value:.2f}x" for label, value in ratios if value is not None]
    if shown:
        lines.append("speedup: " + "; ".join(shown))
    timed = {n: r for n, r in summary["methods"].items() if "per_step_ms" in r}
    if timed:
        lines.append(f"{'per step ms':12}" + "".join(f"{p:>9}" for p in (*PHASES, "total")) + f"{'prefill':>9}")
        for name, row in timed.items():
            lines.append(f"{name:12}" + "".join(f"{row['per_step_ms'][p]:9.2f}" for p in (*PHASES, "total"))
                         + f"{row['prefill_ms']:9.2f}")
    if summary.get("ideal_speedup") is not None:
        lines.append(f"engine efficiency {summary['engine_efficiency']:.2f} = speedup {summary['speedup_vs_ar']:.2f}"
                     f" / ideal {summary['ideal_speedup']:.2f} (tau {summary['tau']:.2f} x t_AR_step "
                     f"{summary['t_ar_step_ms']:.2f} ms / t_tree_forward {summary['t_tree_forward_ms']:.2f} ms)")
    check = summary.get("greedy_check")
    if check is not None and len(check) > 2:  # at least one baseline compared
        parts = [f"{k.removeprefix('mismatches_').replace('_vs_', ' vs ')} {v}/{check['compared_turns']}"
                 for k, v in check.items() if k.startswith("mismatches_")]
        verdict = "identical" if check["identical"] else "NOT identical"
        lines.append(f"greedy outputs {verdict} (mismatched turns: {', '.join(parts)})")
    lines.append(f"{'category':14}{'questions':>10}{'tau':>7}{'tok/s':>9}{'speedup':>9}")
    for category, row in summary["categories"].items():
        lines.append(f"{category:14}{row['questions']:10d}{row['tau']:7.2f}{row['tokens_per_s']:9.1f}"
                     f"{_f(row['speedup'], '9.2f'):>9}")
    return "\n".join(lines)
