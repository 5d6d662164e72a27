"""Drafting from a datastore of the target's own text (inference.drafters.datastore, data.datastore): continuations
against a brute-force search, the sources it reads and the one-line refusals, the chains it adds to prompt lookup and
to a tree drafter's lookup, and greedy output equal to plain greedy decoding with its drafts accepted."""

from __future__ import annotations

import json
import random
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import data.datastore as data_datastore
import inference.api as api
import inference.drafters.datastore as datastore_module
from data.config import load_data_config
from data.datasets import load_conversations
from data.datastore import answer_texts, check_source, is_recipe
from data.errors import UsageError
from inference.api import load
from inference.bench.methods import EngineRunner, Sampling
from inference.bench.run import warm_up
from inference.drafters.datastore import SMOOTHINGS, Datastore, load_datastore
from inference.drafters.medusa import MedusaDrafter
from inference.drafters.prompt_lookup import PromptLookupDrafter
from inference.drafters.registry import CLI, LoadOptions, build_training_free, resolve
from inference.drafters.suffix_index import TextCounts
from inference.drafters.with_lookup import WithLookup
from inference.engine.drafter import DecodeState
from inference.engine.loop import DecodeConfig, generate
from inference.engine.tree import build_tree
from models.checkpoint import save_drafter
from models.medusa import MedusaConfig, MedusaHeads
from tests.data_support import tiny_tokenizer
from tests.model_support import save_tiny_model
from tests.test_draft_model import left_pad
from tests.test_generate import random_heads
from tests.test_lookahead import repetitive_prompts

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

