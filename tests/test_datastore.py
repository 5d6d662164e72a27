"""The datastore of the target's own text (inference.drafters.datastore, inference.drafters.suffix_index): its
continuations, distributions and trees against brute-force references, the request's own counts, sampled ranges and
growing while serving. Its sources: tests/test_datastore_sources.py; its load options and its drafts in the engine:
tests/test_datastore_serving.py."""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction

import pytest

import inference.drafters.datastore as datastore_module
from data.errors import UsageError
from inference.drafters.datastore import SMOOTHINGS, Datastore
from inference.drafters.suffix_index import TextCounts

pytestmark = pytest.mark.usefixtures("single_thread")


def naive_continuation(docs: list[list[int]], context: list[int], length: int, max_match: int) -> list[int]:
    """Reference: scan every document for the longest context suffix (<= max_match) followed by a token; draft the
    most frequent such token (the smallest id on a tie); repeat."""
    seq, out = list(context), []
    while len(out) < length:
        for n in range(min(max_match, len(seq)), 0, -1):
            pattern = seq[len(seq) - n :]
            following = Counter(d[i + n] for d in docs for i in range(len(d) - n) if d[i : i + n] == pattern)
            if following:
                top = max(following.values())
                token = min(t for t, c in following.items() if c == top)
                break
        else:
            return out
        out.append(token)
        seq.append(token)
    return out


@pytest.mark.parametrize("smoothing", SMOOTHINGS)
def test_continuation_examples_and_brute_force(smoothing):
    store = Datastore([[1, 2, 3, 4], [1, 2, 3, 4], [9, 2, 3, 5]], smoothing=smoothing)
    assert store.continuation([9, 2, 3], 8) == [5]  # the longest match "9 2 3" wins over the frequent "2 3" -> 4
    assert store.continuation([7, 2, 3], 8) == [4]  # "2 3" -> 4, 4, 5; after 4 a document ends: nothing follows
    assert store.continuation([8], 4) == [] and store.continuation([5], 4) == []  # unknown, and only at an end
    chain = Datastore([[5, 6, 7, 8, 9]])
    assert chain.continuation([5], 8) == [6, 7, 8, 9] and chain.continuation([0, 5], 2) == [6, 7]
    assert Datastore([[1, 2], [3, 4]]).continuation([2], 4) == []  # documents never run into each other
    assert Datastore([[1, 2, 3], [1, 2, 3]], max_match=1).continuation([7, 2], 5) == [3]
    rng = random.Random(0)
    for _ in range(150):
        docs = [[rng.randrange(6) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 5))]
        context = [rng.randrange(7) for _ in range(rng.randint(1, 8))]
        max_match = rng.randint(1, 4)
        draft = Datastore(docs, max_match=max_match, smoothing=smoothing).continuation(context, 6)
        if smoothing == "longest":
            assert draft == naive_continuation(docs, context, 6, max_match), (docs, context)
        for i, token in enumerate(draft + [None]):  # each token a likeliest one; it stops where nothing follows
            probs = naive_next(docs, context + draft[:i], max_match, smoothing)
            if token is None:
                assert len(draft) == 6 or not probs, (docs, context, draft)
            else:
                assert float(probs[token]) == pytest.approx(float(max(probs.values()))), (docs, context, draft)


def following(docs: list[list[int]], pattern: list[int]) -> Counter:
    return Counter(d[i + len(pattern)] for d in docs for i in range(len(d) - len(pattern)) if d[i : i + len(pattern)]
                   == pattern)


def naive_next(docs: list[list[int]], seq: list[int], max_match: int, smoothing: str) -> dict[int, Fraction]:
    """Reference, in exact fractions: the next token's distribution after `seq`. "longest": the counts after its
    longest suffix (<= max_match) that some document continues. "witten_bell": p_1 = c_1 / C_1, then for each longer
    suffix that occurs with a next token p_n = λ_n c_n / C_n + (1 - λ_n) p_{n-1}, λ_n = C_n / (C_n + T_n)."""
    levels = []
    for n in range(1, min(max_match, len(seq)) + 1):
        counts = following(docs, seq[len(seq) - n :])
        if not counts:
            break
        levels.append(counts)
    if not levels:
        return {}
    if smoothing == "longest":
        total = sum(levels[-1].values())
        return {token: Fraction(count, total) for token, count in levels[-1].items()}
    probs: dict[int, Fraction] = {}
    for n, counts in enumerate(levels, 1):
        total = sum(counts.values())
        weight = Fraction(1) if n == 1 else Fraction(total, total + len(counts))
        probs = {token: weight * Fraction(counts[token], total) + (1 - weight) * probs.get(token, 0)
                 for token in set(probs) | set(counts)}
    return probs


