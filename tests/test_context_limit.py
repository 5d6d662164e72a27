"""A generation must fit the target's context (max_position_embeddings): refused in one line before decoding
(generate(), for Python callers) and, on the command line, before any model loads when --max-new-tokens alone is too
many; within the context, tree steps at its very end stay exact (inference.engine.loop.within_context)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.cli import main
from inference.engine.context import check_context
from inference.engine.loop import DecodeConfig, generate
from inference.engine.tree import load_tree
from tests.conftest import tiny_config
from tests.model_support import save_tiny_model
from tests.test_generate import OracleDrafter, plain_greedy, random_prompts

pytestmark = pytest.mark.usefixtures("single_thread")
ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 40  # the short-context model's max_position_embeddings


@pytest.fixture(scope="module")
def short_model() -> torch.nn.Module:
    """A tiny random Llama whose context is CONTEXT positions."""
    config = tiny_config("llama")
    config.max_position_embeddings = CONTEXT
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("context") / "model")  # 512 positions


def test_generate_refuses_what_the_context_cannot_hold(short_model):
    prompt = torch.arange(3, 13)[None]  # 10 tokens
    with pytest.raises(ValueError) as info:
        generate(short_model, prompt, config=DecodeConfig(max_new_tokens=CONTEXT - 9))
    assert str(info.value) == ("max_new_tokens=31: 10 prompt token(s) + 31 new tokens exceed the model's context of "
                               "40 positions (max_position_embeddings); at most 30 new tokens fit")
    with pytest.raises(ValueError, match=r"^the prompt's 40 tokens fill the model's context of 40 positions"):
        generate(short_model, torch.arange(3, 3 + CONTEXT)[None], config=DecodeConfig(max_new_tokens=1))
    # a left-padded batch is measured by its longest real prompt, not by the padded width
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones_like(prompt)], dim=1)
    out = generate(short_model, padded, config=DecodeConfig(max_new_tokens=CONTEXT - 10), attention_mask=mask)
    assert len(out.sequences[0]) == CONTEXT - 10


def test_check_context_without_a_stated_context_passes():
    check_context(object(), 10**6, 10**6)  # a config without max_position_embeddings: nothing to check


def test_tree_steps_at_the_end_of_the_context_are_exact_and_stay_inside_it(short_model):
    """Prompt + max_new_tokens = the whole context, a depth-3 tree, two rows that finish at different steps (one
    rides along): equal to plain greedy, and no position id the target sees is past the context. Drafts that always
    miss make the last step start one token before the end, so its tree reaches 3 positions past the context
    unclamped; drafts that mostly hit exercise deep acceptance there."""
    tree = load_tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)], num_heads=3, topk=10)
    prompts = random_prompts(7, 2, low=6, high=10)
    width = max(map(len, prompts))
    new = CONTEXT - width
    references = [plain_greedy(short_model, p, CONTEXT - len(p)) for p in prompts]
    batch = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    seen: list[int] = []
    hook = short_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(int(kwargs["position_ids"].max())), with_kwargs=True)
    accepted = []
    try:
        for hit_rate in (0.0, 0.9):
            drafter = OracleDrafter(tree, references, hit_rate=hit_rate, seed=3)
            out = generate(short_model, batch, drafter, DecodeConfig(max_new_tokens=new), attention_mask=mask)
            assert out.sequences == [r[:new] for r in references]
            accepted.append(out.stats.mean_accepted)
    finally:
        hook.remove()
    assert max(seen) == CONTEXT - 1  # the last steps reached the end of the context, and not past it
    assert accepted[1] > 1  # deep paths were accepted


def cli_error(capsys, *argv: str) -> tuple[int, list[str]]:
    code = main([str(a) for a in argv])
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "Loading weights" not in ln]


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_cli_refuses_max_new_tokens_beyond_the_context_before_loading(saved_model, capsys, monkeypatch, tmp_path,
                                                                      command):
    monkeypatch.setattr("inference.session.serve", lambda *a, **k: pytest.fail("a model loaded"))
    questions = tmp_path / "questions" / "q.jsonl"  # its own question file: no shared data folder needed
    questions.parent.mkdir()
    questions.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Say hi."]}) + "\n")
    out = tmp_path / "run" / "out"
    extra = ("--prompt", "hi") if command == "generate" else ("--out", out, "--questions", questions)
    code, err = cli_error(capsys, command, "--base", saved_model, "--max-new-tokens", "10000000", "--device", "cpu",
                          *extra)
    assert code == 2
    assert err == [f"error: --max-new-tokens=10000000: 1 prompt token(s) + 10000000 new tokens exceed {saved_model}'s "
                   f"context of 512 positions (max_position_embeddings); at most 511 new tokens fit"]
    assert not out.parent.exists()  # nothing written, not even bench's --out folder


def test_cli_refuses_a_prompt_that_leaves_too_little_room(saved_model, capsys):
    """--max-new-tokens that fits a 1-token prompt but not this one: refused once the prompt is encoded, before
    decoding, naming the flag."""
    code, err = cli_error(capsys, "generate", "--base", saved_model, "--max-new-tokens", "511", "--device", "cpu",
                          "--raw", "--prompt", "hello there", "--json")
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: --max-new-tokens=511: 4 prompt token(s) ") and err[0].endswith("508 new tokens fit")


def test_cli_entry_point_exit_code_and_one_line(saved_model, tmp_path):
    """The real process: `python -m inference generate --max-new-tokens 10000000`: exit 2, one stderr line, nothing
    loaded."""
    result = subprocess.run(
        [sys.executable, "-m", "inference", "generate", "--base", str(saved_model), "--max-new-tokens", "10000000",
         "--prompt", "hi", "--device", "cpu"], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and "WARNING" not in ln]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: --max-new-tokens=10000000: "), lines
    assert "Loading weights" not in result.stderr + result.stdout and result.stdout == ""
