"""Where the parts of a target model compute, including a target split across devices with `device_map`.

A target loaded with `device_map` (accelerate dispatch) runs each top-level block on its own device: an
`AlignDevicesHook` on the block moves its inputs there, and the hook on the whole model returns the outputs on the
device the inputs came from. A block offloaded to "cpu" or "disk" keeps its weights on the "meta" device and loads
them onto its execution device for each forward, so a weight's `.device` is not where its block runs: the hook's
`execution_device` is. Models without hooks (one device, tensor parallel) compute where their weights are.

The engine keeps its own state (prompt, masks, positions, tree buffers, drafted tokens) on the input device: the
device of the input embeddings. Medusa heads sit on the device of the lm_head they extend.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def hook_device(module: nn.Module) -> torch.device | None:
    """The execution device of an accelerate hook attached to `module` itself, else None."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])  # a SequentialHook chains several
    for h in hooks:
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device)
    return None


def module_device(model: nn.Module, module: nn.Module) -> torch.device:
    """The device `module`, a submodule of `model` (or `model` itself), computes on: its own hook's execution
    device, else where its weights are, else (weights offloaded, hook on an enclosing block) the execution device of
    the nearest enclosing module with a hook."""
    device = hook_device(module)
    if device is not None:
        return device
    param = next(module.parameters(), None)
    if param is not None and param.device.type != "meta":
        return param.device
    path = next((name for name, m in model.named_modules() if m is module), None)
    if path is None:
        raise ValueError(f"{type(module).__name__} is not a submodule of {type(model).__name__}")
    parts = path.split(".") if path else []
    for depth in range(len(parts) - 1, -1, -1):  # the enclosing modules, innermost first, the model itself last
        device = hook_device(model.get_submodule(".".join(parts[:depth])))
        if device is not None:
            return device
    raise ValueError(f"cannot tell where {path or 'the model'} computes: its weights are on the meta device and no "
                     "accelerate hook names an execution device")


def input_device(model: nn.Module) -> torch.device:
    """Device of the input embeddings: where input ids, masks and position ids must be."""
    return module_device(model, model.get_input_embeddings())


def output_device(model: nn.Module) -> torch.device:
    """Device the lm_head computes on: where heads that read the final hidden state belong."""
    return module_device(model, model.get_output_embeddings())



def cuda_sync(model: nn.Module) -> Callable[[], None] | None:
    """A function that waits until every visible GPU has finished its queued kernels, for timers around work on a
    model on CUDA (all of them: a target split by device_map computes on several); None for a model off CUDA."""
    if input_device(model).type != "cuda" and not any(p.is_cuda for p in model.parameters()):
        return None
    devices = range(torch.cuda.device_count())

    def sync() -> None:
        for index in devices:
            torch.cuda.synchronize(index)

    return sync
