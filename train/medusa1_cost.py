"""What a Medusa-1 training step costs, measured: tokens/s against the frozen backbone's forward alone, the arithmetic
bound on that ratio, and the peak GPU memory of a step. Used by scripts/bench_medusa1_train.py (CPU) and
scripts/gpu_check.py (GPU).

Dimension letters: B batch, T time, D hidden, V vocab.

The bound (docs/results.md, "Training cost and memory"): per token the frozen backbone costs `backbone_macs`
multiply-adds (forward only) and the heads 3 x `heads_macs` (forward, input gradients, weight gradients), so a
training step runs at most backbone / (backbone + 3 heads) of the backbone forward's tokens/s, when a multiply-add
costs the same everywhere. It is exact for heads with their own projections; shared-lm_head heads compute no weight
gradient for the projection, so for them it is conservative.
"""

from __future__ import annotations

import gc
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
from omegaconf import OmegaConf
from torch import nn

from models.medusa import MedusaConfig
from train.config import Medusa1Config
from train.medusa1 import MedusaTrainModule, Method

MIB = 2**20


def medusa_method(num_heads: int, share_lm_head: bool = False) -> Method:
    """The medusa1 method with its defaults (conf/method/medusa1.yaml) but `num_heads` and `share_lm_head`."""
    cfg = OmegaConf.create({"method": OmegaConf.structured(Medusa1Config(num_heads=num_heads, share_lm_head=share_lm_head))})
    return Method(cfg)