def test_witten_bell_interpolates_the_suffixes_counts_and_remembers_until_the_store_changes():
    docs = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [2, 5]]
    store = Datastore(docs, max_served=100)
    # "2" -> 3, 3, 4, 5 and "1 2" -> 3, 3, 4: λ_2 = 3 / (3 + 2), p(3) = 0.6 (2/3) + 0.4 (2/4) = 0.6
    tokens, probs, n = store.next_probs([7, 1, 2])
    assert tokens.tolist() == [3, 4, 5] and probs.tolist() == pytest.approx([0.6, 0.3, 0.1]) and n == 2
    longest = store.configured("longest")  # the same index, the longest suffix's counts alone
    assert longest.loaded is store.loaded and store.smoothing == "witten_bell"
    tokens, probs, n = longest.next_probs([7, 1, 2])
    assert tokens.tolist() == [3, 4] and probs.tolist() == pytest.approx([2 / 3, 1 / 3]) and n == 2
    assert store.next_probs([1, 2], longest=1)[1].tolist() == pytest.approx([0.5, 0.25, 0.25])
    assert store.next_probs([9])[2] == 0 and not len(store.next_probs([9])[0])
    for _ in range(3):
        store.add([1, 2, 5, 5])  # what the memo holds goes with every answer served
    tokens, probs, n = store.next_probs([7, 1, 2])
    expected = naive_next(docs + [[1, 2, 5, 5]] * 3, [7, 1, 2], 3, "witten_bell")
    assert dict(zip(tokens.tolist(), probs.tolist())) == pytest.approx({t: float(p) for t, p in expected.items()})
    assert tokens[0] == 5
    store.forget_served()
    assert store.next_probs([7, 1, 2])[1].tolist() == pytest.approx([0.6, 0.3, 0.1])
    rng = random.Random(3)
    for _ in range(100):
        docs = [[rng.randrange(5) for _ in range(rng.randint(1, 14))] for _ in range(rng.randint(1, 5))]
        context = [rng.randrange(6) for _ in range(rng.randint(1, 6))]
        max_match = rng.randint(1, 4)
        for smoothing in SMOOTHINGS:
            tokens, probs, _ = Datastore(docs, max_match=max_match, smoothing=smoothing).next_probs(context)
            expected = naive_next(docs, context, max_match, smoothing)
            assert dict(zip(tokens.tolist(), probs.tolist())) == pytest.approx(
                {t: float(p) for t, p in expected.items()}), (docs, context, smoothing)
            assert probs.tolist() == sorted(probs.tolist(), reverse=True)
    with pytest.raises(ValueError, match="smoothing must be one of witten_bell, longest, got 'kneser_ney'"):
        Datastore(docs, smoothing="kneser_ney")


def test_the_memo_of_distributions_stays_bounded(monkeypatch):
    monkeypatch.setattr(datastore_module, "MEMO_SIZE", 5)
    store = Datastore([list(range(40))])
    for token in range(39):
        assert store.continuation([token], 1) == [token + 1]
        assert 1 <= len(store.memo) <= 5


def naive_scores(docs: list[list[int]], context: list[int], depth: int, max_match: int,
                 smoothing: str) -> dict[tuple, float]:
    """Reference: the nodes of the datastore's tree down to `depth`, with their scores (the product of their tokens'
    probabilities), every node that can be among the `depth` best: a path scored below the depth-th best node of the
    levels above it is not expanded (a child never scores more than its parent)."""
    scores: dict[tuple, float] = {}
    level = {(): 1.0}
    for _ in range(depth):
        best = sorted(scores.values(), reverse=True)
        floor = best[depth - 1] * (1 - 1e-9) if len(best) >= depth else 0.0
        deeper = {}
        for path, score in level.items():
            if score < floor:
                continue
            for token, prob in naive_next(docs, context + list(path), max_match, smoothing).items():
                deeper[path + (token,)] = score * float(prob)
        scores.update(deeper)
        level = deeper
    return scores


