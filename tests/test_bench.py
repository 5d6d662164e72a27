"""`python -m inference bench` additions: named prompt sets, the HF speculative baselines (prompt lookup, assisted
generation), greedy identity judged by a float64 rerun (inference.bench.greedy_ties); the bookkeeping without a model
(depth acceptance, the bandwidth floor, progress lines) is in test_bench_stats.py."""

from __future__ import annotations

import argparse
import importlib.util
import copy
import gzip
import json
from pathlib import Path

import pytest
import torch

from inference.api import Engine
from inference.bench.greedy_ties import Fp64Judge, TieVerdict
from inference.bench.methods import EngineRunner, ForwardCounter, HFRunner, Sampling, assisted_settings, pld_defaults
from inference.bench.prompt_sets import DATA_ENV, HUMANEVAL_TURN, load_questions
from inference.bench.run import add_bench_args, answer, command_line
from inference.bench.stats import SHOWN_DIVERGENCES, Answer, TurnResult, format_table, greedy_check, summarize
from inference.cli import UsageError, main
from inference.drafters.prompt_lookup import PromptLookupDrafter
from inference.engine.drafter import NoDrafter
from tests.model_support import save_tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")
GREEDY = Sampling(0.0, 0, 1.0, "exact")
MT_BENCH = [{"question_id": 81 + i, "category": c, "turns": [f"{c} question {i}", "follow-up"]}
            for i, c in enumerate(["writing", "roleplay", "math"])]
GSM8K = [{"question": f"Natalia sold {n} clips. How many?", "answer": f"#### {n}"} for n in (48, 12, 7)]
HUMANEVAL = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
              "canonical_solution": f"    return x + {i}\n", "test": "", "entry_point": f"f{i}"} for i in range(2)]


@pytest.fixture
def data_dir(tmp_path, monkeypatch) -> Path:
    """A $DRAFTSMITH_DATA folder with the three sets in their upstream formats (humaneval gzipped)."""
    (tmp_path / "mt_bench").mkdir()
    (tmp_path / "mt_bench" / "question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MT_BENCH))
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    (tmp_path / "humaneval").mkdir()
    with gzip.open(tmp_path / "humaneval" / "HumanEval.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in HUMANEVAL))
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    return tmp_path


# --- prompt sets

def test_prompt_sets_take_the_first_n_of_each(data_dir):
    questions, taken = load_questions("mt_bench,gsm8k:2,humaneval:1")
    assert taken == {"mt_bench": 3, "gsm8k": 2, "humaneval": 1}
    assert [q.question_id for q in questions] == [81, 82, 83, "gsm8k/0", "gsm8k/1", "HumanEval/0"]
    assert [q.category for q in questions] == ["writing", "roleplay", "math", "gsm8k", "gsm8k", "humaneval"]
    assert questions[0].turns == ("writing question 0", "follow-up")
    assert questions[4].turns == (GSM8K[1]["question"],)
    assert questions[5].turns == ("Complete the following Python function:\n```python\n"
                                  "def f0(x):\n    \"\"\"Return x + 0.\"\"\"\n```",)
    assert questions[5].turns[0] == HUMANEVAL_TURN.format(prompt=HUMANEVAL[0]["prompt"])
    assert load_questions("gsm8k")[1] == {"gsm8k": 3}
    file_questions, none = load_questions(str(data_dir / "mt_bench" / "question.jsonl"))
    assert none is None and file_questions == questions[:3]


def test_self_instruct_turns_join_the_instruction_and_its_input(data_dir):
    (data_dir / "self_instruct_seed").mkdir()
    records = [{"id": "user_oriented_task_0", "instruction": "Fix the grammar.", "instances": [{"input": "me go",
                                                                                               "output": "I go"}]},
               {"id": "user_oriented_task_1", "instruction": "Name a colour.",
                "instances": [{"input": " ", "output": "red"}]},
               {"id": "user_oriented_task_2", "instruction": "", "instances": []},
               {"id": "user_oriented_task_3", "instruction": "Go.", "instances": {"input": "x"}}]
    path = data_dir / "self_instruct_seed" / "user_oriented_instructions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    questions, taken = load_questions("self_instruct")
    assert taken == {"self_instruct": 2}
    assert [q.turns for q in questions] == [("Fix the grammar.\n\nme go",), ("Name a colour.",)]
    assert [q.question_id for q in questions] == ["user_oriented_task_0", "user_oriented_task_1"]
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    with pytest.raises(UsageError, match=r"user_oriented_instructions\.jsonl:3: expected an object with a non-empty "
                                         r"string 'instruction'"):
        load_questions("self_instruct")
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:2] + records[3:]))
    with pytest.raises(UsageError, match=r"jsonl:3: 'instances' must be a list of objects whose 'input' is a string"):
        load_questions("self_instruct")


