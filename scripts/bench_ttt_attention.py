"""EAGLE-3's training-time test attention, chunked (models/ttt_attention.py) against the dense [B, H, T, T] block it
replaced: bytes saved for backward and the time of one forward + backward of `Eagle3Draft.unroll`, in one run.

    python scripts/bench_ttt_attention.py                        # T 512,1024,2048 x 3,7 steps, hidden 1024, 16/4 heads
    python scripts/bench_ttt_attention.py --lengths 256 --steps 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128

A random Llama-shaped draft (hidden --hidden, --heads query heads over --kv-heads key heads, MLP --intermediate) unrolls
--steps steps over one batch of --batch random sequences of each length T; the loss is a fixed random projection of
every step's outputs. After a warm-up at the smallest length, each (T, steps) runs the dense attention and the chunked
one --repeats times, alternating; the quickest round of each is shown. Saved bytes count each storage autograd keeps
for backward once (torch.autograd.graph.saved_tensors_hooks), the draft's parameters left out: the activation memory
a training step holds at its peak, less the transient of one op. "per extra step" is (saved at n steps - saved at 1
step) / (n - 1), from a 1-step run (sdpa in both). --attentions picks one of the two (the dense block's saved bytes grow
as T²: at T = 2,048 and 7 steps it needs more memory than a shared 2-core host should give). Both attentions give the
same outputs and gradients (tests/test_ttt_attention.py): this script only measures.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

import models.eagle3  # noqa: E402
from data.errors import UsageError  # noqa: E402
from models.eagle3 import Eagle3Config, Eagle3Draft  # noqa: E402
from models.ttt_attention import ttt_attention  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def dense_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        scaling: float) -> torch.Tensor:
    """The attention `unroll` used before models/ttt_attention.py (commit 2db1370's `_unrolled_attention`, verbatim but
    for building the causal mask here): step 0 by sdpa, a later step j materialising the [B, H, T, T] scores and their
    exp (both kept by autograd) with the j chain scores under one shared max. q [B, H, T, Hd]; keys / values
    [B, Hkv, T, Hd] each -> [B, T, H * Hd]."""
    b, h, t, hd = q.shape
    groups = h // keys[0].shape[1]
    if len(keys) == 1:
        out = F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, scale=scaling,
                                             enable_gqa=groups > 1)  # [B, H, T, Hd]
        return out.transpose(1, 2).reshape(b, t, h * hd)

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(groups, dim=1) if groups > 1 else x

    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()  # [T, T]
    q = q * scaling
    scores = torch.matmul(q, heads(keys[0]).transpose(-1, -2))  # [B, H, T, T]
    scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    chain = torch.stack([(q * heads(k)).sum(-1) for k in keys[1:]], dim=-1)  # [B, H, T, j]
    top = torch.maximum(scores.amax(-1), chain.amax(-1)).detach()[..., None]  # [B, H, T, 1]
    block, own = torch.exp(scores - top), torch.exp(chain - top)  # [B, H, T, T], [B, H, T, j]
    out = torch.matmul(block, heads(values[0]))  # [B, H, T, Hd]
    for i, v in enumerate(values[1:]):
        out = out + own[..., i : i + 1] * heads(v)
    out = out / (block.sum(-1, keepdim=True) + own.sum(-1, keepdim=True))
    return out.transpose(1, 2).reshape(b, t, h * hd)


ATTENTIONS: dict[str, Callable[..., torch.Tensor]] = {"dense": dense_ttt_attention, "chunked": ttt_attention}


@contextmanager
def unrolled_with(attention: Callable[..., torch.Tensor]) -> Iterator[None]:
    """`Eagle3Draft.unroll` calling `attention` in place of models.ttt_attention's (for measuring the old one only)."""
    with mock.patch.object(models.eagle3, "ttt_attention", attention):
        yield


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while the context is open, `skip` storages (the
    parameters) left out. A storage is counted once however many saved tensors view it."""

    def __init__(self, skip: tuple[torch.Tensor, ...] = ()) -> None:
        self.skip = {t.untyped_storage().data_ptr() for t in skip}
        self.sizes: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.sizes[storage.data_ptr()] = storage.nbytes()  # saved tensors stay alive: no address is reused
        return t

    @property
    def total(self) -> int:
        return sum(self.sizes.values())

    def __enter__(self) -> SavedBytes:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    batch: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Run:
    saved: int  # bytes saved for backward (parameters left out)
    seconds: float  # forward + backward


def llama_draft(shape: Shape) -> Eagle3Draft:
    target = LlamaConfig(vocab_size=512, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=2, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads)
    torch.manual_seed(0)
    return Eagle3Draft(Eagle3Config(target=target.to_dict(), layers=(1, 2), draft_vocab_size=256)).to(shape.dtype)


def measure(draft: Eagle3Draft, shape: Shape, length: int, steps: int, attention: str) -> Run:
    """One forward + backward of `unroll` over random inputs [batch, length, hidden]."""
    gen = torch.Generator().manual_seed(length)
    hidden, embeds, weight = (torch.randn(shape.batch, length, shape.hidden, generator=gen).to(shape.dtype)
                              for _ in range(3))
    draft.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with unrolled_with(ATTENTIONS[attention]), SavedBytes(tuple(draft.parameters())) as saved:
        loss = sum((out * weight).float().sum() for out in draft.unroll(hidden, embeds, steps))
    loss.backward()
    return Run(saved.total, time.perf_counter() - start)


def fastest(rounds: list[dict[str, Run]]) -> dict[str, Run]:
    """Each attention's quickest round (its saved bytes are the same every round)."""
    return {a: min((r[a] for r in rounds), key=lambda run: run.seconds) for a in rounds[0]}


