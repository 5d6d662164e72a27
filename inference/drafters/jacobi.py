"""Greedy Jacobi decoding (Santilli et al. 2023; CLLM, Kou et al. 2024) with the KV cache.

Dimension letters: B batch, T prompt length, N block size (tokens guessed at once), K = N tree nodes, V vocab.

Jacobi iteration on an N-token block y (prefix x fixed):   y_i <- argmax p(. | x, y_<i)   for every i at once.
A fixed point (two successive states agree) is the greedy continuation of x, reached in at most N iterations: after
iteration k the first k tokens are final. So Jacobi is lossless by construction, and it fits the speculative loop:

    draft   = the root (last committed token) + the previous iteration's N - 1 guesses, a chain
    verify  = greedy: accept the longest prefix matching the target argmax (those tokens are at their fixed point)
    update  = the target's predictions after the accepted prefix become the next guess; the freed tail of the
              window is refilled with initial tokens (`INITS`), so every step iterates a full N-token block.

Committing the converged prefix at once and sliding the window (instead of waiting for the whole block to converge)
makes the same per-token Jacobi updates and never takes more steps. `jacobi_blocks` runs the textbook block form
(iterate one block until it stops changing, then commit it whole): it records the trajectories CLLM trains on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from data.errors import UsageError
from inference.drafters.spec import DrafterSpec
from inference.engine.cache import commit_slots, new_cache, prefill_inputs, tree_inputs
from inference.engine.drafter import DecodeState, Draft
from inference.engine.tree import build_tree, chain_choices
from inference.engine.verify import VerifyResult, greedy_argmax

INITS = ("random", "pad", "repeat")  # random prompt tokens | the pad id | the last committed token repeated
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class JacobiOptions:
    block_size: int = DEFAULT_BLOCK_SIZE  # N, root included in the engine's window
    init: str = "random"
    seed: int = 0  # for init="random"

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"Jacobi block_size must be >= 2, got {self.block_size}")
        if self.init not in INITS:
            raise ValueError(f"Jacobi init must be one of {', '.join(INITS)}, got {self.init!r}")

    @staticmethod
    def parse(spec: str) -> JacobiOptions:
        """"jacobi" or "jacobi:n=32,init=pad,seed=1" -> options; a bad key or value raises ValueError naming it."""
        return JacobiOptions.from_spec(DrafterSpec.parse(spec))

    @staticmethod
    def from_spec(spec: DrafterSpec) -> JacobiOptions:
        values: dict[str, int | str] = {}
        for key, value in spec.options:
            if key not in ("n", "init", "seed"):
                raise UsageError(f"drafter spec {str(spec)!r}: expected n=<int>, init=<{'|'.join(INITS)}> or "
                                 f"seed=<int>, got {key}={value}")
            if key == "init":
                values["init"] = value
            elif not value.isdigit():
                raise UsageError(f"drafter spec {str(spec)!r}: {key} must be an integer, got {value!r}")
            else:
                values["block_size" if key == "n" else "seed"] = int(value)
        try:
            return JacobiOptions(**values)
        except ValueError as e:  # a value out of range: name the spec the user wrote
            raise UsageError(f"drafter spec {str(spec)!r}: {e}") from None


@dataclass(frozen=True)
class JacobiStats:
    """Per step and row: fast_forwarded = tokens committed beyond the one every step commits (accepted guesses);
    stationary = guesses after the first wrong one that the iteration left unchanged (CLLM sec. 3.3)."""

    fast_forwarded: tuple[tuple[int, ...], ...]  # [step][row]
    stationary: tuple[tuple[int, ...], ...]  # [step][row]

    @property
    def tokens_per_step(self) -> float:
        """Mean committed tokens per target forward (prefill excluded), over all rows."""
        flat = [a for step in self.fast_forwarded for a in step]
        return 1.0 + sum(flat) / max(len(flat), 1)


def fill_tokens(
    prompt: torch.Tensor, prompt_mask: torch.Tensor, last: torch.Tensor, width: int, init: str, pad_id: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Initial guesses [B, width]: "random" draws uniformly from each row's real prompt tokens, "pad" is `pad_id`,
    "repeat" repeats `last` [B] (the last committed token)."""
    b = prompt.shape[0]
    if init == "pad":
        return torch.full((b, width), pad_id, dtype=prompt.dtype, device=prompt.device)
    if init == "repeat":
        return last[:, None].expand(b, width).clone()
    weights = prompt_mask.float()  # [B, T] uniform over real tokens
    picks = torch.multinomial(weights.cpu(), width, replacement=True, generator=generator).to(prompt.device)
    return prompt.gather(1, picks)


@dataclass(eq=False)
class JacobiRun:
    """The drafter's per-generation state (kept in DecodeState.drafter_state)."""

    guess: torch.Tensor  # [B, N - 1] guesses for the tokens after the root
    generator: torch.Generator  # init="random" draws
    fast_forwarded: list[tuple[int, ...]]
    stationary: list[tuple[int, ...]]


