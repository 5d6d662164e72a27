"""Benchmark bookkeeping: per-turn results -> summary dict (JSON-ready) -> printed table. No model code.

Definitions (also in inference.bench.run): tau = new tokens / target forwards (prefill included); speedup = tokens/s of
the main method over a baseline's (one per baseline); ideal speedup = tau x t_AR_step / t_tree_forward; efficiency =
speedup vs ar / ideal speedup. Greedy identity: every method's turns against the reference's (ar, else hf), a
differing turn judged a verified near tie or a mismatch by a `Judge` the caller passes (inference.bench.greedy_ties: the
rule, a stated rounding tolerance on float64 logits at the first differing token and at every later token of the
method's output, and Fp64Judge, the float64 rerun). "Lossless" only when no turn is a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from inference.bench.greedy_ties import Divergence, Judge, TieVerdict, first_divergence
from inference.engine.loop import StepTimes

PHASES = ("draft", "forward", "verify", "cache", "other")


@dataclass(frozen=True)
class TurnResult:
    tokens: tuple[int, ...]  # new tokens, trimmed at EOS / max_new_tokens
    text: str
    wall_time: float  # seconds, the whole generate call
    target_forwards: int  # prefill included
    accepted: tuple[int, ...]  # accepted draft tokens per decoding step
    times: StepTimes | None  # per-phase totals (engine methods only)
    prompt: tuple[int, ...] = ()  # the prompt ids this turn was generated from


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
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("prefill", *PHASES), 0.0))
    timed: bool = False
    accepted: list[int] = field(default_factory=list)  # accepted drafts of every decoding step

    def add(self, turn: TurnResult) -> None:
        self.turns += 1
        self.tokens += len(turn.tokens)
        self.wall += turn.wall_time
        self.forwards += turn.target_forwards
        self.accepted += turn.accepted
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

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def accepted_at_depth(self) -> list[float]:
        """[d - 1]: the share of decoding steps that accepted at least d drafts (depth-d acceptance); empty
        for a method that never accepts one."""
        depth = max(self.accepted, default=0)
        return [n / self.steps for n in accepted_per_position(self.accepted, depth)]

    def as_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {"turns": self.turns, "new_tokens": self.tokens, "wall_time_s": self.wall,
                               "tokens_per_s": self.tokens_per_s, "target_forwards": self.forwards, "tau": self.tau,
                               "accepted_at_depth": self.accepted_at_depth}
        if self.timed:
            per_step = {p: self.phases[p] / max(self.steps, 1) * 1e3 for p in PHASES}
            row.update(steps=self.steps, prefill_ms=self.phases["prefill"] / max(self.turns, 1) * 1e3,
                       per_step_ms={**per_step, "total": sum(per_step.values())})
        return row


def accepted_per_position(accepted_per_step: Sequence[int], num_draft: int) -> tuple[int, ...]:
    """[N] how many steps accepted the draft at position i: a step accepting a drafts accepts positions 0..a-1."""
    return tuple(sum(1 for a in accepted_per_step if a > i) for i in range(num_draft))


VERDICTS = ("identical", "near_tie", "mismatch", "not_compared")
SHOWN_DIVERGENCES = 10  # near-ties listed per method in summary.json (every mismatch is listed)
SHOWN_MISMATCHES = 10  # mismatches named in the printed report (summary.json lists them all)


def _ratio(a: Totals, b: Totals | None) -> float | None:
    return a.tokens_per_s / b.tokens_per_s if b is not None and b.tokens_per_s > 0 else None


def summarize(answers: dict[str, list[Answer]], main: str, greedy: bool, judge: Judge | None = None
              ) -> dict[str, Any]:
    """Summary of one benchmark run. `answers[method]` lists every question in the same order for every method;
    `main` is the method the summary is about (the others are baselines). `judge` rules on greedy turns that differ
    from the reference's (None: every such turn counts as a mismatch)."""
    totals = {name: Totals() for name in answers}
    by_category: dict[str, dict[str, Totals]] = {}
    for name, rows in answers.items():
        for a in rows:
            cat = by_category.setdefault(a.category, {n: Totals() for n in answers})[name]
            for turn in a.turns:
                totals[name].add(turn)
                cat.add(turn)
    m = totals[main]
    baselines = [name for name in answers if name != main]
    ar, hf = totals.get("ar") if main != "ar" else None, totals.get("hf") if main != "hf" else None
    summary: dict[str, Any] = {
        "main": main,
        "methods": {name: t.as_dict() for name, t in totals.items()},
        "tau": m.tau,
        "tokens_per_s": m.tokens_per_s,
        "speedup_vs": {b: _ratio(m, totals[b]) for b in baselines},
        "speedup_vs_ar": _ratio(m, ar),
        "speedup_vs_hf": _ratio(m, hf),
        "ar_vs_hf": _ratio(totals["ar"], totals["hf"]) if {"ar", "hf"} <= set(totals) else None,
    }
    summary.update(efficiency(m, ar))
    summary["greedy_check"] = greedy_check(answers, main, judge) if greedy else None
    summary["categories"] = {}
    for category, cat in by_category.items():
        mc = cat[main]
        baseline = cat["ar"] if ar is not None else (cat["hf"] if hf is not None else None)
        summary["categories"][category] = {
            "questions": sum(1 for a in answers[main] if a.category == category),
            "tau": mc.tau,
            "tokens_per_s": mc.tokens_per_s,
            "speedup": _ratio(mc, baseline),  # vs ar, else hf (the figure's bars)
            "speedup_vs": {b: _ratio(mc, cat[b]) for b in baselines},
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


OWN_NUMERICS = ("llama_cpp",)  # methods on other kernels (quantised dot products): timed, not held to greedy identity


def greedy_reference(methods: list[str], main: str) -> str | None:
    """The method every other's greedy tokens are compared with: ar, else hf, else the first baseline."""
    return next((r for r in ("ar", "hf") if r in methods),
                next((n for n in methods if n != main and n not in OWN_NUMERICS), None))


def greedy_check(answers: dict[str, list[Answer]], main: str, judge: Judge | None = None) -> dict[str, Any]:
    """Greedy decoding must not depend on the method. Each turn of each method is compared with the reference's
    same turn when both were generated from the same prompt (else not_compared: an earlier turn differed, so the two
    conversations differ): identical, or judged by `judge` (near_tie: a verified near tie, float rounding explains
    the parting and every later token of the method; mismatch: it does not, or there is no judge). `divergences`
    names every mismatch and the first SHOWN_DIVERGENCES near-ties."""
    reference = greedy_reference(list(answers), main)
    check: dict[str, Any] = {"reference": reference, "compared_turns": sum(len(a.turns) for a in answers[main]),
                             "methods": {}}
    for name in answers:
        if name == reference or reference is None or name in OWN_NUMERICS:
            continue
        counts: dict[str, Any] = dict.fromkeys(VERDICTS, 0)
        shown: list[dict[str, Any]] = []
        for ref_answer, answer in zip(answers[reference], answers[name]):
            for j, (ref, turn) in enumerate(zip(ref_answer.turns, answer.turns)):
                if ref.prompt != turn.prompt:
                    counts["not_compared"] += 1
                    continue
                d = first_divergence(ref.prompt, ref.tokens, turn.tokens)
                if d is None:
                    counts["identical"] += 1
                    continue
                verdict = judge(d) if judge is not None else TieVerdict(False)
                if not verdict.near_tie or counts["near_tie"] < SHOWN_DIVERGENCES:  # a mismatch is always named
                    shown.append(divergence_record(answer.question_id, j, d, verdict))
                counts["near_tie" if verdict.near_tie else "mismatch"] += 1
        check["methods"][name] = {**counts, "divergences": shown}
    rows = check["methods"].values()
    check["identical"] = all(r["identical"] == sum(r[v] for v in VERDICTS) for r in rows) if rows else None
    check["lossless"] = all(r["mismatch"] == 0 for r in rows) if rows else None
    return check


def divergence_record(question_id: Any, turn: int, d: Divergence, verdict: TieVerdict) -> dict[str, Any]:
    """One entry of a method's `divergences` in summary.json (left = the reference, right = the method). fp64_*:
    at the first differing token; failed_*: the first new token further below the fp64 argmax than the tolerance
    (None for a near tie; for an output that ended, its position alone)."""
    return {"question_id": question_id, "turn": turn, "position": d.index, "reference_token": d.left,
            "method_token": d.right, "verdict": "near_tie" if verdict.near_tie else "mismatch",
            "fp64_argmax": verdict.hi_argmax, "fp64_gap": verdict.gap, "fp64_relative_gap": verdict.relative_gap,
            "tolerance": verdict.tolerance, "checked_tokens": verdict.checked, "failed_at": verdict.failed_at,
            "failed_by": verdict.failed_by, "failed_tolerance": verdict.failed_tolerance}


def bandwidth_floor(weight_bytes: int, read_bytes_per_s: float, summary: dict[str, Any]) -> dict[str, Any]:
    """The memory-bandwidth floor of one plain decoding step, weight bytes / read bandwidth (every weight is read
    once per step), next to our measured mean plain step (ar, when it ran with per-phase times)."""
    floor_ms = weight_bytes / read_bytes_per_s * 1e3
    ar_row = summary["methods"].get("ar", {})
    ar_ms = ar_row["per_step_ms"]["total"] if "per_step_ms" in ar_row else None
    return {"weight_bytes": weight_bytes, "read_gb_per_s": read_bytes_per_s / 1e9, "floor_ms": floor_ms,
            "ar_step_ms": ar_ms, "ar_step_over_floor": ar_ms / floor_ms if ar_ms is not None and floor_ms > 0
            else None}


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(summary: dict[str, Any]) -> str:
    """The summary as the plain-text report printed at the end of a run."""
    main, check = summary["main"], summary.get("greedy_check") or {"methods": {}, "reference": None}
    lines = [f"{'method':12}{'turns':>6}{'tokens':>8}{'wall s':>9}{'tok/s':>8}{'tau':>6}{'forwards':>9}"
             f"{'speedup':>9}{'identical':>10}{'near-tie':>9}{'mismatch':>9}"
             f"   (speedup: {main}'s tok/s over the row's; greedy turns vs {check['reference'] or '-'})"]
    for name, row in summary["methods"].items():
        ident = check["methods"].get(name)
        marks = (f"{ident['identical']:10d}{ident['near_tie']:9d}{ident['mismatch']:9d}" if ident is not None
                 else f"{'ref' if name == check['reference'] else '-':>10}{'-':>9}{'-':>9}")
        lines.append(f"{name:12}{row['turns']:6d}{row['new_tokens']:8d}{row['wall_time_s']:9.2f}"
                     f"{row['tokens_per_s']:8.1f}{row['tau']:6.2f}{row['target_forwards']:9d}"
                     f"{_f(summary['speedup_vs'].get(name), '9.2f'):>9}{marks}")
    if main != "ar" and summary["ar_vs_hf"] is not None:
        lines.append(f"our AR vs HF generate {summary['ar_vs_hf']:.2f}x")
    timed = {n: r for n, r in summary["methods"].items() if "per_step_ms" in r}
    if timed:
        lines.append(f"{'per step ms':12}" + "".join(f"{p:>9}" for p in (*PHASES, "total")) + f"{'prefill':>9}")
        for name, row in timed.items():
            lines.append(f"{name:12}" + "".join(f"{row['per_step_ms'][p]:9.2f}" for p in (*PHASES, "total"))
                         + f"{row['prefill_ms']:9.2f}")
    floor = summary.get("bandwidth")
    if floor is not None:
        ar_part = "" if floor["ar_step_ms"] is None else \
            f"; our plain step {floor['ar_step_ms']:.2f} ms = {floor['ar_step_over_floor']:.2f}x the floor"
        lines.append(f"memory-bandwidth floor {floor['floor_ms']:.2f} ms per step "
                     f"({floor['weight_bytes'] / 1e6:.1f} MB of weights / {floor['read_gb_per_s']:.1f} GB/s "
                     f"read bandwidth){ar_part}")
    depths = summary["methods"][main].get("accepted_at_depth")
    if depths:
        lines.append(f"{main}: steps accepting at least d drafts, d = 1..{len(depths)}: "
                     + " / ".join(f"{p:.3f}" for p in depths))
    if summary.get("ideal_speedup") is not None:
        lines.append(f"engine efficiency {summary['engine_efficiency']:.2f} = speedup {summary['speedup_vs_ar']:.2f}"
                     f" / ideal {summary['ideal_speedup']:.2f} (tau {summary['tau']:.2f} x t_AR_step "
                     f"{summary['t_ar_step_ms']:.2f} ms / t_tree_forward {summary['t_tree_forward_ms']:.2f} ms)")
    if check["methods"]:
        lines += greedy_verdict(check)
    baselines = list(summary["speedup_vs"])
    lines.append(f"{'category':14}{'questions':>10}{'tau':>7}{'tok/s':>9}"
                 + "".join(f"{'vs ' + b:>15}" for b in baselines))
    for category, row in summary["categories"].items():
        lines.append(f"{category:14}{row['questions']:10d}{row['tau']:7.2f}{row['tokens_per_s']:9.1f}"
                     + "".join(f"{_f(row['speedup_vs'][b], '15.2f'):>15}" for b in baselines))
    return "\n".join(lines)


def greedy_verdict(check: dict[str, Any]) -> list[str]:
    """Lines for the report: lossless or not, the counts apart, and what each mismatch means."""
    rows, reference = check["methods"], check["reference"]
    if check["identical"]:
        return [f"greedy outputs identical, lossless (every turn of {', '.join(rows)} equals {reference}'s)"]
    parts = ", ".join(f"{name} {r['identical']} identical / {r['near_tie']} verified near-tie / {r['mismatch']} "
                      f"mismatch" + (f" / {r['not_compared']} not compared" if r["not_compared"] else "")
                      for name, r in rows.items())
    verdict = "lossless" if check["lossless"] else "NOT lossless"
    lines = [f"greedy outputs vs {reference}: {verdict} ({parts}); a verified near tie parts where the two tokens' "
             f"float64 logits are tied within the run dtype's rounding tolerance, and every later token of the "
             f"method is float64's greedy choice within it (inference.bench.greedy_ties)"]
    mismatches = [(name, d) for name, r in rows.items() for d in r["divergences"] if d["verdict"] == "mismatch"]
    for name, d in mismatches[:SHOWN_MISMATCHES]:
        lines.append(f"MISMATCH {name}, question {d['question_id']} turn {d['turn']}: " + mismatch_reason(d))
    if len(mismatches) > SHOWN_MISMATCHES:
        lines.append(f"... and {len(mismatches) - SHOWN_MISMATCHES} more mismatches in summary.json")
    return lines


def mismatch_reason(d: dict[str, Any]) -> str:
    """What one mismatch record says, in words: which token, how far off, and what that means."""
    where = f"parts from the reference at new token {d['position']}"
    if d["reference_token"] is None or d["method_token"] is None:
        side = "the reference" if d["reference_token"] is None else "the method"
        return f"{where}, where {side} ended and the other went on (an end of output is not judged as a tie)"
    if d["failed_at"] is None:  # no float64 rerun (no judge): not judged
        return f"{where} (not judged: no float64 rerun for a quantized or device-mapped target)"
    if d["failed_at"] == d["position"]:
        what = f"there, the {'method' if d['fp64_gap'] >= 0 else 'reference'}'s token is"
    else:
        what = f"(a tie there), then the method's token at new token {d['failed_at']} is"
    return (f"{where}; {what} {d['failed_by']:.3g} below the float64 greedy choice, over the tolerance "
            f"{d['failed_tolerance']:.3g}: rounding cannot explain it, likely an engine bug (rerun with --dtype "
            f"fp64 to confirm)")
