"""`python -m inference generate | bench | build-tree` end to end on a tiny random model and Medusa heads saved to disk,
plus the pure parts (text streaming, tree planning) against brute force; the summary's arithmetic is in
test_bench_stats.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.bench.prompt_sets import read_questions
from inference.bench.tree_fit import CostCurve, RankCounter, plan_tree
from inference.cli import UsageError, main
from inference.engine.drafter import NoDrafter
from inference.engine.loop import DecodeConfig, generate
from inference.engine.tree import expected_accept_length, load_tree
from inference.textstream import TextStream
from models.checkpoint import save_drafter
from models.medusa import MedusaConfig, MedusaHeads
from tests.data_support import FIXTURES, tiny_tokenizer
from tests.model_support import tiny_config

pytestmark = pytest.mark.usefixtures("single_thread")
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a poem about the sea.", "Now make it shorter."]},
    {"question_id": 2, "category": "math", "turns": ["What is 2 + 3?", "And times 4?"]},
    {"question_id": 3, "category": "writing", "turns": ["Describe a process of making crepes.", "Summarise it."]},
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    """A peaked tiny Llama (argmax gaps dwarf fp32 reordering) + 2 Medusa heads copied from its lm_head (so they are
    sometimes right when the model repeats itself) + a question file."""
    root = tmp_path_factory.mktemp("cli")
    tokenizer = tiny_tokenizer()
    config = tiny_config("llama", vocab_size=len(tokenizer), hidden_size=32)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    config.initializer_range = 0.2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=32, vocab_size=len(tokenizer)))
    heads.init_from_base(model.lm_head)
    metrics = {"eval_head1_top1": 0.4, "eval_head1_top5": 0.6, "eval_head2_top1": 0.2, "eval_head2_top5": 0.4}
    save_drafter(root / "ckpt", heads, str(root / "model"), tokenizer=tokenizer, extra={"metrics": metrics})
    questions = root / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return {"root": root, "model": root / "model", "ckpt": root / "ckpt", "questions": questions}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def generate_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, "generate", "--dtype", "fp32", "--json", *argv)
    assert code == 0, err
    return json.loads(out)


def test_generate_equals_plain_decoding_and_streams_the_same_text(assets, capsys):
    spec = generate_json(capsys, "--drafter", assets["ckpt"], "--prompt", "hello world", "--max-new-tokens", "24")
    plain = generate_json(capsys, "--base", assets["model"], "--prompt", "hello world", "--max-new-tokens", "24")
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 24
    assert spec["text"] == tiny_tokenizer().decode(spec["token_ids"], skip_special_tokens=True,
                                                   clean_up_tokenization_spaces=False)
    stats = spec["stats"]
    assert stats["new_tokens"] == 24 and stats["target_forwards"] == stats["steps"] + 1
    assert stats["tau"] == pytest.approx(24 / stats["target_forwards"]) and plain["stats"]["tau"] == 1.0
    assert set(stats["per_step_ms"]) == {"draft", "forward", "verify", "cache", "other"}
    code, out, err = run(capsys, "generate", "--drafter", assets["ckpt"], "--prompt", "hello world",
                         "--max-new-tokens", "24", "--dtype", "fp32")
    assert code == 0 and out == spec["text"] + "\n" and "target forwards" in err


def test_draft_model_with_a_stop_policy_from_the_cli(assets, capsys):
    """--draft-stop reaches the draft model (the model drafting for itself: every draft accepted until it stops);
    a learned stop on a draft model without a stopper is one line and exit code 2."""
    argv = ("--drafter", assets["model"], "--base", assets["model"], "--tree", "chain:3", "--prompt", "hello world",
            "--max-new-tokens", "24")
    plain = generate_json(capsys, "--base", assets["model"], "--prompt", "hello world", "--max-new-tokens", "24")
    fixed = generate_json(capsys, *argv, "--draft-stop", "fixed")
    stopped = generate_json(capsys, *argv, "--draft-stop", "confidence:1.0")  # stops after one draft every step
    assert fixed["token_ids"] == stopped["token_ids"] == plain["token_ids"]
    assert stopped["stats"]["steps"] == 12 and fixed["stats"]["steps"] == 6  # 23 tokens after prefill: 2 or 4 a step
    code, out, err = run(capsys, "generate", "--dtype", "fp32", *argv, "--draft-stop", "learned")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "has no stopper" in err


def test_stop_string_cuts_text_and_ids(assets, capsys):
    full = generate_json(capsys, "--drafter", assets["ckpt"], "--prompt", "hi", "--max-new-tokens", "32")
    tok = tiny_tokenizer()
    pieces = [tok.decode([t]) for t in full["token_ids"]]
    stop = next(p for p in pieces[4:] if p.isascii() and p.strip() and p.isprintable())
    cut = generate_json(capsys, "--drafter", assets["ckpt"], "--prompt", "hi", "--max-new-tokens", "32",
                        "--stop", stop)
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    ids = cut["token_ids"]
    assert ids == full["token_ids"][: len(ids)]
    assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])


def test_chat_turns_as_strings_equal_messages(assets, capsys):
    common = ("--base", assets["model"], "--max-new-tokens", "4")
    as_strings = generate_json(capsys, *common, "--chat", json.dumps(["hi", "hello", "bye"]))
    chat_file = assets["root"] / "chat.json"
    chat_file.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                     "content": "hello"}, {"role": "user", "content": "bye"}]}))
    as_file = generate_json(capsys, *common, "--chat", chat_file)
    assert as_strings["token_ids"] == as_file["token_ids"] and as_strings["prompt_tokens"] == as_file["prompt_tokens"]
    assert as_file["prompt_tokens"] > 10


def test_stream_returning_true_stops_the_row(tiny_lm):
    seen = []
    out = generate(tiny_lm, torch.tensor([[5, 6, 7]]), NoDrafter(), DecodeConfig(max_new_tokens=10),
                   stream=lambda row, toks: seen.extend(toks) or len(seen) >= 3)
    assert out.sequences[0] == seen and len(seen) == 3


def test_bench_end_to_end(assets, capsys, tmp_path):
    out_dir, plots = tmp_path / "out", tmp_path / "plots"
    code, out, err = run(capsys, "bench", "--drafter", assets["ckpt"], "--questions", assets["questions"],
                         "--turns", "all", "--max-new-tokens", "16", "--dtype", "fp32", "--out", out_dir,
                         "--plot", plots, "--model-id", "heads")
    assert code == 0, err
    assert "greedy outputs identical" in out
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["main"] == "drafter" and set(summary["methods"]) == {"drafter", "ar", "hf"}
    assert summary["greedy_check"]["identical"] is True and summary["greedy_check"]["compared_turns"] == 6
    assert summary["greedy_check"]["methods"]["drafter"]["identical"] == 6 and summary["config"]["fp64_reruns"] == 0
    assert summary["bandwidth"]["floor_ms"] > 0 and summary["bandwidth"]["ar_step_ms"] > 0
    assert summary["config"]["cpu_capability"] and set(summary["speedup_vs"]) == {"ar", "hf"}
    assert summary["methods"]["ar"]["tau"] == 1.0 and summary["tau"] >= 1.0
    assert summary["speedup_vs_ar"] > 0 and summary["speedup_vs_hf"] > 0 and summary["engine_efficiency"] > 0
    assert set(summary["categories"]) == {"writing", "math"} and summary["categories"]["writing"]["questions"] == 2
    for model_id in ("heads", "model-ar", "model-hf"):
        records = [json.loads(line) for line in (out_dir / f"{model_id}.jsonl").read_text().splitlines()]
        assert [r["question_id"] for r in records] == [1, 2, 3]
        for r in records:
            assert set(r) == {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
            choice = r["choices"][0]
            assert set(choice) == {"index", "turns", "new_tokens", "idxs", "wall_time", "accept_lengths"}
            assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) == 2
            assert len(choice["accept_lengths"]) == sum(choice["idxs"]) - 2  # one entry per step after prefill
            assert r["model_id"] == model_id
    tokens = sum(sum(json.loads(line)["choices"][0]["new_tokens"])
                 for line in (out_dir / "heads.jsonl").read_text().splitlines())
    assert tokens == summary["methods"]["drafter"]["new_tokens"]
    pytest.importorskip("matplotlib")
    assert {p.name for p in plots.iterdir()} == {"head_accuracy.png", "accept_hist.png", "bench_summary.png"}


def test_bench_plain_decoding_only(assets, capsys, tmp_path):
    code, out, err = run(capsys, "bench", "--base", assets["model"], "--questions", assets["questions"],
                         "--limit", "1", "--baselines", "ar", "--max-new-tokens", "4", "--out", tmp_path)
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["main"] == "ar" and summary["speedup_vs_ar"] is None and summary["speedup_vs"] == {}
    assert summary["greedy_check"]["methods"] == {} and summary["greedy_check"]["identical"] is None  # nothing to compare
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-ar.jsonl", "summary.json"]


def test_build_tree_round_trip(assets, capsys, tmp_path):
    tree_file = tmp_path / "tree.json"
    code, out, err = run(capsys, "build-tree", "--drafter", assets["ckpt"], "--data", "sharegpt", "--data-path",
                         FIXTURES / "sharegpt.json", "--split", "train", "--source", "greedy", "--greedy-tokens", "8",
                         "--max-nodes", "6", "--sizes", "1,3,6", "--reps", "1", "--context", "16", "--dtype", "fp32",
                         "--out", tree_file)
    assert code == 0, err
    written = json.loads(tree_file.read_text())
    assert "chosen tree" in out and written["num_nodes"] == len(written["choices"]) + 1 <= 6
    assert len(written["accuracy"]) == 2 and len(written["accuracy"][0]) == 10
    tree = load_tree(tree_file, num_heads=2, topk=10)
    assert [list(c) for c in tree.choices] == sorted(written["choices"], key=lambda p: (len(p), p))
    assert written["expected_tokens_per_step"] == pytest.approx(
        expected_accept_length(tree.choices, written["accuracy"]), rel=1e-4)
    args = ("--prompt", "hello", "--max-new-tokens", "12")
    plain = generate_json(capsys, "--base", assets["model"], *args)["token_ids"]
    assert generate_json(capsys, "--drafter", assets["ckpt"], "--tree", tree_file, *args)["token_ids"] == plain
    assert generate_json(capsys, "--drafter", assets["ckpt"], "--tree", tree_file, "--lookup", "5", *args)[
        "token_ids"] == plain  # the fitted tree with a prompt-lookup chain grafted on


@pytest.mark.parametrize("case", ["temperature", "tree", "drafter", "chat", "questions", "question_line", "source",
                                  "head_vocab", "head_vocab_type", "lookup", "lookup_type", "lookup_build_tree",
                                  "datastore", "datastore_line", "datastore_lookup", "datastore_grow",
                                  "datastore_grow_lookup", "datastore_grow_build_tree", "datastore_smoothing",
                                  "datastore_smoothing_alone", "datastore_request_weight",
                                  "datastore_request_weight_alone", "min_expected", "min_expected_alone",
                                  "node_cost", "node_cost_with_min_expected", "lookup_budget",
                                  "lookup_budget_alone", "lookup_budget_build_tree", "cache_slots_alone",
                                  "cache_slots_small", "cache_slots_request"])
def test_bad_input_is_one_line_and_writes_nothing(assets, capsys, tmp_path, case):
    bad_tree = tmp_path / "bad.json"
    bad_tree.write_text(json.dumps({"choices": [[0], [0, 0, 0]]}))
    bad_questions = tmp_path / "q.jsonl"
    bad_questions.write_text(json.dumps(QUESTIONS[0]) + "\n{\"question_id\": 2, \"turns\": []}\n")
    bad_store = tmp_path / "answers.jsonl"
    answer = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    bad_store.write_text(json.dumps(answer) + "\n[1,\n")  # line 2 does not parse
    gen = ("generate", "--drafter", assets["ckpt"], "--max-new-tokens", "2")
    argv, needle = {
        "temperature": ((*gen, "--prompt", "x", "--temperature", "-1"), "--temperature"),
        "tree": ((*gen, "--prompt", "x", "--tree", bad_tree), "bad.json: entry 1 [0, 0, 0]"),
        "drafter": (("generate", "--drafter", tmp_path / "nope", "--prompt", "x"), "nope"),
        "chat": ((*gen, "--chat", "[1, 2"), "not valid JSON"),
        "questions": (("bench", "--drafter", assets["ckpt"], "--questions", tmp_path / "missing.jsonl"), "missing"),
        "question_line": (("bench", "--drafter", assets["ckpt"], "--questions", bad_questions), "q.jsonl:2"),
        "source": (("build-tree", "--drafter", assets["ckpt"], "--source", "oracle"), "--source"),
        "head_vocab": ((*gen, "--prompt", "x", "--head-vocab", "8"), "token_counts.safetensors: missing"),
        "head_vocab_type": (("generate", "--drafter", "jacobi", "--base", assets["model"], "--prompt", "x",
                             "--head-vocab", "8"), "--head-vocab does not apply to drafter 'jacobi'; it applies to medusa"),
        "lookup": ((*gen, "--prompt", "x", "--lookup", "0"),
                   "--lookup must be a whole number of tokens in [1, 64], got 0"),
        "lookup_type": (("generate", "--drafter", "prompt_lookup", "--base", assets["model"], "--prompt", "x",
                         "--lookup", "4"), "--lookup does not apply to drafter 'prompt_lookup'; it applies to eagle3, "
                                           "medusa"),
        "lookup_build_tree": (("build-tree", "--drafter", assets["ckpt"], "--lookup", "4"),
                              "--lookup does not apply to build-tree"),
        "datastore": (("generate", "--drafter", "prompt_lookup", "--base", assets["model"], "--prompt", "x",
                       "--datastore", tmp_path / "none"), f"--datastore={tmp_path / 'none'}: no such file or folder"),
        "datastore_line": (("bench", "--drafter", "prompt_lookup", "--base", assets["model"], "--questions",
                            assets["questions"], "--datastore", bad_store), f"--datastore={bad_store}:2: "),
        "datastore_lookup": ((*gen, "--prompt", "x", "--datastore", bad_store),
                             "--datastore needs --lookup on drafter_type 'medusa'"),
        "datastore_grow": (("generate", "--drafter", "prompt_lookup", "--base", assets["model"], "--prompt", "x",
                            "--datastore-grow", "0"), "--datastore-grow must be a whole number of tokens >= 1"),
        "datastore_grow_lookup": ((*gen, "--prompt", "x", "--datastore-grow", "1000"),
                                  "--datastore-grow needs --lookup on drafter_type 'medusa'"),
        "datastore_grow_build_tree": (("build-tree", "--drafter", assets["ckpt"], "--datastore-grow", "1000"),
                                      "--datastore-grow does not apply to build-tree"),
        "datastore_smoothing": (("generate", "--drafter", "prompt_lookup", "--base", assets["model"], "--prompt", "x",
                                 "--datastore-grow", "100", "--datastore-smoothing", "kneser_ney"),
                                "--datastore-smoothing must be one of witten_bell, longest, got 'kneser_ney'"),
        "datastore_smoothing_alone": (("generate", "--drafter", "prompt_lookup", "--base", assets["model"], "--prompt",
                                       "x", "--datastore-smoothing", "longest"),
                                      "--datastore-smoothing applies with --datastore or --datastore-grow"),
        "datastore_request_weight": (("generate", "--drafter", "prompt_lookup", "--base", assets["model"], "--prompt",
                                      "x", "--datastore-grow", "100", "--datastore-request-weight", "-2"),
                                     "--datastore-request-weight must be a number >= 0"),
        "datastore_request_weight_alone": (("bench", "--drafter", "prompt_lookup", "--base", assets["model"],
                                            "--questions", assets["questions"], "--datastore-request-weight", "5"),
                                           "--datastore-request-weight applies with --datastore or --datastore-grow"),
        "min_expected": (("generate", "--drafter", "prompt_lookup", "--drafter-option", "min_expected=-1", "--base",
                          assets["model"], "--prompt", "x", "--datastore-grow", "100"),
                         "prompt_lookup: min_expected must be a number >= 0"),
        "min_expected_alone": (("bench", "--drafter", "prompt_lookup", "--drafter-option", "min_expected=1.5", "--base",
                                assets["model"], "--questions", assets["questions"]),
                               "prompt_lookup: min_expected needs a datastore (--datastore or --datastore-grow)"),
        "node_cost": (("generate", "--drafter", "prompt_lookup", "--drafter-option", "node_cost=x", "--base",
                       assets["model"], "--prompt", "x", "--datastore-grow", "100"), "node_cost"),
        "node_cost_with_min_expected": (("generate", "--drafter", "prompt_lookup", "--drafter-option", "node_cost=0.1",
                                         "--drafter-option", "min_expected=1", "--base", assets["model"], "--prompt",
                                         "x", "--datastore-grow", "100"), "min_expected and node_cost both decide"),
        "lookup_budget": ((*gen, "--prompt", "x", "--lookup", "4", "--datastore-grow", "100", "--lookup-budget", "0"),
                          "--lookup-budget must be a whole number of nodes in [1, 256], got 0"),
        "lookup_budget_alone": ((*gen, "--prompt", "x", "--lookup", "4", "--lookup-budget", "8"),
                                "--lookup-budget needs --lookup and --datastore"),
        "lookup_budget_build_tree": (("build-tree", "--drafter", assets["ckpt"], "--lookup-budget", "8"),
                                     "--lookup-budget does not apply to build-tree"),
        "cache_slots_alone": ((*gen, "--prompt", "x", "--cache-slots", "256"),
                              "--cache-slots sizes the static cache: add --compile or --static-cache"),
        "cache_slots_small": ((*gen, "--prompt", "x", "--static-cache", "--cache-slots", "64"),
                              "--cache-slots must be a whole number >= 128, got 64"),
        "cache_slots_request": (("generate", "--drafter", assets["ckpt"], "--max-new-tokens", "100", "--prompt", "x",
                                 "--static-cache", "--cache-slots", "128"),
                                "--cache-slots 128: 8 prompt token(s) + max_new_tokens=100 + 64 tree slots need 172"),
    }[case]
    try:
        code = main([str(a) for a in (*argv, *(() if argv[0] == "generate" else ("--out", tmp_path / "out")))])
    except SystemExit as e:  # argparse's own checks
        code = e.code
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "Loading weights" not in ln]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["tree_file", "tree_spec", "device", "device_name", "chat_template",
                                  "chat_template_file", "chat_file", "other_base"])
def test_refused_before_any_model_loads(assets, capsys, tmp_path, monkeypatch, case):
    """What a checkpoint's config.json, the base's config.json and the arguments alone can refuse is refused before
    the target's weights load (a 7B load takes minutes): load_target is made to fail the test if it is reached."""
    def reached(*args, **kwargs):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr("inference.api.load_target", reached)
    bad_tree = tmp_path / "bad.json"
    bad_tree.write_text(json.dumps({"choices": [[0], [0, 0, 0]]}))
    wide = tmp_path / "wide"  # heads trained for a base twice as wide as assets["model"]
    tokenizer = tiny_tokenizer()
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=64, vocab_size=len(tokenizer)))
    save_drafter(wide, heads, str(assets["model"]), tokenizer=tokenizer)
    gen = ("generate", "--drafter", assets["ckpt"], "--max-new-tokens", "2", "--prompt", "x")
    argv, needle = {
        "tree_file": ((*gen, "--tree", bad_tree), "bad.json: entry 1 [0, 0, 0]"),
        "tree_spec": ((*gen, "--tree", "chain:x"), "tree 'chain:x': expected 'chain' or 'chain:<depth>'"),
        "device": ((*gen, "--device", "cuda:7"), "device 'cuda:7': "),
        "device_name": ((*gen, "--device", "banana"), "device 'banana': not a device"),
        "chat_template": ((*gen, "--chat-template", "nosuch"), "unknown chat template 'nosuch'"),
        "chat_template_file": ((*gen, "--chat-template", tmp_path / "t.jinja"),
                               f"chat template {tmp_path / 't.jinja'}: no such file"),
        "chat_file": (("generate", "--drafter", assets["ckpt"], "--chat", tmp_path / "chat.json"),
                      f"--chat {tmp_path / 'chat.json'}: no such file"),
        "other_base": (("generate", "--drafter", wide, "--prompt", "x"), "drafter hidden_size=64 does not match"),
    }[case]
    code = main([str(a) for a in argv])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_chat_template_from_a_file_renders_like_the_same_text(assets, capsys, tmp_path):
    """--chat-template takes a .jinja file (as vLLM's does): the prompt it renders is the one the same Jinja text
    renders."""
    jinja = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    path = tmp_path / "chat.jinja"
    path.write_text(jinja)
    common = ("--base", assets["model"], "--prompt", "hello", "--max-new-tokens", "4")
    from_file = generate_json(capsys, *common, "--chat-template", path)
    as_text = generate_json(capsys, *common, "--chat-template", jinja)
    assert from_file["token_ids"] == as_text["token_ids"] and from_file["prompt_tokens"] == as_text["prompt_tokens"]


