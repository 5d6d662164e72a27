"""Section `drafters` of the GPU check (scripts/gpu_check.py): every drafter kind through the public API on the device.

A small random Llama saved with Medusa heads, an EAGLE-3 draft and a draft model (each a checkpoint), plus prompt
lookup, lookahead and Jacobi by name, each loaded with `inference.load` in fp32 with TF32 off: a left-padded batch
decoded greedily must equal plain greedy decoding token for token, and seeded sampling must run. `plan` is
gpu_check's Plan (drafter_vocab, drafter_prompts, drafter_new_tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch


def drafters_section(folder: Path, plan: Any, device: torch.device, seed: int, say: Callable[[str], None]) -> dict:
    """Greedy identity of every drafter kind, loaded as a user loads it, on `device` (see the module docstring)."""
    from transformers import AutoModelForCausalLM, LlamaConfig  # deferred: after the package checks

    from inference import load  # deferred: after the package checks
    from inference.bench.engine_check import lm_head_eagle3, lm_head_heads  # deferred: after the package checks
    from models.checkpoint import save_drafter  # deferred: after the package checks
    from models.eagle3 import save_eagle3  # deferred: after the package checks

    config = LlamaConfig(vocab_size=plan.drafter_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    base = folder / "target"
    target.save_pretrained(base)
    save_drafter(folder / "medusa", lm_head_heads(target, 3), str(base))
    save_eagle3(folder / "eagle3", lm_head_eagle3(target), str(base))
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for mine, theirs in zip(draft.parameters(), target.parameters()):
            mine.copy_(theirs + 0.02 * torch.randn_like(theirs))
    draft.save_pretrained(folder / "draft")
    kinds = {"medusa": (folder / "medusa", None), "eagle3": (folder / "eagle3", None),
             "eagle3_dynamic": (folder / "eagle3", "dynamic:10:4:3"), "draft_model": (folder / "draft", "chain:3"),
             "prompt_lookup": ("prompt_lookup", None), "lookahead": ("lookahead", None), "jacobi": ("jacobi", None)}
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for row, length in enumerate(plan.drafter_prompts):  # a short pattern repeated: drafts find matches
        pattern = torch.randint(3, plan.drafter_vocab, (row % 4 + 1,), generator=g).tolist()
        prompts.append((pattern * length)[:length])
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        def engine(path, tree=None, device_=device):
            return load(path, base=str(base), dtype="fp32", device=device_, tree=tree)

        def run(loaded, **sampling):
            return loaded.generate_ids(prompts, max_new_tokens=plan.drafter_new_tokens, **sampling)

        plain = run(engine(None))
        on_cpu = run(engine(None, device_="cpu"))
        results: dict[str, Any] = {
            "prompts": len(prompts), "new_tokens": plan.drafter_new_tokens,
            "plain_device_vs_cpu_identical_rows": sum(a == b for a, b in zip(plain.sequences, on_cpu.sequences))}
        for name, (path, tree) in kinds.items():
            say(f"drafters: {name}")
            loaded = engine(path, tree)
            out, sampled = run(loaded), run(loaded, temperature=0.8, top_k=20, seed=seed)
            results[name] = {
                "identical_rows": sum(a == b for a, b in zip(out.sequences, plain.sequences)),
                "tau": 1.0 + out.stats.mean_accepted, "target_forwards": out.stats.target_forwards,
                "sampled_tokens": sampled.stats.new_tokens}
        results["mismatched"] = [name for name in kinds if results[name]["identical_rows"] != len(prompts)]
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    if results["mismatched"]:
        raise AssertionError(f"greedy output differs from plain greedy decoding for {', '.join(results['mismatched'])}"
                             f": {json.dumps({n: results[n] for n in results['mismatched']})}")
    return results
