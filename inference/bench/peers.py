"""The offline half of scripts/bench_peers.py: which peers, in which environments, and what one run's record says.

A run record (JSON, written by the script) holds, per method, the turns it produced on the same prompts:
    {"config": {...}, "versions": {stack: {package: version}}, "patches": {peer: [line, ...]},
     "unavailable": {peer: reason}, "methods": {name: {"turns": [Turn, ...]}}}
    Turn: {"tokens": [ids], "wall": s, "forwards": n (prefill included), "accepted": [per step], "times": {phase: s}}
`METHODS` says what each name is, which plain-greedy method of the same stack it is measured against and, for ours,
which peer it is compared with. Definitions (the same as `python -m inference bench`):
    tok/s   all new tokens / all wall time of the method
    tau     new tokens / target forwards (1.0 for plain decoding)
    xgreedy tok/s / tok/s of the plain greedy of the same stack
    ours/peer  tok/s of our method / tok/s of the peer it replaces
    =greedy answers token-identical to the same stack's plain greedy / to our plain greedy (ar); the others are
            judged at their first differing token in float64 (record "divergences": near-tie or mismatch)

Medusa's tree: medusa-llm 0.1 (the PyPI release) takes `medusa_choices=[1, k_1, ..., k_H]`, the full cartesian tree
whose depth-d nodes are every combination of the top-k_1 .. top-k_d candidates of heads 1..d. `cartesian_paths`
turns that into our choice paths (inference.engine.tree) and `cartesian_choices` back, refusing a tree that is not such
a product, so both engines run the same tree.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

Path_ = tuple[int, ...]


class PeerBenchError(ValueError):
    """Bad input to the peer bench (the message names the option or the record key)."""


@dataclass(frozen=True)
class Method:
    label: str
    stack: str  # the key of its versions in the record
    greedy: str | None  # the plain-greedy method of the same stack (None: this is one)
    peer: str | None = None  # ours only: the peer method it is compared with


METHODS: dict[str, Method] = {
    "ar": Method("draftsmith plain greedy (our loop, no drafter)", "ours", None),
    "hf": Method("HF generate greedy", "ours", None),
    "medusa_greedy": Method("HF generate greedy, Medusa's venv", "medusa", None),
    "medusa": Method("Medusa engine (medusa-llm), heads+tree", "medusa", "medusa_greedy"),
    "ours_medusa": Method("draftsmith Medusa, same heads+tree", "ours", "ar", "medusa"),
    "hf_assisted": Method("HF assisted generation, draft", "ours", "hf"),
    "ours_draft": Method("draftsmith draft model, same draft", "ours", "ar", "hf_assisted"),
    "hf_pld": Method("HF prompt-lookup decoding", "ours", "hf"),
    "ours_pld": Method("draftsmith prompt_lookup", "ours", "ar", "hf_pld"),
}
GOALS = {"ours_medusa": 5.0, "ours_draft": 1.3, "ours_pld": 1.0}  # ours/peer tok/s at least this
PHASES = ("prefill", "draft", "forward", "verify", "cache", "other")


def cartesian_paths(choices: Sequence[int]) -> list[Path_]:
    """medusa-llm 0.1's `medusa_choices` [1, k_1, ..., k_H] -> our choice paths (every node but the root)."""
    choices = list(choices)
    if len(choices) < 2 or choices[0] != 1 or any(not isinstance(k, int) or k < 1 for k in choices):
        raise PeerBenchError(f"medusa choices {choices}: expected [1, k_1, ..., k_H] with every k >= 1 (the first "
                             f"entry is the root, the target's own token)")
    topks = choices[1:]
    return [p for d in range(1, len(topks) + 1) for p in itertools.product(*(range(k) for k in topks[:d]))]


