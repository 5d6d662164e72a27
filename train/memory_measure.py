"""Measured peak memory of real training steps, to check train/memory_model.py against.

A random Llama of the given shapes, the method's own code path (train/medusa1.py, train/eagle3.py or train/cllm.py:
build, forward_loss, backward, AdamW step, zero_grad as HF Trainer does; CLLM's batch is random trajectories laid
out by its own collator, `cllm_batch`), two steps (the second runs with the optimizer's
moments allocated). On CUDA the figure is torch.cuda.max_memory_allocated above what was allocated before the steps;
on CPU it is the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) above the resident set
before the steps. glibc keeps freed blocks under its mmap threshold for reuse, so CPU runs should start with
MALLOC_MMAP_THRESHOLD_=65536 in the environment (scripts/train_memory.py --measure sets it).
Dimension letters: B batch, T time.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from train.memory_model import Breakdown, Shape, TrainSetup, predict

CONF = Path(__file__).resolve().parents[1] / "conf" / "method"
DTYPES = {2: torch.bfloat16, 4: torch.float32}
MEASURED_METHODS = ("medusa1", "eagle3", "cllm")


@dataclass(frozen=True)
class Measurement:
    setup: TrainSetup
    measured: int  # bytes above the loaded model (target + trained weights) at the steps' peak
    predicted: int  # the model's peak less the same resident weights
    breakdown: Breakdown
    seconds: float  # both steps
    device: str

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted - self.measured) / self.measured


def llama_config(shape: Shape, **overrides: Any):
    """A LlamaConfig of `shape`; `overrides` replace any of its fields."""
    from transformers import LlamaConfig

    fields = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=shape.tied,
                  attention_bias=shape.qkv_bias)  # Qwen2's q, k, v biases (and here o's: d more)
    return LlamaConfig(**{**fields, **overrides})


def random_llama(shape: Shape, dtype: torch.dtype, device: torch.device | str, seed: int,
                 **overrides: Any) -> torch.nn.Module:
    """A Llama of `shape` (llama_config with `overrides`) initialised from `seed` directly on `device` (no CPU copy
    of a 7B target's weights), sdpa attention; trainable, as built."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(llama_config(shape, **overrides), dtype=dtype,
                                                attn_implementation="sdpa")


def method_config(setup: TrainSetup, model_path: str) -> DictConfig:
    """conf/method/<method>.yaml with K set, and the model keys the methods read."""
    from train.config import METHOD_SCHEMAS  # deferred: the schema registers Hydra configs on import

    values = OmegaConf.load(CONF / f"{setup.method}.yaml")
    values.pop("defaults", None)
    method = OmegaConf.merge(OmegaConf.structured(METHOD_SCHEMAS[setup.method]), values)
    method.name = setup.method
    if setup.method != "cllm":
        method["num_heads" if setup.method == "medusa1" else "ttt_steps"] = setup.steps
    if setup.method == "medusa1":
        method.share_lm_head = setup.share_lm_head
    if setup.method == "eagle3":
        method.teacher = "topk" if setup.teacher == "none" else setup.teacher
        method.soft_labels = 0.0 if setup.teacher == "none" else method.soft_labels
    if setup.method == "cllm":
        method.update(trajectories="random", backbone=setup.backbone, lora_r=setup.lora_r, ar_loss=setup.ar_loss,
                      packing=setup.packing, block_size=setup.block_size)
    return OmegaConf.create({"method": method, "deepspeed": {"config": None},
                             "model": {"path": model_path, "trust_remote_code": False, "revision": None,
                                       "quantization": None}})