def test_text_stream_holds_back_partial_stop_strings():
    tok = tiny_tokenizer()
    ids = tok("hello world, hello there! Have a nice day.", add_special_tokens=False)["input_ids"]
    written = []
    stream = TextStream(tok, ["there!"], written.append)
    stopped_at = next(i for i in range(len(ids)) if stream(0, ids[i : i + 1]))
    text, kept = stream.finish(ids[: stopped_at + 1])
    assert text == "hello world, hello " and "".join(written) == text
    assert "there!" in tok.decode(kept) and "there!" not in tok.decode(kept[:-1])


def test_read_questions_names_the_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(QUESTIONS[0]) + "\n\nnot json\n")
    with pytest.raises(UsageError, match=r"q\.jsonl:3: not valid JSON"):
        read_questions(path)
    path.write_text(json.dumps(QUESTIONS[1]) + "\n")
    assert read_questions(path)[0].turns == tuple(QUESTIONS[1]["turns"])


def test_input_files_with_a_byte_order_mark_and_crlf_read_like_plain_utf8(tmp_path):
    from inference.cli import read_chat
    from inference.engine.tree import read_tree_file
    from models.loading import resolve_device_map

    def windows(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode("utf-8"))
        return path

    questions = windows("q.jsonl", "\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    assert [q.turns for q in read_questions(questions)] == [tuple(q["turns"]) for q in QUESTIONS]
    assert read_tree_file(windows("tree.json", '{"choices": [\n  [0],\n  [0, 0]\n]}\n')) == [[0], [0, 0]]
    assert resolve_device_map(str(windows("map.json", '{\n  "": "cpu"\n}\n'))) == {"": "cpu"}
    assert read_chat(str(windows("chat.json", '["hi",\n "hello"]\n')))[0] == {"role": "user", "content": "hi"}


def test_rank_counter_equals_brute_force():
    torch.manual_seed(0)
    logits, targets = torch.randn(50, 12), torch.randint(12, (50,))
    targets[::7] = -100
    counter = RankCounter(num_heads=1, topk=4)
    counter.add(0, logits, targets)
    scored = [(row, t) for row, t in zip(logits.tolist(), targets.tolist()) if t != -100]
    for r in range(4):
        brute = sum(sorted(range(12), key=lambda v: -row[v])[r] == t for row, t in scored) / len(scored)
        assert counter.accuracy()[0][r] == pytest.approx(brute)


def test_cost_curve_and_tree_plan():
    curve = CostCurve((1, 4, 16), (1.0, 1.0, 4.0))
    assert curve(2) == 1.0 and curve(10) == pytest.approx(2.5) and curve(32) == pytest.approx(8.0)
    noisy = CostCurve((1, 2, 4, 8), (3.0, 1.0, 2.0, 5.0)).monotone()
    assert noisy.seconds == (2.0, 2.0, 2.0, 5.0) and curve.monotone() == curve
    accuracy = [[0.7, 0.2, 0.05], [0.6, 0.2, 0.05]]
    flat = plan_tree(accuracy, CostCurve((1, 64), (1.0, 1.0)), (0.0, 0.0), max_nodes=8)
    steep = plan_tree(accuracy, CostCurve((1, 2), (1.0, 2.0)), (0.0, 0.0), max_nodes=8)
    assert flat.num_nodes == 8 and steep.num_nodes < flat.num_nodes
    assert flat.predicted_speedup == pytest.approx(flat.expected_tokens)  # step cost = plain step
    costly_heads = plan_tree(accuracy, CostCurve((1, 64), (1.0, 1.0)), (0.05, 10.0), max_nodes=8)
    assert costly_heads.depth == 1 and math.isclose(costly_heads.step_seconds, 1.05)


def test_model_settings_read_conf_model_files_global_or_not():
    from models.refs import BuiltinRef, HubRef, LocalRef, ModelSettings, model_settings

    # tiny.yaml is a global package (model keys under `model`); tiny-draft.yaml and vicuna7b.yaml are plain.
    assert model_settings("tiny") == ModelSettings(BuiltinRef("tiny"), "fp32", None)
    assert model_settings("builtin:tiny") == model_settings("tiny")
    assert model_settings("builtin:tiny-draft").path == "builtin:tiny-draft"
    vicuna = model_settings("vicuna7b")
    assert vicuna.path == "lmsys/vicuna-7b-v1.3" and vicuna.chat_template == "vicuna_v1.1"
    assert model_settings("/models/x") == ModelSettings(LocalRef("/models/x"))
    assert model_settings("org/model") == ModelSettings(HubRef("org/model"))


def test_build_tree_for_an_eagle3_checkpoint(assets, capsys, tmp_path):
    """build-tree on an EAGLE-3 checkpoint: accuracy from its stored acceptance table, its drafting timed per depth;
    the fitted tree serves and greedy output equals plain decoding."""
    from models.eagle3 import Eagle3Config, Eagle3Draft, save_eagle3, target_text_config

    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    text = target_text_config(model)
    acceptance = [[0.6, 0.2] + [0.01] * 8, [0.5, 0.1] + [0.0] * 8, [0.4, 0.1] + [0.0] * 8]
    draft = Eagle3Draft(Eagle3Config(target=text, layers=(1, 2), draft_vocab_size=text["vocab_size"],
                                     acceptance=acceptance))
    with torch.no_grad():
        draft.lm_head.weight.copy_(model.lm_head.weight)
    ckpt = save_eagle3(tmp_path / "eagle3", draft, str(assets["model"]), tokenizer=tiny_tokenizer())
    tree_file = tmp_path / "tree.json"
    code, out, err = run(capsys, "build-tree", "--drafter", ckpt, "--max-nodes", "6", "--sizes", "1,3,6", "--reps",
                         "1", "--context", "16", "--dtype", "fp32", "--out", tree_file)
    assert code == 0, err
    written = json.loads(tree_file.read_text())
    assert written["accuracy"] == acceptance and len(written["head_ms"]) == 3
    assert written["source"] == "the checkpoint's training evaluation"
    args = ("--prompt", "hello", "--max-new-tokens", "12")
    assert generate_json(capsys, "--drafter", ckpt, "--tree", tree_file, *args)["token_ids"] == \
        generate_json(capsys, "--base", assets["model"], *args)["token_ids"]
