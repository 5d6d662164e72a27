"""Lookahead drafting: trie operations against brute-force n-gram counts, bounded memory, per-step token trees, and
the loop with lookahead drafts against plain greedy decoding and the target's sampling distribution."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from inference.drafters.lookahead import LookaheadDrafter, TokenTrie
from inference.drafters.path_trees import TreeCache, chain_nodes, merge_rows, paths_draft, rank_tree
from inference.engine.drafter import DecodeState, Draft
from inference.engine.loop import DecodeConfig, generate
from inference.engine.verify import SamplingParams, VerifyResult, target_probs
from tests.test_generate import VOCAB, binned_chi_square, plain_greedy

pytestmark = pytest.mark.usefixtures("single_thread")


def ngram_counts(seq: list[int], max_n: int, ends_from: int = 0, weight: float = 1.0) -> Counter:
    """Brute force: weighted occurrences of every n-gram (n <= max_n) of `seq` ending at an index >= ends_from."""
    counts: Counter = Counter()
    for j in range(ends_from, len(seq)):
        for i in range(max(0, j + 1 - max_n), j + 1):
            counts[tuple(seq[i : j + 1])] += weight
    return counts


def assert_invariant(trie: TokenTrie) -> None:
    """Size bookkeeping matches the nodes, and count / recency never increase along a path."""
    nodes = list(trie.nodes())
    assert len(nodes) == len(trie) <= trie.max_nodes
    for node in nodes:
        assert node.count > 0 and node.alive
        for child in node.children.values():
            assert child.count <= node.count and child.last <= node.last


def repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a short pattern (so n-gram drafts have something to match), of different lengths."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        pattern = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 6))]
        prompts.append(pattern * rng.randint(2, 3) + pattern[: rng.randint(0, 2)])
    return prompts


def test_trie_counts_equal_brute_force_and_stream_like_insert():
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    trie = TokenTrie(max_nodes=1000, max_depth=3)
    trie.insert(seq, weight=2.0)
    assert trie.ngrams() == ngram_counts(seq, 3, weight=2.0)
    assert trie.match([1, 2]).count == 6.0 and trie.match([3, 2]) is None
    assert trie.continuations([1, 2], budget=5, depth=2) == [(3,), (4,)]  # (3,) twice as frequent; depth <= 3
    assert trie.continuations([1], budget=2, depth=2) == [(2,), (2, 3)]
    rng = random.Random(0)
    for _ in range(20):
        full = [rng.randrange(6) for _ in range(rng.randint(1, 30))]
        cut = rng.randint(0, len(full))
        streamed = TokenTrie(max_nodes=10_000, max_depth=4)
        streamed.insert(full[:cut])
        streamed.extend(full, cut)
        assert streamed.ngrams() == ngram_counts(full, 4)
        assert_invariant(streamed)


def test_eliminate_undoes_insert_and_keeps_output_branches():
    rng = random.Random(1)
    kept = [rng.randrange(8) for _ in range(40)]
    prompt = [rng.randrange(8) for _ in range(30)]
    trie = TokenTrie(max_nodes=10_000, max_depth=4)
    trie.insert(kept)
    trie.insert(prompt, weight=2.0)
    trie.eliminate(prompt, weight=2.0)
    assert trie.ngrams() == ngram_counts(kept, 4)
    # a prompt followed by output: eliminating the prompt keeps every n-gram that ends in the output
    trie = TokenTrie(max_nodes=10_000, max_depth=4)
    output = [rng.randrange(8) for _ in range(20)]
    trie.insert(prompt, weight=2.0)
    trie.extend(prompt + output, len(prompt))
    trie.eliminate(prompt, weight=2.0)
    expected = ngram_counts(prompt + output, 4, ends_from=len(prompt))
    grams = trie.ngrams()
    assert all(grams[g] >= c for g, c in expected.items())  # >=: an output n-gram may also be a prefix of another
    assert all(g in expected or any(e[: len(g)] == g for e in expected) for g in grams)  # nothing prompt-only
    assert_invariant(trie)


def test_prune_bounds_the_trie_and_keeps_frequent_ngrams():
    rng = random.Random(2)
    trie = TokenTrie(max_nodes=60, max_depth=4)
    frequent = [7, 8, 9, 10]
    for step in range(200):
        if step % 4 == 0:
            trie.insert(frequent)
        else:
            trie.extend([rng.randrange(50) for _ in range(6)], 0)
        assert len(trie) <= 60
    assert_invariant(trie)
    assert trie.continuations([7], budget=3, depth=3) == [(8,), (8, 9), (8, 9, 10)]
    trie.prune(10)
    assert len(trie) <= 10 and trie.match(frequent) is not None  # the most frequent n-grams are the last to go
    assert_invariant(trie)
    with pytest.raises(ValueError, match="max_nodes"):
        TokenTrie(max_nodes=10, max_depth=4)


def test_token_paths_merge_into_one_tree_per_step():
    nodes = rank_tree([(5, 6, 7), (5, 8), (9,), (5, 6)])
    assert nodes == [((0,), 5), ((0, 0), 6), ((0, 0, 0), 7), ((0, 1), 8), ((1,), 9)]
    # sources that take turns come after the priority paths, a node at a time: chains a level at a time, every
    # second token (4, 8) before 7; a tree's nodes in its own order
    turns = rank_tree([(5, 6)], take_turns=[chain_nodes((5, 6, 7, 2)), chain_nodes((9, 4)), chain_nodes((5, 8))])
    assert turns == [((0,), 5), ((0, 0), 6), ((1,), 9), ((1, 0), 4), ((0, 1), 8), ((0, 0, 0), 7), ((0, 0, 0, 0), 2)]
    mixed = rank_tree([], take_turns=[chain_nodes((5, 6)), [(9,), (3,), (9, 4), (5, 7)]])
    assert mixed == [((0,), 5), ((1,), 9), ((0, 0), 6), ((2,), 3), ((1, 0), 4), ((0, 1), 7)]
    other = rank_tree([(4,), (3, 3)])  # ranks (0,), (1,), (1, 0)
    assert merge_rows([nodes, other], max_nodes=3) == [(0,), (0, 0), (1,)]  # rows take turns; prefix-closed
    trees = TreeCache()
    root = torch.tensor([1, 2, 3])
    draft = paths_draft(root, [[(5, 6, 7), (5, 8), (9,)], [(4,), (3, 3)], []], max_nodes=15, trees=trees)
    assert draft.tree.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert draft.tokens.tolist() == [
        [1, 5, 9, 6, 8, 9, 7],  # (1, 0) is a filler for row 0: a copy of its parent's token
        [2, 4, 3, 4, 4, 3, 4],
        [3, 3, 3, 3, 3, 3, 3],  # no paths: every node a filler
    ]
    again = paths_draft(root, [[(9, 8, 7), (9, 1), (4,)], [(2,), (6, 6)], []], max_nodes=15, trees=trees)
    assert again.tree is draft.tree and again.tokens[0].tolist() == [1, 9, 4, 8, 1, 4, 7]  # shape from the cache
    assert paths_draft(root, [[], [], []], max_nodes=15, trees=trees).tree.num_nodes == 1


def test_retrieval_prefers_long_prefixes_and_adapts():
    drafter = LookaheadDrafter(draft_nodes=4, branch_length=3, max_prefix=3)
    drafter.trie.insert([1, 2, 3, 4, 5, 6])
    drafter.trie.insert([9, 2, 3, 7, 7, 7])
    assert drafter.retrieve([1, 2, 3]) == [(4,), (4, 5), (4, 5, 6), (7,)]  # 3-token match, then 2-token fill
    assert drafter.retrieve([9, 2, 3]) == [(7,), (7, 7), (7, 7, 7), (4,)]
    assert drafter.retrieve([8, 8]) == []


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lookahead_greedy_equals_plain_greedy_batched(tiny_lm_factory, arch):
    model = tiny_lm_factory(arch)
    prompts = repetitive_prompts(3, 4)
    references = [plain_greedy(model, p, 30) for p in prompts]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    drafter = LookaheadDrafter(draft_nodes=12, branch_length=6, max_prefix=3)
    out = generate(model, ids, drafter, DecodeConfig(max_new_tokens=30), attention_mask=mask)
    assert out.sequences == references
    assert sum(a for step in out.stats.accepted for a in step if a > 0) > 0
    for prompt, reference in zip(prompts, references):  # one row at a time; the trie carries over between requests
        single = generate(model, torch.tensor([prompt]), drafter, DecodeConfig(max_new_tokens=30))
        assert single.sequences[0] == reference and single.stats.mean_accepted > 0


class Checked:
    """Wraps a LookaheadDrafter: checks the trie after every propose and update, keeps the last generation's state."""

    needs_hidden = False

    def __init__(self, inner: LookaheadDrafter) -> None:
        self.inner, self.peak, self.run = inner, 0, None

    def check(self) -> None:
        assert_invariant(self.inner.trie)
        self.peak = max(self.peak, len(self.inner.trie))

    def propose(self, state: DecodeState) -> Draft:
        draft = self.inner.propose(state)
        self.check()
        return draft

    def update(self, state: DecodeState, draft: Draft, result: VerifyResult) -> None:
        self.inner.update(state, draft, result)
        self.check()
        self.run = state.drafter_state


