"""Section `compiled` of scripts/gpu_check.py: the engine's static cache and compiled step (DecodeConfig.compile) on the
random bf16 target, against the eager engine and the memory-bandwidth floor.

- `step_ms`: a target forward over the root plus 0, 8 and 31 drafted nodes (buckets 1, 9 and 32) on a --context cache,
  eager and compiled (CUDA graphs), each the median of `reps` after a warm-up that compiles (inference.engine.step_cost);
  `floor_ms` = weight bytes / copy bandwidth, and each plain step over it; `step_wall_s`: each curve's wall time (the
  compiled one's excess is compilation).
- `decode`: greedy decoding of the random prompts (prompt_len + new_tokens, a batch of one), plain and with prompt
  lookup, eager and compiled: tokens/s without compilation, compile seconds, and the rows whose answer is the eager
  engine's (bf16: a compiled graph rounds differently, so a near tie may flip; fp32 equality is section `drafters`'
  and tests/test_static_cache.py's).
- `identical_fp32`: a small fp32 random Llama (TF32 off), plain and prompt lookup: compiled answers must equal eager
  ones token for token.
The prompts' lengths put every run's cache on one capacity (prompt + new tokens + 64 within 512 slots), so each
bucket compiles once for the step curve and the decoding alike.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def compiled_section(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, context: int, reps: int,
                     small_model: Callable[[], torch.nn.Module], say: Callable[[str], None]) -> dict[str, Any]:
    from inference.bench.bandwidth import copy_bandwidth, weight_bytes  # deferred: after the package checks
    from inference.engine.step_cost import measure_step_cost

    device = model.get_input_embeddings().weight.device
    floor_ms = weight_bytes(model) / copy_bandwidth(device) * 1e3
    result: dict[str, Any] = {"floor_ms": floor_ms, "step_ms": {}, "step_wall_s": {}}
    for mode, settings in (("eager", {}), ("compiled", {"compile": True})):
        say(f"compiled: step cost, {mode}")
        start = time.perf_counter()
        cost = measure_step_cost(model, (0, 8, 31), repeats=reps, context=context, **settings)
        result["step_ms"][mode] = dict(cost.points)
        result["step_wall_s"][mode] = time.perf_counter() - start  # compiled: its excess over eager is compilation
        result[f"{mode}_plain_over_floor"] = cost.ms(0) / floor_ms
        result[f"{mode}_8_drafted_over_plain"] = cost.ms(8) / cost.ms(0)
    result["decode"] = decode_runs(model, prompts, new_tokens, say)
    say("compiled: fp32 identity on a small random Llama")
    result["identical_fp32"] = identity(small_model(), [p[:40] for p in prompts], min(new_tokens, 32))
    return result


def small_llama(vocab: int, device: torch.device, seed: int) -> torch.nn.Module:
    """A frozen fp32 random Llama of 2 layers (hidden 64, GQA) on `device`."""
    from transformers import AutoModelForCausalLM, LlamaConfig  # deferred: after the package checks

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0, initializer_range=0.2)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval().requires_grad_(False)


def runs(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Each mode x drafter: the answers, tokens/s (compilation excluded) and compile seconds."""
    from inference.drafters.prompt_lookup import PromptLookupDrafter  # deferred: after the package checks
    from inference.engine.loop import DecodeConfig, generate

    device = model.get_input_embeddings().weight.device
    out: dict[str, Any] = {}
    for drafter_name in ("plain", "prompt_lookup"):
        for mode in ("eager", "compiled"):
            config = DecodeConfig(max_new_tokens=new_tokens, compile=mode == "compiled")
            answers, tokens, seconds, compile_s, forwards = [], 0, 0.0, 0.0, 0
            for prompt in prompts:
                drafter = PromptLookupDrafter(num_draft=7) if drafter_name == "prompt_lookup" else None
                ids = torch.tensor([prompt], device=device)
                gen = generate(model, ids, drafter, config)
                answers.append(gen.sequences[0])
                tokens += gen.stats.new_tokens
                seconds += gen.stats.times.total
                compile_s += gen.stats.times.compile
                forwards += gen.stats.target_forwards
            out[f"{drafter_name}.{mode}"] = {"answers": answers, "tokens_per_s": tokens / seconds,
                                             "compile_s": compile_s, "tau": tokens / forwards}
    return out


def decode_runs(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int,
                say: Callable[[str], None]) -> dict[str, Any]:
    say("compiled: decoding, eager and compiled")
    made = runs(model, prompts, new_tokens)
    summary: dict[str, Any] = {}
    for name, run in made.items():
        drafter, mode = name.split(".")
        eager = made[f"{drafter}.eager"]["answers"]
        summary[name] = {k: v for k, v in run.items() if k != "answers"}
        summary[name]["rows_equal_eager"] = sum(a == b for a, b in zip(run["answers"], eager))
        summary[name]["speedup_over_eager_plain"] = run["tokens_per_s"] / made["plain.eager"]["tokens_per_s"]
    return summary


def identity(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        vocab = model.config.vocab_size
        made = runs(model, [[t % vocab for t in p] for p in prompts], new_tokens)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return {drafter: {"rows": len(prompts), "identical": sum(a == b for a, b in zip(made[f"{drafter}.compiled"]["answers"],
                                                                                    made[f"{drafter}.eager"]["answers"]))}
            for drafter in ("plain", "prompt_lookup")}
