"""The text a datastore drafter copies from (inference.drafters.datastore): assistant tokens, one document per turn.

Sources (`source`, a path):
    a feature cache folder (manifest.json, see data.features)   the trained tokens of its train split: each run of
                                                                 loss-masked tokens (an assistant turn) is a document;
                                                                 no tokenizer needed, the ids are the cache's own
    a ShareGPT-format file or folder (data.readers)              every assistant turn's text, tokenised by the caller
                                                                 (`encode`), e.g. the self-distilled answers a
                                                                 features job writes to <cache>/self_distill/
The target's own answers make the best datastore (docs/eagle3.md): a feature cache made with data.self_distill=true
already holds them. `check_source` checks what it can without a tokenizer; every error is one line naming the source
(and the file and record where a record is bad). A ShareGPT source is parsed once per process while its files stay
unchanged: the command line checks it, `load` checks it again and then encodes it, all from one parse.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

from data.chat import IGNORE_INDEX
from data.errors import DataError
from data.features import MANIFEST, FeatureDataset, check_cache
from data.readers import read_conversations

PARSES_KEPT = 4  # text sources whose parsed answers stay in memory (a walk may compare several)


def is_feature_cache(source: str | Path) -> bool:
    return (Path(source) / MANIFEST).is_file()


def located(source: str | Path) -> Path:
    """`source` as a path that exists; DataError (one line) otherwise."""
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"{source}: no such file or folder (expected a feature cache folder or a ShareGPT-format "
                        f"file or folder of the target's answers)")
    return path


def check_source(source: str | Path) -> None:
    """Raise DataError (one line) when `source` is not a usable datastore source: a feature cache's manifest is
    checked, a ShareGPT source parsed whole (a bad record is named before anything else starts)."""
    path = located(source)
    if is_feature_cache(path):
        check_cache(path, key="")
    else:
        answer_texts(path)


def answer_texts(source: str | Path) -> tuple[str, ...]:
    """Every non-empty assistant turn of a ShareGPT-format source, in order; the last PARSES_KEPT sources' parses are
    kept and reused while no file under them changes (size or modification time): a source is checked on the command
    line, then read to be encoded, and a walk over several sources checks them all before it reads any."""
    path = Path(source).expanduser()
    return _parsed_answers(str(source), path.resolve(), file_signature(path))


def file_signature(path: Path) -> tuple[tuple[str, int, int], ...]:
    """(relative name, size, mtime in ns) of `path`, or of every file under a folder."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return tuple((str(f.relative_to(path)) if f != path else "", *_size_mtime(f)) for f in files)


def _size_mtime(file: Path) -> tuple[int, int]:
    stat = file.stat()
    return stat.st_size, stat.st_mtime_ns


@lru_cache(maxsize=PARSES_KEPT)
def _parsed_answers(source: str, resolved: Path, signature: tuple) -> tuple[str, ...]:
    """answer_texts' parse, cached by `source` as given, its resolved path and its files' signature."""
    read = read_conversations(Path(source).expanduser(), "sharegpt", on_error="raise")
    texts = tuple(m["content"] for conversation in read.conversations for m in conversation
                  if m["role"] == "assistant" and m["content"].strip())
    if not texts:
        raise DataError(f"{source}: no assistant turn to copy from")
    return texts


def cache_documents(folder: str | Path, tokenizer_hash: str | None = None) -> list[list[int]]:
    """The trained-token runs of a complete feature cache's train split; `tokenizer_hash` (models.fingerprint) refuses
    a cache made with another tokenizer."""
    check_cache(folder, tokenizer=tokenizer_hash, key="")
    documents: list[list[int]] = []
    for labels in FeatureDataset(folder, "train").labels():
        run: list[int] = []
        for token in labels.tolist():
            if token == IGNORE_INDEX:
                if run:
                    documents.append(run)
                run = []
            else:
                run.append(token)
        if run:
            documents.append(run)
    if not documents:
        raise DataError(f"{folder}: the feature cache's train split holds no trained (assistant) token")
    return documents


def corpus_documents(source: str | Path, encode: Callable[[str], Sequence[int]] | None = None,
                     tokenizer_hash: str | None = None) -> list[list[int]]:
    """Token-id documents of `source` (see the module docstring); a ShareGPT source needs `encode` (text -> ids)."""
    path = located(source)
    if is_feature_cache(path):
        return cache_documents(path, tokenizer_hash)
    if encode is None:
        raise DataError(f"{source}: a text source needs the target's tokenizer; this engine has none (pass a feature "
                        f"cache folder, which stores token ids)")
    return [list(encode(text)) for text in answer_texts(path)]