def sharegpt_file(tmp_path, records: list, name: str = "answers.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def chat(user: str, *answers: str) -> dict:
    turns = [{"from": "human", "value": user}]
    for answer in answers:
        turns += [{"from": "gpt", "value": answer}, {"from": "human", "value": "more"}]
    return {"conversations": turns[:-1] if answers else turns}


def test_tokenised_answers_are_kept_on_disk_by_text_and_tokenizer(tmp_path, monkeypatch, capsys):
    """A text source's tokenised answers are written once to the cache root and read back by a later load (no
    encoding); another tokenizer, another end token or edited text is another file; an unreadable file is tokenised
    again and replaced; without a tokenizer fingerprint, or where the cache cannot be written, nothing is kept and the
    documents are the same."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    kept = tmp_path / "cache" / "datastore"
    source = sharegpt_file(tmp_path, [chat("hi", "hello world"), chat("a", "b c d")])
    calls = []

    def encode(texts):
        calls.append(len(texts))
        return [[len(word) for word in text.split()] for text in texts]

    def documents(*args):
        return [list(doc) for doc in data_datastore.corpus_documents(source, encode, *args)]

    assert documents("tok-a", 0) == [[5, 5, 0], [1, 1, 1, 0]] and calls == [2]
    files = sorted(kept.iterdir())
    assert len(files) == 1 and files[0].suffix == ".npz"  # no temporary file left behind
    assert documents("tok-a", 0) == [[5, 5, 0], [1, 1, 1, 0]] and calls == [2]  # read back, not encoded
    assert documents("tok-b", 0) == [[5, 5, 0], [1, 1, 1, 0]] and calls == [2, 2]
    assert documents("tok-a", None) == [[5, 5], [1, 1, 1]] and calls == [2, 2, 2] and len(list(kept.iterdir())) == 3
    assert documents(None, 0) == [[5, 5, 0], [1, 1, 1, 0]] and calls == [2, 2, 2, 2] and len(list(kept.iterdir())) == 3
    files[0].write_bytes(b"not an archive")
    assert documents("tok-a", 0) == [[5, 5, 0], [1, 1, 1, 0]] and calls == [2, 2, 2, 2, 2]
    assert "cannot be read (" in capsys.readouterr().err
    assert documents("tok-a", 0) == [[5, 5, 0], [1, 1, 1, 0]] and len(calls) == 5  # the file was replaced
    Path(source).write_text(Path(source).read_text() + json.dumps(chat("?", "xy")) + "\n")
    assert documents("tok-a", 0) == [[5, 5, 0], [1, 1, 1, 0], [2, 0]] and len(calls) == 6
    (tmp_path / "blocked").write_text("a file where the cache folder would be")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "blocked"))
    assert documents("tok-a", 0) == [[5, 5, 0], [1, 1, 1, 0], [2, 0]] and len(calls) == 7
    assert "could not be kept" in capsys.readouterr().err


def test_a_large_corpus_index_is_kept_on_disk_and_read_back(tmp_path, monkeypatch, capsys):
    """Datastore(keep=True) writes its corpus's sorted positions to the cache root once; a later datastore of the same
    corpus reads them instead of sorting, with the same index; another corpus is another file; an unreadable or
    mismatched file is sorted again and replaced."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    rng = random.Random(4)
    docs = [[rng.randrange(9) for _ in range(rng.randint(1, 40))] for _ in range(30)]
    fresh = Datastore(docs)
    first = Datastore(docs, keep=True)
    files = sorted((tmp_path / "cache" / "datastore").iterdir())
    assert len(files) == 1 and files[0].name.startswith("index-") and files[0].suffix == ".npy"
    real = np.argsort
    with monkeypatch.context() as patched:
        patched.setattr(np, "argsort", lambda *a, **k: pytest.fail("sorted again"))
        again = Datastore(docs, keep=True)
    for store in (first, again):
        assert store.loaded.order.tolist() == fresh.loaded.order.tolist()
        assert store.loaded.keys.tobytes() == fresh.loaded.keys.tobytes()
    assert again.tree([1, 2], 6) == fresh.tree([1, 2], 6)
    Datastore(docs[1:], keep=True)
    assert len(list((tmp_path / "cache" / "datastore").iterdir())) == 2
    for bad in (b"not an array", None):
        if bad is None:
            np.save(files[0], np.arange(3, dtype=np.int32))  # another corpus's length
        else:
            files[0].write_bytes(bad)
        calls = []
        with monkeypatch.context() as patched:
            patched.setattr(np, "argsort", lambda *a, **k: calls.append(1) or real(*a, **k))
            rebuilt = Datastore(docs, keep=True)
        assert calls and rebuilt.loaded.order.tolist() == fresh.loaded.order.tolist()
        assert "cannot be read (" in capsys.readouterr().err
        assert np.load(files[0]).tolist() == fresh.loaded.order.tolist()  # replaced


def test_a_sharegpt_source_gives_one_document_per_assistant_turn(tmp_path):
    tokenizer = tiny_tokenizer()
    path = sharegpt_file(tmp_path, [chat("hi", "hello world", "have a nice day"), chat("who?", "I am a helpful")])
    store = load_datastore(path, tokenizer)
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]  # an answer ends
               for t in ("hello world", "have a nice day", "I am a helpful")]
    assert store.num_documents == 3 and store.num_tokens == sum(map(len, encoded))
    assert store.continuation(encoded[1][:1], 20) == encoded[1][1:]


def test_a_spec_of_several_sources_and_a_recipe_indexes_them_together(tmp_path, monkeypatch):
    """"a,b" and ["a", "b"] name the same datastore; a data recipe's name (here the built-in chat corpus) reads the
    assistant turns of its train split, as training reads them; a file of a recipe's name is a file."""
    tokenizer = tiny_tokenizer()
    file = sharegpt_file(tmp_path, [chat("hi", "hello world")])
    recipe = [m["content"] for c in load_conversations(load_data_config("default"), "train") for m in c
              if m["role"] == "assistant" and m["content"].strip()]
    assert is_recipe("default") and answer_texts("default") == tuple(recipe)
    joined, listed = load_datastore(f"{file}, default", tokenizer), load_datastore([file, "default"], tokenizer)
    assert joined.num_documents == listed.num_documents == 1 + len(recipe)
    assert joined.num_tokens == listed.num_tokens == load_datastore(file, tokenizer).num_tokens + sum(
        len(ids) + 1 for ids in tokenizer(recipe, add_special_tokens=False)["input_ids"])
    monkeypatch.chdir(tmp_path)
    Path("default").write_text(json.dumps(chat("hi", "a file named like a recipe")) + "\n")
    assert not is_recipe("default") and answer_texts("default") == ("a file named like a recipe",)


