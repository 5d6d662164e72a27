"""Streaming detokenisation with stop strings, as an `Engine.generate(stream=...)` callback for one row.

Stop strings are matched on the decoded text, so they fire whatever tokens spell them. Text is decoded with
`clean_up_tokenization_spaces=False` so that the decode of a prefix of ids is a prefix of the decode of all ids,
which is what lets text be written before generation ends.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index of the earliest occurrence of any stop string in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


class TextStream:
    """Callable `(row, new_ids) -> bool` for a single-row generation.

    Writes through `emit` only text that can no longer change: no trailing partial UTF-8 character, no suffix that
    could still grow into a stop string. Returns True (stop this row) once the text holds a stop string; the text
    then ends before the stop string.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), emit: Callable[[str], Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.emit = emit
        self.ids: list[int] = []
        self.emitted = 0  # characters of the text already written
        self.stopped = False

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def __call__(self, row: int, new_ids: list[int]) -> bool:
        if self.stopped:
            return True
        self.ids.extend(new_ids)
        text = self.decode(self.ids)
        cut = first_stop(text, self.stops)
        if cut is not None:
            self.stopped = True
            self._write(text[:cut])
            return True
        self._write(text[: self._stable_end(text)])
        return False

    def _stable_end(self, text: str) -> int:
        end = len(text.rstrip("\ufffd"))  # an incomplete multi-byte character decodes to U+FFFD
        hold = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        return min(end, len(text) - hold)

    def _write(self, text: str) -> None:
        if self.emit is not None and len(text) > self.emitted:
            self.emit(text[self.emitted :])
        self.emitted = max(self.emitted, len(text))

    def finish(self, token_ids: Sequence[int]) -> tuple[str, list[int]]:
        """Flush and return (text, ids) of the finished row (`token_ids`: the engine's output for it). With a stop
        string, the text ends before it and the ids end at the token that completed it."""
        ids = list(token_ids)
        text = self.decode(ids)
        cut = first_stop(text, self.stops)
        if cut is not None:
            text = text[:cut]
            low, high = 1, len(ids)  # smallest prefix whose text holds a stop string (monotone in the length)
            while low < high:
                mid = (low + high) // 2
                if first_stop(self.decode(ids[:mid]), self.stops) is None:
                    low = mid + 1
                else:
                    high = mid
            ids = ids[:high]
        self._write(text)
        return text, ids
