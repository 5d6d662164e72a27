"""scripts/serve_check.py (inference.bench.serve_check): the comparison logic, the vLLM worker's counters, bad input
(one line, exit 2, before any model loads) and, marked `vllm`, the whole check on the built-in tiny target.

The `vllm` test needs vLLM's Python: DRAFTSMITH_VLLM_PYTHON=<python of a vLLM environment> (vLLM pins its own
transformers, so it lives apart), or vLLM importable here; and tiny built (python scripts/build_tiny_models.py):
    DRAFTSMITH_VLLM_PYTHON=/work/vllm-venv/bin/python python -m pytest -q -p no:xdist tests/test_serve_check.py -m vllm
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from inference.bench import serve_check as sc
from inference.bench import vllm_worker
from inference.bench.stats import accepted_per_position
from models.checkpoint import save_drafter
from models.eagle3 import Eagle3Config, Eagle3Draft, save_eagle3
from models.loading import load_target
from models.medusa import MedusaConfig, MedusaHeads
from models.tiny import is_built
from tests.model_support import tiny_config
from tests.script_support import ROOT, exit_code, load_script

VLLM_PYTHON_ENV = "DRAFTSMITH_VLLM_PYTHON"


def run(engine: str, tokens, accepted, drafts: int, wall=None) -> sc.Run:
    tokens = tuple(tuple(t) for t in tokens)
    return sc.Run(engine, tokens, tuple(wall or [1.0] * len(tokens)), drafts, tuple(accepted))


# -- the comparison ----------------------------------------------------------------------------------------------------

def test_accepted_per_position_counts_the_steps_that_reached_each_position():
    steps = [0, 1, 3, 2, 3, 0, 1]
    brute = [sum(1 for a in steps for i in range(a) if i == pos) for pos in range(3)]
    assert accepted_per_position(steps, 3) == tuple(brute) == (5, 3, 2)
    assert accepted_per_position([], 2) == (0, 0)


@pytest.mark.parametrize("a, b, first", [
    ([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1), ([1, 2], [1, 2, 7], 2), ([5], [], 0)])
def test_first_difference(a, b, first):
    assert sc.first_difference(a, b) == first == sc.first_difference(b, a)


def test_compare_reports_each_prompt_and_each_position():
    ours = run("draftsmith", [[1, 2, 3], [4, 5]], accepted=[100, 50, 20], drafts=120)
    theirs = run("vllm", [[1, 2, 3], [4, 6]], accepted=[101, 50, 0], drafts=120)
    c = sc.compare(ours, theirs)
    assert c.identical == (True, False) and c.first_difference == (None, 1) and not c.all_identical
    assert c.position_gap == pytest.approx((0.01, 0.0, -1.0))
    assert not c.within_goal
    assert sc.compare(ours, ours).within_goal and sc.compare(ours, ours).all_identical


def test_a_gap_over_zero_counts():
    assert sc.relative_gap(0, 0) == 0.0 and sc.relative_gap(3, 0) == float("inf")
    assert sc.relative_gap(98, 100) == pytest.approx(-0.02)


def test_runs_of_different_shapes_are_refused():
    with pytest.raises(ValueError, match="1 vs 2 prompts"):
        sc.compare(run("a", [[1]], [1], 1), run("b", [[1], [2]], [1], 1))


def greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_a_difference_is_judged_in_float64(tiny_lm_factory, single_thread):
    model = tiny_lm_factory("llama")
    prompts = [[1, 5, 7], [3, 9]]
    answers = [greedy(model, ids, 6) for ids in prompts]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompts[1] + answers[1][:2]])).logits[0, -1]
    wrong = answers[1][:2] + [int(logits.argmin())] + answers[1][3:]  # far below the argmax: no rounding puts it there
    ours = run("draftsmith", answers, accepted=[3, 1], drafts=10)
    theirs = run("vllm", [answers[0], wrong], accepted=[3, 1], drafts=10)
    verdicts = sc.judge(model, prompts, ours, theirs)
    assert verdicts[0] is None and not verdicts[1].near_tie and verdicts[1].failed_at == 2
    c = sc.compare(ours, theirs, verdicts)
    assert c.near_ties == 0 and "MISMATCH at token 2" in sc.verdict_text(c.first_difference[1], verdicts[1])
    tie = replace(verdicts[1], near_tie=True)
    assert sc.compare(ours, theirs, [None, tie]).near_ties == 1
    assert "near tie" in sc.verdict_text(2, tie) and sc.verdict_text(None, None) == "identical"


def test_run_figures():
    r = run("draftsmith", [[1] * 30, [2] * 10], accepted=[20, 10, 5], drafts=20, wall=[1.5, 0.5])
    assert r.new_tokens == 40 and r.tokens_per_s == pytest.approx(20.0)
    assert r.mean_acceptance_length == pytest.approx(1 + 35 / 20)


# -- vLLM's side -------------------------------------------------------------------------------------------------------

def snapshot(drafts: int, accepted_per_pos: list[int], engines: int = 1) -> list:
    """What `LLM.get_metrics()` returns for spec decoding: Counters (.value) and one Vector (.values) per engine."""
    metrics = []
    for _ in range(engines):
        metrics += [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=drafts),
                    SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=3 * drafts),
                    SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=sum(accepted_per_pos)),
                    SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=accepted_per_pos),
                    SimpleNamespace(name="vllm:generation_tokens", value=999)]
    return metrics


def test_worker_counts_what_the_prompts_added():
    before = vllm_worker.spec_counts(snapshot(2, [2, 1, 0]), 3)
    after = vllm_worker.spec_counts(snapshot(12, [10, 6, 3], engines=2), 3)
    assert after == {"num_drafts": 24, "num_draft_tokens": 72, "num_accepted_tokens": 38,
                     "num_accepted_tokens_per_pos": [20, 12, 6]}
    added = vllm_worker.counts_added(before, after)
    assert added["num_drafts"] == 22 and added["num_accepted_tokens_per_pos"] == [18, 11, 6]
    assert vllm_worker.spec_counts([], 2)["num_accepted_tokens_per_pos"] == [0, 0]


def test_worker_result_becomes_a_run():
    result = {"vllm_version": "0.32.0", "answers": [{"tokens": [5, 6, 2], "wall_s": 0.5, "finish_reason": "stop"}],
              "counts": {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 1,
                         "num_accepted_tokens_per_pos": [1, 0, 0]}}
    r, version = sc.parse_vllm_result(result, 3)
    assert version == "0.32.0" and r == run("vllm", [[5, 6, 2]], accepted=[1, 0, 0], drafts=2, wall=[0.5])


def test_the_worker_error_line_is_the_exception():
    log = "INFO start\nTraceback (most recent call last):\n  File x\nValueError: There is no module or parameter " \
          "named 'draft_id_to_target_id'\nINFO shutting down\n"
    assert sc.last_error(log) == "ValueError: There is no module or parameter named 'draft_id_to_target_id'"
    assert sc.last_error("only info\n") == "only info" and sc.last_error("") == "no output"


# -- bad input ---------------------------------------------------------------------------------------------------------

@pytest.fixture
def inputs(tmp_path):
    """A fake vLLM python (executable), a question file, an EAGLE-3 checkpoint of a 4-layer target and Medusa heads,
    both for a base folder holding only a config."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["Hi"]}) + "\n")
    base = tmp_path / "base"
    tiny_config("llama", vocab_size=64, layers=4).save_pretrained(base)
    target = tiny_config("llama", vocab_size=64, layers=4).to_dict()
    eagle3 = save_eagle3(tmp_path / "eagle3", Eagle3Draft(Eagle3Config(target=target, layers=(1, 2, 3),
                                                                       draft_vocab_size=64)), str(base))
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=32, vocab_size=64))
    medusa = save_drafter(tmp_path / "medusa", heads, str(base))
    shortlist = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=32, vocab_size=64, draft_vocab_size=16))
    shortlist.set_draft_vocab(torch.arange(16))
    shortlist = save_drafter(tmp_path / "medusa-shortlist", shortlist, str(base))
    return SimpleNamespace(python=python, questions=questions, base=base, eagle3=eagle3, medusa=medusa,
                           shortlist=shortlist, tmp=tmp_path)