@pytest.mark.parametrize("spec, needle", [
    ("{file},", "a datastore names a source, or several joined by ',', none empty"),
    ("{file},{missing}", "{missing}: no such file or folder, nor a data recipe"),
    ("jsonl", "jsonl: the data recipe's train split cannot be read: data.path is required"),
])
def test_a_bad_source_among_several_is_named_in_one_line(tmp_path, spec, needle):
    file, missing = sharegpt_file(tmp_path, [chat("hi", "hello")]), str(tmp_path / "nope")
    spec, needle = spec.format(file=file, missing=missing), needle.format(missing=missing)
    for check in (lambda: resolve("prompt_lookup", base="builtin:tiny").check(LoadOptions(datastore=spec), CLI),
                  lambda: load_datastore(spec, tiny_tokenizer(), label="--datastore")):
        with pytest.raises(UsageError) as err:
            check()
        message = str(err.value)
        assert message.startswith("--datastore=") and needle in message and "\n" not in message, message


@pytest.mark.parametrize("case", ["missing", "bad_line", "no_answer", "no_tokenizer"])
def test_a_bad_source_is_one_line_naming_it(tmp_path, case):
    path = str(tmp_path / "nope.jsonl") if case == "missing" else sharegpt_file(tmp_path, {
        "bad_line": [chat("hi", "hello"), "{not json"],
        "no_answer": [chat("only a question")],
        "no_tokenizer": [chat("hi", "hello")],
    }[case])
    needle = {"missing": "no such file or folder", "bad_line": "malformed JSON line", "no_answer": "no assistant turn",
              "no_tokenizer": "needs the target's tokenizer"}[case]
    with pytest.raises(UsageError) as err:
        load_datastore(path, None if case == "no_tokenizer" else tiny_tokenizer(), label="--datastore")
    message = str(err.value)
    record = {"bad_line": ":2", "no_answer": ":1"}.get(case, "")  # the record at fault, where there is one
    where = f"--datastore={path}{record}: "
    assert message.startswith(where) and needle in message and "\n" not in message
    assert message.count(path) == 1  # the source is named once


def state_of(contexts: list[list[int]]) -> DecodeState:
    """The state after the prefill: each context's last token is the root, committed after its prompt."""
    ids = torch.tensor([c[:-1] for c in contexts])
    return DecodeState(cache=DynamicCache(), valid=ids > 0, next_pos=(ids > 0).sum(-1),
                       root=torch.tensor([c[-1] for c in contexts]), hidden=None, prompt=ids,
                       generated=[[c[-1]] for c in contexts])


def test_prompt_lookup_adds_the_datastore_tree_within_its_nodes():
    store = Datastore([[7, 8, 9, 10, 11]], request_weight=0)  # the corpus's counts alone
    # row 0: its own text has "1 2" -> 5 6, the datastore "1 2" never, "2" never: its own chain only;
    # row 1: no earlier occurrence of its last token 7 in its own text: the datastore's 8 9 10 11
    drafter = PromptLookupDrafter(num_draft=4, datastore=store)
    state = state_of([[1, 2, 5, 6, 1, 2], [3, 3, 4, 4, 4, 7]])
    assert drafter.sources(state)[1] == [[(8,), (8, 9), (8, 9, 10), (8, 9, 10, 11)]]
    assert drafter.sources(state)[0] == [[(5,), (5, 6), (5, 6, 1), (5, 6, 1, 2)]]
    # with the request's own counts (the default weight), row 0's tree drafts from its own text as well: "2" -> 5
    own = PromptLookupDrafter(num_draft=4, datastore=store.configured(request_weight=100))
    chain = [(5,), (5, 6), (5, 6, 1), (5, 6, 1, 2)]
    fresh = state_of([[1, 2, 5, 6, 1, 2], [3, 3, 4, 4, 4, 7]])  # a new generation: the run's state starts again
    assert own.sources(fresh) == [[chain, chain], [[(8,), (8, 9), (8, 9, 10), (8, 9, 10, 11)]]]
    # a row with both: the two share their first token 5 and take turns below it, a node at a time
    both = PromptLookupDrafter(num_draft=3, datastore=Datastore([[2, 5, 9, 9]], request_weight=0))
    found = both.sources(state_of([[1, 2, 5, 6, 1, 2]]))[0]
    assert found == [[(5,), (5, 6), (5, 6, 1)], [(5,), (5, 9), (5, 9, 9)]]
    draft = both.propose(state_of([[1, 2, 5, 6, 1, 2]]))
    assert draft.tree.choices == ((0,), (0, 0), (0, 1))  # 3 nodes: 5, then 6 and 9 below it; the cap cuts 1 and 9
    assert draft.tokens.tolist() == [[2, 5, 6, 9]]
    draft = both.propose(state_of([[1, 3, 5, 6, 4, 2]]))  # no earlier 2 in its own text: the datastore's tree
    assert draft.tokens.tolist() == [[2, 5, 9, 9]]


