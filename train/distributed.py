"""Several processes, one run: the launcher environment, DeepSpeed ZeRO configs, and ZeRO-3 parameter gathering.

A launcher (torchrun, the `deepspeed` launcher, srun via scripts/) starts one process per device and sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; HF Trainer joins the process group from them. Every process
runs the whole of `train.task.run`; only the main process (RANK 0) writes checkpoints and prints the report.

Under ZeRO-3 each process keeps a 1/world slice of every parameter, frozen target included: outside a forward a
partitioned parameter has shape [0] and its real shape in `ds_shape`. Code that reads weights (the heads' init from
lm_head, writing a checkpoint) reads them inside `gathered(params)`, a collective that every process must enter.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from data.errors import UsageError
from models.loading import ModelLoadError
from models.refs import locate
from train.memory_model import MemoryModelError, Shape

log = logging.getLogger("draftsmith")

# DeepSpeed config keys whose "auto" depends on the model's hidden size D (HF's formulas; HF fills them only when the
# model passed to Trainer has a `.config`, which a drafter train module does not). ZeRO-3 keys must be filled before
# the target loads, because `from_pretrained` partitions it under zero.Init with the config as it is then.
HIDDEN_SIZE_KEYS = {
    "reduce_bucket_size": lambda d: d * d,
    "stage3_prefetch_bucket_size": lambda d: int(0.9 * d * d),
    "stage3_param_persistence_threshold": lambda d: 10 * d,
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_launch_env(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Give a process started by plain `python` (no launcher) the environment of a one-process world, so DeepSpeed
    can initialise torch.distributed from env:// instead of probing MPI. Returns True when it filled anything.

    A process with RANK set, or a WORLD_SIZE above one, belongs to a launcher's world and is left alone; variables
    already set (a chosen MASTER_PORT) are kept."""
    if "RANK" in environ or environ.get("WORLD_SIZE", "1") != "1":
        return False
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key, value in defaults.items():
        environ.setdefault(key, value)
    return True


def resolve_deepspeed_config(config: Mapping[str, Any] | None, hidden_size: int) -> dict[str, Any] | None:
    """conf/deepspeed/<name>.yaml's `config` as a plain dict with the hidden-size "auto" keys of `zero_optimization`
    filled; every other "auto" (batch sizes, accumulation, clipping, bf16, lr) is left for HF Trainer to fill from
    TrainingArguments. None stays None (DeepSpeed off)."""
    if config is None:
        return None
    resolved = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else dict(config)
    zero = dict(resolved.get("zero_optimization") or {})
    for key, formula in HIDDEN_SIZE_KEYS.items():
        if zero.get(key) == "auto":
            zero[key] = formula(hidden_size)
    if zero:
        resolved["zero_optimization"] = zero
    return resolved


def zero_stage(config: Mapping[str, Any] | None) -> int:
    return int((config or {}).get("zero_optimization", {}).get("stage", 0))


def deepspeed_settings(cfg: DictConfig) -> dict[str, Any] | None:
    """The DeepSpeed dict for TrainingArguments(deepspeed=...), or None when `deepspeed=none`.

    Checks the combination first (one line naming the keys), sets the one-process launch environment when no launcher
    did, and reads the target's hidden size from its config file (the weights are not loaded here)."""
    if cfg.deepspeed.config is None:
        return None
    name = cfg.deepspeed.name
    if cfg.model.quantization not in (None, "none"):
        raise UsageError(f"deepspeed={name} with model.quantization={cfg.model.quantization}: DeepSpeed cannot shard or "
                         f"cast 4-bit weights; use deepspeed=none")
    stage = zero_stage(cfg.deepspeed.config)
    if stage == 3 and cfg.model.dtype != "fp32" and not cfg.training.bf16:
        log.warning("deepspeed=%s without training.bf16=true: ZeRO-3 materialises the %s target in fp32 (twice the "
                    "memory); set training.bf16=true", name, cfg.model.dtype)
    if ensure_launch_env():
        log.info("deepspeed=%s: no launcher environment, running as a one-process world", name)
    from transformers import AutoConfig

    path = locate(cfg.model.path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code, revision=cfg.model.revision)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model.path={cfg.model.path}: cannot read its config ({str(e).splitlines()[0]})") from None
    if stage == 3 and OmegaConf.select(cfg, "data.self_distill") and not OmegaConf.select(cfg, "data.features"):
        param_bytes = 4 if cfg.model.dtype == "fp32" or not cfg.training.bf16 else 2
        try:
            params = Shape.from_config(config.to_dict(), str(cfg.model.path)).params()
        except MemoryModelError as e:  # a family the memory model does not read: it fails when it gathers, if at all
            log.warning("deepspeed=%s with data.self_distill: cannot size the gathered target (%s)", name, e)
        else:
            check_gather_fits(params * param_bytes, name)
    return resolve_deepspeed_config(cfg.deepspeed.config, config.get_text_config().hidden_size)


GATHER_HEADROOM = 0.9  # of a GPU's free memory for the gathered target's weights; the rest for generation's KV cache


def check_gather_fits(weight_bytes: int, name: str, free_bytes: int | None = None) -> None:
    """data.self_distill under ZeRO-3 gathers the whole target on every rank while it answers
    (train.self_distill.trainer_datasets): refuse in one line, before it loads, when its weights would not fit in
    GATHER_HEADROOM of this rank's free GPU memory (`free_bytes`, else read from the device; no check on a CPU)."""
    if free_bytes is None:
        if not torch.cuda.is_available():
            return
        free_bytes = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))[0]
    if weight_bytes > GATHER_HEADROOM * free_bytes:
        raise UsageError(f"data.self_distill=true with deepspeed={name} gathers the whole target on every GPU to "
                         f"generate ({weight_bytes / 2**30:.1f} GiB of weights, {free_bytes / 2**30:.1f} GiB free): "
                         f"write the answers first with scripts/self_distill.py and pass them as data.path")


def init_deepspeed_comm() -> None:
    """Put DeepSpeed's communication layer on the process group HF TrainingArguments started. On GPUs accelerate does
    this itself; on CPUs it starts gloo without it, and zero.Init would then size the world as 1 (wrong batch checks,
    nothing partitioned)."""
    import deepspeed

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend() if torch.distributed.is_initialized() else "gloo",
                                   auto_mpi_discovery=False, verbose=False)


def is_partitioned(param: torch.Tensor) -> bool:
    """True for a ZeRO-3 parameter (its data is a shard; the full tensor exists only inside `gathered`)."""
    return hasattr(param, "ds_id")


@contextlib.contextmanager
def gathered(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Inside the block, ZeRO-3 parameters among `params` hold their full data on every process (read-only: changes
    are discarded on exit). A no-op for ordinary parameters, so callers need no DeepSpeed branch. Collective: under
    ZeRO-3 every process must enter it with the same parameters."""
    partitioned = [p for p in params if is_partitioned(p)]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def is_main_process() -> bool:
    """RANK 0 of the world (True without a launcher): the one process that writes files and prints reports."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0
