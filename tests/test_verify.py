"""Verification rules on hand-made and stub distributions (no model): greedy, typical, exact rejection sampling."""

from __future__ import annotations

import math

import pytest
import torch

from inference.engine.tree import build_tree, chain_choices
from inference.engine.verify import (
    SamplingParams,
    target_probs,
    typical_threshold,
    verify_greedy,
    verify_rejection,
    verify_typical,
)

pytestmark = pytest.mark.usefixtures("single_thread")
TREE = build_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], num_heads=3, topk=2)
# node ids: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (0,1), 5 (1,0), 6 (0,0,0)


def peaked_logits(argmax: list[int], vocab: int = 8) -> torch.Tensor:
    """[1, K, V] logits whose argmax at node i is argmax[i]."""
    logits = torch.zeros(1, len(argmax), vocab)
    logits[0, torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


def test_greedy_picks_the_longest_matching_path():
    tokens = torch.tensor([[7, 1, 2, 3, 4, 5, 6]])
    # root predicts 2 (node 2 = rank-1 child), node 2 predicts 5 (its child node 5), node 5 predicts 0 (bonus)
    result = verify_greedy(tokens, peaked_logits([2, 3, 5, 6, 0, 0, 0]), TREE)
    assert result.node.tolist() == [5] and result.num_accepted.tolist() == [2]
    assert result.path.tolist() == [[0, 2, 5, -1]]
    assert result.tokens.tolist() == [[2, 5, 0, -1]]
    assert result.next_token.tolist() == [0]
    assert 5 in TREE.retrieve[result.path_index[0]].tolist()


def test_greedy_full_path_gets_a_bonus_token_and_rejection_gets_the_correction():
    tokens = torch.tensor([[7, 1, 2, 3, 4, 5, 6], [7, 1, 2, 3, 4, 5, 6]])
    logits = torch.cat([peaked_logits([1, 3, 0, 6, 0, 0, 4]), peaked_logits([0, 0, 0, 0, 0, 0, 0])])
    result = verify_greedy(tokens, logits, TREE)
    assert result.num_accepted.tolist() == [3, 0]
    assert result.tokens.tolist() == [[1, 3, 6, 4], [0, -1, -1, -1]]


@pytest.mark.parametrize("seed", range(5))
def test_rejection_at_temperature_zero_is_greedy(seed):
    gen = torch.Generator().manual_seed(seed)
    tree = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)], 3, 3)
    vocab, batch = 4, 64  # small vocab so drafts often match the argmax
    # siblings hold distinct tokens, as top-k drafts do: node i gets a random permutation entry of its rank
    perms = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(batch * tree.num_nodes)])
    tokens = perms.view(batch, tree.num_nodes, vocab)[:, tree.parent.clamp(min=0), tree.rank.clamp(min=0)]
    logits = torch.randn(batch, tree.num_nodes, vocab, generator=gen)
    greedy = verify_greedy(tokens, logits, tree)
    sampled = verify_rejection(tokens, logits, tree, SamplingParams(temperature=0.0), gen)
    assert torch.equal(greedy.tokens, sampled.tokens) and torch.equal(greedy.node, sampled.node)
    assert greedy.num_accepted.float().mean() > 0.3


def test_sampling_params_processing_by_hand():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert torch.allclose(target_probs(logits, SamplingParams(temperature=1.0)), torch.tensor([0.4, 0.3, 0.2, 0.1]))
    top2 = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([4 / 7, 3 / 7, 0, 0]))
    top_p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))  # 0.4 + 0.3 < 0.75: keep three
    assert torch.allclose(top_p, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0]))
    hot = target_probs(logits, SamplingParams(temperature=2.0))
    expected = torch.tensor([0.4, 0.3, 0.2, 0.1]).sqrt()
    assert torch.allclose(hot, expected / expected.sum())
    assert target_probs(logits, SamplingParams()).tolist() == [1.0, 0.0, 0.0, 0.0]
    for bad in (dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_typical_threshold_by_hand():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    entropy = -sum(x * math.log(x) for x in p.tolist())
    assert 0.3 * math.exp(-entropy) > 0.09  # so the threshold is epsilon
    assert typical_threshold(p, 0.09, 0.3).item() == pytest.approx(0.09)
    flat = torch.full((5,), 0.2)  # H = ln 5, so delta * exp(-H) = 0.3 / 5
    assert typical_threshold(flat, 0.09, 0.3).item() == pytest.approx(0.06)


def test_typical_acceptance_on_hand_made_distributions():
    tree = build_tree([(0,), (1,), (2,), (0, 0)], num_heads=2, topk=3)  # 0 root, 1-3 depth 1, 4 = (0, 0)
    root_p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])  # threshold 0.09: tokens 0, 1, 2 pass; 3, 4 fail
    confident = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])
    probs = torch.stack([root_p, confident, confident, confident, confident])[None]  # [1, K, V]
    logits = probs.clamp(min=1e-12).log()
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)

    # depth-1 drafts 1 (p .3), 0 (p .5), 3 (p .05): two equal-length paths pass; the likelier (token 0) wins
    result = verify_typical(torch.tensor([[4, 1, 0, 3, 2]]), logits, tree, params, generator=gen)
    assert result.node.tolist() == [2] and result.tokens.tolist() == [[0, 4, -1]]

    # a longer accepted path beats a likelier short one: node 1 (token 2, p .15) then node 4 (token 4, p 1)
    result = verify_typical(torch.tensor([[4, 2, 0, 3, 4]]), logits, tree, params, generator=gen)
    assert result.node.tolist() == [4] and result.num_accepted.tolist() == [2]
    assert result.tokens.tolist() == [[2, 4, 4]]

    # nothing passes: the next token is sampled from the root distribution (token 4 has p 0 there)
    tokens = torch.tensor([[4, 3, 4, 4, 0]])
    nexts = {verify_typical(tokens, logits, tree, params, generator=gen).next_token.item() for _ in range(50)}
    assert nexts <= {0, 1, 2, 3} and len(nexts) > 1


