"""Readers: every format on tiny fixture files, per-record errors naming file:record, on_error=skip counts."""

import json
import logging

import pytest

from data.readers import DataError, missing_source, read_conversations
from tests.data_support import FIXTURES, SHARED


U, A, S = "user", "assistant", "system"


def _msgs(*pairs):
    return [{"role": role, "content": content} for role, content in pairs]


def test_sharegpt_json_list_normalises_roles_system_and_leading_reply():
    result = read_conversations(FIXTURES / "sharegpt.json", "sharegpt")
    assert result.skipped == 0
    assert result.sources == [f"{FIXTURES / 'sharegpt.json'}:{i}" for i in (1, 2, 3)]
    assert result.conversations == [
        _msgs((U, "Who are you?"), (A, "I am a helpful assistant."), (U, "Have a nice day!"), (A, "You too!")),
        _msgs((S, "Answer briefly."), (U, "What is 2 + 3?"), (A, "The answer is 5.")),
        _msgs((S, "Be nice."), (U, "hello there"), (A, "hello world")),
    ]


def test_sharegpt_jsonl_numbers_records_by_line():
    result = read_conversations(FIXTURES / "sharegpt.jsonl", "sharegpt")
    assert [s.rsplit(":", 1)[1] for s in result.sources] == ["1", "3"]  # line 2 is blank
    assert result.conversations[1] == _msgs((U, "Translate to French: hello"), (A, "bonjour"))


@pytest.mark.parametrize("name", ["sharegpt.json", "sharegpt.jsonl"])
def test_byte_order_mark_and_crlf_line_ends_read_like_plain_utf8(tmp_path, name):
    """Windows editors save UTF-8 with a BOM and CRLF line ends: the same records, numbered the same way."""
    plain = read_conversations(FIXTURES / name, "sharegpt")
    text = (FIXTURES / name).read_text(encoding="utf-8")
    assert not text.startswith("\ufeff") and "\r" not in text
    windows = tmp_path / name
    windows.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode("utf-8"))
    result = read_conversations(windows, "sharegpt")
    assert result.conversations == plain.conversations and result.skipped == 0
    assert [s.rsplit(":", 1)[1] for s in result.sources] == [s.rsplit(":", 1)[1] for s in plain.sources]
    assert not any("\r" in m["content"] or "\ufeff" in m["content"] for c in result.conversations for m in c)


def test_byte_order_mark_does_not_hide_a_bad_first_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'\xef\xbb\xbf{"conversations": [}\r\n')
    # column 20 is the "}" counted from the first character after the mark
    with pytest.raises(DataError, match=rf"^{bad}:1: malformed JSON line: Expecting value \(column 20\)$"):
        read_conversations(bad, "sharegpt")


def test_directory_reads_json_files_in_name_order(tmp_path):
    (tmp_path / "b.jsonl").write_bytes((FIXTURES / "sharegpt.jsonl").read_bytes())
    (tmp_path / "a.json").write_bytes((FIXTURES / "sharegpt.json").read_bytes())
    (tmp_path / "notes.txt").write_text("ignored")
    result = read_conversations(tmp_path, "sharegpt")
    assert len(result.conversations) == 3 + 2
    assert result.sources[0] == f"{tmp_path / 'a.json'}:1" and result.sources[-1] == f"{tmp_path / 'b.jsonl'}:3"


def test_alpaca_joins_input_and_keeps_system_and_history():
    result = read_conversations(FIXTURES / "alpaca.json", "alpaca")
    assert result.conversations == [
        _msgs((U, "Describe a process of making crepes."), (A, "Mix the batter, heat the pan, cook each side.")),
        _msgs((U, "Translate to French:\nhello"), (A, "bonjour")),
        _msgs((S, "Be nice."), (U, "Who are you?"), (A, "I am a helpful assistant."), (U, "And now?"),
              (A, "Have a nice day.")),
    ]


def test_gsm8k_keeps_answer_verbatim():
    result = read_conversations(FIXTURES / "gsm8k.jsonl", "gsm8k")
    assert result.conversations[1] == _msgs((U, "What is 2 + 3?"), (A, "2 + 3 = <<2+3=5>>5\n#### 5"))


def test_text_is_one_assistant_turn_with_custom_field(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"body": "hello world"}\n{"body": "bonjour"}\n')
    result = read_conversations(path, "text", text_field="body")
    assert result.conversations == [_msgs((A, "hello world")), _msgs((A, "bonjour"))]


def test_saved_hf_dataset_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"question": "q1", "answer": "a1"}, {"question": "q2", "answer": "a2"}]).save_to_disk(
        str(tmp_path / "ds")
    )
    result = read_conversations(tmp_path / "ds", "gsm8k")
    assert result.conversations[1] == _msgs((U, "q2"), (A, "a2"))
    assert result.sources[1] == f"{tmp_path / 'ds'}[train]:2"


GOOD = '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}'
BAD_LINES = {
    "malformed JSON line": '{"conversations": [',
    "unknown role 'robot'": '{"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]}',
    "missing field 'conversations' or 'messages'": '{"id": 3}',
    "turn 1: missing field 'value' or 'content'": '{"conversations": [{"from": "human"}]}',
    "turn 2: empty assistant turn":
        '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": " "}]}',
    "content must be a string, got int": '{"conversations": [{"from": "human", "value": 7}]}',
    "no assistant turn": '{"conversations": [{"from": "human", "value": "hi"}]}',
}


