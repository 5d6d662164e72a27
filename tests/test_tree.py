"""Tree buffers: equivalence with brute-force definitions, validation errors, shipped trees."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from inference.engine.tree import (
    TreeError,
    accepted_drafts,
    best_tree_choices,
    build_tree,
    chain_choices,
    default_tree_path,
    expected_accept_length,
    greedy_tree_choices,
    load_tree,
    read_tree_file,
    root_only_tree,
    walk_forwards,
)


def random_choices(rng: random.Random, num_heads: int, topk: int, size: int) -> list[tuple[int, ...]]:
    """A random prefix-closed set of paths, in random order."""
    chosen: set[tuple[int, ...]] = set()
    frontier = [(r,) for r in range(topk)]
    while frontier and len(chosen) < size:
        path = frontier.pop(rng.randrange(len(frontier)))
        chosen.add(path)
        if len(path) < num_heads:
            frontier += [path + (r,) for r in range(topk)]
    paths = list(chosen)
    rng.shuffle(paths)
    return paths


@pytest.mark.parametrize("seed", range(8))
def test_buffers_match_brute_force(seed):
    rng = random.Random(seed)
    heads, topk = rng.randint(1, 5), rng.randint(1, 4)
    tree = build_tree(random_choices(rng, heads, topk, rng.randint(1, 30)), heads, topk)
    paths = [()] + list(tree.choices)
    k = len(paths)
    expected_attn = torch.tensor([[paths[i][: len(paths[j])] == paths[j] for j in range(k)] for i in range(k)])
    assert torch.equal(tree.attn, expected_attn)
    assert tree.depth.tolist() == [len(p) for p in paths]
    assert tree.parent.tolist() == [-1] + [paths.index(p[:-1]) for p in paths[1:]]
    assert tree.head.tolist() == [len(p) - 1 for p in paths]
    assert tree.rank.tolist() == [p[-1] if p else -1 for p in paths]
    # parents precede children; siblings in rank order
    assert all(tree.parent[i] < i for i in range(1, k))
    for i, row in enumerate(tree.child_table.tolist()):
        kids = [c for c in row if c >= 0]
        assert kids == [j for j in range(k) if paths[j][:-1] == paths[i] and j > 0]
        assert [paths[c][-1] for c in kids] == sorted(paths[c][-1] for c in kids)
    # retrieve: one row per leaf, each row the root-to-leaf chain
    leaves = {i for i in range(k) if not any(paths[j][:-1] == paths[i] for j in range(1, k))}
    assert {int(row[row >= 0][-1]) for row in tree.retrieve} == leaves
    assert tree.retrieve.shape == (len(leaves), tree.max_depth + 1)
    for i in range(k):
        chain = tree.node_path[i][tree.node_path[i] >= 0].tolist()
        assert [paths[j] for j in chain] == [paths[i][:d] for d in range(len(paths[i]) + 1)]
        assert i in tree.retrieve[tree.node_to_path[i]].tolist()
    # candidate index: head-major [H * topk] flattening of (head, rank)
    assert tree.candidate_index.tolist() == [(len(p) - 1) * tree.topk + p[-1] for p in paths[1:]]


def test_chain_is_blockwise_parallel():
    tree = build_tree(chain_choices(4), num_heads=4, topk=1)
    assert tree.num_nodes == 5 and tree.topk == 1
    assert torch.equal(tree.attn, torch.ones(5, 5, dtype=torch.bool).tril())
    assert tree.retrieve.tolist() == [[0, 1, 2, 3, 4]]
    assert load_tree("chain", num_heads=3, topk=10).choices == ((0,), (0, 0), (0, 0, 0))
    assert load_tree("chain:2", num_heads=3, topk=10).max_depth == 2


def test_root_only_tree():
    tree = root_only_tree()
    assert tree.num_nodes == 1 and tree.retrieve.tolist() == [[0]] and tree.topk == 0


@pytest.mark.parametrize(
    "choices, message",
    [
        ([(0,), (0, 0), (0, 0, 0)], "exceeds the drafter's 2 head"),
        ([(0,), (4,)], r"ranks must be in \[0, 4\)"),
        ([(0,), (-1,)], "ranks must be in"),
        ([(0,), (1, 0)], r"parent \[1\] is missing"),
        ([(0,), (1,), (0,)], "duplicate path"),
        ([(), (0,)], "implicit root"),
        ([(0,), "ab"], "not a list of integer ranks"),
        ([(0,), (1.0,)], "not a list of integer ranks"),
    ],
)
def test_validation_errors(choices, message):
    with pytest.raises(TreeError, match=message):
        build_tree(choices, num_heads=2, topk=4)


def test_tree_file_round_trip_and_errors(tmp_path):
    good = tmp_path / "tree.json"
    good.write_text(json.dumps({"choices": [[0], [1], [0, 0]]}))
    assert load_tree(str(good), num_heads=2, topk=2).choices == ((0,), (1,), (0, 0))
    bare = tmp_path / "bare.json"
    bare.write_text("[[0], [0, 0]]")
    assert load_tree(bare, num_heads=2, topk=1).num_nodes == 3

    broken = tmp_path / "broken.json"
    broken.write_text('{"choices": [[0],\n [1,]]}')
    with pytest.raises(TreeError, match=r"broken\.json: line 2"):
        load_tree(str(broken), num_heads=2, topk=2)
    deep = tmp_path / "deep.json"
    deep.write_text("[[0], [0, 0], [0, 0, 0]]")
    with pytest.raises(TreeError, match=r"deep\.json: entry 2 \[0, 0, 0\]: depth 3 exceeds"):
        load_tree(str(deep), num_heads=2, topk=2)
    with pytest.raises(TreeError, match="cannot read tree file"):
        load_tree(str(tmp_path / "missing.json"), num_heads=2, topk=2)
    with pytest.raises(TreeError, match="chain:<depth>"):
        load_tree("chain:x", num_heads=2, topk=2)


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 5])
def test_shipped_default_trees(heads):
    tree = load_tree(None, num_heads=heads, topk=10)
    assert 8 <= tree.num_nodes <= 32
    assert tree.max_depth <= heads and tree.topk <= 10
    doc = json.loads(default_tree_path(heads).read_text())
    assert doc["num_heads"] == heads and doc["num_nodes"] == tree.num_nodes
    # the shipped tree is the greedy optimum for its stated accuracies
    assert tree.choices == tuple(greedy_tree_choices(doc["nominal_accuracy"], tree.num_nodes - 1))
    # a drafter with fewer heads than the largest default uses the cut tree
    assert load_tree("default", num_heads=7, topk=10).max_depth <= 5


def test_greedy_tree_is_optimal_against_brute_force():
    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.15, 0.05]]
    universe = [p for d in (1, 2) for p in itertools.product(range(3), repeat=d)]
    for size in (1, 3, 5):
        best = max(
            expected_accept_length(subset, accuracy)
            for subset in itertools.combinations(universe, size)
            if all(len(p) == 1 or p[:-1] in subset for p in subset)
        )
        greedy = greedy_tree_choices(accuracy, size)
        assert len(greedy) == size
        assert expected_accept_length(greedy, accuracy) == pytest.approx(best)


def test_best_tree_trades_acceptance_for_cost():
    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.15, 0.05], [0.4, 0.1, 0.05]]
    free = best_tree_choices(accuracy, lambda nodes, depth: 1.0, max_nodes=10)
    assert len(free) == 9 and max(map(len, free)) == 3  # no cost: the largest tree
    pricey_heads = best_tree_choices(accuracy, lambda nodes, depth: 1.0 + 10.0 * depth, max_nodes=10)
    assert max(map(len, pricey_heads)) == 1  # heads cost more than they return: stay one level deep
    pricey_nodes = best_tree_choices(accuracy, lambda nodes, depth: float(nodes), max_nodes=10)
    assert pricey_nodes == [(0,)]


def test_accepted_drafts_follow_the_longest_path_of_the_tree():
    tree = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    assert accepted_drafts(tree, [0, 0, 0, 0]) == 3  # the tree is 3 deep
    assert accepted_drafts(tree, [0, 1, 0]) == 2  # (0, 1) has no child
    assert accepted_drafts(tree, [1, 0]) == 1
    assert accepted_drafts(tree, [2, 0]) == 0  # rank 2 is not a node
    assert accepted_drafts(tree, [0, -1, 0]) == 1  # depth 2's token was not among the candidates
    assert accepted_drafts(chain_choices(2), []) == 0


def test_walk_counts_forwards_the_way_the_engine_steps():
    """Twenty tokens, the first half easy (a chain of 3 gets all three drafts accepted at each of those roots), the
    second hard (none). The mean over the 19 roots says τ = 1 + 3 · 9/19 ≈ 2.42, but the walk crosses the easy half
    in 3 steps and the hard half in 7: 20 tokens in 1 + 3 + 7 = 11 forwards, τ ≈ 1.82."""
    easy, hard = [0, 0, 0], [5, 5, 5]
    ranks = [easy] * 9 + [hard] * 10  # the root after c committed tokens: easy for c <= 9
    assert walk_forwards(chain_choices(3), ranks, 20) == 11
    assert walk_forwards([], ranks, 20) == 20  # no tree: one forward a token, as a plain loop
    # the last step may overshoot the token budget: it is cut, still one forward
    assert walk_forwards(chain_choices(3), [easy] * 3, 4) == 2
    assert walk_forwards(chain_choices(3), [], 1) == 1


def test_read_tree_file_rejects_wrong_shape(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"nodes": []}')
    with pytest.raises(TreeError, match="'choices' list"):
        read_tree_file(path)