# --- exact rejection sampling reproduces the target distribution ------------------------------------------------

VOCAB = 5
STEPS_TOKENS = 3  # compare the joint law of the first 3 committed tokens: 125 cells


def markov_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target P[last] -> next-token probabilities [V, V] and a different drafter table Q [D, V, V]."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(2.0 * torch.randn(VOCAB, VOCAB, generator=gen), -1)
    draft = torch.softmax(2.0 * torch.randn(4, VOCAB, VOCAB, generator=gen), -1)
    return target, draft


def simulate(tree, target, draft, params, samples, seed, duplicate_siblings=False):
    """Run the verify loop with a stub drafter (Medusa-like: head d's top-R of draft[d][root]) and a stub Markov
    target (logits at a node depend on its token only). Returns the first STEPS_TOKENS tokens per sample."""
    gen = torch.Generator().manual_seed(seed)
    root = torch.zeros(samples, dtype=torch.long)
    committed = [[] for _ in range(samples)]
    accepted = []
    ranks = draft.argsort(-1, descending=True)  # [D, V, V]
    while min(map(len, committed)) < STEPS_TOKENS:
        cand = ranks[:, root].permute(1, 0, 2)  # [B, D, V] candidates per head by rank
        if duplicate_siblings:
            cand = torch.cat([cand[:, :, :1], cand[:, :, :-1]], dim=2)  # ranks 0 and 1 propose the same token
        flat = cand[:, :, : tree.topk].reshape(samples, -1)
        tokens = torch.cat([root[:, None], flat[:, tree.candidate_index]], dim=1)  # [B, K]
        logits = target[tokens].log()  # [B, K, V]
        result = verify_rejection(tokens, logits, tree, params, gen)
        accepted.append(result.num_accepted.float().mean().item())
        for row, (toks, n) in enumerate(zip(result.tokens.tolist(), result.num_accepted.tolist())):
            committed[row] += toks[: n + 1]
        root = result.next_token
    return torch.tensor([c[:STEPS_TOKENS] for c in committed]), sum(accepted) / len(accepted)


def chi_square_check(samples: torch.Tensor, joint: torch.Tensor) -> None:
    """Pearson chi-square goodness of fit at alpha = 1e-3 (Wilson-Hilferty critical value; z = 3.09)."""
    n = samples.shape[0]
    index = (samples * torch.tensor([VOCAB**2, VOCAB, 1])).sum(-1)
    observed = torch.bincount(index, minlength=VOCAB**3).double()
    expected = joint.reshape(-1).double() * n
    assert observed[expected == 0].sum() == 0, "sampled a sequence the target gives probability 0"
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    df = int(keep.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f} (df={df})"


@pytest.mark.parametrize(
    "choices, params, duplicates",
    [
        (chain_choices(3), SamplingParams(temperature=1.0), False),
        ([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], SamplingParams(temperature=1.0), False),
        ([(0,), (1,), (0, 0), (0, 1), (1, 0)], SamplingParams(temperature=0.7, top_k=3, top_p=0.9), False),
        ([(0,), (1,), (2,), (0, 0), (1, 0)], SamplingParams(temperature=1.0), True),
    ],
    ids=["chain", "tree", "tree-topk-topp", "duplicate-siblings"],
)
def test_rejection_sampling_reproduces_the_target(choices, params, duplicates):
    target, draft = markov_tables(seed=1)
    tree = build_tree(choices, num_heads=3, topk=3)
    samples, mean_accepted = simulate(tree, target, draft, params, 20_000, seed=2, duplicate_siblings=duplicates)
    processed = target_probs(target.log(), params)  # the law plain sampling with `params` follows: [V, V]
    joint = processed[0][:, None, None] * processed[:, :, None] * processed[None, :, :]  # root token is 0
    chi_square_check(samples, joint)
    assert mean_accepted > 0.2  # the drafts are accepted often enough for the test to exercise acceptance
