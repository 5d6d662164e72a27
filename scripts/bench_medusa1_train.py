"""Medusa-1 training cost, measured in one run.

1. Throughput: tokens/s of a medusa1 training step (frozen backbone forward + heads forward/backward + AdamW)
   divided by tokens/s of the frozen backbone's forward alone (the floor), on the same batches, alternating.
2. Memory: peak resident memory of a medusa1 step with an NF4 backbone divided by the same with bf16, on a random
   Llama large enough for weights to dominate (each run in its own subprocess; peak measured above the
   post-import baseline).

    python scripts/bench_medusa1_train.py [--model builtin:tiny] [--heads 3] [--batch 8] [--seq 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.loading import load_target  # noqa: E402
from train.medusa1_cost import medusa_method, random_batches  # noqa: E402
from train.medusa1_cost import throughput as measure_throughput  # noqa: E402


def throughput(args) -> dict[str, float]:
    target = load_target(args.model, dtype=args.dtype)
    data = random_batches(target.config.vocab_size, args.steps, args.batch, args.seq)
    t = measure_throughput(target, medusa_method(args.heads), data, args.rounds)
    return {"train_tok_s": t.train_tok_s, "forward_tok_s": t.forward_tok_s}


def peak_memory_child(path: str, quantization: str, heads: int, steps: int, batch: int, seq: int) -> None:
    """Runs in a subprocess: print the peak RSS (MiB) of `steps` medusa1 steps (weights loaded, heads and AdamW
    state included) above the post-import baseline."""

    def rss(field: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024
        raise RuntimeError(field)

    import train.medusa1  # noqa: F401  # deferred: its imports land before the baseline RSS is read

    baseline = rss("VmRSS")
    target = load_target(path, dtype="bf16", quantization=None if quantization == "bf16" else "nf4")
    method = medusa_method(heads, share_lm_head=True)
    module = method.build(target, None)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return the load's freed buffers (e.g. bf16 weights before NF4) to the OS
    loaded = rss("VmRSS") - baseline
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak: measure training, not the one-off load
    for b in random_batches(target.config.vocab_size, steps, batch, seq):
        method.forward_loss(module, b).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print(json.dumps({"peak_mib": rss("VmHWM") - baseline, "loaded_mib": loaded}))


def memory(args) -> dict[str, float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=args.mem_hidden, intermediate_size=args.mem_hidden * 8 // 3,
                         num_hidden_layers=args.mem_layers, num_attention_heads=args.mem_hidden // 64,
                         num_key_value_heads=args.mem_hidden // 64)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
        peaks = {}
        for quant in ("bf16", "nf4"):
            child = [sys.executable, __file__, "--child", tmp, quant, str(args.heads), str(args.mem_steps),
                     str(args.mem_batch), str(args.mem_seq)]
            out = subprocess.run(child, capture_output=True, text=True, check=True)
            peaks[quant] = json.loads(out.stdout.strip().splitlines()[-1])
    return {"bf16_peak_mib": peaks["bf16"]["peak_mib"], "nf4_peak_mib": peaks["nf4"]["peak_mib"],
            "bf16_loaded_mib": peaks["bf16"]["loaded_mib"], "nf4_loaded_mib": peaks["nf4"]["loaded_mib"],
            "nf4_over_bf16": peaks["nf4"]["peak_mib"] / peaks["bf16"]["peak_mib"]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        peak_memory_child(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mem-hidden", type=int, default=1536)
    p.add_argument("--mem-layers", type=int, default=12)
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--mem-batch", type=int, default=2)
    p.add_argument("--mem-seq", type=int, default=128)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    if not args.skip_throughput:
        t = throughput(args)
        print(f"model {args.model} ({args.dtype}), {args.heads} heads, batch {args.batch} x {args.seq} tokens")
        print(f"  backbone forward only : {t['forward_tok_s']:9.0f} tokens/s")
        print(f"  medusa1 training step : {t['train_tok_s']:9.0f} tokens/s")
        print(f"  ratio (goal >= 0.85)  : {t['train_tok_s'] / t['forward_tok_s']:9.3f}")
    if not args.skip_memory:
        m = memory(args)
        print(f"random Llama hidden {args.mem_hidden} x {args.mem_layers} layers, peak memory of {args.mem_steps} medusa1 "
              f"steps ({args.heads} heads, batch {args.mem_batch} x {args.mem_seq})")
        print(f"  bf16 backbone : {m['bf16_peak_mib']:8.0f} MiB peak ({m['bf16_loaded_mib']:.0f} MiB after loading)")
        print(f"  nf4 backbone  : {m['nf4_peak_mib']:8.0f} MiB peak ({m['nf4_loaded_mib']:.0f} MiB after loading)")
        print(f"  ratio (goal <= 0.4) : {m['nf4_over_bf16']:.3f}")


if __name__ == "__main__":
    main()
