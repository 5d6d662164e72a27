"""A datastore's sources (data.datastore, inference.drafters.datastore.load_datastore): ShareGPT files, feature caches
and recipes read, tokenised and indexed once (kept on disk, shared by the engines of a process until a file changes),
and a bad one named in one line. The Datastore's drafting: tests/test_datastore.py; serving from it:
tests/test_datastore_serving.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

import data.datastore as data_datastore
import inference.drafters.datastore as datastore_module
from data.config import load_data_config
from data.datasets import load_conversations
from data.datastore import answer_texts, check_source, is_recipe
from data.errors import UsageError
from inference.api import load
from inference.drafters.datastore import Datastore, load_datastore
from inference.drafters.registry import CLI, LoadOptions, resolve
from tests.data_support import tiny_tokenizer
from tests.model_support import save_tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")


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