@pytest.mark.parametrize("reason", list(BAD_LINES))
def test_bad_record_raises_with_file_and_line(tmp_path, reason):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join([GOOD, GOOD, BAD_LINES[reason], GOOD]) + "\n")
    with pytest.raises(DataError) as err:
        read_conversations(path, "sharegpt")
    assert str(err.value).startswith(f"{path}:3: ")
    assert reason in str(err.value)


def test_non_utf8_bytes_reported_per_record(tmp_path):
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_bytes(GOOD.encode() + b"\n" + GOOD.replace("hello", "h\xffllo").encode("latin-1") + b"\n")
    with pytest.raises(DataError, match=rf"^{jsonl}:2: non-UTF-8 bytes"):
        read_conversations(jsonl, "sharegpt")
    json_list = tmp_path / "chat.json"
    json_list.write_bytes(b"[" + GOOD.encode() + b",\n" + GOOD.replace("hi", "h\xe9").encode("latin-1") + b"]")
    with pytest.raises(DataError, match=rf"^{json_list}:2: non-UTF-8 bytes"):
        read_conversations(json_list, "sharegpt")


def test_skip_counts_bad_records_and_logs_one_line(tmp_path, caplog):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join([GOOD, *BAD_LINES.values(), GOOD]) + "\n")
    with caplog.at_level(logging.WARNING, logger="data.readers"):
        result = read_conversations(path, "sharegpt", on_error="skip")
    assert len(result.conversations) == 2 and result.skipped == len(BAD_LINES)
    assert result.first_error.startswith(f"{path}:2: malformed JSON line")
    assert [r.getMessage() for r in caplog.records] == [
        f"skipped {len(BAD_LINES)} bad records in {path} (first: {result.first_error})"
    ]


def test_alpaca_and_gsm8k_missing_fields(tmp_path):
    alpaca = tmp_path / "a.json"
    alpaca.write_text(json.dumps([{"instruction": "x", "output": "y"}, {"instruction": "x"}]))
    with pytest.raises(DataError, match=rf"^{alpaca}:2: missing field 'output'"):
        read_conversations(alpaca, "alpaca")
    gsm = tmp_path / "g.jsonl"
    gsm.write_text('{"question": "q", "answer": ""}\n')
    with pytest.raises(DataError, match=rf"^{gsm}:1: turn 2: empty assistant turn"):
        read_conversations(gsm, "gsm8k")


def test_empty_and_all_bad_and_missing_sources_name_the_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=rf"^{empty}: empty dataset"):
        read_conversations(empty, "sharegpt")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    with pytest.raises(DataError, match=rf"^{bad}: no usable records \(1 bad records skipped"):
        read_conversations(bad, "sharegpt", on_error="skip")
    with pytest.raises(DataError, match=r"no_such\.json: no such file or directory"):
        read_conversations(tmp_path / "no_such.json", "sharegpt")
    broken = tmp_path / "broken.json"
    broken.write_text('[\n{"a": 1},\n{"a": \n')
    with pytest.raises(DataError, match=rf"^{broken}:\d+: malformed JSON"):
        read_conversations(broken, "sharegpt", on_error="skip")


def test_missing_source_tells_a_missing_file_from_a_named_source_or_a_hub_id(tmp_path):
    """What training refuses before anything loads (train.checks.check_data_sources) is what reading would refuse:
    a path that is not there; a named source and a hub dataset id pass, to be read (and checked) later."""
    present = tmp_path / "chats.json"
    present.write_text("[]")
    missing = [tmp_path / "nope.json", "nope.jsonl", "./no-such-folder", "~/no/such/dir", "a/b/c"]
    passing = [present, tmp_path, "sharegpt_v3", "org/dataset", "dataset"]
    assert [p for p in missing if not missing_source(p)] == []
    assert [p for p in passing if missing_source(p)] == []
    for path in missing:
        with pytest.raises(DataError, match="no such file or directory"):
            read_conversations(path, "sharegpt")


def test_shared_sharegpt_and_gsm8k_files_read_cleanly():
    dummy = SHARED / "fastchat_dummy_conversation" / "dummy_conversation.json"
    gsm8k = SHARED / "gsm8k" / "test.jsonl"
    if not (dummy.exists() and gsm8k.exists()):
        pytest.skip("../shared/data absent")
    chats = read_conversations(dummy, "sharegpt")
    assert len(chats.conversations) == 500 and chats.skipped == 0
    assert read_conversations(gsm8k, "gsm8k").conversations[0][1]["content"].rsplit("#### ", 1)[1].strip().isdigit()


def test_jsonl_lines_split_only_on_newline(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "one\u2028still one\u0085"}\r\n{"text": "two"}\n', encoding="utf-8", newline="")
    result = read_conversations(path, "text")
    assert [c[0]["content"] for c in result.conversations] == ["one\u2028still one\u0085", "two"]
    assert result.sources == [f"{path}:1", f"{path}:2"]
