"""`python -m inference build-tree`: a draft tree fitted to one drafter on one machine.

Dimension letters: B batch, T time, D hidden, V vocab, H heads, R top-k ranks, K tree nodes (root included).

1. Rank-wise head accuracy: accuracy[h][r] = P(the rank-r candidate of head h+1 is the token it predicts), measured on
   the target's greedy continuations of validation prompts (what greedy acceptance compares against; --source greedy)
   or on the validation data itself (--source data).
2. Step cost on this machine: t(K) = one target forward over K tree nodes on a cache of --context tokens and its
   greedy verification (the engine's own forward_tree and verify_greedy, several K, piecewise-linear in between),
   plus the cost of running the first d heads (each a D x V projection: not free on small models). Cache surgery
   and bookkeeping (~1 ms a step on CPU) are left out, so predictions lean optimistic for tiny models.
   An EAGLE-3 checkpoint brings its accuracy (the [depth][rank] acceptance its training evaluation measured on the
   target's greedy continuations of held-out prompts, conditional on the shallower drafts being right); its drafting
   cost is timed per depth (`measure_eagle3_cost`).
3. Tree: inference.engine.tree.best_tree_choices over sizes up to --max-nodes and depths up to H, maximising
   expected tokens per step / (t(K) + heads(d)); predicted speedup = that ratio x t(1) (a plain step).
Writes {"choices": [...], ...measurements} that `--tree tree.json` reads.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from data.atomic import write_text
from data.chat import encode_chat, encode_text, first_user_turn
from data.config import load_data_config
from data.datasets import load_conversations
from data.errors import UsageError
from inference.api import Engine
from inference.drafters.eagle3 import Eagle3Drafter, Pending
from inference.drafters.medusa import MedusaDrafter
from inference.drafters.options import LOOKUP_OPTIONS, MEDUSA_TOPK
from inference.engine.devices import input_device
from inference.engine.drafter import Draft, NoDrafter
from inference.engine.loop import DecodeConfig, forward_tree, prefill
from inference.engine.options import flag
from inference.engine.tree import best_tree_choices, build_tree, expected_accept_length
from inference.engine.verify import verify_greedy
from inference.kernels.attention import gqa_attention
from inference.kernels.cpu_linear import fast_linears
from inference.session import add_model_args, encode_messages, open_session
from models.backbone import final_hidden
from models.medusa import head_targets

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one step as a function of tree nodes K: measured points, linear in between and beyond."""

    sizes: tuple[int, ...]  # increasing
    seconds: tuple[float, ...]

    def monotone(self) -> CostCurve:
        """The closest non-decreasing curve (pool adjacent violators, least squares): more nodes never cost less,
        so a dip is timing noise, which would otherwise make a tree look cheaper than a plain step."""
        blocks: list[list[float]] = []  # [mean, count] per pooled run of points
        for y in self.seconds:
            blocks.append([y, 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
                blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
        fitted = [m for m, n in blocks for _ in range(int(n))]
        return CostCurve(self.sizes, tuple(fitted))

    def __call__(self, k: float) -> float:
        xs, ys = self.sizes, self.seconds
        if len(xs) == 1:
            return ys[0]
        i = min(max(sum(x <= k for x in xs) - 1, 0), len(xs) - 2)  # segment [xs[i], xs[i+1]], extended at the ends
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return max(ys[i] + slope * (k - xs[i]), 0.0)


@dataclass(frozen=True)
class TreePlan:
    choices: tuple[tuple[int, ...], ...]
    num_nodes: int  # root included
    depth: int  # heads used
    expected_tokens: float  # per step, under the independence model
    step_seconds: float  # t(K) + heads(depth)
    ar_step_seconds: float  # t(1)

    @property
    def predicted_speedup(self) -> float:
        return self.expected_tokens * self.ar_step_seconds / self.step_seconds


class RankCounter:
    """hits[h][r]: how often head h's rank-r candidate was the target token; count[h]: positions scored."""

    def __init__(self, num_heads: int, topk: int) -> None:
        self.hits = torch.zeros(num_heads, topk, dtype=torch.long)
        self.count = torch.zeros(num_heads, dtype=torch.long)

    def add(self, head: int, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """logits [N, V], targets [N] (-100 = not scored)."""
        valid = targets != -100
        top = logits[valid].topk(self.hits.shape[1], dim=-1).indices  # [N, R]
        self.hits[head] += (top == targets[valid][:, None]).sum(0).cpu()
        self.count[head] += int(valid.sum())

    def accuracy(self) -> list[list[float]]:
        return (self.hits.double() / self.count.clamp(min=1)[:, None]).tolist()


@torch.no_grad()
def score_heads(counter: RankCounter, heads: Any, hidden: torch.Tensor, labels: torch.Tensor,
                base_lm_head: torch.nn.Module | None) -> None:
    """hidden [B, T, D] final-norm states, labels [B, T] unshifted (-100 = untrained): head h (1-based) at t is
    scored against labels[t + h + 1] (models.medusa.head_targets)."""
    param = next(heads.parameters(), None)
    h = hidden if param is None else hidden.to(param.device, param.dtype)  # heads sit on the lm_head's device
    labels = labels.to(h.device)
    for k in range(counter.hits.shape[0]):
        # indices into the heads' logits; a target outside a draft vocabulary maps to S, a rank no candidate has
        targets = heads.draft_targets(head_targets(labels, k + 1), missing=heads.config.out_size)  # [B, T]
        keep = targets != -100
        if keep.any():
            logits = heads.head_logits(k, h[keep], base_lm_head).float()
            counter.add(k, logits, targets[keep].to(logits.device))


def measure_accuracy(session: Any, cfg: Any, split: str, source: str, greedy_tokens: int, batch_size: int,
                     topk: int) -> tuple[list[list[float]], int]:
    """Rank-wise accuracy [H][R] of the session's Medusa heads and the number of sequences scored."""
    conversations = load_conversations(cfg, split)
    if not conversations:
        raise UsageError(f"--data {cfg.name}: the {split} split is empty (try --split train or --data-path)")
    model, drafter = session.engine.model, session.engine.drafter
    if source == "data":
        encode = (lambda c: encode_text(session.tokenizer, c[0]["content"], cfg.max_length)) if cfg.format == "text" \
            else (lambda c: encode_chat(session.tokenizer, c, cfg.max_length, cfg.chat_template))
        samples = [(s.input_ids, s.labels) for s in map(encode, conversations)]
    else:
        samples = greedy_samples(session, conversations, greedy_tokens, batch_size, cfg.max_length)
    counter = RankCounter(len(drafter.heads.heads), topk)
    device = session.engine.device
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        width = max(len(ids) for ids, _ in chunk)  # right-padded: causal attention never sees the padding
        ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in chunk], device=device)
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in chunk], device=device)
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in chunk], device=device)
        with torch.no_grad():
            hidden = final_hidden(model, ids, mask)  # [B, T, D]
        score_heads(counter, drafter.heads, hidden, labels, drafter.base_lm_head)
    if int(counter.count.min()) == 0:
        raise UsageError("too little data to score every head (sequences shorter than the heads' offsets); "
                         "raise --max-samples or --greedy-tokens")
    return counter.accuracy(), len(samples)


