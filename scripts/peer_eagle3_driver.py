"""Runs a reference EAGLE-3 trainer on a CPU-only machine, inside the peer's own virtual environment; started by the
commands scripts/peer_eagle3.py prints. Standalone on purpose: it imports nothing from draftsmith.

    <speculators-venv>/bin/python scripts/peer_eagle3_driver.py speculators-dataset OUT
        OUT/rows.jsonl -> the Arrow dataset OUT/data (beside OUT/data/hidden_states), as speculators' preprocessing
        leaves it (torch format)
    <speculators-venv>/bin/python scripts/peer_eagle3_driver.py speculators -- <speculators.train arguments>
    <specforge-venv>/bin/python scripts/peer_eagle3_driver.py specforge -- <specforge.cli arguments>

Runtime patches, each printed to stderr before the peer starts (the peers assume an accelerator):
    speculators  local_rank   speculators.train.trainer moves the model and batches with .to(get_local_rank()),
                              i.e. cuda:0; it gets "cpu"
                 device_type  Trainer sets device_type "cuda" when torch.accelerator has none (its autocast); "cpu"
                 synchronize  torch.accelerator.synchronize (the trainer's timers) does nothing without an accelerator
    specforge    env          SPECFORGE_DEVICE=cpu FSDP_SHARDING=NO_SHARD TORCHDYNAMO_DISABLE=1 unless set
                 triton       specforge.core.loss imports triton for its fused loss; a module of the same name
                              is given whose kernels are the same math in torch (`_torch_loss`)
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import types
from pathlib import Path

PATCHES: list[str] = []


def speculators_dataset(out: Path) -> Path:
    from datasets import Dataset

    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list(rows)
    dataset.set_format(type="torch")
    staging = out / "arrow.tmp"
    dataset.save_to_disk(str(staging))
    for path in staging.iterdir():  # the dataset folder also holds hidden_states/
        path.replace(out / "data" / path.name)
    staging.rmdir()
    return out / "data"


def patch_speculators() -> None:
    import torch
    from speculators.train import trainer

    trainer.get_local_rank = lambda: "cpu"
    PATCHES.append("local_rank: speculators.train.trainer.get_local_rank returns 'cpu' (the package moves the model "
                   "and every batch to .to(local_rank), cuda:0)")
    original = trainer.Trainer.__init__

    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = __init__
    PATCHES.append("device_type: Trainer.device_type 'cpu' (the package falls back to 'cuda' without an accelerator)")
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.synchronize = lambda *args, **kwargs: None
        PATCHES.append("synchronize: torch.accelerator.synchronize is a no-op (no accelerator; the trainer's timers)")


class _TritonStandIn(types.ModuleType):
    """Enough of triton for specforge.core.loss to import: its kernels are never launched (`patch_specforge`)."""

    def __getattr__(self, name: str):
        if name == "jit":
            return lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)
        if name == "next_power_of_2":
            return lambda n: 1 << (int(n) - 1).bit_length()
        if name == "constexpr":
            return object  # tl.constexpr: used only in the kernels' annotations
        raise AttributeError(f"module 'triton' stand-in has no {name!r}")


class _TorchLogSoftmaxLoss:
    """specforge.core.loss.LogSoftmaxLoss in torch: its reference `_compute_loss` without torch.compile,
    mean over B*T of -sum_v mask * p * log_softmax(logits)."""

    @staticmethod
    def apply(logits, target, position_mask):
        import torch

        logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]
        return -(position_mask * target * logp).sum(-1).mean()


SPECFORGE_ENV = {"SPECFORGE_DEVICE": "cpu", "FSDP_SHARDING": "NO_SHARD", "TORCHDYNAMO_DISABLE": "1"}


def patch_specforge() -> None:
    for key, value in SPECFORGE_ENV.items():  # before torch reads them; TORCHDYNAMO_DISABLE keeps torch.compile
        os.environ.setdefault(key, value)     # (loss.py's reference function) from loading inductor, which probes triton
    PATCHES.append("env: " + " ".join(f"{k}={os.environ[k]}" for k in SPECFORGE_ENV))
    import torch._dynamo  # noqa: F401 - loaded first: it probes for triton, which must stay absent for torch

    triton = _TritonStandIn("triton")
    triton.language = _TritonStandIn("triton.language")
    sys.modules.update({"triton": triton, "triton.language": triton.language})
    try:
        from specforge.algorithms.eagle3 import model
        from specforge.core import loss
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]

    loss.LogSoftmaxLoss = model.LogSoftmaxLoss = _TorchLogSoftmaxLoss
    PATCHES.append("triton: specforge.core.loss.LogSoftmaxLoss (a Triton kernel) is the same math in torch, "
                   "its own reference _compute_loss without torch.compile; triton is a stand-in module so the file "
                   "imports (its kernels never run)")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("speculators-dataset", "speculators", "specforge"):
        print("usage: peer_eagle3_driver.py speculators-dataset OUT | speculators -- ARGS | specforge -- ARGS",
              file=sys.stderr)
        return 2
    command, rest = argv[0], [a for a in argv[1:] if a != "--"]
    if command == "speculators-dataset":
        print(speculators_dataset(Path(rest[0])))
        return 0
    if command == "speculators":
        patch_speculators()
        module = "speculators.train"
    else:
        patch_specforge()
        module = "specforge.cli"
    for line in PATCHES:
        print(f"patch: {line}", file=sys.stderr)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
