"""The offline stdlib corpus (split by file, exclusions) and the chat data mined from it with ast."""

import textwrap
from pathlib import Path

import pytest

from data.stdlib_chat import MAX_SOURCE_CHARS, file_conversations, module_name, stdlib_conversations
from data.stdlib_corpus import SPLITS, VALIDATION_PERCENT, corpus_documents, corpus_files, split_of, stdlib_root


@pytest.fixture(scope="module")
def files():
    return {split: corpus_files(split) for split in SPLITS}


def test_splits_are_disjoint_sorted_and_sized(files):
    train, validation = files["train"], files["validation"]
    assert train == sorted(train) and validation == sorted(validation)
    assert not set(train) & set(validation)
    assert len(train) > 200 and len(validation) >= 5
    # ~VALIDATION_PERCENT of files; wide bounds since it is a hash bucket over a few hundred files.
    fraction = len(validation) / (len(train) + len(validation))
    assert VALIDATION_PERCENT / 400 < fraction < VALIDATION_PERCENT * 4 / 100


def test_split_depends_only_on_relative_path(files):
    root = stdlib_root()
    for split, paths in files.items():
        assert all(split_of(p.relative_to(root).as_posix()) == split for p in paths)
    names = [f"pkg{i}/mod{i}.py" for i in range(5000)]
    share = sum(split_of(n) == "validation" for n in names) / len(names)
    assert abs(share - VALIDATION_PERCENT / 100) < 0.01  # binomial sd ~0.003 at 4 %


def test_excludes_tests_third_party_and_generated(files):
    root = stdlib_root()
    for path in files["train"] + files["validation"]:
        rel = path.relative_to(root)
        assert not {"test", "tests", "idle_test", "site-packages", "__pycache__"} & set(rel.parts[:-1]), rel
        assert not rel.name.startswith("test_"), rel
    names = {p.relative_to(root).as_posix() for p in files["train"] + files["validation"]}
    assert "encodings/cp1252.py" not in names  # gencodec.py output
    assert "os.py" in names or split_of("os.py") == "validation"


def test_documents_follow_files_and_are_real_python(files):
    docs = list(corpus_documents("validation"))
    assert len(docs) == len(files["validation"])  # no empty stdlib module in this split
    assert any("def " in d for d in docs) and any('"""' in d for d in docs)


def test_unknown_split_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        corpus_files("dev")


def test_module_names():
    assert module_name(Path("email/mime/text.py")) == "email.mime.text"
    assert module_name(Path("json/__init__.py")) == "json"
    assert module_name(Path("os.py")) == "os"


SOURCE = textwrap.dedent('''
    import functools

    def documented(a, b=1, *args, key=None, **kw):
        """Add things.

        Longer explanation here.
        """
        return a + b

    def undocumented(x):
        return x

    def huge():
        """Far too long to be an answer."""
        return """%s"""

    class Box:
        """A box holding one value."""

        @functools.cache
        def get(self):
            """Return the held value."""
            return self.value

        def put(self, value):
            """Store a value in the box."""
            self.value = value

        def nodoc(self):
            pass

        def empty(self):
            """Tell whether nothing is held."""
            return self.value is None

        def size(self):
            """Count held values, 0 or 1."""
            return int(self.value is not None)
''' % ("x" * MAX_SOURCE_CHARS))


def test_function_conversations_pair_prompt_with_real_source():
    conversations = file_conversations(SOURCE, "pkg.mod")
    write, explain = conversations[0], conversations[1]
    prompt = "Write `documented(a, b=1, *args, key=None, **kw)` from `pkg.mod`: Add things."
    assert write[0] == {"role": "user", "content": prompt}
    assert write[1]["content"].startswith("def documented(a, b=1") and write[1]["content"].endswith("return a + b")
    assert explain == [
        {"role": "user", "content": "What does `pkg.mod.documented` do?"},
        {"role": "assistant", "content": "Add things.\n\nLonger explanation here."},
    ]
    everything = repr(conversations)
    assert "undocumented" not in everything and "huge" not in everything and "nodoc" not in everything


def test_class_methods_become_multi_turn_conversations_in_source_order():
    conversations = file_conversations(SOURCE, "pkg.mod")
    assert conversations[2] == [
        {"role": "user", "content": "What does the class `pkg.mod.Box` do?"},
        {"role": "assistant", "content": "A box holding one value."},
    ]
    first, second = conversations[3], conversations[4]
    assert len(first) == 6 and len(second) == 2  # 4 documented methods -> chunks of 3 and 1
    assert first[0]["content"] == "Write the method `Box.get(self)` of `pkg.mod.Box`: Return the held value."
    method = '@functools.cache\ndef get(self):\n    """Return the held value."""\n    return self.value'
    assert first[1]["content"] == method
    assert first[2]["content"] == "Now write `put(self, value)`: Store a value in the box."
    assert first[4]["content"].startswith("Now write `empty(self)`")
    assert second[0]["content"].startswith("Write the method `Box.size(self)`")
    for conversation in conversations:
        assert [m["role"] for m in conversation] == ["user", "assistant"] * (len(conversation) // 2)


def test_unparsable_source_yields_nothing():
    assert file_conversations("def broken(:\n", "m") == []


def test_stdlib_validation_conversations_are_deterministic_and_local():
    first = stdlib_conversations("validation", limit=40)
    assert first == stdlib_conversations("validation", limit=40) and len(first) == 40
    root = stdlib_root()
    validation_modules = {module_name(p.relative_to(root)) for p in corpus_files("validation")}
    for conversation in first:
        prompt = conversation[0]["content"]
        assert any(f"`{m}" in prompt for m in validation_modules), prompt
