"""Jacobi decoding: engine output == plain greedy (batched, every init), block trajectories reproduce their fixed
points, which are the greedy continuation."""

import pytest
import torch

from inference.drafters.jacobi import JacobiDrafter, JacobiOptions, jacobi_blocks
from inference.engine.drafter import NoDrafter
from inference.engine.loop import DecodeConfig, generate

PROMPTS = [[5, 9, 17, 3, 44, 8, 21], [7, 7, 60], [11, 90, 4, 33, 2, 19]]


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def naive_jacobi_step(model, prefix: list[int], state: list[int]) -> list[int]:
    """One Jacobi iteration without a cache: y_i <- argmax p(. | prefix, y_<i)."""
    logits = model(torch.tensor([prefix + state])).logits[0]  # [T + N, V]
    return logits[len(prefix) - 1 : len(prefix) + len(state) - 1].argmax(-1).tolist()


@pytest.mark.parametrize("block_size,init", [(2, "random"), (5, "pad"), (16, "repeat"), (16, "random")])
def test_jacobi_equals_greedy_batched(tiny_lm, single_thread, block_size, init):
    ids, mask = left_padded(PROMPTS)
    config = DecodeConfig(max_new_tokens=30)
    greedy = generate(tiny_lm, ids, NoDrafter(), config, mask)
    drafter = JacobiDrafter(JacobiOptions(block_size=block_size, init=init))
    jacobi = generate(tiny_lm, ids, drafter, config, mask)
    assert jacobi.sequences == greedy.sequences
    stats = drafter.stats()
    assert len(stats.fast_forwarded) == jacobi.stats.steps
    for step_fast, step_accepted, step_stationary in zip(stats.fast_forwarded, jacobi.stats.accepted, stats.stationary):
        for fast, accepted, stationary in zip(step_fast, step_accepted, step_stationary):
            assert accepted in (-1, fast)  # -1: a row already finished
            assert 0 <= stationary <= max(block_size - 2 - fast, 0)
    assert 1.0 <= stats.tokens_per_step <= block_size


def test_jacobi_reuses_the_drafter_across_generations(tiny_lm_factory, single_thread):
    model = tiny_lm_factory("llama")
    ids, mask = left_padded(PROMPTS)
    drafter = JacobiDrafter(JacobiOptions(block_size=6))
    first = generate(model, ids, drafter, DecodeConfig(max_new_tokens=12), mask)
    second = generate(model, ids[1:], drafter, DecodeConfig(max_new_tokens=12), mask[1:])
    assert second.sequences == first.sequences[1:]
    assert len(drafter.stats().fast_forwarded) == second.stats.steps


def test_block_trajectories_reach_the_greedy_fixed_point(tiny_lm, single_thread):
    ids, mask = left_padded(PROMPTS)
    n, blocks = 6, 3
    greedy = generate(tiny_lm, ids, NoDrafter(), DecodeConfig(max_new_tokens=n * blocks), mask).sequences
    trajectories = jacobi_blocks(tiny_lm, ids, mask, JacobiOptions(block_size=n, init="random"), num_blocks=blocks)
    for row, prompt in enumerate(PROMPTS):
        assert len(trajectories[row]) == blocks
        prefix = list(prompt)
        for block in trajectories[row]:
            states = [list(s) for s in block.states]
            assert 1 <= len(states) <= n + 1 and all(len(s) == n for s in states)
            for before, after in zip(states, states[1:]):  # every recorded state is one Jacobi step from the last
                assert before != after
                assert naive_jacobi_step(tiny_lm, prefix, before) == after
            fixed = list(block.fixed_point)
            assert naive_jacobi_step(tiny_lm, prefix, fixed) == fixed  # fixed-point detection
            prefix += fixed
        assert prefix[len(prompt):] == greedy[row]


def test_block_trajectories_stop_at_eos(tiny_lm_factory, single_thread):
    model = tiny_lm_factory("qwen2")
    ids, mask = left_padded(PROMPTS)
    full = jacobi_blocks(model, ids, mask, JacobiOptions(block_size=4), num_blocks=3)
    eos = full[0][0].fixed_point[1]  # pretend row 0's second token is EOS: row 0 stops after its first block
    stopped = jacobi_blocks(model, ids, mask, JacobiOptions(block_size=4), num_blocks=3, eos_token_ids=(eos,))
    assert len(stopped[0]) == 1 and stopped[0][0] == full[0][0]
    for row in (1, 2):
        expected = next((i + 1 for i, b in enumerate(full[row]) if eos in b.fixed_point), 3)
        assert len(stopped[row]) == expected


@pytest.mark.parametrize("spec,expected", [("jacobi", JacobiOptions()), ("jacobi:n=32,init=pad,seed=3",
                                                                       JacobiOptions(32, "pad", 3))])
def test_parse_spec(spec, expected):
    assert JacobiOptions.parse(spec) == expected


@pytest.mark.parametrize("spec", ["jacobi:n=1", "jacobi:init=zeros", "jacobi:size=4", "jacobi:n=x"])
def test_parse_spec_rejects_bad_options(spec):
    with pytest.raises(ValueError, match="block_size|init|expected|integer"):
        JacobiOptions.parse(spec)


def test_block_progress_reports_every_block(tiny_lm, single_thread):
    """on_block(j, iterations) runs once per block, in order, with the forwards that block took (at most N + 1,
    at least 1), and does not change the trajectories."""
    ids, mask = left_padded(PROMPTS)
    n, blocks = 4, 3
    calls = []
    seen = jacobi_blocks(tiny_lm, ids, mask, JacobiOptions(block_size=n), num_blocks=blocks,
                         on_block=lambda j, iterations: calls.append((j, iterations)))
    assert seen == jacobi_blocks(tiny_lm, ids, mask, JacobiOptions(block_size=n), num_blocks=blocks)
    assert [j for j, _ in calls] == list(range(blocks))
    for j, iterations in calls:  # the slowest row decides a block's forwards: its states + the confirming one
        assert iterations == max(len(row[j].states) for row in seen) and 1 <= iterations <= n + 1