def bad_cases(i) -> dict[str, tuple[list[str], str]]:
    common = ["--vllm-python", str(i.python), "--questions", str(i.questions)]
    vllm_medusa = i.tmp / "vllm-medusa"
    vllm_medusa.mkdir()
    (vllm_medusa / "config.json").write_text(json.dumps({"model_type": "medusa"}))
    return {
        "no_python": (["--vllm-python", str(i.tmp / "nope"), "--questions", str(i.questions), "--drafter",
                       str(i.eagle3)], "--vllm-python"),
        "num_draft": ([*common, "--drafter", str(i.eagle3), "--num-draft", "0"], "--num-draft must be >= 1"),
        "max_new_tokens": ([*common, "--drafter", str(i.eagle3), "--max-new-tokens", "0"], "--max-new-tokens"),
        "threads": ([*common, "--drafter", str(i.eagle3), "--threads", "0"], "--threads"),
        "no_drafter": ([*common, "--drafter", str(i.tmp / "nope")], "no such folder"),
        "no_config": ([*common, "--drafter", str(i.tmp)], "no config.json"),
        "vllm_medusa": ([*common, "--drafter", str(vllm_medusa)], "a vLLM Medusa folder"),
        "too_many_drafts": ([*common, "--drafter", str(i.medusa), "--num-draft", "3"], "has 2 Medusa heads"),
        "medusa_draft_vocab": ([*common, "--drafter", str(i.shortlist)], "draft_vocab_size=16) have no vLLM layout"),
        "questions": (["--vllm-python", str(i.python), "--questions", str(i.tmp / "none.jsonl"), "--drafter",
                       str(i.eagle3)], "question file not found"),
        "base": ([*common, "--drafter", str(i.eagle3), "--base", str(i.tmp / "gone")], "does not exist"),
        "dtype": ([*common, "--drafter", str(i.eagle3), "--dtype", "fp8"], "--dtype"),
        "out": ([*common, "--drafter", str(i.eagle3), "--out", str(i.tmp / "no" / "x.json")], "--out"),
    }