def test_prompt_lookup_drafts_only_where_the_datastore_expects_enough_accepted():
    """min_expected: a row drafts when the sum of its nodes' scores reaches it; a chain node is scored by the
    datastore's probabilities along its path, a node both sources draft by the larger score."""
    store = Datastore([[7, 8, 9]] * 3 + [[7, 8, 5]], smoothing="longest", request_weight=0)
    # no earlier 7 in the row's own text: the datastore's tree alone, "7" -> 8 (1), "7 8" -> 9 (3/4), 5 (1/4)
    row = [[3, 3, 4, 4, 4, 7]]
    for threshold, drafts in ((0.0, True), (2.0, True), (2.01, False)):
        drafter = PromptLookupDrafter(num_draft=3, datastore=store, min_expected=threshold)
        assert drafter.sources(state_of(row)) == ([[[(8,), (8, 9), (8, 5)]]] if drafts else [[]]), threshold
    # the chain 5 6 1 and the tree 5 9 9 share 5 (score 1 in both); the 3 nodes taken are 5, 6 (the chain's: 0, as
    # "2 5" is followed by 9 alone) and 9 (1): 2 expected
    both = Datastore([[2, 5, 9, 9]], smoothing="longest", request_weight=0)
    row = [[1, 2, 5, 6, 1, 2]]
    assert PromptLookupDrafter(num_draft=3, datastore=both, min_expected=2.0).sources(state_of(row)) == \
        [[[(5,), (5, 6), (5, 6, 1)], [(5,), (5, 9), (5, 9, 9)]]]
    gated = PromptLookupDrafter(num_draft=3, datastore=both, min_expected=2.5)
    assert gated.sources(state_of(row)) == [[]]
    draft = gated.propose(state_of(row + [[3, 3, 4, 4, 4, 7]]))  # the other row drafts nothing either: root only
    assert draft.tree.num_nodes == 1 and draft.tokens.tolist() == [[2], [7]]
    for bad in (-0.5, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="prompt_lookup: min_expected must be a number >= 0"):
            PromptLookupDrafter(datastore=store, min_expected=bad)
    with pytest.raises(ValueError, match="prompt_lookup: min_expected needs a datastore"):
        PromptLookupDrafter(min_expected=1.0)
    assert PromptLookupDrafter(min_expected=0.0).min_expected == 0.0