def cartesian_choices(paths: Sequence[Sequence[int]]) -> list[int]:
    """Our choice paths -> [1, k_1, ..., k_H] when they form a full cartesian tree, else PeerBenchError naming the
    first node that is missing or extra."""
    given = {tuple(p) for p in paths}
    if not given:
        raise PeerBenchError("tree: no nodes; Medusa's engine needs at least one head level")
    depth = max(len(p) for p in given)
    topks = [1 + max((p[d] for p in given if len(p) > d), default=-1) for d in range(depth)]
    expected = set(cartesian_paths([1, *topks]))
    missing, extra = sorted(expected - given), sorted(given - expected)
    if missing or extra:
        what = f"lacks node {list(missing[0])}" if missing else f"has node {list(extra[0])} outside"
        raise PeerBenchError(f"tree {what} the cartesian tree [1, {', '.join(map(str, topks))}]; medusa-llm 0.1 "
                             f"runs only full cartesian trees")
    return [1, *topks]


@dataclass(frozen=True)
class Row:
    name: str
    tokens: int
    wall: float
    forwards: int
    steps: int
    accepted: int  # accepted drafts, all steps
    identical_own: int  # answers identical to the same stack's plain greedy
    identical_ours: int  # answers identical to our plain greedy (ar)
    answers: int
    times: dict[str, float] | None  # phase totals, when the method reports them

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else float("nan")

    @property
    def tau(self) -> float:
        return self.tokens / self.forwards if self.forwards else float("nan")


def _turns(record: dict[str, Any], name: str) -> list[dict[str, Any]]:
    try:
        return record["methods"][name]["turns"]
    except (KeyError, TypeError):
        raise PeerBenchError(f"record: methods.{name}.turns missing") from None


def summarize(record: dict[str, Any]) -> dict[str, Row]:
    """One Row per method present in the record (in METHODS order)."""
    present = [n for n in METHODS if n in record.get("methods", {})]
    unknown = sorted(set(record.get("methods", {})) - set(METHODS))
    if unknown:
        raise PeerBenchError(f"record: methods.{unknown[0]} is not a known method ({', '.join(METHODS)})")
    rows = {}
    for name in present:
        turns = _turns(record, name)
        own = METHODS[name].greedy or name
        own_turns = _turns(record, own) if own in present else None
        ref_turns = _turns(record, "ar") if "ar" in present else None
        times = None
        if all(t.get("times") for t in turns) and turns:
            times = {p: sum(t["times"].get(p, 0.0) for t in turns) for p in PHASES}
        rows[name] = Row(
            name=name, tokens=sum(len(t["tokens"]) for t in turns), wall=sum(t["wall"] for t in turns),
            forwards=sum(t["forwards"] for t in turns), steps=sum(len(t["accepted"]) for t in turns),
            accepted=sum(sum(t["accepted"]) for t in turns),
            identical_own=_identical(turns, own_turns), identical_ours=_identical(turns, ref_turns),
            answers=len(turns), times=times,
        )
    return rows


def _identical(turns: list[dict[str, Any]], reference: list[dict[str, Any]] | None) -> int:
    if reference is None:
        return -1
    if len(reference) != len(turns):
        raise PeerBenchError(f"record: {len(turns)} answers against {len(reference)} of the reference")
    return sum(a["tokens"] == b["tokens"] for a, b in zip(turns, reference))


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None or x != x else format(x, spec)