def test_spread_takes_evenly_spaced_questions(data_dir):
    questions, taken = load_questions("mt_bench:2:spread,gsm8k:3:spread,humaneval:1")
    assert [q.question_id for q in questions] == [81, 82, "gsm8k/0", "gsm8k/1", "gsm8k/2", "HumanEval/0"]
    assert taken == {"mt_bench": 2, "gsm8k": 3, "humaneval": 1}
    three = load_questions("mt_bench:3:spread")[0]
    assert [q.category for q in three] == ["writing", "roleplay", "math"]
    one = load_questions("gsm8k:1:spread")[0]
    assert [q.question_id for q in one] == ["gsm8k/0"]


@pytest.mark.parametrize("spec, needle", [
    ("mt_bnch,gsm8k", "unknown prompt set 'mt_bnch'"),
    ("gsm8k:2:every", "'gsm8k:2:every': after the count only ':spread' may follow"),
    ("gsm8k:2:", "'gsm8k:2:': after the count only ':spread' may follow"),
    ("gsm8k::spread", "'gsm8k::spread': the count after ':' must be a positive integer"),
    ("gsm8k:0", "'gsm8k:0': the count after ':' must be a positive integer"),
    ("gsm8k:x", "'gsm8k:x': the count"),
    ("gsm8k,gsm8k:2", "'gsm8k' is named twice"),
    ("gsm8k:4", "gsm8k:4: {data}/gsm8k/test.jsonl has only 3 questions"),
    ("humaneval", "--questions humaneval: {data}/humaneval/HumanEval.jsonl.gz not found (set DRAFTSMITH_DATA"),
    ("gsm8k", "{data}/gsm8k/test.jsonl:2: expected an object with a non-empty string 'question'"),
    ("humaneval:1", "HumanEval.jsonl.gz: not a readable gzip file"),
    ("missing.jsonl", "missing.jsonl: question file not found"),
])
def test_prompt_set_errors_are_one_line_naming_the_set_or_file(data_dir, spec, needle):
    if spec == "humaneval":
        (data_dir / "humaneval" / "HumanEval.jsonl.gz").unlink()
    elif spec == "gsm8k":
        (data_dir / "gsm8k" / "test.jsonl").write_text(json.dumps(GSM8K[0]) + "\n{\"answer\": \"#### 1\"}\n")
    elif spec == "humaneval:1":
        (data_dir / "humaneval" / "HumanEval.jsonl.gz").write_text("plain text, not gzip\n")
    with pytest.raises(UsageError) as info:
        load_questions(spec)
    assert needle.format(data=data_dir) in str(info.value) and "\n" not in str(info.value)


# --- HF baselines

@pytest.fixture(scope="module")
def target(tiny_lm_factory) -> torch.nn.Module:
    return tiny_lm_factory("llama", seed=0)


def hf_run(model, prompt, n, **extra) -> TurnResult:
    return HFRunner(model, [2], 0, GREEDY, extra)(prompt, n, seed=0)


PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 10, 11]


