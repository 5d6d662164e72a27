"""build_datasets / load_conversations: splits, max_samples, packing, system prompts, errors naming file:record."""

import json
from dataclasses import replace

import pytest

from data.chat import IGNORE_INDEX, EncodedChat, encode_chat
from data.datasets import build_datasets, load_conversations, pack
from data.readers import DataError
from tests.data_support import DataCfg, FIXTURES, SHARED, SHAREGPT, tiny_tokenizer



@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _qa_file(tmp_path, n):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) + "\n" for i in range(n)))
    return str(path)


def test_sharegpt_samples_equal_encode_chat(tok):
    splits = build_datasets(SHAREGPT, tok)
    assert splits.validation is None  # validation_fraction=0 and no validation_path
    conversations = load_conversations(SHAREGPT, "train")
    assert len(splits.train) == len(conversations) == 3
    for i, conversation in enumerate(conversations):
        expected = encode_chat(tok, conversation, SHAREGPT.max_length)
        assert splits.train[i] == {"input_ids": expected.input_ids, "labels": expected.labels}


def test_hash_split_is_disjoint_complete_and_deterministic(tmp_path):
    cfg = DataCfg(format="gsm8k", path=_qa_file(tmp_path, 200), validation_fraction=0.25, seed=3)
    train, val = load_conversations(cfg, "train"), load_conversations(cfg, "validation")
    questions = lambda convs: {c[0]["content"] for c in convs}  # noqa: E731
    assert questions(train) | questions(val) == {f"q{i}" for i in range(200)}
    assert not questions(train) & questions(val)
    assert 19 <= len(val) <= 81  # Binomial(200, 0.25): mean 50, sd 6.1; a 5-sd band
    assert load_conversations(cfg, "validation") == val
    assert questions(load_conversations(replace(cfg, seed=4), "validation")) != questions(val)


def test_validation_path_and_max_samples(tmp_path, tok):
    cfg = DataCfg(format="gsm8k", path=_qa_file(tmp_path, 30), validation_path=str(FIXTURES / "gsm8k.jsonl"),
                  max_samples=5)
    train, val = load_conversations(cfg, "train"), load_conversations(cfg, "validation")
    assert [c[0]["content"] for c in train] == [f"q{i}" for i in range(5)]  # no hash split: all 30, first 5 kept
    assert [c[1]["content"] for c in val] == ["Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
                                               "<<48+24=72>>72 clips altogether in April and May.\n#### 72",
                                               "2 + 3 = <<2+3=5>>5\n#### 5"]
    splits = build_datasets(cfg, tok)
    assert (len(splits.train), len(splits.validation)) == (5, 2)


def test_packing_concatenates_samples_into_full_blocks(tok):
    plain = build_datasets(SHAREGPT, tok).train
    samples = [EncodedChat(**plain[i]) for i in range(len(plain))]
    blocks = pack(samples, 8)
    assert [t for b in blocks for t in b.input_ids] == [t for s in samples for t in s.input_ids]
    assert [t for b in blocks for t in b.labels] == [t for s in samples for t in s.labels]
    total = sum(len(s.input_ids) for s in samples)
    assert [len(b.input_ids) for b in blocks] == [8] * (len(blocks) - 1) + [total % 8 or 8]
    packed = build_datasets(replace(SHAREGPT, packing=True, max_length=8), tok).train
    kept = [b for b in blocks if b.num_trained]
    assert 0 < len(kept) < len(blocks)  # record 2's 29-token prompt fills blocks with no trained token
    assert [packed[i] for i in range(len(packed))] == [{"input_ids": b.input_ids, "labels": b.labels} for b in kept]


def test_system_prompt_only_where_missing():
    convs = load_conversations(replace(SHAREGPT, system_prompt="Be brief."), "train")
    assert [c[0] for c in convs] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer briefly."},
        {"role": "system", "content": "Be nice."},
    ]


