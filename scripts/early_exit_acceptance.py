"""Greedy acceptance of early-exit drafts (models.early_exit) at several exit layers, from one greedy decode of the
target per prompt, and a speedup estimate from CPU-time costs: a cheap stand-in for one `bench` run per layer count.

Why one decode is enough: under greedy verification a chain draft's depth-j token is accepted iff it equals the
target's greedy token and every earlier one was accepted, and while they are, the draft has read exactly the target's
own prefix. The early-exit draft at layer N predicts argmax lm_head(norm(h_N)) there, h_N being the target's own
state after layer N (the draft is the truncated target: tests/test_early_exit.py). So one forward of the target over
prompt + greedy answer with output_hidden_states gives every depth's verdict for every N, and replaying the engine's
steps (`chain_tau`) gives τ = new tokens per target forward, prefill included, as `bench` reports it (up to float
rounding between a cached and an uncached forward).

Costs are CPU seconds (time.process_time, one thread), so they depend less on what else the machine runs (cache
contention still counts): t_ar (one cached target token), t_verify (γ + 1 cached target tokens) and t_draft (one
cached token of the real early-exit model). Estimated speedup over plain greedy, forwards only (the engine's own
per-step work left out, so `bench` measures somewhat less): (T − 1)·t_ar / (steps·(t_verify + γ·t_draft)).

    python scripts/early_exit_acceptance.py --model smollm2 --layers 4 8 12 --gamma 1 2 4 --limit 5 --max-new-tokens 64

`--draft DIR ...` adds trained draft models (a `distill` / `stopper` checkpoint, or any plain draft model): their
verdicts come from one forward of the draft itself over prompt + answer (argmax at each answer position), which is
again exactly what greedy chain drafting accepts while the draft reads the target's own prefix.

    python scripts/early_exit_acceptance.py --model smollm2 --layers 6 --draft outputs/distill/smollm2-ee6 --dtype bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.chat import encode_prompt  # noqa: E402
from inference.api import Engine  # noqa: E402
from inference.bench.prompt_sets import default_questions, read_questions  # noqa: E402
from inference.engine.drafter import NoDrafter  # noqa: E402
from models.draft_model import load_draft_model  # noqa: E402
from models.loading import load_target, load_tokenizer  # noqa: E402
from models.refs import model_settings  # noqa: E402


def chain_tau(matches: list[bool], gamma: int) -> tuple[int, int]:
    """(target forwards, steps) of greedy chain drafting over T new tokens, T = len(matches) + 1: prefill yields the
    first token; each step drafts the next gamma, keeps the leading run that `matches` (matches[p - 1]: the draft
    predicts new token p from the exact prefix) and adds the target's own token after it."""
    total, pos, steps = len(matches) + 1, 1, 0
    while pos < total:
        run = 0
        while run < gamma and pos + run < total and matches[pos + run - 1]:
            run += 1
        pos += run + 1
        steps += 1
    return steps + 1, steps