def test_node_cost_drafts_the_best_scored_nodes_that_pay():
    """node_cost: a row's nodes (the chain's and the tree's, a node both draft scored by the larger) ranked by score,
    parents first, cut to the k maximising (1 + their scores' sum) / (1 + node_cost * k); k = 0 drafts nothing."""
    store = Datastore([[7, 8, 9]] * 3 + [[7, 8, 5]], smoothing="longest", request_weight=0)
    # the datastore's tree alone: 8 (score 1), 8 9 (3/4), 8 5 (1/4)
    row = [[3, 3, 4, 4, 4, 7]]
    # cost 0.3: 2 / 1.3, 2.75 / 1.6, 3 / 1.9 -> 2 nodes; 0.6: 2 / 1.6 = 2.75 / 2.2 -> 1 (ties keep fewer); 1: 2 / 2
    # is no gain over a plain step -> none
    for cost, nodes in ((0.01, [(8,), (8, 9), (8, 5)]), (0.3, [(8,), (8, 9)]), (0.6, [(8,)]), (1.0, None)):
        drafter = PromptLookupDrafter(num_draft=3, datastore=store, node_cost=cost)
        assert drafter.sources(state_of(row)) == ([[nodes]] if nodes else [[]]), cost
    # the chain 5 6 1 (5 scores 1, 6 scores 0: "2 5" is followed by 9 alone) and the tree 5 9 9 9 (1 each): 5 once,
    # then the tree's path, the chain's 6 ranked last and cut by num_draft
    both = Datastore([[2, 5, 9, 9]], smoothing="longest", request_weight=0)
    row = [[1, 2, 5, 6, 1, 2]]
    sized = PromptLookupDrafter(num_draft=4, datastore=both, node_cost=0.01)
    assert sized.sources(state_of(row)) == [[[(5,), (5, 9), (5, 9, 9), (5, 9, 9, 9)]]]
    draft = PromptLookupDrafter(num_draft=4, datastore=both, node_cost=2.0).propose(state_of(row))
    assert draft.tree.num_nodes == 1  # nothing pays at 2 plain steps a node: a plain step
    for bad in (-0.5, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="prompt_lookup: node_cost must be a number >= 0"):
            PromptLookupDrafter(datastore=store, node_cost=bad)
    with pytest.raises(ValueError, match="prompt_lookup: node_cost needs a datastore"):
        PromptLookupDrafter(node_cost=0.1)
    with pytest.raises(ValueError, match="min_expected and node_cost both decide"):
        PromptLookupDrafter(datastore=store, node_cost=0.1, min_expected=1.0)


def test_min_expected_is_checked_with_the_load_options_before_the_model_loads(tmp_path, monkeypatch):
    target = save_tiny_model(tmp_path / "target", initializer_range=0.2)
    source = sharegpt_file(tmp_path, [chat("hi", "hello world, hello there!")])
    request = resolve("prompt_lookup:min_expected=1.5", base=str(target))
    request.check(LoadOptions(datastore=source))  # an empty datastore stands in for the one read at load
    request.check(LoadOptions(datastore_grow=100))
    with pytest.raises(ValueError, match="^prompt_lookup: min_expected needs a datastore"):
        request.check(LoadOptions())
    engine = load("prompt_lookup:min_expected=1.5", base=str(target), dtype="fp32", datastore=source)
    assert engine.drafter.min_expected == 1.5 and engine.drafter.datastore.num_documents == 1
    monkeypatch.setattr(api, "load_target", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match="^prompt_lookup: min_expected needs a datastore"):
        load("prompt_lookup:min_expected=1.5", base=str(target), dtype="fp32")


def test_a_datastore_is_a_load_option_never_a_spec_option(tmp_path):
    with pytest.raises(UsageError, match="prompt_lookup: unknown option 'datastore'"):
        build_training_free("prompt_lookup", {"datastore": "x"})
    source = sharegpt_file(tmp_path, [chat("hi", "hello")])
    with pytest.raises(UsageError, match="datastore= does not apply to drafter 'lookahead'; it applies to eagle3, "
                                         "medusa, prompt_lookup"):
        resolve("lookahead", base="builtin:tiny").check(LoadOptions(datastore=source))
    with pytest.raises(UsageError, match="datastore=.*nope: no such file or folder"):
        resolve("prompt_lookup", base="builtin:tiny").check(LoadOptions(datastore=str(tmp_path / "nope")))