def random_batches(vocab: int, n: int, batch: int, seq: int, device: torch.device | str = "cpu",
                   seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`n` batches of [B, T] uniform token ids, every position trained (labels = inputs)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued kernels, so a wall-clock timer sees the work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Throughput:
    train_tok_s: float  # a medusa1 step: backbone forward + heads forward/backward + AdamW
    forward_tok_s: float  # the frozen backbone's forward alone (the floor), same batches

    @property
    def ratio(self) -> float:
        return self.train_tok_s / self.forward_tok_s


@dataclass(frozen=True)
class Bound:
    backbone_macs: int  # multiply-adds per token of the backbone forward (every linear layer, lm_head included)
    heads_macs: int  # multiply-adds per token of the heads' forward (residual blocks + vocabulary projections)

    @property
    def ratio(self) -> float:
        return self.backbone_macs / (self.backbone_macs + 3 * self.heads_macs)


@dataclass(frozen=True)
class PeakMemory:
    loaded_mib: float  # allocated once the target is loaded, before the heads exist
    peak_mib: float  # torch.cuda.max_memory_allocated over the steps: weights, heads, AdamW state, activations


def trainer(method: Method, target: nn.Module, device: torch.device,
            autocast: torch.dtype | None = None) -> tuple[MedusaTrainModule, Callable[[dict], torch.Tensor]]:
    """The method's train module on `target` (heads moved to `device`) and one optimizer step over a batch,
    returning the loss. `autocast` mirrors training.bf16 (HF Trainer autocasts the loss computation only)."""
    module = method.build(target, None)
    module.heads.to(device)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(device.type, dtype=autocast) if autocast is not None else nullcontext():
            loss = method.forward_loss(module, batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return module, step


def throughput(target: nn.Module, method: Method, batches: list[dict[str, torch.Tensor]], rounds: int,
               autocast: torch.dtype | None = None) -> Throughput:
    """Tokens/s of medusa1 steps and of the frozen forward on the same batches, alternating `rounds` times so
    background load hits both alike; one warm-up of each first. Synchronises around every timer on CUDA."""
    device = batches[0]["input_ids"].device
    module, train_step = trainer(method, target, device, autocast)

    @torch.no_grad()
    def forward_step(b: dict[str, torch.Tensor]) -> None:
        target(input_ids=b["input_ids"], attention_mask=b["attention_mask"])

    for fn in (train_step, forward_step):
        fn(batches[0])
    seconds = {"train": 0.0, "forward": 0.0}
    for _ in range(rounds):
        for name, fn in (("train", train_step), ("forward", forward_step)):
            synchronize(device)
            start = time.perf_counter()
            for b in batches:
                fn(b)
            synchronize(device)
            seconds[name] += time.perf_counter() - start
    del module, train_step
    release(device)
    tokens = rounds * sum(b["input_ids"].numel() for b in batches)
    return Throughput(train_tok_s=tokens / seconds["train"], forward_tok_s=tokens / seconds["forward"])


def arithmetic_bound(target: nn.Module, c: MedusaConfig) -> Bound:
    """B and H of the bound for `target` and heads of config `c` (quantized linears count their logical in x out
    shape)."""
    backbone = sum(m.in_features * m.out_features for m in target.modules() if isinstance(m, nn.Linear))
    return Bound(backbone_macs=backbone,
                 heads_macs=c.num_heads * (c.num_layers * c.hidden_size**2 + c.hidden_size * c.vocab_size))


def cuda_peak_memory(target: nn.Module, method: Method, batches: list[dict[str, torch.Tensor]],
                     baseline: int) -> PeakMemory:
    """Peak GPU memory of medusa1 steps on `target` (already on the GPU), above `baseline` bytes (what was allocated
    before the target was loaded). The peak is reset after loading: the steps are measured, not the one-off load."""
    device = batches[0]["input_ids"].device
    release(device)
    loaded = torch.cuda.memory_allocated(device) - baseline
    torch.cuda.reset_peak_memory_stats(device)
    module, step = trainer(method, target, device)
    for b in batches:
        step(b)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    del module, step
    release(device)
    return PeakMemory(loaded_mib=loaded / MIB, peak_mib=peak / MIB)


def release(device: torch.device) -> None:
    """Free what the last measurement left behind, so the next one starts from the same allocation."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class StepSetup:
    """`heads` medusa1 heads (method defaults otherwise) trained on `steps` random batches of batch x seq tokens."""

    heads: int
    batch: int
    seq: int
    steps: int
    share_lm_head: bool = False

    def batches(self, target: nn.Module, seed: int) -> list[dict[str, torch.Tensor]]:
        device = target.get_input_embeddings().weight.device
        return random_batches(target.config.vocab_size, self.steps, self.batch, self.seq, device, seed)


def memory_figures(target: nn.Module, setup: StepSetup, baseline: int, seed: int = 0) -> dict[str, Any]:
    """Peak GPU memory of `setup`'s steps as a JSON-ready dict. Off CUDA the steps still run (their last loss is
    reported) and the memory figures are None, with the reason: peak resident memory is another quantity."""
    method = medusa_method(setup.heads, share_lm_head=setup.share_lm_head)
    data = setup.batches(target, seed)
    device = data[0]["input_ids"].device
    row: dict[str, Any] = {"heads": setup.heads, "share_lm_head": setup.share_lm_head, "steps": setup.steps,
                           "batch": setup.batch, "seq": setup.seq}
    if device.type == "cuda":
        peak = cuda_peak_memory(target, method, data, baseline)
        return {**row, "loaded_mib": peak.loaded_mib, "peak_mib": peak.peak_mib, "reason": None}
    module, step = trainer(method, target, device)
    losses = [float(step(b)) for b in data]
    return {**row, "loaded_mib": None, "peak_mib": None, "last_loss": losses[-1],
            "reason": "not on CUDA: torch.cuda.max_memory_allocated has no CPU equivalent (the steps ran)"}


def throughput_figures(target: nn.Module, setup: StepSetup, rounds: int, variants: dict[str, torch.dtype | None],
                       seed: int = 0) -> dict[str, Any]:
    """Throughput (one entry per autocast variant: name -> None or a dtype) and the bound, as a JSON-ready dict."""
    method = medusa_method(setup.heads, share_lm_head=setup.share_lm_head)
    data = setup.batches(target, seed)
    row: dict[str, Any] = {"heads": setup.heads, "share_lm_head": setup.share_lm_head, "steps": setup.steps,
                           "batch": setup.batch, "seq": setup.seq, "rounds": rounds}
    for name, autocast in variants.items():
        t = throughput(target, method, data, rounds, autocast)
        row[name] = {"train_tok_s": t.train_tok_s, "forward_tok_s": t.forward_tok_s, "ratio": t.ratio}
    hidden = target.config.get_text_config().hidden_size
    c = MedusaConfig(setup.heads, method.m.num_layers, hidden, target.config.vocab_size, setup.share_lm_head)
    bound = arithmetic_bound(target, c)
    row["bound"] = {"backbone_macs": bound.backbone_macs, "heads_macs": bound.heads_macs, "ratio": bound.ratio}
    return row
