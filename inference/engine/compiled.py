"""The target's decode step, run as it is or compiled (`DecodeConfig.compile`).

Dimension letters: B batch, W tree nodes run (a bucket, inference.engine.static), C cache capacity.

A compiled step is `torch.compile` of the model's forward, made once per model and kept while the model lives. Over a
static cache every step of a run has one of a few shapes (B, W, C), so the graph compiles once per shape and is
replayed after. On CUDA it runs as CUDA graphs (`mode="reduce-overhead"`): one launch per step instead of one per
kernel, which is what an eager step of a 7B model loses most to (docs/results.md: 33 ms a step against ~3 ms of
weight reads on an H200). On the CPU inductor fuses the elementwise work between the linears and runs without
Python's per-module overhead; the few-row linears stay the engine's own kernels where they are routed
(inference.kernels.cpu_linear registers them as custom ops), stock ones elsewhere.

The prefill is not compiled (its length changes with every prompt). `TargetStep.compiles` says whether the next call
meets a shape not seen yet, so that the loop can bill its time to `compile` instead of `forward`: the first step of
each shape includes its compilation (seconds to minutes), later ones do not.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from inference.engine import static
from inference.engine.drafter import DecodeState, Draft


class TargetStep:
    """Calls the target's forward for a decode step: the model itself, or its compiled forward."""

    def __init__(self, model: torch.nn.Module, compiled: bool) -> None:
        self.model = model
        self.compiled = compiled
        self.forward = _compile(model) if compiled else model
        self.graphs = compiled and on_cuda(model)  # replayed as CUDA graphs
        self.seen: set[tuple[Any, ...]] = set()

    def compiles(self, state: DecodeState, draft: Draft, needs_hidden: bool, layers: tuple[int, ...]) -> bool:
        """Whether the next step's call compiles a new graph (always False when not compiled); records its shape."""
        if not self.compiled:
            return False
        b, k = draft.tokens.shape
        key = (b, static.bucket(k), static.capacity(state.cache), needs_hidden, layers)
        new = key not in self.seen
        self.seen.add(key)
        return new

    def __call__(self, **inputs: Any) -> Any:
        if not self.graphs:
            return self.forward(**inputs)
        torch.compiler.cudagraph_mark_step_begin()  # a new step: the previous replay's outputs may be overwritten
        out = self.forward(**inputs)
        # a replay writes its outputs into the same memory every time; the loop keeps logits and hidden states past
        # the next step (Jacobi reads the last logits, EAGLE-3 the last features), so they leave the graph's pool
        out.logits = out.logits.clone()
        if out.hidden_states is not None:
            out.hidden_states = tuple(h.clone() for h in out.hidden_states)
        return out


_steps: weakref.WeakKeyDictionary[torch.nn.Module, TargetStep] = weakref.WeakKeyDictionary()


def target_step(model: torch.nn.Module, compiled: bool) -> TargetStep:
    """The model's step; a compiled one is made once per model and shared by its later generations."""
    if not compiled:
        return TargetStep(model, False)
    if model not in _steps:
        _steps[model] = TargetStep(model, True)
    return _steps[model]


RECOMPILE_LIMIT = 256  # graphs of one forward: every (batch, bucket, capacity) is one; dynamo's default stops at 8


def has_compiled_step(model: torch.nn.Module) -> bool:
    """Whether `target_step(model, True)` was made already."""
    return model in _steps


def _compile(model: torch.nn.Module) -> Any:
    """torch.compile of the model's forward: CUDA graphs on CUDA, inductor's default elsewhere; shapes static (a
    new shape compiles anew rather than one dynamic graph that serves all). Dynamo runs a function eagerly, with a
    warning, past its recompile limit; the limits are raised (process-wide) so that every shape keeps its graph."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
    return torch.compile(model.forward, dynamic=False, mode="reduce-overhead" if on_cuda(model) else None)


def on_cuda(model: torch.nn.Module) -> bool:
    return next(model.parameters()).device.type == "cuda"