def test_greedy_equals_plain_greedy_with_the_datastores_drafts_accepted(tiny_lm):
    """Batched, left-padded, fp32: prompt lookup alone, with a datastore of the target's own answers to other
    prompts, and Medusa with both grafted on give plain greedy decoding; the datastore raises tokens per step."""
    prompts, others = repetitive_prompts(11, 3), repetitive_prompts(12, 6)
    ids, mask = left_pad(prompts)
    config = DecodeConfig(max_new_tokens=20)
    plain = generate(tiny_lm, ids, None, config, attention_mask=mask).sequences
    other_ids, other_mask = left_pad(others)
    answers = generate(tiny_lm, other_ids, None, config, attention_mask=other_mask).sequences
    store = Datastore(answers + plain[:1])  # the target's answers, one of them to a prompt decoded below
    alone = generate(tiny_lm, ids, PromptLookupDrafter(num_draft=6), config, attention_mask=mask)
    with_store = generate(tiny_lm, ids, PromptLookupDrafter(num_draft=6, datastore=store), config,
                          attention_mask=mask)
    tree = build_tree([(0,), (1,), (0, 0)], num_heads=2, topk=2)
    grafted = generate(tiny_lm, ids, WithLookup(MedusaDrafter(random_heads(2, tiny_lm, seed=3), tree), num_draft=6,
                                                datastore=store), config, attention_mask=mask)
    assert alone.sequences == plain and with_store.sequences == plain and grafted.sequences == plain
    assert with_store.stats.mean_accepted > alone.stats.mean_accepted + 0.2, (alone.stats.mean_accepted,
                                                                             with_store.stats.mean_accepted)
    gated = generate(tiny_lm, ids, PromptLookupDrafter(num_draft=6, datastore=store, min_expected=1.0), config,
                     attention_mask=mask)
    never = generate(tiny_lm, ids, PromptLookupDrafter(num_draft=6, datastore=store, min_expected=1e9), config,
                     attention_mask=mask)
    sized = generate(tiny_lm, ids, PromptLookupDrafter(num_draft=6, datastore=store, node_cost=0.1), config,
                     attention_mask=mask)
    assert gated.sequences == plain and never.sequences == plain and sized.sequences == plain
    assert never.stats.mean_accepted == 0 and never.stats.steps == max(map(len, plain)) - 1  # a token a step
    own = store.configured(request_weight=10)  # each row's own text in the counts: rows draft differently
    for drafter in (PromptLookupDrafter(num_draft=6, datastore=own),
                    WithLookup(MedusaDrafter(random_heads(2, tiny_lm, seed=3), tree), num_draft=6, datastore=own)):
        assert generate(tiny_lm, ids, drafter, config, attention_mask=mask).sequences == plain


