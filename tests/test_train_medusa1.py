"""`python -m train medusa1` end to end on a tiny random model: few steps, checkpoint, load, resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.checkpoint import head_vocabulary, load_drafter
from tests.model_support import save_tiny_model
from tests.data_support import random_chats, write_sharegpt

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def nf4_model_dir(tmp_path_factory) -> Path:
    """Hidden 64: every 4-bit layer's width is a multiple of bitsandbytes' 64-value quantisation block."""
    return save_tiny_model(tmp_path_factory.mktemp("models") / "llama64", hidden_size=64)


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory) -> Path:
    return write_sharegpt(tmp_path_factory.mktemp("data") / "chats.json", random_chats(40))


# `python -m train` with bitsandbytes' dequantise-then-matmul CPU path forced (see tests/test_nf4_cpu.py).
WITHOUT_AVX512BF16 = ("-c", "import runpy, bitsandbytes.nn.modules as m; m.has_avx512bf16 = lambda: False; "
                            "runpy.run_module('train', run_name='__main__', alter_sys=True)")


def train(model_dir: Path, data: Path, out: Path, *overrides: str, launcher: tuple[str, ...] = ("-m", "train")
          ) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, *launcher, "medusa1", "+model=tiny", f"model.path={model_dir}", "model.dtype=fp32",
        "data.self_distill=false", "data=sharegpt", f"data.path={data}", "data.max_length=64", "data.validation_fraction=0.25",
        "training.max_steps=3", "training.per_device_train_batch_size=2", "training.logging_steps=1",
        "method.num_heads=2", "eval.greedy_prompts=2", "eval.greedy_new_tokens=6", "logger=none", f"output_dir={out}",
        *overrides,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def test_few_steps_write_a_loadable_checkpoint(tiny_model_dir, sharegpt_file, tmp_path):
    out = tmp_path / "run"
    result = train(tiny_model_dir, sharegpt_file, out)
    assert_ok(result)
    assert "head 1 (predicts t+2)" in result.stdout and "backbone (predicts t+1)" in result.stdout
    loaded = load_drafter(out)
    assert loaded.config["num_heads"] == 2 and loaded.config["base_model_name_or_path"] == str(tiny_model_dir)
    assert loaded.config["training"]["global_step"] == 3
    metrics = loaded.config["training"]["metrics"]
    assert 0.0 <= metrics["eval_head1_top1"] <= metrics["eval_head1_top5"] <= 1.0
    # Enum-typed choices are saved as their plain values (train.config's StrEnums), in config.json and .hydra/
    saved = loaded.config["training"]["config"]
    assert (saved["model"]["dtype"], saved["training"]["on_nonfinite"], saved["data"]["format"]) == ("fp32", "stop", "sharegpt")
    hydra_saved = (out / ".hydra" / "config.yaml").read_text()
    assert "dtype: fp32" in hydra_saved and "format: sharegpt" in hydra_saved and "Dtype" not in hydra_saved
    assert "eval_greedy_head1_top1" in metrics and "eval_backbone_top1" in metrics
    assert (out / "tokenizer.json").is_file() and (out / "README.md").is_file()
    # The heads trained: they moved away from the zero-initialised residual blocks.
    assert any(b.linear.weight.abs().sum() > 0 for h in loaded.heads.heads for b in h.blocks)
    # The train split's label frequencies ship with the heads and serve a shortlisted, still exact, engine.
    from safetensors.torch import load_file

    from inference import NoDrafter, load

    counts = load_file(str(out / "token_counts.safetensors"))["counts"]
    assert counts.shape == (loaded.config["vocab_size"],) and counts.sum() > 0
    engine = load(out, dtype="fp32", head_vocab=12)
    assert engine.drafter.vocab.tolist() == head_vocabulary(out, 12, topk=engine.drafter.tree.topk).tolist()
    assert all(counts[t] > 0 for t in engine.drafter.vocab[:5].tolist())
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    plain = load(None, base=str(tiny_model_dir), dtype="fp32")
    assert (engine.generate(prompts, max_new_tokens=8, ignore_eos=True).sequences
            == plain.generate(prompts, max_new_tokens=8, ignore_eos=True).sequences)
    assert isinstance(plain.drafter, NoDrafter)


@pytest.mark.parametrize("cpu_path", ["native", "dequantise"])
def test_nf4_backbone(nf4_model_dir, sharegpt_file, tmp_path, cpu_path):
    """Both of bitsandbytes' CPU paths train: this CPU's own (packed on AVX-512-bf16, else dequantise-then-matmul)
    and the dequantise path forced."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import has_avx512bf16

    out = tmp_path / "nf4"
    launcher = WITHOUT_AVX512BF16 if cpu_path == "dequantise" else ("-m", "train")
    result = train(nf4_model_dir, sharegpt_file, out, "model.quantization=nf4", "model.dtype=bf16", launcher=launcher)
    assert_ok(result)
    packed = cpu_path == "native" and has_avx512bf16()
    expected = "packed AVX-512-bf16 kernels" if packed else "dequantise-then-matmul"
    assert f"model.quantization=nf4 on CPU: {expected}" in result.stdout + result.stderr
    loaded = load_drafter(out)
    assert loaded.config["training"]["config"]["model"]["quantization"] == "nf4"
    assert loaded.config["training"]["global_step"] == 3
    assert 0.0 <= loaded.config["training"]["metrics"]["eval_greedy_head1_top1"] <= 1.0
    assert torch.isfinite(torch.cat([p.flatten() for p in loaded.heads.parameters()])).all()
    assert any(b.linear.weight.abs().sum() > 0 for h in loaded.heads.heads for b in h.blocks)