def format_table(record: dict[str, Any]) -> str:
    """The markdown table of one run, then the goals and the peers that did not run."""
    rows = summarize(record)
    lines = ["| method | stack | tok/s | τ | × greedy (same stack) | ours ÷ peer | = own greedy | = our greedy |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in rows.items():
        m = METHODS[name]
        base = rows.get(m.greedy) if m.greedy else None
        peer = rows.get(m.peer) if m.peer else None
        ratio = row.tok_s / base.tok_s if base else None
        vs = row.tok_s / peer.tok_s if peer else None
        own = f"{row.identical_own}/{row.answers}" if row.identical_own >= 0 else "—"
        ours = f"{row.identical_ours}/{row.answers}" if row.identical_ours >= 0 else "—"
        ties = sum(d["near_tie"] for d in (record.get("divergences") or {}).get(name, []))
        if ties:
            ours += f" (+{ties} near-tie)"
        lines.append(f"| {m.label} | {m.stack} | {row.tok_s:.2f} | {row.tau:.2f} | {_fmt(ratio, '.2f')} | "
                     f"{_fmt(vs, '.2f')} | {own} | {ours} |")
    for peer, reason in (record.get("unavailable") or {}).items():
        lines.append(f"| {peer}: not run | — | — | — | — | — | — | — |")
    out = ["\n".join(lines), ""]
    out += goal_lines(rows, record)
    for name, found in (record.get("divergences") or {}).items():
        for d in found:
            kind = "near-tie" if d["near_tie"] else "MISMATCH"
            out.append(f"{kind}: {METHODS[name].label}, prompt {d['prompt']}, new token {d['index']}: "
                       f"{d['method']} where our greedy has {d['ours']}")
    for peer, reason in (record.get("unavailable") or {}).items():
        out.append(f"{peer} not run: {reason}")
    return "\n".join(out)


def goal_lines(rows: dict[str, Row], record: dict[str, Any] | None = None) -> list[str]:
    """One line per goal: met or missed, with the figures. For our Medusa against Medusa's engine, τ is also given
    over the answers both wrote identically: τ over different texts (a near-tie sends one of them down another
    continuation) compares the texts as much as the engines."""
    lines = []
    for name, need in GOALS.items():
        ours, peer = rows.get(name), rows.get(METHODS[name].peer or "")
        if ours is None or peer is None:
            continue
        ratio = ours.tok_s / peer.tok_s
        ok = ratio >= need and (name != "ours_medusa" or ours.tau >= peer.tau)
        tau = f", τ {ours.tau:.2f} vs {peer.tau:.2f}" if name == "ours_medusa" else ""
        if name == "ours_medusa" and record is not None:
            n, mine, theirs = same_answer_tau(record, name, peer.name)
            tau += f" (on the {n} identical answers: {_fmt(mine, '.2f')} vs {_fmt(theirs, '.2f')})"
        lines.append(f"goal {METHODS[name].label} ≥ {need:g}× {METHODS[peer.name].label}: "
                     f"{ratio:.2f}×{tau} — {'met' if ok else 'MISSED'}")
    return lines


def same_answer_tau(record: dict[str, Any], ours: str, peer: str) -> tuple[int, float, float]:
    """(answers, τ of `ours`, τ of `peer`) over the answers where both wrote the same tokens (nan when none)."""
    pairs = [(a, b) for a, b in zip(_turns(record, ours), _turns(record, peer)) if a["tokens"] == b["tokens"]]

    def tau(turns: list[dict[str, Any]]) -> float:
        forwards = sum(t["forwards"] for t in turns)
        return sum(len(t["tokens"]) for t in turns) / forwards if forwards else float("nan")

    return len(pairs), tau([a for a, _ in pairs]), tau([b for _, b in pairs])


def format_breakdown(record: dict[str, Any]) -> str:
    """Mean milliseconds per decoding step of each phase, for the methods that time their phases; tokens/step is
    1 + the mean accepted drafts (our prefill commits an answer's first token, Medusa's prefill commits none and its
    first step commits that token: hence its one extra forward per answer in τ)."""
    rows = [r for r in summarize(record).values() if r.times is not None and r.steps]
    if not rows:
        return ""
    lines = ["| method | steps | tokens/step | " + " | ".join(f"{p} ms" for p in PHASES[1:]) + " | step ms | prefill ms/answer |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in PHASES[1:]) + " | ---: | ---: |"]
    for r in rows:
        per = [1000 * r.times[p] / r.steps for p in PHASES[1:]]
        lines.append(f"| {METHODS[r.name].label} | {r.steps} | {1 + r.accepted / r.steps:.2f} | "
                     + " | ".join(f"{x:.1f}" for x in per) + f" | {sum(per):.1f} | "
                     f"{1000 * r.times['prefill'] / r.answers:.1f} |")
    return "\n".join(lines)