def test_load_reads_the_datastore_before_the_model_and_decodes_exactly(tmp_path, monkeypatch):
    target = save_tiny_model(tmp_path / "target", initializer_range=0.2)
    tokenizer = tiny_tokenizer()
    source = sharegpt_file(tmp_path, [chat("hi", "hello world, hello there! Have a nice day.")])
    engine = load("prompt_lookup", base=str(target), dtype="fp32", datastore=source)
    assert isinstance(engine.drafter.datastore, Datastore) and engine.drafter.datastore.num_documents == 1
    prompt = tokenizer("hello world, hello", add_special_tokens=False)["input_ids"]
    plain = load(None, base=str(target), dtype="fp32").generate(prompt, max_new_tokens=12).sequences
    assert engine.generate(prompt, max_new_tokens=12).sequences == plain
    bad = sharegpt_file(tmp_path, [chat("hi", "hello"), "[1, 2"], name="bad.jsonl")
    monkeypatch.setattr(api, "load_target", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(UsageError, match=r"^datastore=.*bad\.jsonl:2: "):
        load("prompt_lookup", base=str(target), dtype="fp32", datastore=bad)



def test_a_growing_datastore_drafts_from_earlier_answers_and_decodes_exactly(tmp_path):
    """load(..., datastore_grow=N): each generation's answers join the datastore when it ends, so asking again
    accepts more a step; every answer is plain greedy decoding (batched, left-padded, prompt lookup alone and Medusa
    with the lookup grafted on); a bench warm-up's answers are forgotten."""
    target = save_tiny_model(tmp_path / "target", initializer_range=0.2)
    prompts = repetitive_prompts(13, 3)
    plain = [load(None, base=str(target), dtype="fp32").generate_ids(p, max_new_tokens=24).sequences[0]
             for p in prompts]
    engine = load("prompt_lookup:min_ngram=3,num_draft=6", base=str(target), dtype="fp32", datastore_grow=10_000)
    store = engine.drafter.datastore
    assert store.grows and store.num_tokens == 0
    first = engine.generate_ids(prompts[0], max_new_tokens=24)
    assert store.num_served == 1 and store.num_tokens == 24
    again = engine.generate_ids(prompts[0], max_new_tokens=24)
    assert first.sequences[0] == again.sequences[0] == plain[0]
    assert again.stats.target_forwards < first.stats.target_forwards
    batch = engine.generate_ids(prompts, max_new_tokens=24)
    assert batch.sequences == plain and store.num_served == 5
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=32, vocab_size=engine.model.vocab_size))
    heads.init_from_base(engine.model.lm_head)
    save_drafter(tmp_path / "heads", heads, str(target))
    grafted = load(str(tmp_path / "heads"), base=str(target), dtype="fp32", lookup=4, datastore_grow=10_000)
    assert [grafted.generate_ids(p, max_new_tokens=24).sequences[0] for p in prompts * 2] == plain * 2
    assert grafted.drafter.datastore.num_served == 6
    warm_up("prompt lookup", lambda: engine.generate_ids(prompts[1], max_new_tokens=8),
            EngineRunner(engine, Sampling(0.0, None, None, "exact")))
    assert store.num_served == 0 and store.num_tokens == 0
    request = resolve("prompt_lookup", base=str(target))
    with pytest.raises(UsageError, match="^datastore_grow applies to a datastore source"):
        request.check(LoadOptions(datastore=Datastore([[1, 2]]), datastore_grow=100))
    for bad in (0, True, 2.5):
        with pytest.raises(UsageError, match=r"^datastore_grow= must be a whole number of tokens >= 1"):
            request.check(LoadOptions(datastore_grow=bad))
    with pytest.raises(UsageError, match=r"^datastore_grow= does not apply to drafter 'jacobi'; it applies to eagle3, "
                                         r"medusa, prompt_lookup"):
        resolve("jacobi", base=str(target)).check(LoadOptions(datastore_grow=100))


def test_the_datastore_smoothing_is_a_load_option_checked_first(tmp_path):
    """load(..., datastore_smoothing=...) builds the datastore with it, and decoding stays plain greedy decoding;
    a bad value, one without a datastore and one beside a Datastore object are refused in one line."""
    target = save_tiny_model(tmp_path / "target", initializer_range=0.2)
    prompts = repetitive_prompts(13, 2)
    plain = [load(None, base=str(target), dtype="fp32").generate_ids(p, max_new_tokens=24).sequences[0]
             for p in prompts]
    for smoothing in SMOOTHINGS:
        engine = load("prompt_lookup:min_ngram=3,num_draft=6", base=str(target), dtype="fp32", datastore_grow=10_000,
                      datastore_smoothing=smoothing)
        assert engine.drafter.datastore.smoothing == smoothing
        assert [engine.generate_ids(p, max_new_tokens=24).sequences[0] for p in prompts * 2] == plain * 2
    assert load("prompt_lookup", base=str(target), dtype="fp32", datastore_grow=10).drafter.datastore.smoothing == \
        "witten_bell"
    engine = load("prompt_lookup:min_ngram=3,num_draft=6", base=str(target), dtype="fp32", datastore_grow=10_000,
                  datastore_request_weight=25)
    assert engine.drafter.datastore.request_weight == 25.0
    assert [engine.generate_ids(p, max_new_tokens=24).sequences[0] for p in prompts * 2] == plain * 2
    assert load("prompt_lookup", base=str(target), dtype="fp32", datastore_grow=10).drafter.datastore.request_weight \
        == datastore_module.REQUEST_WEIGHT
    request = resolve("prompt_lookup", base=str(target))
    for options, needle in [
        (LoadOptions(datastore_grow=10, datastore_smoothing="kneser_ney"),
         "^datastore_smoothing= must be one of witten_bell, longest, got 'kneser_ney'"),
        (LoadOptions(datastore_smoothing="longest"), "^datastore_smoothing applies with datastore or datastore_grow"),
        (LoadOptions(datastore=Datastore([[1, 2]]), datastore_smoothing="longest"),
         "^datastore_smoothing applies to a datastore source"),
        *((LoadOptions(datastore_grow=10, datastore_request_weight=bad),
           r"^datastore_request_weight= must be a number >= 0 \(how many times the request's own text counts\), got ")
          for bad in (-1, float("nan"), float("inf"), "3", True)),
        (LoadOptions(datastore_request_weight=3), "^datastore_request_weight applies with datastore or datastore_grow"),
        (LoadOptions(datastore=Datastore([[1, 2]]), datastore_request_weight=3),
         "^datastore_request_weight applies to a datastore source"),
    ]:
        with pytest.raises(UsageError, match=needle):
            request.check(options)
    with pytest.raises(UsageError, match=r"^datastore_smoothing= does not apply to drafter 'jacobi'"):
        resolve("jacobi", base=str(target)).check(LoadOptions(datastore_smoothing="longest"))

