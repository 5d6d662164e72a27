"""The counting structures a datastore drafts from: `SuffixIndex`, one indexed segment of a corpus, and
`TextCounts`, the growing counts of one request's own text (inference.drafters.datastore adds them together).

Index: every corpus position's next `max_match + 1` tokens, as one big-endian byte string, sorted (a suffix array cut
at that depth). All positions starting with a pattern form one range of it, found by binary search, so a lookup costs
O(max_match log N) whatever the corpus size; memory is 4 (max_match + 3) bytes a token (4 MB for the 179k tokens of
the CPU recipe's answers, 245 MB for ShareGPT V3's 10.2M, at the datastore's default MAX_MATCH 3).
"""

from __future__ import annotations

import hashlib
import sys
from typing import Sequence

import numpy as np

from data.datastore import cache_file, keep_file

MAX_SCAN = 1024  # occurrences counted per lookup and segment at most (evenly spaced over the range): O(1) a lookup


class SuffixIndex:
    """One segment: a corpus (ids + 1, each document followed by a 0, so a continuation never crosses documents)
    and its positions sorted by the `width` tokens that follow them."""

    def __init__(self, corpus: np.ndarray, width: int, order: np.ndarray | None = None) -> None:
        """`order`: this corpus's sorted positions from an earlier index of it (its sort skipped), else None."""
        self.corpus, self.width = corpus, width  # [N] int32
        padded = np.concatenate([corpus, np.zeros(width, np.int32)])
        windows = np.lib.stride_tricks.sliding_window_view(padded, width)[: len(corpus)].astype(">u4")  # [N, W]
        keys = np.ascontiguousarray(windows).view(f"V{4 * width}").ravel()  # [N] byte strings: memcmp = token order
        if order is None:
            order = np.argsort(keys, kind="stable")
        self.order = order.astype(np.int32)  # [N] corpus positions, by what follows them
        self.keys = keys[self.order]  # [N]
        self.num_tokens = int(np.count_nonzero(corpus))

    @classmethod
    def of_documents(cls, parts: Sequence[np.ndarray], width: int) -> "SuffixIndex":
        return cls(corpus_of(parts), width)

    @classmethod
    def kept(cls, parts: Sequence[np.ndarray], width: int) -> "SuffixIndex":
        """of_documents, its sorted positions read from the cache root when an index of the same corpus was kept
        there (<cache root>/datastore/index-<hash of the corpus and width>.npy), else sorted and kept."""
        corpus = corpus_of(parts)
        digest = hashlib.sha256(f"{width}\0{len(corpus)}\0".encode())
        digest.update(corpus.tobytes())
        path = cache_file(f"index-{digest.hexdigest()[:32]}.npy")
        order = None
        if path.is_file():
            try:
                order = np.load(path)
                if order.shape != corpus.shape or order.dtype != np.int32:
                    raise ValueError("another corpus's index")
            except (OSError, ValueError, EOFError) as err:
                print(f"datastore: {path} cannot be read ({type(err).__name__}); indexing again", file=sys.stderr)
                order = None
        index = cls(corpus, width, order)
        if order is None:
            keep_file(path, lambda f: np.save(f, index.order), "the index")
        return index

    def merged(self, other: "SuffixIndex") -> "SuffixIndex":
        """One segment over this corpus, then `other`'s."""
        return SuffixIndex(np.concatenate([self.corpus, other.corpus]), self.width)

    def _range(self, pattern: Sequence[int]) -> tuple[int, int]:
        """[a, b) of `order` whose positions start with `pattern` (original ids, len < width + 1)."""
        low = np.zeros(self.width, ">u4")
        high = np.full(self.width, 0xFFFFFFFF, ">u4")
        low[: len(pattern)] = high[: len(pattern)] = np.asarray(pattern, np.int64) + 1
        dtype = self.keys.dtype
        a = int(np.searchsorted(self.keys, low.view(dtype)[0], "left"))
        b = int(np.searchsorted(self.keys, high.view(dtype)[0], "right"))
        return a, b

    def following(self, pattern: Sequence[int]) -> np.ndarray:
        """The tokens (ids + 1) that follow occurrences of `pattern`, at most MAX_SCAN of them evenly spaced over the
        occurrences; empty when it does not occur with a next token."""
        a, b = self._range(pattern)
        if b <= a:
            return self.corpus[:0]
        picks = self.order[a:b] if b - a <= MAX_SCAN else self.order[np.linspace(a, b - 1, MAX_SCAN).astype(np.int64)]
        after = self.corpus[picks + len(pattern)]
        return after[after > 0]


def corpus_of(parts: Sequence[np.ndarray]) -> np.ndarray:
    """[N] int32: each document's ids + 1, each followed by a 0 (a continuation never crosses documents)."""
    return np.concatenate([np.append(p + 1, 0) for p in parts]).astype(np.int32)


class TextCounts:
    """What followed every n-gram of 1 to `max_n` tokens of one growing text (a request's prompt and committed
    tokens), counted: the request's own counts that `Datastore.next_probs` adds to the corpus's. Extending by a token
    costs O(max_n)."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], dict[int, int]] = {}  # n-gram -> {next token: count}

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens, each counted after the n-grams that end just before it."""
        for token in tokens:
            token, j = int(token), len(self.tokens)
            for n in range(1, min(self.max_n, j) + 1):
                followers = self.after.setdefault(tuple(self.tokens[j - n :]), {})
                followers[token] = followers.get(token, 0) + 1
            self.tokens.append(token)

    def following(self, pattern: Sequence[int]) -> dict[int, int]:
        """{next token: count} of `pattern`'s occurrences with a next token ({} when none)."""
        return self.after.get(tuple(pattern), {})