def test_hf_prompt_lookup_and_assisted_equal_plain_greedy(target, tiny_lm_factory):
    """Same greedy tokens as plain HF generate and our loop; the forward hook counts fewer target forwards where
    drafts are accepted (the tiny model falls into a loop that prompt lookup copies; a copy of the target as its own
    assistant is always right: with the confidence stop off, 40 tokens take ceil(40 / (20 + 1)) = 2 forwards)."""
    plain = hf_run(target, PROMPT, 40)
    ours = EngineRunner(Engine(target, NoDrafter()), GREEDY)(PROMPT, 40, seed=0)
    assert ours.tokens == plain.tokens and plain.target_forwards == len(plain.tokens) == 40
    tokens, ngram = pld_defaults(NoDrafter())
    pld = hf_run(target, PROMPT, 40, prompt_lookup_num_tokens=tokens, max_matching_ngram_size=ngram)
    assisted = hf_run(target, PROMPT, 40, assistant_model=tiny_lm_factory("llama", seed=1))
    self_draft = copy.deepcopy(target)
    self_draft.generation_config.assistant_confidence_threshold = 0.0  # this tiny model is never 40 % sure
    self_assisted = hf_run(target, PROMPT, 40, assistant_model=self_draft)
    for result in (pld, assisted, self_assisted):
        assert result.tokens == plain.tokens and result.accepted == ()
    assert pld.target_forwards < 40 and assisted.target_forwards <= 40 and self_assisted.target_forwards == 2


def test_forward_counter_counts_and_removes_its_hook(target):
    with ForwardCounter(target) as counter:
        target(input_ids=torch.tensor([[5, 6]]))
        target(input_ids=torch.tensor([[7]]))
    target(input_ids=torch.tensor([[8]]))
    assert counter.count == 2 and not target._forward_hooks


def test_baseline_settings(target):
    assert pld_defaults(PromptLookupDrafter(max_ngram=4, num_draft=5)) == (5, 4)
    assert pld_defaults(NoDrafter()) == (PromptLookupDrafter().num_draft, PromptLookupDrafter().max_ngram)
    settings = assisted_settings(target)  # transformers 5 defaults, applied at generate time
    assert settings["num_assistant_tokens"] == 20 and settings["num_assistant_tokens_schedule"] == "constant"
    assert settings["assistant_confidence_threshold"] == 0.4
    assert target.generation_config.num_assistant_tokens is None  # read, not set


# --- greedy identity with near-ties

class ChangedToken:
    """A stub method: `runner`'s tokens with the one at `position` replaced by `pick(fp32 logits there, token)`."""

    def __init__(self, runner, model, position, pick):
        self.runner, self.model, self.position, self.pick = runner, model, position, pick

    def __call__(self, prompt, max_new_tokens, seed):
        result = self.runner(prompt, max_new_tokens, seed)
        k = self.position
        logits = self.model(input_ids=torch.tensor([prompt + list(result.tokens[:k])])).logits[0, -1]
        tokens = result.tokens[:k] + (int(self.pick(logits, result.tokens[k])),)
        return TurnResult(tokens, "", result.wall_time, len(tokens), (), None)


def run_methods(runners: dict, prompt: list[int], n: int = 12) -> dict[str, list[Answer]]:
    from inference.bench.prompt_sets import Question

    question = Question(1, "a", ("hi",))
    return {name: [answer(r, question, 1, lambda m: prompt, lambda ids: "", n, 0)] for name, r in runners.items()}


def worst(logits, token):
    return logits.argmin()


