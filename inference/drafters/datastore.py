"""A datastore of the target's own text to draft from: the most frequent continuation of the context's last tokens.

Prompt lookup (inference.drafters.prompt_lookup) copies from the request's own prompt and output; a datastore copies
from a corpus, retrieval-based drafting as in REST (He et al. 2024) and SuffixDecoding (Oliaro et al. 2024). The corpus
that pays is the target's own answers (data.datastore: a self-distilled feature cache holds them): a model says the
same phrases again and again ("Here are some", "```python\\ndef", "I hope this helps"), and an n-gram of its own text
predicts them where a trained drafter guesses token by token.

`Datastore.continuation(context, n)` drafts greedily: the longest suffix of the context (at most `max_match` tokens)
that occurs in the corpus with a next token picks the occurrences; their most frequent next token is drafted; repeat
with the drafted token appended. A chain stops where not even the last token occurs with a next token (documents never
run into each other).

Index: every corpus position's next `max_match + 1` tokens, as one big-endian byte string, sorted (a suffix array cut
at that depth). All positions starting with a pattern form one range of it, found by binary search, so a lookup costs
O(max_match log N) whatever the corpus size; memory is 4 (max_match + 3) bytes a token (5 MB for the 179k tokens of
the CPU recipe's answers, max_match 4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from data.datastore import corpus_documents
from data.errors import UsageError
from models.fingerprint import tokenizer_fingerprint

MAX_SCAN = 4096  # occurrences counted per lookup at most (evenly spaced over the range): a lookup stays O(1)


class Datastore:
    """A corpus of token-id documents, indexed for `continuation`. Ids must lie in [0, vocab_size) when given."""

    def __init__(self, documents: Sequence[Sequence[int]], max_match: int = 4, vocab_size: int | None = None) -> None:
        if max_match < 1:
            raise ValueError(f"Datastore: max_match must be >= 1, got {max_match}")
        parts = [np.asarray(doc, dtype=np.int64) for doc in documents if len(doc)]
        if not parts:
            raise UsageError("no tokens to draft from")
        ids = np.concatenate(parts)
        high = vocab_size if vocab_size is not None else np.iinfo(np.int32).max
        if ids.min() < 0 or ids.max() >= high:
            bad = int(ids.min() if ids.min() < 0 else ids.max())
            raise UsageError(f"token id {bad} is outside the target's vocabulary [0, {high})")
        self.max_match = max_match
        self.num_documents, self.num_tokens, self.max_id = len(parts), len(ids), int(ids.max())
        # corpus: ids + 1, each document followed by a 0 (no token), so a continuation never crosses documents
        self.corpus = np.concatenate([np.append(p + 1, 0) for p in parts]).astype(np.int32)  # [N]
        width = max_match + 1
        padded = np.concatenate([self.corpus, np.zeros(width, np.int32)])
        windows = np.lib.stride_tricks.sliding_window_view(padded, width)[: len(self.corpus)].astype(">u4")  # [N, W]
        keys = np.ascontiguousarray(windows).view(f"V{4 * width}").ravel()  # [N] byte strings: memcmp = token order
        self.order = np.argsort(keys, kind="stable").astype(np.int32)  # [N] corpus positions, by what follows them
        self.keys = keys[self.order]  # [N]
        self._width = width

    def _range(self, pattern: Sequence[int]) -> tuple[int, int]:
        """[a, b) of `order` whose positions start with `pattern` (original ids, len <= max_match + 1)."""
        low = np.zeros(self._width, ">u4")
        high = np.full(self._width, 0xFFFFFFFF, ">u4")
        low[: len(pattern)] = high[: len(pattern)] = np.asarray(pattern, np.int64) + 1
        dtype = self.keys.dtype
        a = int(np.searchsorted(self.keys, low.view(dtype)[0], "left"))
        b = int(np.searchsorted(self.keys, high.view(dtype)[0], "right"))
        return a, b

    def _next_token(self, a: int, b: int, matched: int) -> int | None:
        """The most frequent token after the `matched` tokens at positions order[a:b]; None if none continues."""
        picks = self.order[a:b] if b - a <= MAX_SCAN else self.order[np.linspace(a, b - 1, MAX_SCAN).astype(np.int64)]
        following = self.corpus[picks + matched]
        following = following[following > 0]
        return int(np.bincount(following).argmax()) - 1 if len(following) else None

    def continuation(self, context: Sequence[int], length: int) -> list[int]:
        """Up to `length` tokens drafted after `context` (see the module docstring); [] when not even its last token
        occurs in the corpus with a next token."""
        tail = list(context[-self.max_match :])
        draft: list[int] = []
        longest = self.max_match  # a match can grow by at most one token per drafted token
        while len(draft) < length and tail:
            token = None
            for n in range(min(longest, len(tail)), 0, -1):  # the longest suffix that occurs with a next token
                a, b = self._range(tail[-n:])
                token = self._next_token(a, b, n) if b > a else None
                if token is not None:
                    longest = n + 1
                    break
            if token is None:
                break
            draft.append(token)
            tail = (tail + [token])[-self.max_match :]
        return draft


def source_error(label: str, source: str | Path, err: Exception) -> UsageError:
    """One line: `label`=source (or the file and record inside it that the error names), then what is wrong."""
    message = str(err)
    return UsageError(f"{label}={message}" if message.startswith(str(source)) else f"{label}={source}: {message}")


def load_datastore(source: str | Path, tokenizer: Any = None, label: str = "datastore") -> Datastore:
    """The Datastore of `source` (data.datastore: a feature cache, or a ShareGPT file or folder tokenised with
    `tokenizer`). A cache made with another tokenizer or unreadable data raise UsageError, one line starting with
    `label`=source. (The target's vocabulary is checked against `Datastore.max_id` where the target is loaded.)"""
    encode = None if tokenizer is None else (lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    fingerprint = None if tokenizer is None else tokenizer_fingerprint(tokenizer)
    try:
        return Datastore(corpus_documents(source, encode, fingerprint))
    except UsageError as err:
        raise source_error(label, source, err) from None