@pytest.mark.parametrize("smoothing", SMOOTHINGS)
def test_the_tree_takes_the_most_likely_nodes_best_first(smoothing):
    """Datastore.tree against exhaustive enumeration: its nodes' scores are the `size` best of every node, in
    non-increasing order, each node after its parent; ties go to the more frequent, then the smaller token."""
    store = Datastore([[1, 2, 3], [1, 2, 4], [1, 2, 3], [2, 5]], smoothing=smoothing)
    if smoothing == "longest":  # "1 2" -> 3, 4; documents end after 3 and 4: only 3 nodes exist
        assert store.tree([1], 4) == [(2,), (2, 3), (2, 4)]
    else:  # "2" -> 5 too, with a share of the probability
        assert store.tree([1], 5) == [(2,), (2, 3), (2, 4), (2, 5)]
    assert store.tree([2], 3) == [(3,), (4,), (5,)]  # "2" -> 3 twice, 4 and 5 once each (a tie: 4 first)
    assert store.tree([9], 3) == [] and store.tree([1], 0) == []
    rng = random.Random(2)
    for _ in range(150):
        docs = [[rng.randrange(5) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 5))]
        context = [rng.randrange(6) for _ in range(rng.randint(1, 6))]
        max_match, size = rng.randint(1, 4), rng.randint(1, 9)
        store = Datastore(docs, max_match=max_match, smoothing=smoothing)
        nodes = store.tree(context, size)
        scores = naive_scores(docs, context, size, max_match, smoothing)
        got = [scores[node] for node in nodes]
        assert len(set(nodes)) == len(nodes) and all(n[:-1] == () or n[:-1] in nodes[:i] for i, n in enumerate(nodes))
        assert got == sorted(got, reverse=True)
        assert got == pytest.approx(sorted(scores.values(), reverse=True)[:size]), (docs, context, max_match)
        # the scores it ranks by, and the same score for a path asked for directly (a chain's nodes)
        scored = store.scored_tree(context, size)
        assert [path for path, _ in scored] == nodes and [score for _, score in scored] == pytest.approx(got)
        for path, score in scored:
            prefixes = [path[:i] for i in range(1, len(path) + 1)]
            assert store.path_scores(context, path) == pytest.approx([scores[p] for p in prefixes])
        assert store.path_scores(context, [9, 1]) == [0.0, 0.0]  # 9 never follows: nothing below it counts either


def test_text_counts_count_what_followed_every_short_ngram():
    own = TextCounts(2)
    own.extend([5, 6])
    own.extend([5, 6, 7])
    assert own.tokens == [5, 6, 5, 6, 7]
    assert own.following([5]) == {6: 2} and own.following([6]) == {5: 1, 7: 1} and own.following([7]) == {}
    assert own.following([5, 6]) == {5: 1, 7: 1} and own.following([6, 5]) == {6: 1}
    assert own.following([6, 5, 6]) == {}  # longer than max_n: never counted


@pytest.mark.parametrize("smoothing", SMOOTHINGS)
def test_the_requests_own_text_counts_as_that_many_copies_of_it_in_the_corpus(smoothing):
    """request_weight=w with the request's TextCounts drafts as a corpus that holds the request's text w more times
    (distribution, greedy chain, tree); without the counts, or with w=0, the corpus alone; the memo of the corpus's
    distributions is never touched by a request's counts."""
    rng = random.Random(7)
    docs = [[rng.randrange(6) for _ in range(rng.randint(1, 30))] for _ in range(12)]
    plain = Datastore(docs, smoothing=smoothing)
    for weight in (1, 3):
        store = Datastore(docs, smoothing=smoothing, request_weight=weight)
        for _ in range(40):
            context = [rng.randrange(7) for _ in range(rng.randint(1, 25))]  # 6: only ever in the request
            own = TextCounts(store.max_match)
            own.extend(context)
            copies = Datastore(docs + [context] * weight, smoothing=smoothing)
            for longest in (None, 1, 2):
                got, want = store.next_probs(context, longest, own), copies.next_probs(context, longest)
                assert got[0].tolist() == want[0].tolist() and got[2] == want[2]
                assert got[1].tolist() == pytest.approx(want[1].tolist(), abs=1e-12)
            assert store.tree(context, 9, own) == copies.tree(context, 9)
            assert store.continuation(context, 6, own) == copies.continuation(context, 6)
            for alone in (store.tree(context, 9), store.configured(request_weight=0).tree(context, 9, own)):
                assert alone == plain.tree(context, 9)
            assert all(6 + 1 not in store.counts_memo[key][0] for key in store.counts_memo)