def greedy_samples(session: Any, conversations: list, new_tokens: int, batch_size: int, max_length: int
                   ) -> list[tuple[list[int], list[int]]]:
    """(prompt + the target's greedy continuation, labels on the continuation only) per conversation's first turn."""
    plain = Engine(session.engine.model, NoDrafter())
    prompts = []
    for conversation in conversations:
        turn = first_user_turn(conversation)
        if turn is not None:
            prompts.append(encode_messages(session, turn)[-max_length:])
    samples = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        out = plain.generate(chunk, max_new_tokens=new_tokens)
        samples += [(p + s, [-100] * len(p) + s) for p, s in zip(chunk, out.sequences)]
    return samples


def _timed(fn: Any, reps: int, cuda: bool) -> float:
    """Median seconds of fn() over `reps` runs, after one warm-up run."""
    times = []
    for i in range(reps + 1):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def measure_forward_cost(model: torch.nn.Module, context: int, sizes: Sequence[int], reps: int,
                         needs_hidden: bool = True, seed: int = 0, cpu_kernel: bool = True,
                         gqa: bool = True, kernel_rows: int | None = None) -> CostCurve:
    """t(K): the engine's tree forward of K nodes (a star tree: attention cost barely depends on the shape) on a
    cache of `context` random tokens, plus greedy verification of its logits; with the engine's CPU kernel unless
    `cpu_kernel` is False (at most `kernel_rows` rows through it, see inference.kernels.cpu_linear.fast_linears), and
    with inference.kernels.attention's GQA path unless `gqa` is False, as `generate` serves it."""
    device = input_device(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (1, context), generator=gen).to(device)
    state = prefill(model, ids, torch.ones_like(ids, dtype=torch.bool), DecodeConfig(), needs_hidden, None)
    seconds = []
    with fast_linears(model, enabled=cpu_kernel, row_limit=kernel_rows), gqa_attention(model, enabled=gqa):
        for k in sizes:
            tree = build_tree([(r,) for r in range(k - 1)], num_heads=1, topk=max(k - 1, 1), device=device)
            draft = Draft(tree=tree, tokens=torch.randint(vocab, (1, k), generator=gen).to(device))

            def step() -> None:
                logits, _ = forward_tree(model, state, draft, needs_hidden)
                verify_greedy(draft.tokens, logits, draft.tree)
                state.cache.crop(-k)  # drop the K tree slots again

            seconds.append(_timed(step, reps, device.type == "cuda"))
    return CostCurve(tuple(sizes), tuple(seconds))