def test_near_tie_and_mismatch_judged_by_float64_rerun(target):
    """A copy of the target whose lm_head row b equals row a ties the two tokens' logits at every position: a method
    that swaps the reference's a for b (or b for a) parts at a near tie; one that takes the worst token parts for
    real. One float64 copy serves both reruns."""
    greedy = EngineRunner(Engine(target, NoDrafter()), GREEDY)(PROMPT, 12, seed=0).tokens
    a = greedy[3]
    k = greedy.index(a)  # the first time the target picks a; the twin b is never its pick in this output
    b = next(t for t in range(target.config.vocab_size) if t not in greedy)
    twin = copy.deepcopy(target)
    twin.lm_head.weight[b] = twin.lm_head.weight[a]
    other = {a: b, b: a}
    ar = EngineRunner(Engine(twin, NoDrafter()), GREEDY)
    answers = run_methods({"ar": ar, "swap": ChangedToken(ar, twin, k, lambda z, t: other[t]),
                           "worst": ChangedToken(ar, twin, k, worst)}, PROMPT)
    judge = Fp64Judge(twin)
    check = summarize(answers, "ar", greedy=True, judge=judge)["greedy_check"]
    assert check["reference"] == "ar" and judge.reruns == 2
    ref = answers["ar"][0].turns[0].tokens[k]
    assert ref in (a, b)
    swap, bad = check["methods"]["swap"], check["methods"]["worst"]
    assert (swap["identical"], swap["near_tie"], swap["mismatch"]) == (0, 1, 0)
    assert (bad["identical"], bad["near_tie"], bad["mismatch"]) == (0, 0, 1)
    d = swap["divergences"][0]
    assert (d["position"], d["reference_token"], d["method_token"], d["verdict"]) == (k, ref, other[ref], "near_tie")
    assert d["fp64_argmax"] in (a, b) and abs(d["fp64_gap"]) <= d["tolerance"] < 1e-4  # fp32: 64 x 2^-24 x max|hi|
    assert d["failed_at"] is None and d["checked_tokens"] == 1  # the stub method stops at the swapped token
    d = bad["divergences"][0]
    assert (d["position"], d["reference_token"], d["verdict"]) == (k, ref, "mismatch")
    assert d["fp64_gap"] > 1.0 and d["fp64_relative_gap"] > 0 and d["fp64_argmax"] in (a, b)
    assert d["failed_at"] == k and d["failed_by"] == pytest.approx(d["fp64_gap"]) and d["failed_by"] > 1.0
    assert check["lossless"] is False and check["identical"] is False


def test_every_mismatch_is_named_however_many_near_ties_come_first():
    """summary.json lists the first SHOWN_DIVERGENCES near-ties of a method but every mismatch, so a mismatch late in
    a long run can be rerun by question id."""
    n = SHOWN_DIVERGENCES + 3

    def turn(tokens):
        return TurnResult(tuple(tokens), "", 1.0, len(tokens), (), None, prompt=(1, 2))

    ref = [Answer(q, "a", (turn([5, 6, 7]),)) for q in range(n)]
    method = [Answer(q, "a", (turn([5, 8, 7]),)) for q in range(n)]  # every turn parts at position 1
    late = n - 1  # only the last question's divergence is a real mismatch
    verdicts = iter([TieVerdict(near_tie=q != late) for q in range(n)])
    check = greedy_check({"ar": ref, "m": method}, "m", judge=lambda d: next(verdicts))["methods"]["m"]
    assert (check["near_tie"], check["mismatch"]) == (n - 1, 1)
    shown = check["divergences"]
    assert [d["question_id"] for d in shown if d["verdict"] == "near_tie"] == list(range(SHOWN_DIVERGENCES))
    assert [d["question_id"] for d in shown if d["verdict"] == "mismatch"] == [late]


def test_a_method_on_its_own_kernels_is_timed_not_held_to_greedy_identity():
    """llama_cpp computes with quantised dot products: its answers are not compared, and it is never the reference."""
    def answer(tokens):
        return [Answer(0, "a", (TurnResult(tuple(tokens), "", 1.0, len(tokens), (), None, prompt=(1, 2)),))]

    check = greedy_check({"m": answer([5, 6]), "llama_cpp": answer([9, 9])}, "m")
    assert check["reference"] is None and check["methods"] == {}
    check = greedy_check({"m": answer([5, 6]), "ar": answer([5, 6]), "llama_cpp": answer([9, 9])}, "m")
    assert check["reference"] == "ar" and set(check["methods"]) == {"m"} and check["lossless"] is True


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_decodes_the_smollm2_gguf_greedily(tmp_path):
    """The runner on the GGUF smollm2 is converted from: as many tokens as asked, from our prompt ids."""
    from inference.bench.methods import LlamaCppRunner
    from inference.bench.run import gguf_for

    try:
        gguf = gguf_for("smollm2", None)
    except Exception as err:  # noqa: BLE001 - no wheel cached and no network: nothing to run on
        pytest.skip(f"no SmolLM2 GGUF here: {err}")
    runner = LlamaCppRunner(gguf, eos_ids=())
    result = runner([1, 2, 3, 4, 5], 6, seed=0)
    assert len(result.tokens) == 6 and result.target_forwards == 6 and result.accepted == (0,) * 5
    assert runner([1, 2, 3, 4, 5], 6, seed=1).tokens == result.tokens  # greedy: the same answer again