def test_trie_memory_stays_bounded_over_a_long_generation(tiny_lm_factory):
    model = tiny_lm_factory("llama")
    prompt = repetitive_prompts(5, 1)[0] + [random.Random(5).randrange(3, VOCAB) for _ in range(40)]
    drafter = Checked(LookaheadDrafter(max_nodes=64, draft_nodes=8, branch_length=5, max_prefix=2))
    out = generate(model, torch.tensor([prompt]), drafter, DecodeConfig(max_new_tokens=120))
    assert out.sequences[0] == plain_greedy(model, prompt, 120)
    assert 48 <= drafter.peak <= 64  # the budget was reached and held


def test_a_new_generation_swaps_prompts_and_keeps_outputs(tiny_lm_factory):
    model = tiny_lm_factory("llama")
    first, second = repetitive_prompts(6, 2)
    drafter = Checked(LookaheadDrafter(draft_nodes=8, branch_length=4, max_prefix=2))
    generate(model, torch.tensor([first]), drafter, DecodeConfig(max_new_tokens=20))
    first_context = drafter.run.contexts[0]  # prompt + every committed token
    generate(model, torch.tensor([second]), drafter, DecodeConfig(max_new_tokens=20))
    reference = TokenTrie(max_depth=6)
    reference.insert(first, 2.0)
    reference.extend(first_context, len(first))
    reference.eliminate(first, 2.0)
    reference.insert(second, 2.0)
    reference.extend(drafter.run.contexts[0], len(second))
    assert drafter.inner.trie.ngrams() == reference.ngrams()
    assert drafter.inner.counted_prompts == [second]


