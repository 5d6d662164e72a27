"""The text a datastore drafter copies from (inference.drafters.datastore): assistant tokens, one document per turn.

Sources (`source`):
    a feature cache folder (manifest.json, see data.features)   the trained tokens of its train split: each run of
                                                                 loss-masked tokens (an assistant turn) is a document;
                                                                 no tokenizer needed, the ids are the cache's own
    a ShareGPT-format file or folder (data.readers)              every assistant turn's text, tokenised by the caller
                                                                 (`encode`), e.g. the self-distilled answers a
                                                                 features job writes to <cache>/self_distill/
    a data recipe's name (conf/data/<name>.yaml), where no      the assistant turns of the recipe's train split, as
    file or folder has that name, e.g. `sharegpt_v3`            training reads it (curated, decontaminated)
A datastore spec names one source or several (`sources_of`: joined by commas, or a list); their documents are indexed
together. The target's own answers make the best small datastore (docs/eagle3.md): a feature cache made with
data.self_distill=true already holds them; ShareGPT V3's 10M tokens of answers (`sharegpt_v3`) add phrasing they lack.
`check_source` checks what it can without a tokenizer; every error is one line naming the source (and the file and
record where a record is bad). A text source is parsed once per process while its files stay unchanged: the command
line checks it, `load` checks it again and then encodes it, all from one parse.

Tokenised answers are kept on disk (<cache root>/datastore/<key>.npz, data.cache), keyed by a hash of the answers'
text, the tokenizer's fingerprint and the end token: a later process reads ShareGPT V3's 10.2M tokens back in about a
second instead of tokenising them again (13–30 s on 2 cores). Changed text or another tokenizer is another key; an
unreadable file is tokenised again and replaced; a file is written whole or not at all. Without a tokenizer
fingerprint nothing is kept.
"""

from __future__ import annotations

import hashlib
import sys
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO, Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from data.atomic import write_file
from data.cache import cache_root
from data.chat import IGNORE_INDEX
from data.config import available_data_configs, load_data_config
from data.datasets import load_conversations
from data.errors import DataError, UsageError
from data.features import MANIFEST, FeatureDataset, check_cache
from data.readers import read_conversations

PARSES_KEPT = 4  # text sources whose parsed answers stay in memory (a walk may compare several)
SEPARATOR = ","  # between the sources of one datastore spec
ENCODE_BATCH = 1000  # answers tokenised per call; a bar shows progress past one batch
Encode = Callable[[Sequence[str]], Sequence[Sequence[int]]]  # texts -> their token ids (no special tokens)
TOKENS_FORMAT = 1  # of the tokenised answers kept on disk (see the module docstring); part of their key


def sources_of(spec: str | Path | Sequence[str | Path]) -> tuple[str, ...]:
    """The sources a datastore spec names: one (a path or a recipe name), several joined by commas, or a list of
    them; DataError (one line) for an empty spec or an empty name between commas."""
    parts = [str(spec)] if isinstance(spec, (str, Path)) else [str(s) for s in spec]
    names = tuple(name.strip() for part in parts for name in part.split(SEPARATOR))
    if not names or not all(names):
        raise DataError(f"{spec!r}: a datastore names a source, or several joined by {SEPARATOR!r}, none empty")
    return names


def is_recipe(source: str | Path) -> bool:
    """Whether `source` names a data recipe (conf/data) rather than a file or folder: no path of that name exists."""
    return not Path(source).expanduser().exists() and str(source) in available_data_configs()


def is_feature_cache(source: str | Path) -> bool:
    return (Path(source) / MANIFEST).is_file()


def located(source: str | Path) -> Path:
    """`source` as a path that exists; DataError (one line) otherwise."""
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"{source}: no such file or folder, nor a data recipe (expected a feature cache folder, a "
                        f"ShareGPT-format file or folder of the target's answers, or one of "
                        f"{', '.join(available_data_configs())})")
    return path


def check_source(source: str | Path) -> None:
    """Raise DataError (one line) when `source` is not a usable datastore source: a feature cache's manifest is
    checked, a ShareGPT source parsed whole (a bad record is named before anything else starts)."""
    if is_recipe(source):
        answer_texts(source)
        return
    path = located(source)
    if is_feature_cache(path):
        check_cache(path, key="")
    else:
        answer_texts(path)


def answer_texts(source: str | Path) -> tuple[str, ...]:
    """Every non-empty assistant turn of a ShareGPT-format source or a recipe's train split, in order; the last
    PARSES_KEPT sources' parses are kept and reused while no file under them changes (size or modification time): a
    source is checked on the command line, then read to be encoded, and a walk over several sources checks them all
    before it reads any."""
    if is_recipe(source):
        return _recipe_answers(str(source))
    path = Path(source).expanduser()
    return _parsed_answers(str(source), path.resolve(), file_signature(path))