def test_a_large_range_is_counted_from_a_sample_and_ids_are_checked():
    store = Datastore([[1, 2]] * 6000 + [[1, 3]] * 2000)  # 8,000 occurrences of 1: more than one lookup scans
    assert store.continuation([1], 3) == [2]
    assert store.num_documents == 8000 and store.num_tokens == 16000 and store.max_id == 3
    with pytest.raises(UsageError, match=r"token id 50 is outside the target's vocabulary \[0, 10\)"):
        Datastore([[1, 50]], vocab_size=10)
    with pytest.raises(UsageError, match="token id -1 is outside"):
        Datastore([[1, -1]])
    with pytest.raises(UsageError, match="no tokens to draft from"):
        Datastore([[], []])


def test_a_growing_datastore_drafts_as_one_index_over_everything_it_keeps():
    """Served answers added one by one (segments merging as a binary counter) draft exactly as one Datastore over the
    loaded documents and those answers, with or without loaded documents; segments stay O(log) in number."""
    rng = random.Random(1)
    for trial in range(40):
        loaded = [[rng.randrange(6) for _ in range(rng.randint(1, 10))] for _ in range(rng.randint(0, 3))]
        store = Datastore(loaded, max_match=3, max_served=10_000)
        served = []
        for _ in range(rng.randint(1, 24)):
            answer = [rng.randrange(6) for _ in range(rng.randint(0, 9))]
            store.add(answer)
            served += [answer] if answer else []
            reference = Datastore(loaded + served, max_match=3)
            for _ in range(5):
                context = [rng.randrange(7) for _ in range(rng.randint(1, 6))]
                assert store.continuation(context, 5) == reference.continuation(context, 5), (trial, context)
                assert store.tree(context, 6) == reference.tree(context, 6), (trial, context)
        assert store.num_tokens == reference.num_tokens and store.num_served == len(served)
        assert len(store.served) <= max(store.num_tokens, 1).bit_length()


def test_a_growing_datastore_keeps_the_latest_served_tokens_and_never_its_corpus():
    store = Datastore([[1, 2, 3]], max_served=40)  # segments merge up to 10 tokens
    for i in range(30):
        store.add([100 + i, 200 + i, 300 + i, 400 + i])  # 4 tokens each
        assert store.num_tokens - 3 <= 40 and store.continuation([100 + i], 3) == [200 + i, 300 + i, 400 + i]
    assert store.continuation([1], 2) == [2, 3]  # the loaded corpus stays
    assert store.continuation([100], 3) == []  # the oldest answers went
    kept = (store.num_tokens - 3) // 4
    assert 30 <= 4 * kept <= 40 and store.continuation([100 + 30 - kept], 1) == [200 + 30 - kept]
    store.forget_served()
    assert store.num_tokens == 3 and store.num_served == 0 and store.continuation([129], 1) == []
    with pytest.raises(ValueError, match="does not grow"):
        Datastore([[1, 2]]).add([3, 4])
    fixed = Datastore([[1, 2, 3]])
    grown = fixed.growing(40)  # the same loaded index, its own served answers
    grown.add([1, 2, 7, 7])
    assert grown.loaded is fixed.loaded and grown.num_tokens == 7 and grown.continuation([7], 1) == [7]
    assert not fixed.grows and fixed.num_tokens == 3 and fixed.continuation([7], 1) == []
    with pytest.raises(ValueError, match="max_served must be >= 1"):
        fixed.growing(0)
    with pytest.raises(UsageError, match="token id -2 is outside"):
        Datastore([], max_served=10).add([1, -2])
    assert Datastore([], max_served=10).continuation([1, 2], 4) == []