class PeakMemory:
    """Peak bytes above the start, on `device` (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.base = self._status("VmRSS")

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return self._status("VmHWM") - self.base

    @staticmethod
    def _status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/self/status has no {key}")


def random_batch(shape: Shape, setup: TrainSetup, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """B rows of T random tokens, every one trained."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, shape.vocab, (setup.batch, setup.seq), generator=g).to(device)  # [B, T]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def cllm_batch(shape: Shape, setup: TrainSetup, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """B rows of T = setup.seq tokens as train/cllm.py's collators lay them out, from random trajectories of blocks of
    N = setup.block_size (a random state and a fixed point each). Unpacked: each row is a prompt, J - 1 fixed-point
    blocks and the last block's state (its AR row the prompt and all J blocks); packed: prompt + answer, then every
    block's state less its last token, so the row is P + J·N + J·(N - 1) tokens."""
    from data.jacobi import (  # deferred: only for cllm
        PackedTrajectoryCollator, PackedTrajectoryDataset, TrajectoryCollator, TrajectoryDataset)

    n, t = setup.block_size, setup.seq
    per_block = 2 * n - 1 if setup.packing else n  # row tokens a block adds: its answer (and its state, packed)
    blocks = max(1, (t // 2) // per_block)
    prompt = t - blocks * per_block
    if prompt < 1:
        raise ValueError(f"measure cllm: seq {t} holds no prompt beside one block of {n}")
    g = torch.Generator().manual_seed(seed)

    def tokens(count: int) -> list[int]:
        return torch.randint(3, shape.vocab, (count,), generator=g).tolist()

    records = [{"prompt_ids": tokens(prompt), "answer_ids": [], "answer_labels": [],
                "blocks": [{"states": [tokens(n), tokens(n)]} for _ in range(blocks)]} for _ in range(setup.batch)]
    if setup.packing:
        items = [PackedTrajectoryDataset(records)[d] for d in range(setup.batch)]  # one draw per record
        batch = PackedTrajectoryCollator(pad_token_id=0)(items)
    else:
        dataset = TrajectoryDataset(records)
        items = [dataset[i] for i, (_, j, _) in enumerate(dataset.index) if j == blocks - 1]  # the last block's
        batch = TrajectoryCollator(pad_token_id=0)(items)
    return {key: value.to(device) for key, value in batch.items()}


def measure(shape: Shape, setup: TrainSetup, device: str = "cpu", seed: int = 0, steps: int = 2) -> Measurement:
    """Build a random target of `shape` in the setup's dtype and the method's trained module; run `steps` steps;
    return the measured peak next to the prediction (foreach set as torch picks it on this device)."""
    if setup.method not in MEASURED_METHODS:
        raise ValueError(f"measure: {setup.method} is not measured here (one of {', '.join(MEASURED_METHODS)})")
    if setup.method == "cllm" and setup.ar_loss == "kl" and setup.backbone == "full":
        raise ValueError("measure: cllm with ar_loss kl and a full backbone loads a copy of the target's weights, "
                         "which a random target has not got")
    dev = torch.device(device)
    setup = replace(setup, foreach=dev.type == "cuda", autocast=False)  # the steps run without autocast
    with tempfile.TemporaryDirectory(prefix="memory_measure_") as folder:
        config = llama_config(shape)
        config.save_pretrained(folder)  # eagle3 reads the target's depth from its config.json
        cfg = method_config(setup, folder)
        if setup.method == "medusa1":
            from train.medusa1 import Method  # deferred: only the measured method's trainer
        elif setup.method == "eagle3":
            from train.eagle3 import Method  # deferred: only the measured method's trainer
        else:
            from train.cllm import Method  # deferred: only the measured method's trainer
        method = Method(cfg)
    target = random_llama(shape, DTYPES[setup.target_bytes], dev, seed)
    model = method.build(target, tokenizer=None).to(dev)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, foreach=setup.foreach)
    batch = cllm_batch(shape, setup, dev, seed) if setup.method == "cllm" else random_batch(shape, setup, dev, seed)
    meter = PeakMemory(dev)
    meter.start()
    start = time.perf_counter()
    model.train()
    for _ in range(steps):
        out = method.forward_loss(model, batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del out
    seconds = time.perf_counter() - start
    measured = meter.peak()
    breakdown = predict(shape, setup)
    predicted = breakdown.peak - breakdown.target_weights - breakdown.trained_weights
    return Measurement(setup, measured, predicted, breakdown, seconds, str(dev))


def mmap_threshold_set() -> bool:
    return "MALLOC_MMAP_THRESHOLD_" in os.environ