def test_nf4_backbone_narrower_than_the_block_is_refused_before_loading(tiny_model_dir, sharegpt_file, tmp_path):
    pytest.importorskip("bitsandbytes")
    result = train(tiny_model_dir, sharegpt_file, tmp_path / "nf4", "model.quantization=nf4", "model.dtype=bf16")
    assert_one_line_error(result, "model.quantization=nf4: ")
    assert "in_features=32, not a multiple of the 64-value quantisation block" in result.stderr
    assert "Loading weights" not in result.stderr and not (tmp_path / "nf4" / "config.json").exists()


def test_resume_auto_continues_from_newest_checkpoint(tiny_model_dir, sharegpt_file, tmp_path):
    out = tmp_path / "resume"
    assert_ok(train(tiny_model_dir, sharegpt_file, out, "training.save_steps=2", "training.max_steps=2"))
    result = train(tiny_model_dir, sharegpt_file, out, "training.save_steps=2", "training.max_steps=4", "training.resume_from_checkpoint=auto")
    assert_ok(result)
    state = json.loads((out / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    assert f"resuming from {out / 'checkpoints' / 'checkpoint-2'}" in result.stdout + result.stderr


def assert_one_line_error(result: subprocess.CompletedProcess, needle: str) -> None:
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-4000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], result.stderr[-4000:]
    assert "Traceback" not in result.stderr


def test_input_errors_are_one_line(tiny_model_dir, sharegpt_file, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n{"conversations": [\n')
    result = train(tiny_model_dir, bad, tmp_path / "out1")
    assert_one_line_error(result, f"{bad}:2:")
    result = train(tmp_path / "no-such-model", sharegpt_file, tmp_path / "out2")
    assert_one_line_error(result, "no-such-model")
    assert not (tmp_path / "out2" / "config.json").exists()


def test_nonfinite_loss_stops_naming_the_step(tiny_model_dir, sharegpt_file, tmp_path):
    out = tmp_path / "nan"
    result = train(tiny_model_dir, sharegpt_file, out, "training.learning_rate=1e38", "training.warmup_steps=0",
                   "training.max_grad_norm=0")
    assert_one_line_error(result, "loss is")
    assert "step " in result.stderr and not (out / "config.json").exists()
    # skip: the exploded batches are skipped, but the weights are already non-finite, so nothing is saved
    result = train(tiny_model_dir, sharegpt_file, out, "training.learning_rate=1e38", "training.warmup_steps=0",
                   "training.max_grad_norm=0", "training.on_nonfinite=skip")
    assert_one_line_error(result, "refusing to save non-finite weights")
    assert "batch skipped" in result.stdout + result.stderr


def test_self_distillation_trains_on_the_targets_own_greedy_answers(tiny_model_dir, sharegpt_file, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "self_distill"
    overrides = ("data.self_distill=true", "data.self_distill_samples=5", "data.self_distill_new_tokens=6",
                 "data.self_distill_batch_size=2")
    result = train(tiny_model_dir, sharegpt_file, out, *overrides)
    assert_ok(result)
    rows = [json.loads(line) for line in (out / "self_distill" / "rank000.jsonl").read_text().splitlines()]
    assert 1 <= len(rows) <= 5  # an answer that decodes to nothing is not written
    # Each answer is the target's own greedy continuation of the first user turn (not the data's answer).
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    originals = {str(i): r for i, r in enumerate(json.loads(sharegpt_file.read_text()))}
    for row in rows:
        user, answer = row["conversations"][0]["value"], row["conversations"][1]["value"]
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)["input_ids"]
        greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
        expected = tokenizer.decode(greedy[0, prompt.shape[1]:], skip_special_tokens=True)
        assert answer == expected.strip()
        assert any(o["conversations"][0]["value"] == user for o in originals.values())
    assert load_drafter(out).config["training"]["global_step"] == 3
    # A second run reuses the cached answers instead of generating them again.
    again = train(tiny_model_dir, sharegpt_file, out, *overrides, "training.max_steps=4",
                  "training.resume_from_checkpoint=auto")
    assert_ok(again)
    assert f"0 answers generated, {len(rows)} already in" in again.stdout + again.stderr


def test_draft_vocabulary_trains_on_the_most_frequent_labels(tiny_model_dir, sharegpt_file, tmp_path):
    """method.draft_vocab=S: the heads predict over the S most frequent train labels, ship them, and serve exactly;
    with method.soft_labels they also learn the target's own distribution over those S tokens."""
    out = tmp_path / "draft_vocab"
    result = train(tiny_model_dir, sharegpt_file, out, "method.draft_vocab=24", "method.share_lm_head=true",
                   "method.soft_labels=0.5")
    assert_ok(result)
    assert "head1_soft_loss" in result.stdout + result.stderr
    loaded = load_drafter(out)
    from safetensors.torch import load_file

    from inference import load
    from models.checkpoint import most_frequent

    counts = load_file(str(out / "token_counts.safetensors"))["counts"]
    assert loaded.config["draft_vocab_size"] == 24
    assert loaded.heads.vocab_ids.tolist() == most_frequent(counts, 24).tolist()
    assert 0 < loaded.config["training"]["metrics"]["eval_head1_top5"] <= 1
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    engine = load(out, dtype="fp32")
    plain = load(None, base=str(tiny_model_dir), dtype="fp32")
    assert (engine.generate(prompts, max_new_tokens=8, ignore_eos=True).sequences
            == plain.generate(prompts, max_new_tokens=8, ignore_eos=True).sequences)
    too_big = train(tiny_model_dir, sharegpt_file, tmp_path / "too_big", "method.draft_vocab=100000")
    assert too_big.returncode != 0 and "method.draft_vocab=100000" in too_big.stderr
    assert "Traceback" not in too_big.stderr
    bad_weight = train(tiny_model_dir, sharegpt_file, tmp_path / "bad_weight", "method.soft_labels=1.5")
    assert bad_weight.returncode != 0 and "method.soft_labels=1.5" in bad_weight.stderr
    assert "Traceback" not in bad_weight.stderr and not (tmp_path / "bad_weight").exists()


def test_time_budget_stops_after_the_step_that_crosses_it():
    from types import SimpleNamespace

    from transformers import TrainerControl

    from train.trainer import TimeBudget

    now = [100.0]
    budget = TimeBudget(1.0, clock=lambda: now[0])
    args, state, control = SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(global_step=1), TrainerControl()
    budget.on_step_end(args, state, control)  # before the first step: the clock has not started
    assert not control.should_training_stop
    budget.on_step_begin(args, state, control)
    now[0] += 59.0
    assert not budget.on_step_end(args, state, control).should_training_stop
    now[0] += 1.0
    assert budget.on_step_end(args, state, control).should_training_stop


def test_trim_heap_calls_malloc_trim_after_each_step():
    from types import SimpleNamespace

    from transformers import TrainerControl

    from train.trainer import TrimHeap, glibc

    calls = []
    trim = TrimHeap(SimpleNamespace(malloc_trim=calls.append))
    control = TrainerControl()
    for _ in range(3):
        assert trim.on_step_end(SimpleNamespace(), SimpleNamespace(), control) is control
    assert calls == [0, 0, 0]
    libc = glibc()
    if libc is not None:  # glibc (Linux): the real call returns 0 or 1 and keeps the process alive
        assert libc.malloc_trim(0) in (0, 1)


def test_max_minutes_ends_the_run_with_an_evaluated_checkpoint(tiny_model_dir, sharegpt_file, tmp_path):
    out = tmp_path / "budget"
    result = train(tiny_model_dir, sharegpt_file, out, "training.max_steps=50", "training.max_minutes=1e-6")
    assert_ok(result)
    assert "training.max_minutes=1e-06 reached at step 1" in result.stdout
    loaded = load_drafter(out)
    assert loaded.config["training"]["global_step"] == 1 and "eval_head1_top1" in loaded.config["training"]["metrics"]
    result = train(tiny_model_dir, sharegpt_file, tmp_path / "bad", "training.max_minutes=0")
    assert result.returncode == 2 and result.stderr.strip() == "error: training.max_minutes=0.0: must be > 0 or null"