BAD = ("no_python", "num_draft", "max_new_tokens", "threads", "no_drafter", "no_config", "vllm_medusa",
       "too_many_drafts", "medusa_draft_vocab", "questions", "base", "dtype", "out")


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_exit_2_before_any_model_loads(inputs, capsys, monkeypatch, case):
    script = load_script("serve_check")
    monkeypatch.setattr(sc, "check", lambda p: pytest.fail("a model loaded after bad input"))
    argv, message = bad_cases(inputs)[case]
    assert exit_code(script, argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err


def test_good_input_makes_the_plan(inputs):
    p = sc.plan(sc.parser().parse_args(["--vllm-python", str(inputs.python), "--questions", str(inputs.questions),
                                        "--drafter", str(inputs.medusa), "--num-draft", "2", "--dtype", "bf16"]))
    assert (p.drafter_type, p.given_export, p.base, p.target_dir) == ("medusa", False, str(inputs.base), inputs.base)
    assert (p.num_draft, p.dtype, p.threads, len(p.questions)) == (2, "bf16", 1, 1)


def test_bad_input_through_the_script(inputs):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_check.py"), "--vllm-python",
                           str(inputs.python), "--questions", str(inputs.questions), "--drafter",
                           str(inputs.eagle3), "--num-draft", "-1"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.strip() == "error: --num-draft must be >= 1, got -1"


# -- vLLM itself (marked) ----------------------------------------------------------------------------------------------

def vllm_python() -> str | None:
    """DRAFTSMITH_VLLM_PYTHON, else this Python when it imports vLLM, else None."""
    given = os.environ.get(VLLM_PYTHON_ENV)
    if given:
        return given
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def tiny_drafter(kind: str, folder: Path) -> Path:
    """An untrained drafter for the built-in tiny target that drafts its next token from the target's lm_head (Medusa
    heads as medusa1 initialises them; an EAGLE-3 layer over hidden_states 1, 2, 3 with the target's lm_head)."""
    target = load_target("builtin:tiny", dtype="fp32")
    lm_head = target.get_output_embeddings()
    vocab, hidden = lm_head.weight.shape
    torch.manual_seed(0)
    if kind == "medusa":
        heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=1, hidden_size=hidden, vocab_size=vocab))
        heads.init_from_base(lm_head)
        return save_drafter(folder, heads, "tiny")
    text = target.config.to_dict()
    draft = Eagle3Draft(Eagle3Config(target=text, layers=(1, 2, 3), draft_vocab_size=vocab))
    with torch.no_grad():
        draft.lm_head.weight.copy_(lm_head.weight)
    return save_eagle3(folder, draft, "tiny")


@pytest.mark.vllm
@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_vllm_decodes_what_our_engine_decodes_on_tiny(tmp_path, kind):
    python = vllm_python()
    if python is None:
        pytest.skip(f"no vLLM: set {VLLM_PYTHON_ENV} to the python of a vLLM environment")
    if not is_built("tiny"):
        pytest.skip("builtin:tiny is not built (python scripts/build_tiny_models.py)")
    drafter = tiny_drafter(kind, tmp_path / kind)
    out = tmp_path / "result.json"
    argv = ["--vllm-python", python, "--drafter", str(drafter), "--questions", "mt_bench:3:spread",
            "--max-new-tokens", "24", "--num-draft", "3", "--out", str(out)]
    assert sc.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["all_identical"] and result["within_goal"], result["comparison"]
    assert result["runs"]["vllm"]["drafts"] > 0