def test_reference_far_from_the_float64_argmax_is_a_mismatch_naming_the_method_right(target):
    """The rule is symmetric: when the reference took a token far below the one the method took, the turn still
    differs for real (a bug in the reference, reported all the same); fp64_argmax and a negative gap say the method
    was right."""
    ar = EngineRunner(Engine(target, NoDrafter()), GREEDY)
    answers = run_methods({"ar": ChangedToken(ar, target, 2, worst), "drafter": ar}, PROMPT)
    summary = summarize(answers, "drafter", greedy=True, judge=Fp64Judge(target))
    row = summary["greedy_check"]["methods"]["drafter"]
    d = row["divergences"][0]
    assert row["mismatch"] == 1 and d["fp64_gap"] < 0 and d["fp64_argmax"] == d["method_token"]
    assert summary["greedy_check"]["lossless"] is False and "NOT lossless" in format_table(summary)
    assert "there, the reference's token is" in format_table(summary)


def test_float64_copy_is_lazy_and_later_turns_are_not_compared(target):
    ar = EngineRunner(Engine(target, NoDrafter()), GREEDY)
    same = run_methods({"ar": ar, "drafter": ar}, PROMPT)
    judge = Fp64Judge(target)
    check = summarize(same, "drafter", greedy=True, judge=judge)["greedy_check"]
    assert check["identical"] is True and judge.reruns == 0 and judge._fp64 is None
    t = TurnResult((4, 5), "", 1.0, 2, (0,), None, prompt=(1, 2))
    u = TurnResult((4, 6), "", 1.0, 2, (0,), None, prompt=(1, 2))
    answers = {"ar": [Answer(1, "a", (t, t))],
               "drafter": [Answer(1, "a", (u, TurnResult((4, 5), "", 1.0, 2, (0,), None, prompt=(9,))))]}
    row = summarize(answers, "drafter", greedy=True)["greedy_check"]["methods"]["drafter"]
    assert (row["identical"], row["mismatch"], row["not_compared"]) == (0, 1, 1)


# --- the command

@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench")
    return {"target": save_tiny_model(root / "target", seed=0), "draft": save_tiny_model(root / "draft", seed=1)}


