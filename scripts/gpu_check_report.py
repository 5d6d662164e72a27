"""The text report of scripts/gpu_check.py, from its JSON alone: `python scripts/gpu_check_report.py gpu_check.json`
prints it again (gpu_check.py writes it as gpu_check.txt next to the JSON)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _f(value: Any, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def unavailable(name: str, section: Any) -> list[str]:
    """The report line of a section that has no figures (not run, failed, skipped), else []."""
    if section is None:
        return [f"{name}: not run"]
    if "error" in section:
        return [f"{name}: FAILED: {section['error']}"]
    if "skipped" in section:
        return [f"{name}: skipped: {section['skipped']}"]
    return []


def train_lines(train: Any, nf4: Any) -> list[str]:
    rows = [(label, part["throughput"], key) for label, part, key in (
        ("bf16 backbone, fp32 heads", train, "fp32_heads"), ("bf16 backbone, bf16 autocast", train, "bf16_autocast"),
        ("nf4 backbone, fp32 heads", nf4, "fp32_heads")) if not unavailable("", part) and part.get("throughput")]
    lines = unavailable("train", train) + unavailable("nf4", nf4)
    if rows:
        t = rows[0][1]
        lines.append(f"medusa1 step ({t['heads']} heads, batch {t['batch']} x {t['seq']}): tokens/s of a training step / "
                     f"of the frozen forward alone (bound B/(B+3H) = {t['bound']['ratio']:.3f})")
        lines += [f"  {label:30}{row[key]['train_tok_s']:10.0f} / {row[key]['forward_tok_s']:8.0f} = "
                  f"{row[key]['ratio']:.3f}" for label, row, key in rows]
    memory = {name: part["memory"] for name, part in (("bf16", train), ("nf4", nf4)) if not unavailable("", part)}
    if memory:
        any_memory = next(iter(memory.values()))
        parts = [f"{name} {_f(m['peak_mib'], ',.0f')} MiB" for name, m in memory.items()]
        reason = next((m["reason"] for m in memory.values() if m["reason"]), None)
        ratio = (nf4 or {}).get("nf4_over_bf16_peak")
        lines.append(f"peak GPU memory of a step ({any_memory['heads']} heads sharing the lm_head): {', '.join(parts)}"
                     + (f"; nf4/bf16 {ratio:.3f} (goal <= 0.4)" if ratio is not None else "")
                     + (f" ({reason})" if reason else ""))
    return lines


def engine_lines(engine: Any) -> list[str]:
    lines = unavailable("engine", engine)
    if lines:
        return lines
    cost = ", ".join(f"K={k} {v:.2f}" for k, v in engine["cost_ms"].items())
    heads = ", ".join(f"{v:.2f}" for v in engine["head_ms"])
    lines = [f"engine ({engine['dtype']}, {engine['prompts']} random prompts x {engine['new_tokens']} tokens): "
             f"forward + verify ms {cost}; heads 1..{len(engine['head_ms'])} deep ms {heads}",
             f"  {'method':8}{'nodes':>6}{'tau':>6}{'tok/s':>9}{'vs ar':>7}{'vs hf':>7}{'effic.':>8}   "
             "ms/step: draft forward verify cache other"]
    rows = [("plain", {"nodes": 1, "tau": 1.0, **engine["plain"]})]
    rows += [(f"tree{k}", row) for k, row in engine["trees"].items()]
    for name, row in rows:
        ms = row["per_step_ms"]
        lines.append(f"  {name:8}{row['nodes']:6d}{row['tau']:6.2f}{row['tokens_per_s']:9.1f}"
                     f"{_f(row.get('speedup_vs_ar')):>7}{_f(row.get('speedup_vs_hf')):>7}"
                     f"{_f(row.get('engine_efficiency')):>8}   " + " ".join(f"{ms[p]:.2f}" for p in
                                                                         ("draft", "forward", "verify", "cache", "other")))
    identity = engine["greedy_identity"]
    counts = ", ".join(f"{pair} {c['identical']}/{c['near_tie']}/{c['mismatch']}"
                       for pair, c in identity["pairs"].items())
    lines.append(f"greedy identity per prompt (identical/near tie/mismatch): {counts}")
    return lines


def drafter_lines(drafters: Any) -> list[str]:
    lines = unavailable("drafters", drafters)
    if lines:
        return lines
    kinds = [k for k, v in drafters.items() if isinstance(v, dict)]
    rows = ", ".join(f"{k} {drafters[k]['identical_rows']}/{drafters['prompts']} (tau {drafters[k]['tau']:.2f})"
                     for k in kinds)
    return [f"drafters through inference.load, fp32, {drafters['prompts']} left-padded prompts x "
            f"{drafters['new_tokens']} tokens, rows identical to plain greedy: {rows}; plain on the device vs on the "
            f"CPU {drafters['plain_device_vs_cpu_identical_rows']}/{drafters['prompts']}"]


def tiny_lines(tiny: Any) -> list[str]:
    lines = unavailable("tiny", tiny)
    if lines:
        return lines
    s = tiny["summary"]
    check = s.get("greedy_check") or {}
    return [f"tiny Medusa-1 bench ({s['config']['num_questions']} questions, {s['config']['max_new_tokens']} tokens, "
            f"{s['config']['dtype']}): tau {s['tau']:.2f}, {s['tokens_per_s']:.1f} tok/s, speedup "
            f"{_f(s['speedup_vs_ar'])}x our loop / {_f(s['speedup_vs_hf'])}x HF, engine efficiency "
            f"{_f(s['engine_efficiency'])}; greedy outputs identical: {check.get('identical')}"]


def smollm2_lines(smollm2: Any) -> list[str]:
    lines = unavailable("smollm2", smollm2)
    if lines:
        return lines
    lines = ["smollm2 with the CPU recipe's EAGLE-3 drafter (bf16): tok/s of the drafter / our plain loop / HF "
             "generate"]
    for mode in ("eager", "compiled"):
        s = smollm2[mode]["summary"]
        m, check = s["methods"], s.get("greedy_check") or {}
        lines.append(f"  {mode:9}{s['tokens_per_s']:8.1f} / {m['ar']['tokens_per_s']:7.1f} / "
                     f"{m['hf']['tokens_per_s']:7.1f}   tau {s['tau']:.2f}, {_f(s['speedup_vs_ar'])}x our loop, "
                     f"{_f(s['speedup_vs_hf'])}x HF; lossless (no real mismatch): {check.get('lossless')}")
    return lines


def compiled_lines(compiled: Any) -> list[str]:
    lines = unavailable("compiled", compiled)
    if lines:
        return lines
    steps = compiled["step_ms"]
    lines = [f"compiled step (static cache, CUDA graphs) vs eager on {compiled['shape']}; memory floor "
             f"{compiled['floor_ms']:.2f} ms:"]
    for mode in ("eager", "compiled"):
        ms = ", ".join(f"{k} drafted {v:.2f}" for k, v in steps[mode].items())
        lines.append(f"  {mode:9} ms {ms}; plain {compiled[f'{mode}_plain_over_floor']:.2f}x the floor, a 16-node "
                     f"tree {compiled[f'{mode}_16_nodes_over_plain']:.2f}x plain")
    for name, row in compiled["decode"].items():
        lines.append(f"  {name:24}{row['tokens_per_s']:9.1f} tok/s  tau {row['tau']:.2f}  draft "
                     f"{row['draft_ms']:.2f} ms  "
                     f"{row['speedup_over_eager_plain']:.2f}x eager plain  compile {row['compile_s']:.1f} s  "
                     f"rows equal to eager {row['rows_equal_eager']}")
    same = ", ".join(f"{d} {r['identical']}/{r['rows']} (τ {_f(r['tau_eager'])} eager, {_f(r['tau_compiled'])} "
                     f"compiled)" for d, r in compiled["identical_fp32"].items())
    return lines + [f"  fp32 compiled answers identical to eager: {same}"]


def recipe_lines(recipes: Any) -> list[str]:
    lines = unavailable("recipes", recipes)
    if lines:
        return lines
    plan = recipes["plan"]
    lines = [f"recipes on a random {recipes['shape']} (hidden {plan['hidden']} x {plan['layers']} layers, vocab "
             f"{plan['vocab']}; batch {plan['batch']}, max length {plan['max_length']}, {plan['steps']} steps, "
             f"{plan['prompts']} self-distilled prompts), peak memory vs train/memory_model.py's prediction:"]
    for name, row in recipes["commands"].items():
        peak = row["cuda_peak_bytes"] if row["cuda_peak_bytes"] is not None else row["peak_rss_bytes"]
        kind = "GPU allocated" if row["cuda_peak_bytes"] is not None else "resident set"
        line = f"  {name:14}{row['wall_s']:7.1f} s   peak {peak / 2**30:7.2f} GiB ({kind})"
        if "predicted" in row:
            p, bound = row["predicted"], row["bound"]
            line += (f"   {row['tokens_per_s']:9.0f} tok/s   predicted {p['peak_bytes'] / 2**30:.2f} GiB at "
                     f"T={p['seq']} (the {p['phase']}), {bound['peak_bytes'] / 2**30:.2f} GiB at T={bound['seq']}")
        elif "trajectories" in row:
            line += f"   {row['tokens_per_s']:9.0f} answer tok/s ({row['trajectories']} trajectories)"
        lines.append(line)
    return lines


def format_report(results: dict[str, Any]) -> str:
    m, p = results["meta"], results["meta"]["plan"]
    head = (f"draftsmith GPU check on {m['device_name']} ({m['device']}{', --small' if m['small'] else ''}): random "
            f"Llama hidden {p['hidden']} x {p['layers']} layers, vocab {p['vocab']}; {m['wall_s']:.0f} s")
    bad = [f"NaN or infinite, written as null: {', '.join(m['nonfinite'])}"] if m.get("nonfinite") else []
    return "\n".join([head, *bad, *train_lines(results.get("train"), results.get("nf4")),
                      *engine_lines(results.get("engine")), *compiled_lines(results.get("compiled")),
                      *drafter_lines(results.get("drafters")),
                      *tiny_lines(results.get("tiny")), *smollm2_lines(results.get("smollm2")),
                      *recipe_lines(results.get("recipes"))])


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_file():
        print("usage: python scripts/gpu_check_report.py <gpu_check.json>", file=sys.stderr)
        raise SystemExit(2)
    print(format_report(json.loads(Path(sys.argv[1]).read_text())))
