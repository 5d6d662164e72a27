"""Self-distillation data: ShareGPT JSONL that data=sharegpt reads, batched == one by one, resumable, multi-turn."""

import json
from pathlib import Path

import pytest

from data.chat import encode_prompt
from data.curation import dedupe
from data.datasets import split_key
from data.readers import read_conversations
from inference.api import Engine
from inference.collect.self_distill import (
    SelfDistillConfig, answer_id, main, record_id, script_of, self_distill,
)
from inference.collect.shared import done_ids
from inference.engine.drafter import NoDrafter
from models.loading import load_target, load_tokenizer
from tests.model_support import save_tiny_model

USER_TURNS = ["hello world", "what is two plus three", "have a nice day", "the quick brown fox", "who are you",
              "translate to French", "describe a process"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("models") / "llama", seed=3)
    return path, Engine(load_target(str(path), dtype="fp32"), NoDrafter()), load_tokenizer(str(path))


def conversations() -> list[tuple[str, list[dict]]]:
    convs = [[{"role": "user", "content": u}, {"role": "assistant", "content": "old answer"}] for u in USER_TURNS[:5]]
    convs[1] = [{"role": "system", "content": "Be nice."}, *convs[1],  # two turns: the second sees the new first answer
                {"role": "user", "content": USER_TURNS[5]}, {"role": "assistant", "content": "old"}]
    convs[2] = [{"role": "user", "content": USER_TURNS[6]}]  # a trailing question gets an answer too
    return [(f"src.json:{i + 1}", c) for i, c in enumerate(convs)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_script_of():
    conv = [{"role": "assistant", "content": "orphan"}, {"role": "system", "content": "s"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "x"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "y"},
            {"role": "user", "content": "c"}]
    roles = lambda s: [(m["role"], m["content"]) for m in s]  # noqa: E731
    assert roles(script_of(conv)) == [("system", "s"), ("user", "a"), ("assistant", ""), ("user", "b"), ("assistant", ""),
                                      ("user", "c"), ("assistant", "")]
    assert roles(script_of(conv, max_turns=1)) == [("system", "s"), ("user", "a"), ("assistant", "")]
    assert record_id("/data/a/chats.json:17") == "chats.json:17" and record_id("org/ds:main[train]:3") == "ds:main[train]:3"


def test_batched_equals_one_by_one_and_reads_as_sharegpt(setup, tmp_path):
    path, engine, tokenizer = setup
    config = SelfDistillConfig(max_new_tokens=6, batch_size=3)
    stats = self_distill(engine, tokenizer, conversations(), tmp_path / "batched.jsonl", config)
    self_distill(engine, tokenizer, conversations(), tmp_path / "single.jsonl",
                 SelfDistillConfig(max_new_tokens=6, batch_size=1))
    batched, single = read_jsonl(tmp_path / "batched.jsonl"), read_jsonl(tmp_path / "single.jsonl")
    assert stats.written == len(batched) == 5
    assert stats.truncated_turns + sum(r["finish"].count("stop") for r in batched) == 6  # 6 answers in all
    assert sorted(batched, key=lambda r: r["id"]) == sorted(single, key=lambda r: r["id"])

    read = read_conversations(tmp_path / "batched.jsonl", "sharegpt")  # what data=sharegpt trains on
    assert len(read.conversations) == 5
    two_turns = next(r for r in batched if r["id"] == "src.json:2")
    assert [t["from"] for t in two_turns["conversations"]] == ["system", "human", "gpt", "human", "gpt"]
    assert all(t["value"] not in ("old", "old answer") for t in two_turns["conversations"])
    # The second answer is the model's greedy reply to the conversation holding its own first answer.
    history = [{"role": {"system": "system", "human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
               for t in two_turns["conversations"][:4]]
    tokens = engine.generate(encode_prompt(tokenizer, history), max_new_tokens=6).sequences[0]
    assert two_turns["conversations"][4]["value"] == tokenizer.decode(tokens, skip_special_tokens=True).strip()
    assert [t["from"] for t in next(r for r in batched if r["id"] == "src.json:3")["conversations"]] == ["human", "gpt"]


def test_batches_go_longest_prompt_first_and_progress_counts_every_token(setup, tmp_path):
    """Rows are batched by first-prompt length, longest first (ties in input order), so little padding; the
    progress callback hears of every generated token."""
    path, engine, tokenizer = setup
    convs = [(f"s:{i}", [{"role": "user", "content": u}]) for i, u in enumerate(USER_TURNS)]
    prompts = [encode_prompt(tokenizer, c) for _, c in convs]
    heard: list[int] = []
    stats = self_distill(engine, tokenizer, convs, tmp_path / "o.jsonl", SelfDistillConfig(max_new_tokens=5, batch_size=2),
                         progress=heard.append)
    order = sorted(range(len(convs)), key=lambda i: (-len(prompts[i]), i))
    written = [r["id"] for r in read_jsonl(tmp_path / "o.jsonl")]
    assert written == [f"s:{i}" for i in order if f"s:{i}" in written] and len(written) + stats.empty == len(convs)
    assert len({len(p) for p in prompts}) > 2  # the order above is not the input order by accident
    assert sum(heard) == sum(len(engine.generate(p, max_new_tokens=5).sequences[0]) for p in prompts)


def test_resume_skips_done_ids_and_cuts_a_torn_line(setup, tmp_path):
    path, engine, tokenizer = setup
    out = tmp_path / "out.jsonl"
    config = SelfDistillConfig(max_new_tokens=4, batch_size=2)
    self_distill(engine, tokenizer, conversations()[:2], out, config)
    with open(out, "a") as f:
        f.write('{"id": "src.json:3", "conversa')  # killed mid-write
    assert done_ids(out) == {"src.json:1", "src.json:2"}
    stats = self_distill(engine, tokenizer, conversations(), out, config)
    assert stats.already_done == 2 and stats.written == 3
    ids = [r["id"] for r in read_jsonl(out)]
    assert sorted(ids) == [f"src.json:{i}" for i in range(1, 6)]


def test_cli_writes_and_reports_bad_input_in_one_line(setup, tmp_path, capsys):
    path, _, _ = setup
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": u}, {"from": "gpt", "value": "x"}]})
                              for u in USER_TURNS[:3]) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["--model", str(path), "--data", str(data), "--output", str(out), "--max-new-tokens", "4", "--dtype", "fp32",
            "--device", "cpu"]
    assert main(args) == 0
    assert sorted(r["id"] for r in read_jsonl(out)) == ["in.jsonl:1", "in.jsonl:2", "in.jsonl:3"]
    assert "3 conversations written" in capsys.readouterr().out
    assert main([*args[:3], str(tmp_path / "missing.jsonl"), *args[4:]]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "missing.jsonl" in err[0]


def test_a_further_sampled_answer_stays_beside_the_first_in_one_split(setup, tmp_path, capsys):
    """--answer-index n writes ids "<id>_n": data.dedupe keeps both answers of a prompt, and the validation split
    sends both where the prompt goes. A further greedy answer (it would repeat the first) is refused in one line."""
    path, _, _ = setup
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": u}, {"from": "gpt", "value": "x"}]})
                              for u in USER_TURNS[:4]) + "\n")
    answers = tmp_path / "answers"
    args = ["--model", str(path), "--data", str(data), "--max-new-tokens", "6", "--dtype", "fp32", "--device", "cpu"]
    assert main([*args, "--output", str(answers / "greedy.jsonl")]) == 0
    assert main([*args, "--output", str(answers / "sampled.jsonl"), "--answer-index", "1", "--temperature", "1.0"]) == 0
    sampled = read_jsonl(answers / "sampled.jsonl")
    assert sorted(r["id"] for r in sampled) == [f"in.jsonl:{i}_1" for i in range(1, 5)]

    both = read_conversations(answers, "sharegpt")
    assert len(dedupe(both).conversations) == 8  # no answer of one prompt is taken for a repeat of another
    for i in range(1, 5):
        assert split_key(f"in.jsonl:{i}_1", 0) == split_key(f"in.jsonl:{i}", 1) == f"in.jsonl:{i}"
    assert answer_id("in.jsonl:3", 0) == "in.jsonl:3" and answer_id("in.jsonl:3", 2) == "in.jsonl:3_2"

    capsys.readouterr()
    refused = tmp_path / "refused.jsonl"
    assert main([*args, "--output", str(refused), "--answer-index", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--answer-index 1 needs --temperature > 0" in err[0] and not refused.exists()


def test_a_later_turn_too_long_ends_the_conversation_and_keeps_its_earlier_answers(setup, tmp_path):
    """max_prompt_tokens between the first and the second prompt of a two-turn conversation: it is written with its
    first answer (counted as shortened); a conversation whose first prompt is too long is not written at all."""
    path, engine, tokenizer = setup
    two_turns = conversations()[1]
    first_prompt = len(encode_prompt(tokenizer, two_turns[1][:2]))  # system + first user turn
    long_question = ("src.json:9", [{"role": "user", "content": " ".join(USER_TURNS * 3)}])
    stats = self_distill(engine, tokenizer, [two_turns, long_question], tmp_path / "o.jsonl",
                         SelfDistillConfig(max_new_tokens=4, batch_size=2, max_prompt_tokens=first_prompt))
    assert (stats.written, stats.shortened, stats.too_long) == (1, 1, 1)
    (record,) = read_jsonl(tmp_path / "o.jsonl")
    assert record["id"] == "src.json:2" and [t["from"] for t in record["conversations"]] == ["system", "human", "gpt"]
    assert len(record["finish"]) == 1


def test_the_recipe_keys_reach_each_answer_pass():
    """data.self_distill_turns / _answers / _temperature / _top_p as train.self_distill hands them to the tool."""
    from omegaconf import OmegaConf

    from train.self_distill import answer_passes

    cfg = OmegaConf.create({"seed": 5, "model": {"chat_template": None}, "data": {
        "self_distill_new_tokens": 8, "self_distill_batch_size": 2, "max_length": 64, "chat_template": None,
        "self_distill_turns": None, "self_distill_answers": 2, "self_distill_temperature": 0.9, "self_distill_top_p": 0.8}})
    (_, first, greedy), (_, second, sampled) = answer_passes(cfg, [("train:3", [{"role": "user", "content": "hi"}])])
    assert [i for i, _ in first] == ["train:3"] and [i for i, _ in second] == ["train:3_1"]
    assert (greedy.temperature, greedy.seed, greedy.max_turns, greedy.max_prompt_tokens) == (0.0, 5, None, 56)
    assert (sampled.temperature, sampled.top_p, sampled.seed) == (0.9, 0.8, 6)
