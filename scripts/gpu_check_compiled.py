"""Section `compiled` of scripts/gpu_check.py: the engine's static cache and compiled step (DecodeConfig.compile) on a
random bf16 target of Llama-3.1-8B's shapes (train.memory_model's; a small one with --small), against the eager engine
and the memory-bandwidth floor. Issue #62's GPU goals: a plain step <= 8 ms, a 16-node tree <= 1.2x a plain step, an
EAGLE-3 draft step (random drafter) <= 1.5 ms.

- `step_ms`: a target forward over the root plus 0, 8 and 15 drafted nodes (buckets 1, 9 and 16) on a
  `context`-token cache, eager and compiled (CUDA graphs), each the median of `reps` after a warm-up that compiles
  (inference.engine.step_cost); `floor_ms` = weight bytes / read bandwidth and each plain step over it; `step_wall_s`:
  each curve's wall time (the compiled one's excess is compilation).
- `decode`: greedy decoding of random prompts (a batch of one), plain and EAGLE-3 with a random draft (a static
  16-node tree, so no shape beyond the curve's), eager and compiled: tokens/s without compilation, τ, compile
  seconds, the draft phase's ms a step (EAGLE-3's: its draft step) and the rows whose answer is the eager engine's
  (bf16: a compiled graph rounds differently, so a near tie may flip).
- `identical_fp32`: a small fp32 random Llama (TF32 off), plain, prompt lookup and EAGLE-3: compiled answers must
  equal eager ones token for token, and EAGLE-3's τ with its draft compiled (CUDA graphs) its τ eager.
Every run shares one cache capacity (`cache_slots`), so each bucket compiles once for the curve and the decoding:
three compilations of the 8B step in all (each about a minute with CUDA graphs; prompt lookup's chains would add five),
and EAGLE-3's draft layer step and logits, a few small graphs (pending pairs in buckets, one per tree level).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from train.memory_model import Shape  # the standard library only: no package check needed

NODES = (0, 8, 15)  # drafted nodes of the step curve: buckets 1, 9 and 16
DRAFTERS = ("plain", "eagle3")
FP32_DRAFTERS = ("plain", "prompt_lookup", "eagle3")  # EAGLE-3's compiled draft must accept what its eager one does


def compiled_section(shape: Shape, prompts: int, prompt_len: int, new_tokens: int, context: int, reps: int,
                     device: torch.device, seed: int, say: Callable[[str], None], out: Path | None = None
                     ) -> dict[str, Any]:
    """The section's figures (module docstring). With `out`, what is measured so far is also written to
    out/PARTIAL_NAME after each phase, so that a run cut off by its time limit still brings back its first figures."""
    from inference.bench.bandwidth import read_bandwidth, weight_bytes  # deferred: after the package checks
    from inference.engine.loop import TREE_SLOTS  # deferred: after the package checks
    from inference.engine.static import capacity_for  # deferred: after the package checks
    from inference.engine.step_cost import measure_step_cost  # deferred: after the package checks

    say(f"compiled: a random bf16 Llama of {shape.name}'s shapes on {device}")
    model = random_llama(shape, torch.bfloat16, device, seed)
    slots = capacity_for(max(context + NODES[-1] + 1, prompt_len + new_tokens) + TREE_SLOTS)
    floor_ms = weight_bytes(model) / read_bandwidth(device) * 1e3
    result: dict[str, Any] = {"shape": shape.name, "floor_ms": floor_ms, "cache_slots": slots, "step_ms": {},
                              "step_wall_s": {}}
    for mode, settings in (("eager", {}), ("compiled", {"compile": True, "cache_slots": slots})):
        say(f"compiled: step cost, {mode}")
        start = time.perf_counter()
        cost = measure_step_cost(model, NODES, repeats=reps, context=context, **settings)
        result["step_ms"][mode] = dict(cost.points)
        result["step_wall_s"][mode] = time.perf_counter() - start
        result[f"{mode}_plain_over_floor"] = cost.ms(0) / floor_ms
        result[f"{mode}_16_nodes_over_plain"] = cost.ms(15) / cost.ms(0)
        keep(result, out)
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, shape.vocab, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    say("compiled: decoding, eager and compiled")
    result["decode"] = compare(runs(model, ids, new_tokens, slots, DRAFTERS))
    keep(result, out)
    del model
    say("compiled: fp32 identity on a small random Llama")
    small = random_llama(SMALL, torch.float32, device, seed)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        made = runs(small, [[t % SMALL.vocab for t in p[:40]] for p in ids], min(new_tokens, 32), 256, FP32_DRAFTERS)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    result["identical_fp32"] = {d: {"rows": len(ids), "identical": sum(
        a == b for a, b in zip(made[f"{d}.compiled"]["answers"], made[f"{d}.eager"]["answers"])),
        "tau_eager": made[f"{d}.eager"]["tau"], "tau_compiled": made[f"{d}.compiled"]["tau"]} for d in FP32_DRAFTERS}
    return result


PARTIAL_NAME = "compiled_partial.json"


def keep(result: dict[str, Any], out: Path | None) -> None:
    """Write the figures so far to out/PARTIAL_NAME (Python's JSON: a NaN stays NaN; the report's is strict)."""
    if out is not None:
        from data.atomic import write_text  # deferred: after the package checks

        write_text(out / PARTIAL_NAME, json.dumps(result, indent=2, default=str) + "\n")


def random_llama(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    """A frozen random Llama of `shape` (train.memory_model.Shape), built on `device`; no EOS id, so every method
    decodes the same number of tokens."""
    from train.memory_measure import random_llama as build  # deferred: after the package checks

    model = build(shape, dtype, device, seed, max_position_embeddings=4096, eos_token_id=None,
                  tie_word_embeddings=False, initializer_range=0.02 if dtype == torch.bfloat16 else 0.2)
    return model.eval().requires_grad_(False)


def drafter_for(name: str, model: torch.nn.Module) -> Any:
    from inference.bench.engine_check import lm_head_eagle3  # deferred: after the package checks
    from inference.drafters.eagle3 import Eagle3Drafter, eagle3_tree  # deferred: after the package checks
    from inference.drafters.prompt_lookup import PromptLookupDrafter  # deferred: after the package checks
    from inference.engine.tree import default_tree_path  # deferred: after the package checks

    if name == "prompt_lookup":
        return PromptLookupDrafter(num_draft=8)
    if name == "eagle3":
        draft = lm_head_eagle3(model).to(model.get_input_embeddings().weight)
        tree = eagle3_tree(str(default_tree_path(4)), [], model.device)  # 16 nodes, 4 deep
        return Eagle3Drafter(draft, tree, model.get_input_embeddings())
    return None


def runs(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, slots: int,
         names: tuple[str, ...]) -> dict[str, Any]:
    """Each drafter x mode: the answers, tokens/s (compilation excluded), compile seconds, τ and draft ms a step."""
    from inference.engine.loop import DecodeConfig, generate  # deferred: after the package checks

    device = model.get_input_embeddings().weight.device
    out: dict[str, Any] = {}
    for name in names:
        for mode in ("eager", "compiled"):
            config = DecodeConfig(max_new_tokens=new_tokens, compile=mode == "compiled", cache_slots=slots
                                  if mode == "compiled" else None, sync_phases=True)
            answers, tokens, seconds, compile_s, forwards, draft_s, steps = [], 0, 0.0, 0.0, 0, 0.0, 0
            for prompt in prompts:
                gen = generate(model, torch.tensor([prompt], device=device), drafter_for(name, model), config)
                answers.append(gen.sequences[0])
                s, t = gen.stats, gen.stats.times
                tokens, seconds, compile_s = tokens + s.new_tokens, seconds + t.total, compile_s + t.compile
                forwards, draft_s, steps = forwards + s.target_forwards, draft_s + t.draft, steps + s.steps
            out[f"{name}.{mode}"] = {"answers": answers, "tokens_per_s": tokens / seconds, "compile_s": compile_s,
                                     "tau": tokens / forwards, "draft_ms": draft_s / max(steps, 1) * 1e3}
    return out


def compare(made: dict[str, Any]) -> dict[str, Any]:
    """Each run's figures with its rows equal to the eager run's and its speed-up over eager plain decoding."""
    summary: dict[str, Any] = {}
    for name, run in made.items():
        eager = made[f"{name.split('.')[0]}.eager"]["answers"]
        summary[name] = {k: v for k, v in run.items() if k != "answers"}
        summary[name]["rows_equal_eager"] = sum(a == b for a, b in zip(run["answers"], eager))
        summary[name]["speedup_over_eager_plain"] = run["tokens_per_s"] / made["plain.eager"]["tokens_per_s"]
    return summary


SMALL = Shape("small_fp32", 64, 2, 4, 2, 128, 512)  # the fp32 identity model