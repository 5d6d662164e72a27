"""The `name:key=value,...` language that names a drafter without a checkpoint: one parser for every place that reads
it (`load("jacobi:n=32", ...)`, `--drafter lookahead --drafter-option draft_nodes=31`, the registry's builders).

    "prompt_lookup"                      DrafterSpec("prompt_lookup", ())
    "jacobi:n=32,init=pad"               DrafterSpec("jacobi", (("n", "32"), ("init", "pad")))

Values stay text here; `parse_value` turns one into the type a drafter's keyword takes (int, float, bool, str), and
each drafter checks its own ranges (inference.drafters.registry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from data.errors import UsageError


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    options: tuple[tuple[str, str], ...] = ()  # (key, value text) in the order given

    @classmethod
    def parse(cls, text: str) -> DrafterSpec:
        """"name" or "name:key=value,key=value"; an item without `=` or without a key raises UsageError."""
        name, _, rest = text.partition(":")
        options = []
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise UsageError(f"drafter spec {text!r}: expected key=value, got {item!r}")
            options.append((key, value))
        return cls(name, tuple(options))

    def with_pairs(self, pairs: Sequence[str], flag: str = "--drafter-option") -> DrafterSpec:
        """These options plus `KEY=VALUE` words (a command line's repeated `flag`), appended in order."""
        extra = []
        for pair in pairs:
            key, eq, value = pair.partition("=")
            if not eq or not key or "," in pair:
                raise UsageError(f"{flag} {pair!r}: expected KEY=VALUE (no commas)")
            extra.append((key, value))
        return DrafterSpec(self.name, (*self.options, *extra))

    def __str__(self) -> str:
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in self.options) if self.options else "")


BOOLEANS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def parse_value(text: str, kind: type) -> Any:
    """`text` as a value of `kind` (the type of a drafter keyword's default). A bool reads true/false, yes/no, on/off,
    1/0 (`bool("false")` would be True); an int must be written as one ("3.5" is refused, not truncated); int,
    float and str convert as Python does. ValueError when the text is not such a value."""
    if kind is bool:
        value = BOOLEANS.get(text.strip().lower())
        if value is None:
            raise ValueError(f"not a boolean: {text!r}")
        return value
    if kind in (int, float, str):
        return kind(text)
    raise ValueError(f"no text form for {kind.__name__} options")