def parse_ints(flag: str, text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"{flag} takes positive whole numbers joined by commas, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/bench_ttt_attention.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="512,1024,2048", help="sequence lengths T (default 512,1024,2048)")
    p.add_argument("--steps", default="3,7", help="unrolled steps n (default 3,7)")
    p.add_argument("--hidden", type=int, default=1024, help="draft hidden size (default 1024)")
    p.add_argument("--heads", type=int, default=16, help="query heads (default 16)")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (default 4)")
    p.add_argument("--intermediate", type=int, default=2816, help="MLP width (default 2816)")
    p.add_argument("--batch", type=int, default=1, help="sequences per batch (default 1)")
    p.add_argument("--attentions", default="dense,chunked",
                   help="which to run: dense, chunked or both (default dense,chunked)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds per (T, steps), the attentions alternating; the quickest of each is shown (default 3)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="draft dtype (default fp32)")
    return p


def parse_attentions(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    if not names or any(n not in ATTENTIONS for n in names) or len(set(names)) != len(names):
        raise UsageError(f"--attentions takes {' and/or '.join(ATTENTIONS)} joined by commas, got {text!r}")
    return names


def cell(value: float | None, width: int, digits: int = 2) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def ratio(old: float | None, new: float | None) -> str:
    return cell(new / old if old is not None and new is not None else None, 6, 3)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        lengths, step_counts = parse_ints("--lengths", args.lengths), parse_ints("--steps", args.steps)
        attentions = parse_attentions(args.attentions)
        if min(args.hidden, args.heads, args.kv_heads, args.intermediate, args.batch, args.repeats) < 1:
            raise UsageError("--hidden, --heads, --kv-heads, --intermediate, --batch and --repeats must be >= 1")
        if args.hidden % args.heads or args.heads % args.kv_heads:
            raise UsageError(f"--hidden {args.hidden} must split into --heads {args.heads}, and those into "
                             f"--kv-heads {args.kv_heads} groups")
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    shape = Shape(args.hidden, args.heads, args.kv_heads, args.intermediate, args.batch, DTYPES[args.dtype])
    draft = llama_draft(shape)
    print(f"draft: hidden {shape.hidden}, {shape.heads} heads over {shape.kv_heads} kv heads, "
          f"MLP {shape.intermediate}, "
          f"{args.dtype}, batch {shape.batch}; {torch.get_num_threads()} threads; saved = bytes kept for backward "
          f"(parameters left out), time = one forward + backward, the quickest of {args.repeats}", flush=True)
    for attention in attentions:  # warm-up
        measure(draft, shape, min(*lengths, 128), 2, attention)
    mib = 2**20
    print(f"{'T':>5} {'steps':>5} | {'saved MiB dense':>15} {'chunked':>8} {'ratio':>6} | "
          f"{'per extra step MiB dense':>24} {'chunked':>8} | {'s dense':>8} {'chunked':>8} {'ratio':>6}")
    for length in lengths:
        one = measure(draft, shape, length, 1, "chunked").saved  # step 0 is sdpa in both
        for steps in step_counts:
            runs = fastest([{a: measure(draft, shape, length, steps, a) for a in attentions}
                            for _ in range(args.repeats)])
            got = {a: runs.get(a) for a in ATTENTIONS}
            saved = [r.saved / mib if r else None for r in got.values()]  # dense, chunked
            extra = [(r.saved - one) / max(steps - 1, 1) / mib if r else None for r in got.values()]
            seconds = [r.seconds if r else None for r in got.values()]
            print(f"{length:>5} {steps:>5} | {cell(saved[0], 15)} {cell(saved[1], 8)} {ratio(*saved)} | "
                  f"{cell(extra[0], 24)} {cell(extra[1], 8)} | {cell(seconds[0], 8)} {cell(seconds[1], 8)} "
                  f"{ratio(*seconds)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
