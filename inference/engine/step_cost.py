"""What one target forward costs by the number of drafted nodes: the price side of drafting.

Dimension letters: B batch, K tree nodes (root included).

A step of the loop runs the target over the root and K - 1 drafted nodes. On a GPU that costs about what a plain step
does until the nodes fill the hardware; on a CPU it does not. SmolLM2-135M in fp32 on 2 AMD EPYC cores took 92 ms
over one token, 135 over two and 226 over nine (scripts/step_cost.py), so a step of 8 drafted nodes there must accept
1.45 of them on average before it beats plain decoding. `StepCost` holds such a curve, `measure_step_cost` takes it on the
loaded target, and `StepCost.break_even(k)` is the expected number of accepted drafts at which a step with k nodes
pays: prompt lookup's `min_expected` (inference.drafters.prompt_lookup).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from inference.engine.drafter import Draft
from inference.engine.compiled import target_step
from inference.engine.loop import DecodeConfig, forward_tree, prefill
from inference.engine.static import tree_slots
from inference.engine.tree import build_tree
from inference.kernels.attention import gqa_attention
from inference.kernels.cpu_linear import fast_linears

NODES = (0, 1, 2, 4, 8, 16)  # drafted nodes measured by default


@dataclass(frozen=True)
class StepCost:
    """Milliseconds of one target forward by drafted nodes: `points` are (k, ms), k ascending from 0 (a plain step).
    Between points the cost is linear; past the last one it goes on with the last two points' slope."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        nodes = [k for k, _ in self.points]
        if not nodes or nodes[0] != 0 or any(b <= a for a, b in zip(nodes, nodes[1:])):
            raise ValueError(f"need drafted-node counts ascending from 0, got {nodes}")
        if any(not ms > 0 for _, ms in self.points):  # not `<= 0`: NaN is refused too
            raise ValueError(f"need milliseconds > 0, got {[ms for _, ms in self.points]}")

    @classmethod
    def parse(cls, text: str) -> StepCost:
        """"0:96,1:148,8:216" (k:ms, as `str` writes it) -> StepCost; ValueError naming the bad item."""
        points = []
        for item in text.split(","):
            k, colon, ms = item.partition(":")
            try:
                if not colon:
                    raise ValueError
                points.append((int(k), float(ms)))
            except ValueError:
                raise ValueError(f"expected K:MS items (drafted nodes:milliseconds) joined by commas, got "
                                 f"{item!r}") from None
        return cls(tuple(points))

    def __str__(self) -> str:
        return ",".join(f"{k}:{ms:.1f}" for k, ms in self.points)

    def ms(self, k: int) -> float:
        """Milliseconds of a forward over the root and `k` drafted nodes."""
        for (k0, ms0), (k1, ms1) in zip(self.points, self.points[1:]):
            if k <= k1:
                return ms0 + (ms1 - ms0) * (k - k0) / (k1 - k0)
        if len(self.points) == 1:
            return self.points[0][1]
        (k0, ms0), (k1, ms1) = self.points[-2:]
        return ms1 + (ms1 - ms0) * (k - k1) / (k1 - k0)

    def node_cost(self) -> float:
        """The cost of one drafted node in plain steps, c in t(k) / t(0) ~ 1 + c k: the least-squares slope through
        the origin over the measured points with k >= 1 (prompt lookup's `node_cost`); 0 without such points."""
        drafted = [(k, self.break_even(k)) for k, _ in self.points if k]
        return max(0.0, sum(k * y for k, y in drafted) / sum(k * k for k, _ in drafted)) if drafted else 0.0

    def break_even(self, k: int) -> float:
        """Accepted drafts a step with `k` nodes must average to match plain decoding's tokens per millisecond:
        (1 + a) / ms(k) = 1 / ms(0)."""
        return self.ms(k) / self.ms(0) - 1


@torch.inference_mode()
def measure_step_cost(model: torch.nn.Module, nodes: tuple[int, ...] = NODES, repeats: int = 5, context: int = 256,
                      seed: int = 0, progress: Callable[[int, float], None] | None = None, cpu_kernel: bool = True,
                      static_cache: bool = False, compile: bool = False, cache_slots: int | None = None
                      ) -> StepCost:
    """The median over `repeats` (after one warm-up, which also compiles) of the target's forward over a chain of k
    drafted nodes after a `context`-token prompt of random ids, for each k of `nodes` (ascending from 0), run as the
    loop runs it (`forward_tree` with DecodeConfig's `cpu_kernel`, `static_cache`, `compile` and `cache_slots`); the
    cache is cropped back after each. `progress(k, ms)` after each k."""
    device = model.get_input_embeddings().weight.device
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(vocab, (1, context), generator=torch.Generator().manual_seed(seed)).to(device)  # [1, T]
    config = DecodeConfig(max_new_tokens=max(nodes) + 1, cpu_kernel=cpu_kernel, static_cache=static_cache,
                          compile=compile, cache_slots=cache_slots)
    step = target_step(model, config.compile)
    points = []
    with fast_linears(model, enabled=config.cpu_kernel), gqa_attention(model, enabled=config.gqa_attention):
        state = prefill(model, ids, torch.ones_like(ids, dtype=torch.bool), config, False, None)
        for k in nodes:
            tree = build_tree([(0,) * depth for depth in range(1, k + 1)], num_heads=max(k, 1), topk=1, device=device)
            draft = Draft(tree=tree, tokens=torch.cat([state.root[:, None], ids[:, context - k :]], dim=1))  # [1, K]
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                forward_tree(model, state, draft, needs_hidden=False, step=step)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
                state.cache.crop(-tree_slots(state.cache, k + 1))  # back to the prompt
            ms = 1000 * statistics.median(times[1:])
            points.append((k, ms))
            if progress is not None:
                progress(k, ms)
    return StepCost(tuple(points))