@torch.no_grad()
def measure_eagle3_cost(drafter: Eagle3Drafter, model: torch.nn.Module, context: int, topk: int, reps: int,
                        max_depth: int) -> tuple[float, ...]:
    """Seconds of one EAGLE-3 step's drafting to depth d (d = 1..max_depth): reading two committed pairs, then the
    levels of a top-`topk` tree continued as a chain to depth d, after a prefill of `context` random tokens."""
    device = input_device(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
    state = prefill(model, ids, torch.ones_like(ids, dtype=torch.bool), DecodeConfig(), False, None,
                    drafter.feature_layers)
    costs = []
    for depth in range(1, max_depth + 1):
        choices = [(r,) for r in range(topk)] + [(0,) * d for d in range(2, depth + 1)]
        probe = Eagle3Drafter(drafter.draft, build_tree(choices, depth, topk, device), drafter.embed)
        state.drafter_state = None
        probe.propose(state)  # reads the prompt
        run = state.drafter_state
        run.cache.crop(-run.drafted)
        run.valid, run.drafted = run.valid[:, : run.valid.shape[1] - run.drafted], 0
        last = Pending(state.features[:, -2:], ids[:, -2:], torch.arange(context - 2, context, device=device)[None],
                       torch.ones(1, 2, dtype=torch.bool, device=device))

        def step() -> None:
            before = run.valid
            run.pending = last
            probe.propose(state)
            run.cache.crop(before.shape[1] - run.valid.shape[1])  # drop the pairs and the drafts again
            run.valid, run.drafted = before, 0

        costs.append(_timed(step, reps, device.type == "cuda"))
    return tuple(costs)


@torch.no_grad()
def measure_head_cost(drafter: Any, topk: int, reps: int, device: torch.device) -> tuple[float, ...]:
    """Seconds of drafting with the first d heads (d = 1..H) at one position, top-`topk` each."""
    heads = drafter.heads
    num_heads = len(heads.heads)
    hidden = torch.randn(1, heads.config.hidden_size, device=device)
    costs = []
    for depth in range(1, num_heads + 1):
        choices = [(r,) for r in range(topk)] + [(0,) * d for d in range(2, depth + 1)]
        probe = MedusaDrafter(heads, build_tree(choices, num_heads, topk, device), drafter.base_lm_head)
        costs.append(_timed(lambda: probe.candidates(hidden), reps, device.type == "cuda"))
    return tuple(costs)


def plan_tree(accuracy: Sequence[Sequence[float]], forward: CostCurve, head_cost: Sequence[float],
              max_nodes: int) -> TreePlan:
    """The tree with the most expected tokens per second of step time (sizes <= max_nodes incl. the root)."""
    def step_cost(num_nodes: int, depth: int) -> float:
        return forward(num_nodes) + head_cost[depth - 1]

    choices = tuple(best_tree_choices(accuracy, step_cost, max_nodes))
    depth = max(len(p) for p in choices)
    return TreePlan(choices, len(choices) + 1, depth, expected_accept_length(choices, accuracy),
                    step_cost(len(choices) + 1, depth), forward(1))


def add_build_tree_args(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0]
    add_model_args(p, drafter_required=True)
    p.add_argument("--data", default="default", help="conf/data config name (default: the built-in chat corpus)")
    p.add_argument("--data-path", help="overrides data.path (needed by sharegpt / alpaca / gsm8k / jsonl)")
    p.add_argument("--split", choices=("validation", "train"), default="validation")
    p.add_argument("--max-samples", type=int, default=32, help="conversations to score")
    p.add_argument("--max-length", type=int, help="overrides data.max_length")
    p.add_argument("--source", choices=("greedy", "data"), default="greedy",
                   help="greedy: the target's own greedy continuations (what acceptance at T=0 sees); "
                        "data: the dataset's assistant turns")
    p.add_argument("--greedy-tokens", type=int, default=128, help="continuation length for --source greedy")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-nodes", type=int, default=64, help="largest tree, root included")
    p.add_argument("--context", type=int, default=256, help="cached tokens when timing tree forwards")
    p.add_argument("--sizes", help=f"tree sizes K to time (default: {','.join(map(str, DEFAULT_SIZES))} up to "
                                   "--max-nodes)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (median kept)")
    p.add_argument("--out", default="tree.json")
    p.set_defaults(func=run_build_tree)


def _sizes(args: argparse.Namespace) -> tuple[int, ...]:
    if args.sizes is None:
        sizes = [k for k in DEFAULT_SIZES if k < args.max_nodes] + [args.max_nodes]
    else:
        try:
            sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--sizes {args.sizes!r}: expected a comma list of integers") from None
    sizes = sorted(set(sizes) | {1})
    if sizes[0] < 1:
        raise UsageError(f"--sizes: sizes must be >= 1, got {sizes[0]}")
    return tuple(sizes)


def run_build_tree(args: argparse.Namespace) -> int:
    for key in ("max_nodes", "context", "reps", "batch_size", "max_samples", "greedy_tokens"):
        if getattr(args, key) < 1:
            raise UsageError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.max_nodes < 2:
        raise UsageError("--max-nodes must be >= 2 (the root and at least one draft)")
    for option in LOOKUP_OPTIONS:
        if getattr(args, option) is not None:
            name = flag(option)
            raise UsageError(f"{name} does not apply to build-tree: it fits the drafter's own tree; pass {name} "
                             f"to generate or bench with the fitted tree")
    sizes = _sizes(args)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: folder {out.parent} does not exist")
    session = open_session(args)
    drafter = session.engine.drafter
    if not isinstance(drafter, (MedusaDrafter, Eagle3Drafter)):
        raise UsageError(f"--drafter {session.drafter_name}: build-tree needs Medusa heads or an EAGLE-3 checkpoint")
    cfg = load_data_config(args.data, {"path": args.data_path, "max_samples": args.max_samples,
                                       "max_length": args.max_length,
                                       "chat_template": session.chat_template if args.source == "data" else None})
    if isinstance(drafter, Eagle3Drafter):  # acceptance as its training evaluation measured it (held-out prompts)
        accuracy = [row[:MEDUSA_TOPK] for row in drafter.draft.config.acceptance]
        if not accuracy or not any(row[0] for row in accuracy):
            raise UsageError(f"--drafter {session.drafter_name}: the checkpoint holds no measured acceptance "
                             "(eagle3.acceptance in config.json; train with eval.greedy_prompts > 0)")
        topk, scored, source = len(accuracy[0]), 0, "the checkpoint's training evaluation"
    else:
        topk = min(MEDUSA_TOPK, drafter.heads.config.out_size)
        accuracy, scored = measure_accuracy(session, cfg, args.split, args.source, args.greedy_tokens,
                                            args.batch_size, topk)
        source = args.source
    forward = measure_forward_cost(session.engine.model, args.context, sizes, args.reps,
                                   cpu_kernel=session.engine.cpu_kernel)
    if isinstance(drafter, Eagle3Drafter):
        head_cost = measure_eagle3_cost(drafter, session.engine.model, args.context, topk, args.reps, len(accuracy))
    else:
        head_cost = measure_head_cost(drafter, topk, args.reps, session.engine.device)
    plan = plan_tree(accuracy, forward.monotone(), head_cost, args.max_nodes)
    print(report(accuracy, forward, head_cost, plan))
    tree = tree_json(plan, accuracy, forward, head_cost, {
        "drafter": session.drafter_name, "base": session.base, "data": cfg.path or cfg.name, "split": args.split,
        "source": source, "sequences_scored": scored, "context": args.context,
        "dtype": str(session.engine.model.dtype).removeprefix("torch."), "device": str(session.engine.device),
        "threads": torch.get_num_threads(),
    })
    write_text(out, "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in tree.items()) + "\n}\n")
    print(f"tree written to {out} (use: --tree {out})")
    return 0


def tree_json(plan: TreePlan, accuracy: Sequence[Sequence[float]], forward: CostCurve, head_cost: Sequence[float],
              meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "description": f"{plan.num_nodes}-node tree fitted by `python -m inference build-tree`: most expected "
                       "tokens per second of step time on the machine that measured it",
        "num_heads": len(accuracy),
        "num_nodes": plan.num_nodes,
        "depth": plan.depth,
        "expected_tokens_per_step": plan.expected_tokens,
        "predicted_speedup": plan.predicted_speedup,
        "step_ms": plan.step_seconds * 1e3,
        "ar_step_ms": plan.ar_step_seconds * 1e3,
        "accuracy": [[round(a, 6) for a in row] for row in accuracy],
        "forward_ms": {str(k): s * 1e3 for k, s in zip(forward.sizes, forward.seconds)},  # as measured
        "head_ms": [s * 1e3 for s in head_cost],
        **meta,
        "choices": [list(c) for c in plan.choices],
    }


def report(accuracy: Sequence[Sequence[float]], forward: CostCurve, head_cost: Sequence[float],
           plan: TreePlan) -> str:
    lines = [f"{'head (predicts)':18}{'top-1':>8}{'top-5':>8}{'top-10':>8}{'ms (1..d heads)':>17}"]
    for h, row in enumerate(accuracy):
        lines.append(f"{h + 1} (t+{h + 2}){'':11}{sum(row[:1]):8.3f}{sum(row[:5]):8.3f}{sum(row[:10]):8.3f}"
                     f"{head_cost[h] * 1e3:17.2f}")
    points = zip(forward.sizes, forward.seconds)
    lines.append("tree forward ms: " + ", ".join(f"K={k} {s * 1e3:.2f}" for k, s in points))
    lines.append(f"chosen tree: {plan.num_nodes} nodes (root included), depth {plan.depth}; expected tau "
                 f"{plan.expected_tokens:.2f}; step {plan.step_seconds * 1e3:.2f} ms vs plain step "
                 f"{plan.ar_step_seconds * 1e3:.2f} ms; predicted speedup {plan.predicted_speedup:.2f}x")
    if plan.predicted_speedup < 1 or not math.isfinite(plan.predicted_speedup):
        lines.append("warning: no tree is predicted to beat plain decoding here (heads too weak or too costly)")
    return "\n".join(lines)