class JacobiDrafter:
    """Jacobi decoding as a drafter: a chain of N nodes (the root and N - 1 guesses) per step, see module docstring.
    Needs no weights: any causal LM serves it; a CLLM checkpoint is a target fine-tuned to converge faster."""

    needs_hidden = False

    def __init__(self, options: JacobiOptions = JacobiOptions(), pad_token_id: int = 0) -> None:
        self.options = options
        self.pad_token_id = pad_token_id
        self.tree = build_tree(chain_choices(options.block_size - 1), options.block_size - 1, topk=1)
        self.last_run: JacobiRun | None = None

    def stats(self) -> JacobiStats:
        """Fast-forwarded and stationary counts of the latest generation."""
        if self.last_run is None:
            return JacobiStats((), ())
        return JacobiStats(tuple(self.last_run.fast_forwarded), tuple(self.last_run.stationary))

    def _fill(self, state: DecodeState, run_generator: torch.Generator, width: int) -> torch.Tensor:
        prompt_mask = state.valid[:, : state.prompt.shape[1]]
        return fill_tokens(state.prompt, prompt_mask, state.root, width, self.options.init, self.pad_token_id,
                           run_generator)

    def propose(self, state: DecodeState) -> Draft:
        if state.drafter_state is None:  # first step of a generation
            if self.tree.depth.device != state.root.device:
                self.tree = self.tree.to(state.root.device)
            generator = torch.Generator().manual_seed(self.options.seed)
            guess = self._fill(state, generator, self.options.block_size - 1)
            state.drafter_state = self.last_run = JacobiRun(guess, generator, [], [])
        return Draft(tree=self.tree, tokens=torch.cat([state.root[:, None], state.drafter_state.guess], dim=1))  # [B, N]

    def update(self, state: DecodeState, draft: Draft, result: VerifyResult) -> None:
        """New guess for node j (j >= a + 2, a accepted) = the target's argmax after node j - 1, then refill."""
        if state.logits is None:
            raise ValueError("JacobiDrafter needs state.logits (the loop stores the last tree forward's logits)")
        run: JacobiRun = state.drafter_state
        pred = greedy_argmax(state.logits).to(state.root.device)  # [B, N]: token after each node
        n = pred.shape[1]
        accepted = result.num_accepted  # [B]
        source = accepted[:, None] + 1 + torch.arange(n - 1, device=pred.device)  # [B, N - 1] index into pred
        known = source < n
        guess = torch.where(known, pred.gather(1, source.clamp(max=n - 1)), self._fill(state, run.generator, n - 1))
        old = draft.tokens.gather(1, (source + 1).clamp(max=n - 1))  # the token each kept guess replaces
        stationary = (known & (source + 1 < n) & (guess == old)).sum(-1)
        run.guess = guess
        run.fast_forwarded.append(tuple(accepted.tolist()))
        run.stationary.append(tuple(stationary.tolist()))


@dataclass(frozen=True)
class BlockTrajectory:
    """One block of one row: every Jacobi state from the initial guess to the fixed point (states[-1]), each N ids."""

    states: tuple[tuple[int, ...], ...]

    @property
    def fixed_point(self) -> tuple[int, ...]:
        return self.states[-1]


@torch.inference_mode()
def jacobi_blocks(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    options: JacobiOptions,
    num_blocks: int,
    pad_token_id: int = 0,
    eos_token_ids: tuple[int, ...] = (),
    on_block: Callable[[int, int], None] | None = None,
) -> list[list[BlockTrajectory]]:
    """Textbook block Jacobi on left-padded prompts [B, T]: per block, iterate y <- [argmax after x, argmax after
    x y_<N-1] until no row changes, then commit the block to the cache (its keys/values were computed from the fixed
    point itself, so they are kept as they are). A row that converged keeps riding (a fixed point stays fixed).
    Rows stop after a block holding an EOS id, or after `num_blocks` blocks. Returns [row][block] trajectories.
    `on_block(j, iterations)` is called after block j (0-based) converged, with the forwards it took (progress: a
    batch of a real model takes minutes)."""
    pad_mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    dtype = model.get_input_embeddings().weight.dtype
    n, batch = options.block_size, input_ids.shape[0]
    tree = build_tree(chain_choices(n - 1), n - 1, topk=1, device=input_ids.device)
    generator = torch.Generator().manual_seed(options.seed)
    mask, positions = prefill_inputs(pad_mask, dtype)
    cache = new_cache()
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                logits_to_keep=1)
    first = greedy_argmax(out.logits[:, -1])  # [B] token after the prefix
    valid, next_pos = pad_mask.clone(), pad_mask.long().sum(-1)
    result: list[list[BlockTrajectory]] = [[] for _ in range(batch)]
    live = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
    last = input_ids[:, -1]  # [B] last committed token (for init="repeat")
    for j in range(num_blocks):
        y = fill_tokens(input_ids, pad_mask, last, n, options.init, pad_token_id, generator)  # [B, N]
        states = [[tuple(row)] for row in y.tolist()]
        done = torch.zeros(batch, dtype=torch.bool, device=y.device)
        for iterations in range(1, n + 2):  # N iterations fix every token; one more confirms it
            mask, positions = tree_inputs(tree, valid, next_pos, dtype)
            logits = model(input_ids=y, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True).logits
            new = torch.cat([first[:, None], greedy_argmax(logits[:, :-1])], dim=1)  # [B, N]
            done |= (new == y).all(-1)  # a row is frozen at its first fixed point
            if bool(done.all()):
                break
            cache.crop(-n)
            for row in (~done).nonzero()[:, 0].tolist():
                states[row].append(tuple(new[row].tolist()))
            y = torch.where(done[:, None], y, new)
        if not bool(done.all()):  # cannot happen in exact arithmetic: N iterations always reach it
            raise RuntimeError(f"Jacobi block did not converge in {n + 1} iterations")
        first, last = greedy_argmax(logits[:, -1]), y[:, -1]
        valid = commit_slots(valid, torch.full_like(next_pos, n - 1), n)
        next_pos = next_pos + n
        for row in live.nonzero()[:, 0].tolist():
            result[row].append(BlockTrajectory(tuple(states[row])))
        if eos_token_ids:
            live &= ~torch.isin(y, torch.tensor(eos_token_ids, device=y.device)).any(-1)
        if on_block is not None:
            on_block(j, iterations)
        if not bool(live.any()):
            break
    return result