def test_bench_with_hf_speculative_baselines_and_prompt_sets(models, data_dir, capsys, tmp_path):
    code = main(["bench", "--drafter", str(models["draft"]), "--base", str(models["target"]), "--dtype", "fp32",
                 "--questions", "gsm8k:2,humaneval:1", "--max-new-tokens", "8", "--warmup", "0",
                 "--baselines", "ar,hf,hf_pld,hf_assisted", "--pld-tokens", "5", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["methods"]) == ["drafter", "ar", "hf", "hf_pld", "hf_assisted"]
    assert set(summary["speedup_vs"]) == {"ar", "hf", "hf_pld", "hf_assisted"}
    assert set(summary["categories"]) == {"gsm8k", "humaneval"}
    assert set(summary["categories"]["gsm8k"]["speedup_vs"]) == set(summary["speedup_vs"])
    check = summary["greedy_check"]
    assert check["identical"] is True and check["lossless"] is True
    assert all(r["identical"] == 3 for r in check["methods"].values())
    config = summary["config"]
    assert config["prompt_sets"] == {"gsm8k": 2, "humaneval": 1} and config["num_questions"] == 3
    assert config["hf_pld"] == {"prompt_lookup_num_tokens": 5, "max_matching_ngram_size": 3}
    assert config["hf_assisted"]["assistant"] == str(models["draft"])
    assert config["hf_assisted"]["num_assistant_tokens"] == 20
    assert summary["bandwidth"]["floor_ms"] > 0 and "memory-bandwidth floor" in out
    assert "vs hf_assisted" in out and "greedy outputs identical" in out
    assert "bench: 15/15 answers" in err  # stderr is not a terminal under pytest: plain progress lines
    assert (tmp_path / "target-hf_pld.jsonl").is_file() and (tmp_path / "target-hf_assisted.jsonl").is_file()


@pytest.mark.parametrize("extra, needle", [
    (("--baselines", "ar,hf_pld", "--temperature", "0.7"), "--baselines hf_pld is greedy only"),
    (("--baselines", "ar,hf_assisted", "--drafter", "prompt_lookup"),
     "--baselines hf_assisted needs a draft model: --drafter prompt_lookup is not one; name one with --assistant"),
    (("--baselines", "ar,hf_assisted"), "--drafter none is not one"),
    (("--assistant", "builtin:tiny-draft"), "--assistant applies to --baselines hf_assisted"),
    (("--baselines", "hf_assisted", "--assistant", "{tmp}"), "--assistant {tmp}: not a causal LM directory"),
    (("--baselines", "hf_assisted", "--drafter", "builtin:tiny-draft", "--assistant", "builtin:tiny-draft"),
     "is a draft model already"),
    (("--pld-tokens", "4"), "--pld-tokens 4: needs hf_pld in --baselines"),
    (("--baselines", "hf_pld", "--pld-tokens", "0"), "--pld-tokens 0"),
    (("--baselines", "ar,hf_speculative"), "--baselines 'ar,hf_speculative'"),
    (("--gguf", "{tmp}"), "--gguf applies to --baselines llama_cpp"),
    (("--baselines", "ar,llama_cpp", "--temperature", "0.5"), "--baselines llama_cpp is greedy only"),
    (("--questions", "mt_bench,gsm9k"), "unknown prompt set 'gsm9k'"),
    (("--questions", "gsm8k:2,humaneval"), "HumanEval.jsonl.gz not found"),
])
def test_bad_bench_options_are_one_line_before_any_model_loads(data_dir, capsys, tmp_path, extra, needle):
    """--base names no model at all: reaching the model load would fail with a different message."""
    if "humaneval" in " ".join(extra):
        (data_dir / "humaneval" / "HumanEval.jsonl.gz").unlink()
    argv = ["bench", "--base", str(tmp_path / "no-model"), "--out", str(tmp_path / "out"),
            *(a.format(tmp=tmp_path) for a in extra)]
    code = main(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle.format(tmp=tmp_path) in err[0]
    assert not (tmp_path / "out").exists()


def test_default_questions_follow_the_data_folder(tmp_path, monkeypatch):
    """`bench` without --questions reads MT-bench from $DRAFTSMITH_DATA as set when it runs, not from the folder
    found at import (a user who exports the variable gets their own copy)."""
    (tmp_path / "mt_bench").mkdir()
    record = {"question_id": 7, "category": "writing", "turns": ["Say hi."]}
    (tmp_path / "mt_bench" / "question.jsonl").write_text(json.dumps(record) + "\n")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    args = parser.parse_args([])
    questions, taken = load_questions(args.questions)
    assert [q.question_id for q in questions] == [7] and taken == {"mt_bench": 1}


def test_the_command_line_is_recorded_as_typed(monkeypatch):
    monkeypatch.setattr("sys.argv", ["/x/site-packages/inference/__main__.py", "bench", "--out", "a b"])
    assert command_line() == "python -m inference bench --out 'a b'"
    monkeypatch.setattr("sys.argv", ["scripts/bench_suite.py", "conf/bench/smollm2.yaml"])
    assert command_line() == "python scripts/bench_suite.py conf/bench/smollm2.yaml"