def test_lookahead_sampling_matches_the_target_distribution(tiny_lm_factory):
    """Rejection sampling over multi-branch lookahead trees: (x1, x2) of 4000 sampled continuations against the
    target's exact joint law. The trie is first fed sampled outputs, so drafts are frequent continuations."""
    model = tiny_lm_factory("llama")
    params = SamplingParams(temperature=0.6, top_k=40)
    prompt = [17, 90, 33, 17, 90]
    with torch.no_grad():
        p1 = target_probs(model(input_ids=torch.tensor([prompt])).logits[0, -1], params)  # [V]
        ctx2 = torch.cat([torch.tensor(prompt).expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
        p2 = target_probs(model(input_ids=ctx2).logits[:, -1], params)  # [V, V]
    drafter = LookaheadDrafter(draft_nodes=6, branch_length=2, max_prefix=2)
    config = DecodeConfig(max_new_tokens=2, sampling=params)
    generator = torch.Generator().manual_seed(0)
    generate(model, torch.tensor([prompt] * 300), drafter, config, generator=generator)  # feed the trie
    n = 4000
    out = generate(model, torch.tensor([prompt] * n), drafter, config, generator=generator)
    assert out.stats.mean_accepted > 0.3
    x = torch.tensor(out.sequences)  # [n, 2]
    observed = torch.bincount(x[:, 0] * VOCAB + x[:, 1], minlength=VOCAB * VOCAB)
    stat, critical = binned_chi_square(observed, p1[:, None] * p2, n)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


def test_options_and_api(tmp_path, tiny_lm_factory):
    from inference.api import load
    from inference.drafters.registry import build_from_spec

    drafter = build_from_spec("lookahead:draft_nodes=31,branch_length=10,prompt_weight=3")
    assert (drafter.draft_nodes, drafter.branch_length, drafter.prompt_weight) == (31, 10, 3.0)
    with pytest.raises(ValueError, match="lookahead: unknown option 'depth'"):
        build_from_spec("lookahead:depth=3")
    with pytest.raises(ValueError, match="lookahead: option draft_nodes must be int, got 'many'"):
        build_from_spec("lookahead:draft_nodes=many")
    with pytest.raises(ValueError, match="lookahead: draft_nodes must be >= 1"):
        LookaheadDrafter(draft_nodes=0)

    model = tiny_lm_factory("qwen2")
    base = tmp_path / "base"
    model.save_pretrained(base)
    engine = load("lookahead:draft_nodes=10", base=str(base), dtype="fp32")
    assert isinstance(engine.drafter, LookaheadDrafter) and engine.drafter.draft_nodes == 10
    prompts = repetitive_prompts(8, 2)
    out = engine.generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert out.sequences == [plain_greedy(model, p, 12) for p in prompts]
    with pytest.raises(ValueError, match="load: drafter lookahead: needs a base model; pass base="):
        load("lookahead")
    with pytest.raises(ValueError, match="tree= does not apply to drafter 'lookahead'"):
        load("lookahead", base=str(base), tree="chain")
