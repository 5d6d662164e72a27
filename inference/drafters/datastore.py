"""A datastore of the target's own text to draft from: the likeliest continuations of the context's last tokens.

Prompt lookup (inference.drafters.prompt_lookup) copies from the request's own prompt and output; a datastore copies
from a corpus, retrieval-based drafting as in REST (He et al. 2024) and SuffixDecoding (Oliaro et al. 2024). The corpus
that pays is the target's own answers (data.datastore: a self-distilled feature cache holds them): a model says the
same phrases again and again ("Here are some", "```python\\ndef", "I hope this helps"), and an n-gram of its own text
predicts them where a trained drafter guesses token by token.

What follows a context (`Datastore.next_probs`): every suffix of the context, 1 to `max_match` tokens long, that
occurs in the corpus with a next token has its occurrences' next tokens counted (`Datastore.next_counts` for the
longest), and the distribution of the next token comes from them in one of two ways (`smoothing`):
- "witten_bell" (the default): the counts of every length, interpolated from the shortest up, as an n-gram language
  model with Witten-Bell smoothing does: p_n(x) = λ_n c_n(x) / C_n + (1 - λ_n) p_{n-1}(x), where C_n is the number of
  occurrences of the n-token suffix, T_n the number of distinct tokens that followed it, λ_n = C_n / (C_n + T_n), and
  p_1(x) = c_1(x) / C_1. A long suffix seen a few times leans on the shorter ones; one seen often with few
  continuations, on itself.
- "longest": the longest suffix's counts alone (REST, SuffixDecoding).
Interpolation drafted more on every prompt set, corpus and node budget measured (docs/eagle3.md). Documents never run
into each other. `Datastore.tree(context, n)` drafts a token tree of up to n nodes from it, best first, as
SuffixDecoding does: a node's score is the product of its tokens' probabilities along its path, and the next node
taken is the best-scoring child of the tree so far (each child's distribution comes from the context plus its path).
`Datastore.continuation(context, n)` is the greedy chain: the likeliest next token, appended, up to n times. A
distribution of the corpus alone is computed once per suffix and remembered until the datastore changes (`add`,
`forget_served`).

The request's own text counts too. Given the request's `TextCounts` (its prompt and the tokens committed so far;
prompt lookup keeps them per row), what followed each suffix there is added to the corpus's counts `request_weight`
times (REQUEST_WEIGHT by default), as if the corpus held that many copies of the request. A request's own names,
numbers and code then enter the datastore's tree, beside prompt lookup's chain of their latest occurrence. A weight of
100 drafted more than none on each of five prompt sets measured, and within 0.005 tokens a step of the best weight
from 3 to 10,000 on their mean (docs/eagle3.md). Those counts change every step, so a distribution with them is
computed afresh from the corpus's counts of each suffix, which are remembered.

Index: inference.drafters.suffix_index (a suffix array cut at `max_match + 1` tokens, one per segment).

Loading: `load_datastore` keeps the last INDEXES_KEPT corpora it indexed, by their sources' signatures (a recipe's
name, a path's files' sizes and modification times) and the tokenizer, so a second engine of the process over the
same sources (a bench's methods side by side) shares the index instead of reading, tokenising and indexing again;
a source whose files changed is read again. Between processes the cache root keeps a text source's tokenised answers
(data.datastore) and the index of a corpus of INDEX_NOTICE tokens or more (SuffixIndex.kept), each under a hash of
its content: ShareGPT V3 loads in about 9 s from them (parsing its JSON is most of it), about 50 s without, on 2
slow cores.

Growing while serving (`max_served` > 0, as SuffixDecoding's global tree): `add` indexes each answer the engine has
served, so later requests draft from it too. Served answers go into segments of their own, oldest first; the newest
absorbs the one before it while that one is at most twice its size, so each segment is more than twice the size of
the next, a lookup reads O(log) segments and a token is re-sorted O(log) times. A segment stops merging at
`max_served / 4` tokens, and once the served tokens pass `max_served` the oldest segment is dropped. A lookup counts
the next tokens of every segment together: the same draft as one index over the loaded corpus and the served answers
kept. The loaded corpus is never dropped. Drafts stay exact: the datastore changes between generations, never within
one.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from data.datastore import SEPARATOR, check_source, corpus_documents, source_signature, sources_of
from data.errors import UsageError
from inference.drafters.suffix_index import SuffixIndex, TextCounts
from models.fingerprint import tokenizer_fingerprint

MAX_MATCH = 3  # the longest context suffix matched: 3 drafted more than 4, 6 or 8 on every prompt set (docs/eagle3.md)
INDEX_NOTICE = 1_000_000  # corpora this large say so before indexing (about 0.7 s a million tokens on 2 cores)
SMOOTHINGS = ("witten_bell", "longest")  # how the suffixes' counts make the next token's distribution (see above)
REQUEST_WEIGHT = 100.0  # times the request's own text counts beside the corpus: 100 drafted the most (docs/eagle3.md)
MEMO_SIZE = 4096  # distributions remembered at most (one per suffix, a few KB each); when full, the memo starts again
TREE_BRANCH = 8  # children of a node `Datastore.tree` weighs at most: its most frequent next tokens
INDEXES_KEPT = 2  # corpora load_datastore keeps indexed for the next engine of the process (see the docstring)
NO_TOKENS = np.zeros(0, np.int64)


class Datastore:
    """A corpus of token-id documents, indexed for `continuation`. Ids must lie in [0, vocab_size) when given.
    `max_served` > 0: `add` keeps about the latest `max_served` tokens of served answers too (see the module
    docstring); such a datastore may start without documents. `keep`: the corpus's index is read from (or written to)
    the cache root (SuffixIndex.kept)."""

    def __init__(self, documents: Sequence[Sequence[int]], max_match: int = MAX_MATCH, vocab_size: int | None = None,
                 max_served: int = 0, smoothing: str = SMOOTHINGS[0], request_weight: float = REQUEST_WEIGHT,
                 keep: bool = False) -> None:
        if max_match < 1:
            raise ValueError(f"Datastore: max_match must be >= 1, got {max_match}")
        if max_served < 0:
            raise ValueError(f"Datastore: max_served must be >= 0, got {max_served}")
        check_smoothing(smoothing)
        check_request_weight(request_weight)
        parts = [np.asarray(doc, dtype=np.int64) for doc in documents if len(doc)]
        if not parts and not max_served:
            raise UsageError("no tokens to draft from")
        self.max_match, self.max_served, self.vocab_size, self.smoothing = max_match, max_served, vocab_size, smoothing
        self.request_weight = float(request_weight)
        self.num_documents = len(parts)
        self.max_id = max((self._checked(p) for p in parts), default=-1)
        index = SuffixIndex.kept if keep else SuffixIndex.of_documents
        self.loaded = index(parts, max_match + 1) if parts else None
        self.served: list[SuffixIndex] = []  # oldest first
        self.num_served = 0  # answers added since construction (kept or dropped since)
        self.memo: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, int]] = {}  # suffix -> its next_probs
        self.counts_memo: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}  # suffix -> the corpus's counts

    def _checked(self, ids: np.ndarray) -> int:
        """The largest id of `ids`; UsageError when one lies outside [0, vocab_size)."""
        high = self.vocab_size if self.vocab_size is not None else np.iinfo(np.int32).max
        if ids.min() < 0 or ids.max() >= high:
            bad = int(ids.min() if ids.min() < 0 else ids.max())
            raise UsageError(f"token id {bad} is outside the target's vocabulary [0, {high})")
        return int(ids.max())

    def growing(self, max_served: int) -> "Datastore":
        """A datastore over this one's loaded corpus (its index shared, not rebuilt) that grows from no served answer,
        keeping the latest `max_served` tokens of them; this one is unchanged."""
        if max_served < 1:
            raise ValueError(f"Datastore.growing: max_served must be >= 1, got {max_served}")
        store = copy.copy(self)
        store.max_served, store.served, store.num_served, store.memo, store.counts_memo = max_served, [], 0, {}, {}
        return store

    def configured(self, smoothing: str | None = None, request_weight: float | None = None) -> "Datastore":
        """A datastore over this one's corpus and served answers (their indexes shared, not rebuilt) whose next-token
        distribution is made by `smoothing` (one of SMOOTHINGS) and counts the request's own text `request_weight`
        times (None: this one's setting); this one is unchanged."""
        store = copy.copy(self)
        if smoothing is not None:
            check_smoothing(smoothing)
            store.smoothing = smoothing
        if request_weight is not None:
            check_request_weight(request_weight)
            store.request_weight = float(request_weight)
        store.served, store.memo, store.counts_memo = list(self.served), {}, {}
        return store

    @property
    def segments(self) -> list[SuffixIndex]:
        return ([self.loaded] if self.loaded is not None else []) + self.served

    @property
    def num_tokens(self) -> int:
        """Tokens a lookup reads: the loaded corpus and the served answers kept."""
        return sum(segment.num_tokens for segment in self.segments)

    @property
    def grows(self) -> bool:
        return self.max_served > 0

    def add(self, document: Sequence[int]) -> None:
        """Index one served answer (token ids); a datastore that does not grow refuses."""
        if not self.grows:
            raise ValueError("Datastore.add: this datastore does not grow (max_served=0)")
        ids = np.asarray(document, dtype=np.int64)
        if not len(ids):
            return
        self.max_id = max(self.max_id, self._checked(ids))
        self.num_served += 1
        self.memo.clear()
        self.counts_memo.clear()
        self.served.append(SuffixIndex.of_documents([ids], self.max_match + 1))
        cap = max(self.max_served // 4, 1)
        while (len(self.served) > 1 and 2 * self.served[-1].num_tokens >= self.served[-2].num_tokens
               and self.served[-1].num_tokens + self.served[-2].num_tokens <= cap):
            newest = self.served.pop()
            self.served[-1] = self.served[-1].merged(newest)
        while sum(segment.num_tokens for segment in self.served) > self.max_served:
            self.served.pop(0)

    def forget_served(self) -> None:
        """Drop every served answer (a benchmark's warm-up must not leave its answers behind)."""
        self.served.clear()
        self.num_served = 0
        self.memo.clear()
        self.counts_memo.clear()

    def next_counts(self, context: Sequence[int], longest: int | None = None,
                    own: TextCounts | None = None) -> tuple[np.ndarray, np.ndarray, int]:
        """(tokens, counts, n): what followed the longest suffix of `context` (at most `longest`, else `max_match`
        tokens) that occurs with a next token, over every segment and, `request_weight` times each, in `own` (the
        request's own text), most frequent first (on a tie the smaller id), and that suffix's length n; empty and 0
        when not even the last token occurs with a next token."""
        tail = list(context[-self.max_match :])
        for n in range(min(longest or self.max_match, len(tail)), 0, -1):
            ids, counts = self._level(tail[-n:], own)
            if len(ids):
                order = np.argsort(-counts, kind="stable")  # ids ascending: the smaller id first on a tie
                return ids[order] - 1, counts[order], n
        return NO_TOKENS, NO_TOKENS, 0

    def next_probs(self, context: Sequence[int], longest: int | None = None,
                   own: TextCounts | None = None) -> tuple[np.ndarray, np.ndarray, int]:
        """(tokens, probs, n): the distribution of the token after `context` by `smoothing` (see the module
        docstring) over its suffixes of at most `longest` (else `max_match`) tokens, with `own`'s counts (the
        request's own text) added `request_weight` times each, likeliest first (on a tie the smaller id), and the
        length n of the longest suffix that occurs with a next token; empty and 0 when not even the last token
        does."""
        key = tuple(context[len(context) - min(longest or self.max_match, self.max_match, len(context)) :])
        if own is not None and self.request_weight and key and own.following(key[-1:]):
            return self._distribution(key, own)  # the request's counts change every step: not remembered
        found = self.memo.get(key)
        if found is None:
            found = self._distribution(key, None)
            if len(self.memo) >= MEMO_SIZE:
                self.memo.clear()
            self.memo[key] = found
        return found

    def _distribution(self, key: tuple[int, ...], own: TextCounts | None) -> tuple[np.ndarray, np.ndarray, int]:
        """next_probs of the suffix `key`, computed (not remembered), with `own`'s counts when given."""
        if self.smoothing == "longest":
            tokens, counts, n = self.next_counts(key, own=own)
            return tokens, counts / max(float(counts.sum()), 1.0), n
        return self._interpolated(key, own)

    def _level(self, pattern: Sequence[int], own: TextCounts | None) -> tuple[np.ndarray, np.ndarray]:
        """(ids + 1 ascending, counts): the next tokens of `pattern`'s occurrences in every segment
        (SuffixIndex.following; remembered as `memo` is), plus `request_weight` times each of those in `own`."""
        key = tuple(pattern)
        found = self.counts_memo.get(key)
        if found is None:
            following = np.concatenate([segment.following(pattern) for segment in self.segments] or [NO_TOKENS])
            found = np.unique(following, return_counts=True)
            if len(self.counts_memo) >= MEMO_SIZE:
                self.counts_memo.clear()
            self.counts_memo[key] = found
        extra = own.following(key) if own is not None and self.request_weight else None
        if not extra:
            return found
        ids, where = np.unique(np.concatenate([found[0], np.fromiter(extra, np.int64, len(extra)) + 1]),
                               return_inverse=True)
        weights = np.concatenate([found[1], self.request_weight * np.fromiter(extra.values(), np.float64, len(extra))])
        return ids, np.bincount(where, weights=weights, minlength=len(ids))

    def _interpolated(self, tail: tuple[int, ...], own: TextCounts | None) -> tuple[np.ndarray, np.ndarray, int]:
        """next_probs by Witten-Bell interpolation, from `tail`'s last token up to all of it."""
        levels: list[tuple[np.ndarray, np.ndarray]] = []  # (ids + 1, c_n) of the n-token suffix, n = 1, 2, ...
        for n in range(1, len(tail) + 1):
            ids, counts = self._level(tail[len(tail) - n :], own)
            if not len(ids):
                break  # a longer suffix occurs only where this one does
            levels.append((ids, counts))
        if not levels:
            return NO_TOKENS, np.zeros(0), 0
        vocab = np.unique(np.concatenate([ids for ids, _ in levels]))  # [V] ids + 1, ascending (a lookup samples
        # at most suffix_index.MAX_SCAN occurrences, so a longer suffix's next tokens need not be among a shorter one's)
        probs = np.zeros(len(vocab))  # [V] p_{n-1}; p_0 does not count: λ_1 = 1
        for n, (ids, counts) in enumerate(levels, 1):
            total = counts.sum()  # C_n
            weight = 1.0 if n == 1 else total / (total + len(ids))  # λ_n = C_n / (C_n + T_n)
            spread = np.zeros(len(vocab))  # [V] c_n
            spread[np.searchsorted(vocab, ids)] = counts
            probs = weight * spread / total + (1 - weight) * probs
        order = np.lexsort((vocab, -probs))  # likeliest first, the smaller id on a tie
        return vocab[order] - 1, probs[order], len(levels)

    def continuation(self, context: Sequence[int], length: int, own: TextCounts | None = None) -> list[int]:
        """Up to `length` tokens drafted greedily after `context` (see the module docstring), with `own`'s counts of
        the request's own text (TextCounts; None: the corpus alone); [] when not even its last token occurs in the
        corpus or `own` with a next token."""
        tail = list(context[-self.max_match :])
        draft: list[int] = []
        longest = self.max_match  # a match can grow by at most one token per drafted token
        while len(draft) < length:
            tokens, _, n = self.next_probs(tail + draft, longest, own)
            if not n:
                break
            draft.append(int(tokens[0]))
            longest = n + 1
        return draft

    def tree(self, context: Sequence[int], size: int, own: TextCounts | None = None) -> list[tuple[int, ...]]:
        """Up to `size` nodes of the draft tree after `context`, best first (see the module docstring), with `own`'s
        counts of the request's own text (TextCounts; None: the corpus alone), each as its token path from the root;
        a node comes after its parent; on a tie of scores the node found first."""
        return [path for path, _ in self.scored_tree(context, size, own)]

    def scored_tree(self, context: Sequence[int], size: int, own: TextCounts | None = None
                    ) -> list[tuple[tuple[int, ...], float]]:
        """`tree`'s nodes with their scores: a node's score is the product of `next_probs` along its path, the
        datastore's estimate of the chance that greedy verification accepts it."""
        tail = tuple(context[-self.max_match :])
        frontier: list[tuple[float, int, tuple[int, ...], int]] = []  # heap of (-score, order found, path, longest)
        found = itertools.count()

        def expand(path: tuple[int, ...], score: float, longest: int) -> None:
            tokens, probs, n = self.next_probs(tail + path, longest, own)
            for token, prob in zip(tokens[:TREE_BRANCH].tolist(), probs[:TREE_BRANCH].tolist()):
                heapq.heappush(frontier, (-score * prob, next(found), path + (token,), n + 1))

        nodes: list[tuple[tuple[int, ...], float]] = []
        expand((), 1.0, self.max_match)
        while frontier and len(nodes) < size:
            score, _, path, longest = heapq.heappop(frontier)
            nodes.append((path, -score))
            if len(nodes) < size:
                expand(path, -score, longest)
        return nodes

    def path_scores(self, context: Sequence[int], path: Sequence[int], own: TextCounts | None = None) -> list[float]:
        """The score (`scored_tree`'s) of each prefix of `path` after `context`: the product of the probabilities
        `next_probs` gives its tokens, 0 from the first token it does not give."""
        tail = tuple(context[-self.max_match :])
        scores: list[float] = []
        score, longest = 1.0, self.max_match
        for i, token in enumerate(path):
            tokens, probs, n = self.next_probs(tail + tuple(path[:i]), longest, own)
            hit = np.flatnonzero(tokens == token)
            score = score * float(probs[hit[0]]) if len(hit) else 0.0
            scores.append(score)
            longest = n + 1 if n else self.max_match
        return scores


def check_request_weight(weight: float) -> None:
    """ValueError unless `weight` is a finite number >= 0."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
        raise ValueError(f"Datastore: request_weight must be a number >= 0, got {weight!r}")


def check_smoothing(smoothing: str) -> None:
    """ValueError unless `smoothing` is one of SMOOTHINGS."""
    if smoothing not in SMOOTHINGS:
        raise ValueError(f"Datastore: smoothing must be one of {', '.join(SMOOTHINGS)}, got {smoothing!r}")


def source_error(label: str, source: str | Path, err: Exception) -> UsageError:
    """One line: `label`=source (or the file and record inside it that the error names), then what is wrong."""
    message = str(err)
    return UsageError(f"{label}={message}" if message.startswith(str(source)) else f"{label}={source}: {message}")


def labelled_sources(spec: str | Path | Sequence[str | Path], label: str) -> tuple[str, ...]:
    """data.datastore.sources_of(spec); its one-line error starts with `label`=."""
    try:
        return sources_of(spec)
    except UsageError as err:
        raise UsageError(f"{label}={err}") from None


def check_spec(spec: str | Path | Sequence[str | Path], label: str = "datastore") -> tuple[str, ...]:
    """The sources of a datastore spec, each checked as far as it can be without a tokenizer (data.datastore:
    check_source); UsageError, one line starting with `label`=, for the first bad one."""
    sources = labelled_sources(spec, label)
    for source in sources:
        try:
            check_source(source)
        except UsageError as err:
            raise source_error(label, source, err) from None
    return sources


def load_datastore(spec: str | Path | Sequence[str | Path] | None, tokenizer: Any = None, label: str = "datastore",
                   max_served: int = 0, smoothing: str = SMOOTHINGS[0],
                   request_weight: float = REQUEST_WEIGHT) -> Datastore:
    """The Datastore of `spec` (data.datastore: a source or several, each a feature cache, a ShareGPT file or folder,
    or a data recipe's name, the text ones tokenised with `tokenizer` and each answer ended by its end-of-sequence
    token; None: no corpus, for a datastore that grows from `max_served` > 0 alone). A cache made with another
    tokenizer or unreadable data raise UsageError, one line starting with `label`=source. (The target's vocabulary is
    checked against `Datastore.max_id` where the target is loaded.) `smoothing`, `request_weight`: Datastore's."""
    if spec is None:
        return Datastore([], max_served=max_served, smoothing=smoothing, request_weight=request_weight)
    sources = labelled_sources(spec, label)
    encode = end = fingerprint = None
    if tokenizer is not None:
        encode = lambda texts: tokenizer(list(texts), add_special_tokens=False)["input_ids"]  # noqa: E731
        end, fingerprint = tokenizer.eos_token_id, tokenizer_fingerprint(tokenizer)
    signatures = []
    for source in sources:
        try:
            signatures.append(source_signature(source))
        except UsageError as err:
            raise source_error(label, source, err) from None
    key = (tuple(signatures), fingerprint, end)
    store = _INDEXES.get(key)
    if store is None:
        store = _indexed(sources, label, encode, fingerprint, end)
        _INDEXES[key] = store
        while len(_INDEXES) > INDEXES_KEPT:
            _INDEXES.popitem(last=False)
    _INDEXES.move_to_end(key)
    store = store.configured(smoothing, request_weight)  # its own memo; the index shared
    return store.growing(max_served) if max_served else store


_INDEXES: OrderedDict[tuple, Datastore] = OrderedDict()  # load_datastore's last corpora, oldest first


def _indexed(sources: Sequence[str], label: str, encode: Any, fingerprint: str | None, end: int | None) -> Datastore:
    """load_datastore's Datastore of `sources` (read, tokenised, indexed), neither growing nor configured yet."""
    documents: list[Sequence[int]] = []
    for source in sources:
        try:
            documents += corpus_documents(source, encode, fingerprint, end)
        except UsageError as err:
            raise source_error(label, source, err) from None
    size = sum(map(len, documents))
    if size >= INDEX_NOTICE:
        print(f"datastore {SEPARATOR.join(sources)}: indexing {size:,} tokens", file=sys.stderr, flush=True)
    try:
        return Datastore(documents, keep=size >= INDEX_NOTICE)
    except UsageError as err:
        raise UsageError(f"{label}={SEPARATOR.join(sources)}: {err}") from None
