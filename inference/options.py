"""Every serving option, declared once: how the target loads (`TargetOptions`, here) and what the drafter is loaded
with (inference.drafters.options.LoadOptions). Each field's `Option` (inference.engine.options) gives its help, its
command-line flag (the name with dashes), what a valid value is and, for a drafter's, which drafter types take it.

Read by:
    inference.load(...)          a keyword per field (`signature_of`: its signature is these fields')
    python -m inference ...      a flag per command-line field (inference.session: `add_serving_flags`)
    conf/bench/*.yaml            a plan's `args` are `bench` flags, so the same fields
    checks                       `check` (values) and the drafter registry (which types take what), before loading

Adding an option is one field here or in LoadOptions, and its implementation.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inference.drafters.options import LoadOptions
from inference.engine.options import add_flags, check, keywords, option, options_of, whole
from models.builtin import DTYPES, QUANTIZATIONS


@dataclass(frozen=True)
class TargetOptions:
    """How `load` loads the target model and its tokenizer."""

    dtype: str | None = option(
        choices=tuple(DTYPES), must=f"one of {', '.join(DTYPES)}",
        help="default: the drafter's training dtype, else the conf/model's, else bf16; fp64 checks that a greedy "
             "mismatch is float rounding (near-tied logits), not an engine error")
    quantization: str | None = option(
        choices=tuple(q for q in QUANTIZATIONS if q is not None), cli_default="none",
        must=f"one of {', '.join(q for q in QUANTIZATIONS if q is not None)}",
        help="nf4: the target's linears in 4 bits (bitsandbytes), placed by its own loader")
    device: str | torch.device | None = option(
        "cpu", cli_default=None, help="where the model runs (command line's default: cuda when available, else cpu)")
    device_map: Any = option(
        help="split a target too big for one GPU across devices (accelerate): auto | balanced | balanced_low_0 | "
             "sequential | a JSON file or object mapping module names to GPU indices, \"cpu\" or \"disk\" (a dict in "
             "the Python API; models.loading.resolve_device_map); excludes --device")
    offload_folder: str | Path | None = option(help="directory for the weights a --device-map puts on \"disk\"")
    tp_plan: Any = option(
        cli=False, help="\"auto\" under torchrun shards the target tensor-parallel across the processes (`device` is "
                        "then each process's own); every process runs the same loop and returns the same tokens")
    attn_implementation: str = option("sdpa", cli=False, help="the target's attention (transformers' name)")
    compile: bool = option(
        False, help="compile the target's decoding step (torch.compile; CUDA graphs on a GPU) over a static KV cache; "
                    "each new shape (batch, tree-size bucket, cache capacity) compiles once, timed apart")
    static_cache: bool = option(
        False, help="a fixed-capacity KV cache and trees run in size buckets (fixed step shapes; --compile implies it)")
    cache_slots: int | None = option(
        metavar="N", type=int, valid=whole(128), must="a whole number >= 128",
        help="the static cache's capacity for every request (default: each request's own, rounded up to 256 slots): "
             "one compiled shape per tree bucket; a request whose prompt + max_new_tokens + 64 exceeds it is refused")
    trust_remote_code: bool = option(False, cli=False, help="run the model's own code from its folder or the hub")
    tokenizer: str | Path | None = option(
        help="tokenizer path (default: the checkpoint's own, unless the base is overridden, else the base model's)")
    chat_template: str | None = option(
        help="shipped template name (vicuna_v1.1, llama-2-chat), a .jinja file or a Jinja string (default: the "
             "conf/model's, else the drafter's training setting, else the tokenizer's own)")


def load_keywords() -> dict[str, Any]:
    """Every keyword `inference.load` takes beside the drafter and the base, with its default."""
    return keywords(TargetOptions, LoadOptions)


def check_target(target: TargetOptions, naming: Any) -> None:
    """The target's options' values, and their combinations, in one line each (`naming`: the caller's spelling)."""
    check(target, naming.arg)
    if target.device_map is not None and target.tp_plan is not None:
        raise ValueError("load: device_map and tp_plan are exclusive (pipeline split vs tensor parallel)")
    if target.cache_slots is not None and not (target.compile or target.static_cache):
        raise ValueError(f"{naming.bare('cache_slots')} sizes the static cache: add {naming.bare('compile')} or "
                         f"{naming.bare('static_cache')}")
    if target.compile and (target.device_map is not None or target.tp_plan is not None):
        raise ValueError(f"{naming.bare('compile')} runs on one device: drop it with {naming.bare('device_map')} or "
                         f"{naming.bare('tp_plan')} (a CUDA graph holds one device's kernels)")


def add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for every command-line serving option: the drafter's, then the target's."""
    add_flags(parser, LoadOptions)
    add_flags(parser, TargetOptions)


def options_help() -> str:
    """The serving keywords and their help, for `load`'s docstring."""
    lines = []
    for group in (TargetOptions, LoadOptions):
        for f, opt in options_of(group):
            lines.append(f"    {f.name}: {opt.help}")
    return "\n".join(lines)