def test_text_format_trains_every_token_without_template(tok):
    cfg = DataCfg(format="text", path=str(FIXTURES / "text.jsonl"), validation_fraction=0.0)
    first = build_datasets(cfg, tiny_tokenizer(chat_template=None)).train[0]
    assert tok.decode(first["input_ids"]) == "<s>The quick brown fox jumps over the lazy dog.</s>"
    assert first["labels"] == [IGNORE_INDEX, *first["input_ids"][1:]]


def test_template_rejections_name_the_record_or_are_skipped(tmp_path, tok):
    path = tmp_path / "chat.jsonl"
    ok = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    twice = {"conversations": [{"from": "human", "value": "hi"}, {"from": "human", "value": "hi"},
                               {"from": "gpt", "value": "hello"}]}
    path.write_text("\n".join(json.dumps(r) for r in (ok, twice, ok)) + "\n")
    cfg = DataCfg(format="sharegpt", path=str(path), validation_fraction=0.0, chat_template="llama-2-chat")
    with pytest.raises(DataError, match=rf"^{path}:2: chat template failed.*alternate"):
        build_datasets(cfg, tok)
    assert len(build_datasets(replace(cfg, on_error="skip"), tok).train) == 2


def test_samples_without_trained_tokens_are_dropped(tok):
    first_trained = [
        encode_chat(tok, c, 512).labels.index(next(y for y in encode_chat(tok, c, 512).labels if y != IGNORE_INDEX))
        for c in load_conversations(SHAREGPT, "train")
    ]
    assert first_trained[0] < 25 <= first_trained[1] and first_trained[2] < 25  # record 2 has a long prompt
    cut = build_datasets(replace(SHAREGPT, max_length=25), tok).train
    assert len(cut) == 2
    assert all(any(label != IGNORE_INDEX for label in cut[i]["labels"]) for i in range(len(cut)))
    with pytest.raises(DataError, match="no sample has a trained token"):
        build_datasets(replace(SHAREGPT, max_length=2), tok)


def test_config_errors_name_the_key(tok):
    with pytest.raises(DataError, match="data.path is required for data.format='sharegpt'"):
        build_datasets(replace(SHAREGPT, path=None), tok)
    with pytest.raises(DataError, match="data.chat_template: unknown chat template 'nope'"):
        build_datasets(replace(SHAREGPT, chat_template="nope"), tok)
    with pytest.raises(DataError, match="data.validation_fraction"):
        build_datasets(replace(SHAREGPT, validation_fraction=1.5), tok)
    with pytest.raises(DataError, match="data.on_error"):
        build_datasets(replace(SHAREGPT, on_error="ignore"), tok)
    with pytest.raises(DataError, match="data.max_samples must be >= 1"):
        build_datasets(replace(SHAREGPT, max_samples=0), tok)
    with pytest.raises(DataError, match="data.format: unknown format 'csv'"):
        build_datasets(replace(SHAREGPT, format="csv"), tok)


def test_builtin_corpus(tok):
    pytest.importorskip("data.stdlib_chat")
    cfg = DataCfg(max_samples=4)
    splits = build_datasets(cfg, tok)
    assert 0 < len(splits.train) <= 4 and splits.validation is not None
    assert all(any(label != IGNORE_INDEX for label in splits.train[i]["labels"]) for i in range(len(splits.train)))


def test_shared_gsm8k(tok):
    train, test = SHARED / "gsm8k" / "train.jsonl", SHARED / "gsm8k" / "test.jsonl"
    if not (train.exists() and test.exists()):
        pytest.skip("../shared/data/gsm8k absent")
    cfg = DataCfg(format="gsm8k", path=str(train), validation_path=str(test), max_samples=8, max_length=1024)
    splits = build_datasets(cfg, tok)
    assert (len(splits.train), len(splits.validation)) == (8, 8)
    sample = splits.train[0]
    trained = tok.decode([t for t, y in zip(sample["input_ids"], sample["labels"]) if y != IGNORE_INDEX])
    assert trained.endswith("#### 72<|end|>")


def test_label_counts_count_trained_labels_only():
    from data.datasets import label_counts

    dataset = [{"labels": [-100, 3, 3, 1]}, {"labels": [1, -100, 0]}]
    assert label_counts(dataset).tolist() == [1, 2, 0, 2]
