"""The target's decode step, run as it is or compiled (`DecodeConfig.compile`).

Dimension letters: B batch, W tree nodes run (a bucket, inference.engine.static), C cache capacity.

A compiled step is `torch.compile` of the model's forward, made once per model and kept while the model lives. Over a
static cache every step of a run has one of a few shapes (B, W, C), so the graph compiles once per shape and is
replayed after. On CUDA it runs as CUDA graphs (`mode="reduce-overhead"`): one launch per step instead of one per
kernel, which is what an eager step of a 7B model loses most to (docs/results.md: 33 ms a step against ~3 ms of
weight reads on an H200). On the CPU inductor fuses the elementwise work between the linears and runs without
Python's per-module overhead; the few-row linears stay the engine's own kernels where they are routed
(inference.kernels.cpu_linear registers them as custom ops), stock ones elsewhere.

A drafter's network compiles the same way on CUDA (`network_call`: EAGLE-3's draft layer step and its logits, a draft
model's forward; each drafter runs them over its own static cache of the target's capacity). On a CPU a draft step is
bound by weight reads and compiled calls measured slower, so they stay eager there unless
`DecodeConfig.compile_drafter` asks. Medusa's heads (one batched matmul per layer over [H, B, D]) are not compiled.

The prefill is not compiled (its length changes with every prompt). `TargetStep.compiles` says whether the next call
meets a shape not seen yet, so that the loop can bill its time to `compile` instead of `forward`: the first step of
each shape includes its compilation (seconds to minutes), later ones do not. A drafter network's new shapes are
timed by `NetworkCall` and moved from `draft` to `compile` by the loop.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

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
        # a replay writes its outputs into the same memory every time; the loop keeps logits and hidden states past
        # the next step (Jacobi reads the last logits, EAGLE-3 the last features), so they leave the graph's pool
        return copied_out(self.forward(**inputs))


def copied_out(out: Any) -> Any:
    """A CUDA-graph replay's output with its tensors copied out of the graph's memory pool: a tensor, or a model
    output's logits and hidden states."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    out.logits = out.logits.clone()
    if getattr(out, "hidden_states", None) is not None:
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


class NetworkCall:
    """A drafter network's forward (`fn`, a module's method) compiled as the target's step is: static shapes, CUDA
    graphs on CUDA (outputs copied out of the graph's pool: the drafter keeps one level's outputs for the next),
    inductor elsewhere. A call that meets a shape not seen yet compiles; its seconds go to `compile_seconds()` so that
    the loop can bill them to `compile` instead of `draft`."""

    def __init__(self, fn: Callable[..., Any], cuda: bool) -> None:
        _raise_recompile_limits()
        self.forward = torch.compile(fn, dynamic=False, mode="reduce-overhead" if cuda else None)
        self.graphs = cuda
        self.seen: set[tuple[Any, ...]] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = (*map(shape_key, args), *((k, shape_key(v)) for k, v in sorted(kwargs.items())))
        new = key not in self.seen
        start = time.perf_counter()
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        out = self.forward(*args, **kwargs)
        if self.graphs:
            out = copied_out(out)
        if new:
            self.seen.add(key)
            if self.graphs:
                torch.cuda.synchronize()
            _billed[0] += time.perf_counter() - start
        return out


def shape_key(value: Any) -> Any:
    """What decides a compiled network's graph for one argument: a tensor's shape, dtype and device; a cache's
    capacity and batch (its buffers' shapes); None and other values as they are."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype, value.device
    if static.static_layers(value):
        layer = value.layers[0] if value.layers else None
        return "cache", static.capacity(value), getattr(layer, "batch_size", None)
    return value if value is None or isinstance(value, (bool, int, float, str)) else type(value)


_billed = [0.0]  # seconds of NetworkCall calls that compiled a new shape, in this process
_networks: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, NetworkCall]] = weakref.WeakKeyDictionary()


def compile_seconds() -> float:
    """Seconds drafter networks have spent compiling new shapes so far (NetworkCall), in this process."""
    return _billed[0]


def network_call(module: torch.nn.Module, name: str) -> NetworkCall:
    """`module.<name>` compiled (NetworkCall), made once per module and method and shared by later generations."""
    calls = _networks.setdefault(module, {})
    if name not in calls:
        calls[name] = NetworkCall(getattr(module, name), on_cuda(module))
    return calls[name]


RECOMPILE_LIMIT = 256  # graphs of one forward: every (batch, bucket, capacity) is one; dynamo's default stops at 8


def has_compiled_step(model: torch.nn.Module) -> bool:
    """Whether `target_step(model, True)` was made already."""
    return model in _steps


def _compile(model: torch.nn.Module) -> Any:
    """torch.compile of the model's forward: CUDA graphs on CUDA, inductor's default elsewhere; shapes static (a
    new shape compiles anew rather than one dynamic graph that serves all). Dynamo runs a function eagerly, with a
    warning, past its recompile limit; the limits are raised (process-wide) so that every shape keeps its graph."""
    _raise_recompile_limits()
    return torch.compile(model.forward, dynamic=False, mode="reduce-overhead" if on_cuda(model) else None)


def _raise_recompile_limits() -> None:
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)


def on_cuda(model: torch.nn.Module) -> bool:
    return next(model.parameters()).device.type == "cuda"