@torch.no_grad()
def exit_matches(target, prompt: list[int], answer: list[int], layers: list[int]) -> dict[int, list[bool]]:
    """For each exit layer N: does argmax lm_head(norm(h_N)) at the position before new token p equal it (p >= 1)."""
    ids = torch.tensor([prompt + answer])
    hidden = target(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states  # L + 1 x [1, T, D]
    span = slice(len(prompt), len(prompt) + len(answer) - 1)  # positions predicting answer[1:]
    truth = torch.tensor(answer[1:])
    out = {}
    for n in layers:
        guess = target.lm_head(target.model.norm(hidden[n][0, span])).argmax(-1)  # [T - 1]
        out[n] = (guess == truth).tolist()
    return out


@torch.no_grad()
@torch.no_grad()
def draft_matches(draft, prompt: list[int], answer: list[int]) -> list[bool]:
    """Does the draft model's argmax at the position before new token p equal it (p >= 1), reading the target's
    own prefix (teacher forcing)."""
    logits = draft(input_ids=torch.tensor([prompt + answer]), use_cache=False).logits[0]  # [T, V]
    guess = logits[len(prompt): len(prompt) + len(answer) - 1].argmax(-1)  # [T_answer - 1]
    return (guess == torch.tensor(answer[1:])).tolist()


@torch.no_grad()
def cached_cost(model, context: list[int], width: int, repeats: int) -> float:
    """Median CPU seconds of one forward of `width` new tokens after `context` (its KV cache, cropped back after
    each timed forward)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=torch.tensor([context]), cache=cache, use_cache=True)
    new = torch.tensor([context[-width:]])
    positions = torch.arange(len(context), len(context) + width)[None]
    times = []
    for _ in range(repeats):
        start = time.process_time()
        model(input_ids=new, cache=cache, use_cache=True, position_ids=positions)
        times.append(time.process_time() - start)
        cache.crop(-width)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="target: conf/model name, builtin:<name>, directory or hub id")
    p.add_argument("--layers", type=int, nargs="*", default=[4, 8, 12], help="exit layers N (untrained early exits)")
    p.add_argument("--draft", nargs="*", default=[], help="trained draft models: distill/stopper checkpoints or dirs")
    p.add_argument("--dtype", default=None, help="fp32 | bf16 (default: the model config's dtype, else fp32)")
    p.add_argument("--gamma", type=int, nargs="+", default=[4], help="draft lengths (chain)")
    p.add_argument("--questions", default=str(default_questions()), help="MT-bench style question.jsonl")
    p.add_argument("--limit", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per cost (median)")
    args = p.parse_args()
    torch.set_num_threads(1)
    settings = model_settings(args.model)
    tokenizer = load_tokenizer(settings.ref, settings.chat_template)
    dtype = args.dtype or settings.dtype or "fp32"
    target = load_target(settings.ref, dtype=dtype)
    drafts = {d: load_draft_model(d, target, torch.device("cpu")) for d in args.draft}  # vocabulary checked
    engine = Engine(target, NoDrafter())
    matches: dict[int | str, list[list[bool]]] = {n: [] for n in [*args.layers, *args.draft]}
    new_tokens, costs = 0, None
    for q in read_questions(args.questions)[: args.limit]:
        prompt = encode_prompt(tokenizer, [{"role": "user", "content": q.turns[0]}], settings.chat_template)
        answer = engine.generate(prompt, max_new_tokens=args.max_new_tokens).sequences[0]
        new_tokens += len(answer)
        if costs is None:  # after the first answer (a realistic context length), before the slow part
            costs = measure_costs(target, prompt + answer, args, dtype, drafts)
        for n, m in exit_matches(target, prompt, answer, args.layers).items():
            matches[n].append(m)
        for d, model in drafts.items():
            matches[d].append(draft_matches(model, prompt, answer))
    print(f"{args.model} ({dtype}): {args.limit} prompts, {new_tokens} new tokens (greedy)")
    print(f"{'exit layer':>10} {'agreement':>10} " + " ".join(f"{f'tau g={g}':>9} {f'est. g={g}':>10}"
                                                            for g in args.gamma))
    for n in [*args.layers, *args.draft]:
        agreement = sum(map(sum, matches[n])) / max(sum(map(len, matches[n])), 1)
        row = f"{n:>10} {agreement:10.3f} " if isinstance(n, int) else f"{n}\n{'':>10} {agreement:10.3f} "
        for g in args.gamma:
            runs = [chain_tau(m, g) for m in matches[n]]
            forwards, steps = sum(r[0] for r in runs), sum(r[1] for r in runs)
            step_cost = costs.verify[g] + g * costs.draft[n]
            speedup = (new_tokens - len(runs)) * costs.ar / (steps * step_cost) if steps else float("nan")
            row += f"{new_tokens / forwards:9.2f} {speedup:9.2f}x "
        print(row.rstrip(), flush=True)


@dataclass(frozen=True)
class Costs:
    """CPU seconds of one cached forward: the target on 1 token (ar) and on g + 1 (verify[g]), draft N on 1."""

    ar: float
    verify: dict[int, float]
    draft: dict[int | str, float]  # exit layer N or trained draft path -> CPU seconds


def measure_costs(target, context: list[int], args: argparse.Namespace, dtype: str, drafts: dict[str, object]
                  ) -> Costs:
    exits = {n: load_target(f"early_exit:{args.model}:{n}", dtype=dtype) for n in args.layers}
    costs = Costs(cached_cost(target, context, 1, args.repeats),
                  {g: cached_cost(target, context, g + 1, args.repeats) for g in args.gamma},
                  {n: cached_cost(model, context, 1, args.repeats) for n, model in {**exits, **drafts}.items()})
    print(f"CPU ms per cached forward after {len(context)} tokens, one thread: target 1 token {costs.ar * 1e3:.1f}, "
          + ", ".join(f"{g + 1} tokens {t * 1e3:.1f}" for g, t in costs.verify.items()) + "; early exit "
          + ", ".join(f"{f'N={n}' if isinstance(n, int) else n} {t * 1e3:.1f}" for n, t in costs.draft.items()),
          flush=True)
    return costs

if __name__ == "__main__":
    main()