def test_a_text_source_is_parsed_once_for_check_load_and_encoding(tmp_path, monkeypatch):
    """The command line checks a ShareGPT source, `load` checks it again and encodes it: one parse while the file
    is unchanged; an edited file is read again."""
    target = save_tiny_model(tmp_path / "target", initializer_range=0.2)
    source = sharegpt_file(tmp_path, [chat("hi", "hello world, hello there!")])
    calls = []
    real = data_datastore.read_conversations
    monkeypatch.setattr(data_datastore, "read_conversations", lambda *a, **k: calls.append(a) or real(*a, **k))
    check_source(source)
    engine = load("prompt_lookup", base=str(target), dtype="fp32", datastore=source)
    assert len(calls) == 1 and engine.drafter.datastore.num_documents == 1
    Path(source).write_text(Path(source).read_text() + json.dumps(chat("who?", "me, again")) + "\n")
    assert answer_texts(source) == ("hello world, hello there!", "me, again") and len(calls) == 2


def test_engines_over_the_same_sources_share_one_index_until_a_file_changes(tmp_path, monkeypatch):
    """load_datastore keeps the last corpora it indexed: a second load of the same sources and tokenizer reads,
    tokenises and indexes nothing (its smoothing and growth its own); other sources or a changed file are read
    again."""
    tokenizer = tiny_tokenizer()
    source = sharegpt_file(tmp_path, [chat("hi", "hello world, hello there!")])
    other = sharegpt_file(tmp_path, [chat("hi", "good morning")], name="other.jsonl")
    built = []
    real = datastore_module._indexed
    monkeypatch.setattr(datastore_module, "_indexed", lambda *a: built.append(a[0]) or real(*a))
    first = load_datastore(source, tokenizer)
    again = load_datastore(source, tokenizer, max_served=100, smoothing="longest")
    assert len(built) == 1 and again.loaded is first.loaded and again.memo is not first.memo
    assert (first.smoothing, first.grows, again.smoothing, again.max_served) == ("witten_bell", False, "longest", 100)
    again.add([1, 2, 3])
    assert first.num_tokens == again.num_tokens - 3  # what one engine serves stays its own
    load_datastore([source, other], tokenizer)
    assert len(built) == 2
    Path(source).write_text(Path(source).read_text() + json.dumps(chat("who?", "me, again")) + "\n")
    changed = load_datastore(source, tokenizer)
    assert len(built) == 3 and changed.num_documents == 2 and changed.loaded is not first.loaded
    assert len(datastore_module._INDEXES) <= datastore_module.INDEXES_KEPT


def test_several_text_sources_checked_first_are_each_parsed_once(tmp_path, monkeypatch):
    """A walk over several sources checks them all, then reads each: one parse per source."""
    sources = [sharegpt_file(tmp_path, [chat("hi", f"answer {i}")], name=f"s{i}.jsonl") for i in range(3)]
    calls = []
    real = data_datastore.read_conversations
    monkeypatch.setattr(data_datastore, "read_conversations", lambda *a, **k: calls.append(a) or real(*a, **k))
    for source in sources:
        check_source(source)
    assert [answer_texts(source) for source in sources] == [(f"answer {i}",) for i in range(3)]
    assert len(calls) == 3
