"""`python -m inference bench` additions: named prompt sets, the HF speculative baselines (prompt lookup, assisted
generation), greedy identity judged by a float64 rerun, the bandwidth floor and progress lines for logs."""

from __future__ import annotations

import copy
import gzip
import io
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from inference.api import Engine
from inference.bandwidth import copy_bandwidth, cpu_name, weight_bytes
from inference.bench import ProgressLog, answer
from inference.bench_methods import EngineRunner, ForwardCounter, HFRunner, Sampling, assisted_settings, pld_defaults
from inference.benchstats import Answer, TurnResult, bandwidth_floor, format_table, summarize
from inference.cli import UsageError, main
from inference.drafters import NoDrafter
from inference.near_tie import Fp64Judge, classify
from inference.prompt_lookup import PromptLookupDrafter
from inference.prompt_sets import DATA_ENV, HUMANEVAL_TURN, load_questions
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


@pytest.mark.parametrize("spec, needle", [
    ("mt_bnch,gsm8k", "unknown prompt set 'mt_bnch'"),
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
    """A stub method: `runner`'s tokens with the one at `position` replaced by `pick(fp32 logits there)`."""

    def __init__(self, runner, model, position, pick):
        self.runner, self.model, self.position, self.pick = runner, model, position, pick

    def __call__(self, prompt, max_new_tokens, seed):
        result = self.runner(prompt, max_new_tokens, seed)
        k = self.position
        logits = self.model(input_ids=torch.tensor([prompt + list(result.tokens[:k])])).logits[0, -1]
        tokens = result.tokens[:k] + (int(self.pick(logits)),)
        return TurnResult(tokens, "", result.wall_time, len(tokens), (), None)


def run_methods(runners: dict, prompt: list[int], n: int = 12) -> dict[str, list[Answer]]:
    from inference.prompt_sets import Question

    question = Question(1, "a", ("hi",))
    return {name: [answer(r, question, 1, lambda m: prompt, lambda ids: "", n, 0)] for name, r in runners.items()}


def second_best(logits):
    return logits.topk(2).indices[1]


def test_near_tie_judged_by_float64_rerun_both_ways(target):
    ar = EngineRunner(Engine(target, NoDrafter()), GREEDY)
    k = 3
    answers = run_methods({"ar": ar, "worst": ChangedToken(ar, target, k, lambda z: z.argmin()),
                           "runner_up": ChangedToken(ar, target, k, second_best)}, PROMPT)
    greedy = answers["ar"][0].turns[0].tokens
    z64 = Fp64Judge(target).logits(tuple(PROMPT) + greedy[:k])
    a, b = greedy[k], int(second_best(z64))
    rel = (float(z64[a]) - float(z64[b])) / max(abs(float(z64[a])), abs(float(z64[b])))
    assert z64.dtype == torch.float64 and int(z64.argmax()) == a and rel > 0
    for tol, runner_up in ((rel * 1.01, "near_tie"), (rel * 0.99, "mismatch")):
        judge = Fp64Judge(target, tol)
        check = summarize(answers, "ar", greedy=True, judge=judge)["greedy_check"]
        assert check["reference"] == "ar" and judge.reruns == 2
        worst = check["methods"]["worst"]
        assert (worst["identical"], worst["near_tie"], worst["mismatch"]) == (0, 0, 1)
        row = check["methods"]["runner_up"]
        assert row["near_tie" if runner_up == "near_tie" else "mismatch"] == 1 and row["identical"] == 0
        d = row["divergences"][0]
        assert (d["position"], d["reference_token"], d["method_token"], d["fp64_argmax"]) == (k, a, b, a)
        assert d["verdict"] == runner_up and d["fp64_relative_gap"] == pytest.approx(rel)
        assert check["lossless"] is False and check["identical"] is False


def test_reference_rounding_victim_is_a_near_tie_at_zero_tolerance(target):
    """The reference took the runner-up; the method took the float64 argmax: float64 sides with the method."""
    ar = EngineRunner(Engine(target, NoDrafter()), GREEDY)
    answers = run_methods({"ar": ChangedToken(ar, target, 2, second_best), "drafter": ar}, PROMPT)
    judge = Fp64Judge(target, tol=0.0)
    check = summarize(answers, "drafter", greedy=True, judge=judge)["greedy_check"]
    row = check["methods"]["drafter"]
    assert row["near_tie"] == 1 and row["divergences"][0]["fp64_gap"] < 0
    assert check["lossless"] is True and check["identical"] is False
    assert "identical up to near-ties" in format_table(summarize(answers, "drafter", greedy=True, judge=judge))


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


@pytest.mark.parametrize("za, zb, tol, near", [(10.0, 9.995, 1e-3, True), (10.0, 9.98, 1e-3, False),
                                                (-10.0, -10.005, 1e-3, True), (5.0, 6.0, 0.0, True)])
def test_classify_rule(za, zb, tol, near):
    logits = torch.tensor([-50.0, za, zb, -20.0], dtype=torch.float64)
    verdict = classify(logits, 1, 2, tol)
    assert verdict.near_tie is near and verdict.gap == pytest.approx(za - zb)
    assert verdict.fp64_argmax == (1 if za >= zb else 2)


# --- bandwidth floor and host

def test_bandwidth_floor_arithmetic_and_weight_bytes(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert weight_bytes(model) == 4 * sum(p.numel() for p in model.parameters())
    assert weight_bytes(model) < 4 * sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert weight_bytes(model.to(torch.bfloat16)) == 2 * sum(p.numel() for p in model.parameters())
    rate = copy_bandwidth("cpu", nbytes=2**20, repeats=2)
    assert math.isfinite(rate) and rate > 0
    summary = {"methods": {"ar": {"per_step_ms": {"total": 3.0}}}}
    floor = bandwidth_floor(2_000_000, 1e9, summary)
    assert floor["floor_ms"] == pytest.approx(2.0) and floor["ar_step_over_floor"] == pytest.approx(1.5)
    assert floor["copy_gb_per_s"] == 1.0 and bandwidth_floor(1, 1.0, {"methods": {}})["ar_step_ms"] is None
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU @ 2.0GHz\nflags\t: avx2\n\nmodel name\t: other\n")
    assert cpu_name(info) == "Test CPU @ 2.0GHz" and cpu_name(tmp_path / "none") is None


# --- progress for logs

def test_progress_log_prints_at_least_every_interval_and_at_the_end():
    times = iter([0.0, 4.0, 9.0, 12.0, 30.0, 31.0])  # start, then one reading per update
    out = io.StringIO()
    progress = ProgressLog(5, "bench", interval=10.0, stream=out, clock=lambda: next(times))
    for _ in range(5):
        progress.update(1)
    lines = out.getvalue().splitlines()
    assert lines == ["bench: 3/5 answers, 12 s elapsed, ETA 8 s", "bench: 4/5 answers, 30 s elapsed, ETA 8 s",
                     "bench: 5/5 answers, 31 s elapsed, ETA 0 s"]


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
    (("--tie-tol", "-1"), "--tie-tol must be >= 0"),
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