def source_signature(source: str | Path) -> tuple:
    """What identifies `source`'s content within a process: a recipe's name, or the resolved path and its files'
    signature (`file_signature`); DataError (one line) for a path that does not exist."""
    if is_recipe(source):
        return ("recipe", str(source))
    path = located(source)
    return (str(path.resolve()), file_signature(path))


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
    return _assistant_texts(read.conversations, f"{source}: no assistant turn to copy from")


@lru_cache(maxsize=PARSES_KEPT)
def _recipe_answers(name: str) -> tuple[str, ...]:
    """answer_texts of the recipe conf/data/<name>.yaml: its train split as build_datasets reads it."""
    try:
        conversations = load_conversations(load_data_config(name, flag="datastore recipe"), "train")
    except (UsageError, ValueError, OSError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"{name}: the data recipe's train split cannot be read: {message}") from None
    return _assistant_texts(conversations, f"{name}: the data recipe's train split has no assistant turn to copy from")


def _assistant_texts(conversations: Sequence[Sequence[dict]], empty: str) -> tuple[str, ...]:
    """Every non-empty assistant turn of `conversations`, in order; DataError(`empty`) when there is none."""
    texts = tuple(m["content"] for conversation in conversations for m in conversation
                  if m["role"] == "assistant" and m["content"].strip())
    if not texts:
        raise DataError(empty)
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


def corpus_documents(source: str | Path, encode: Encode | None = None, tokenizer_hash: str | None = None,
                     end: int | None = None) -> list[Sequence[int]]:
    """Token-id documents of `source` (see the module docstring). A text source needs `encode` (a batch of texts ->
    their ids), and each of its answers is followed by `end` when given (the token that ends an answer, as a feature
    cache's trained tokens end with it); a bar shows the encoding of a large one."""
    if not is_recipe(source) and is_feature_cache(located(source)):
        return cache_documents(source, tokenizer_hash)
    if encode is None:
        raise DataError(f"{source}: a text source needs the target's tokenizer; this engine has none (pass a feature "
                        f"cache folder, which stores token ids)")
    texts = answer_texts(source)
    kept = None if tokenizer_hash is None else tokens_file(texts, tokenizer_hash, end)
    documents = None if kept is None else read_tokens(kept)
    if documents is not None:
        return documents
    documents = []
    with tqdm(total=len(texts), desc=f"datastore {source}: tokenising answers", unit="answer",
              disable=len(texts) <= ENCODE_BATCH) as bar:
        for start in range(0, len(texts), ENCODE_BATCH):
            batch = texts[start : start + ENCODE_BATCH]
            documents += [list(ids) + ([] if end is None else [end]) for ids in encode(batch)]
            bar.update(len(batch))
    if kept is not None:
        write_tokens(kept, documents)
    return documents


def tokens_file(texts: Sequence[str], tokenizer_hash: str, end: int | None) -> Path:
    """Where the tokenised `texts` are kept: a hash of the format, the tokenizer's fingerprint, `end` and every text
    (each with its length, so no two lists of texts hash alike by their joins)."""
    digest = hashlib.sha256(f"{TOKENS_FORMAT}\0{tokenizer_hash}\0{end}\0{len(texts)}\0".encode())
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return cache_file(f"{digest.hexdigest()[:32]}.npz")


def cache_file(name: str) -> Path:
    """<cache root>/datastore/`name`: the folder where datastores keep what they computed (see the module docstring
    and inference.drafters.datastore.SuffixIndex.kept)."""
    return cache_root() / "datastore" / name


def keep_file(path: Path, write: Callable[[BinaryIO], None], what: str) -> None:
    """`write(f)` fills `path` (a cache_file) through an open binary file, written whole (data.atomic.write_file) or
    not at all: a cache that cannot be written is a note on stderr, not an error, since the datastore works without
    it."""
    def fill(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: numpy adds no suffix to the temporary's name
            write(f)

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, fill)
    except OSError as err:
        print(f"datastore: {what} could not be kept at {path}: {err}", file=sys.stderr)


def read_tokens(path: Path) -> list[np.ndarray] | None:
    """The documents kept at `path`, None when there is none or it cannot be read (it is then tokenised again)."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as kept:
            ids, ends = kept["ids"], kept["ends"]  # [N] int32 every document's ids in turn; [D] int64 their ends
        if ids.ndim != 1 or ends.ndim != 1 or (len(ends) and (ends[-1] != len(ids) or np.any(np.diff(ends) < 0))):
            raise ValueError("inconsistent arrays")
    except (OSError, ValueError, KeyError, EOFError) as err:
        print(f"datastore: {path} cannot be read ({type(err).__name__}); tokenising again", file=sys.stderr)
        return None
    return np.split(ids.astype(np.int64), ends[:-1])


def write_tokens(path: Path, documents: Sequence[Sequence[int]]) -> None:
    """Keep `documents` at `path` (keep_file: whole or not at all)."""
    ids = np.fromiter((t for doc in documents for t in doc), np.int32, sum(map(len, documents)))
    ends = np.cumsum([len(doc) for doc in documents], dtype=np.int64)
    keep_file(path, lambda f: np.savez(f, ids=ids, ends=ends), "the tokenised answers")
