"""train/memory_model.py and scripts/train_memory.py: the counts the model multiplies equal the real modules', its
structural claims hold (TTT attention linear in T, the fit table's batches are the boundary), its prediction lands
within 15 % of a measured peak, and bad input ends in one line with exit status 2."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from models.eagle3 import Eagle3Config, Eagle3Draft
from models.medusa import MedusaConfig, MedusaHeads
from tests.script_support import exit_code, load_script
from train.memory_model import (
    FIT_GPUS_GIB, FIT_TARGETS, GIB, SHAPES, MemoryModelError, Shape, TrainSetup, eagle3, eagle3_draft_params,
    fit_table, largest_batch, lora_params, medusa1, predict, resolve_shape)

ROOT = Path(__file__).resolve().parents[1]
SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)


def count(module: torch.nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)


@pytest.mark.parametrize("config", [LlamaConfig(**SIZES, tie_word_embeddings=False),
                                    LlamaConfig(**SIZES, tie_word_embeddings=True), Qwen2Config(**SIZES)],
                         ids=["llama", "llama_tied", "qwen2_bias"])
def test_target_params_equal_the_model(config):
    model = AutoModelForCausalLM.from_config(config)
    assert Shape.from_config(config.to_dict(), "t").params() == count(model)


@pytest.mark.parametrize("share", [False, True])
def test_medusa_trained_params_equal_the_heads(share):
    shape = Shape.from_config(LlamaConfig(**SIZES).to_dict(), "t")
    heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=1, hidden_size=64, vocab_size=300, share_lm_head=share))
    setup = TrainSetup("medusa1", batch=1, seq=16, steps=3, share_lm_head=share)
    assert medusa1(shape, setup).trained_params == count(heads)


@pytest.mark.parametrize("config", [LlamaConfig(**SIZES), Qwen2Config(**SIZES)], ids=["llama", "qwen2"])
def test_eagle3_draft_params_equal_the_draft(config):
    """The draft layer is Llama's for every family: a Qwen2 target's q / k / v biases do not carry over."""
    draft = Eagle3Draft(Eagle3Config(target=config.to_dict(), layers=(1, 2, 3), draft_vocab_size=200))
    assert eagle3_draft_params(Shape.from_config(config.to_dict(), "t"), 200) == count(draft)


def test_lora_params_equal_peft_all_linear():
    from peft import LoraConfig, get_peft_model

    config = LlamaConfig(**SIZES)
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert lora_params(Shape.from_config(config.to_dict(), "t"), 4) == count(model, trainable=True)


def test_ttt_attention_grows_linearly_with_length():
    """models/ttt_attention.py saves O(B·H·T) per step: no [B, H, T, T] term."""
    setup = TrainSetup("eagle3", batch=2, seq=1024, steps=7)
    short, long = (eagle3(SHAPES["llama3_1_8b"], replace(setup, seq=t)).saved_attention for t in (1024, 2048))
    assert long == 2 * short


def test_step_memory_grows_with_batch_length_and_steps():
    """The loss/backward phase grows strictly; the peak never shrinks (the optimizer step can be the larger phase)."""
    shape = SHAPES["vicuna7b"]
    for method in ("medusa1", "eagle3", "cllm"):
        base = TrainSetup(method, batch=2, seq=512, steps=3)
        changes = [dict(batch=4), dict(seq=1024)] + ([dict(steps=5)] if method != "cllm" else [])
        for change in changes:
            before, after = predict(shape, base), predict(shape, replace(base, **change))
            assert after.phases["loss/backward"] > before.phases["loss/backward"] and after.peak >= before.peak


def test_largest_batch_is_the_boundary():
    setup = TrainSetup("eagle3", batch=1, seq=2048, steps=7, autocast=True)
    capacity = 80 * GIB
    b = largest_batch(SHAPES["llama3_1_8b"], setup, capacity)
    assert b >= 1
    assert predict(SHAPES["llama3_1_8b"], replace(setup, batch=b)).peak <= capacity
    assert predict(SHAPES["llama3_1_8b"], replace(setup, batch=b + 1)).peak > capacity
    assert largest_batch(SHAPES["llama3_1_8b"], setup, GIB) == 0


def test_fit_table_covers_the_targets_and_grows_with_the_gpu():
    rows = fit_table()
    assert [(r.target, r.method) for r in rows] == [(t, m) for t in FIT_TARGETS for m in ("medusa1", "eagle3")]
    for row in rows:
        batches = [row.largest_batch[label] for label in FIT_GPUS_GIB]
        assert batches == sorted(batches) and batches[-1] >= 1


def test_names_and_config_files_resolve(tmp_path):
    assert resolve_shape("llama3_8b_instruct") == SHAPES["llama3_1_8b"]
    LlamaConfig(**SIZES).save_pretrained(tmp_path)
    assert resolve_shape(str(tmp_path)).hidden == 64 and resolve_shape(str(tmp_path / "config.json")).layers == 3
    with pytest.raises(MemoryModelError, match="unknown model"):
        resolve_shape("gpt5")


@pytest.mark.parametrize("argv, named", [
    (["--target", "missing/config.json", "--batch", "2"], "missing/config.json"),
    (["--target", "gpt5"], "gpt5"),
    (["--target", "vicuna7b", "--batch", "0"], "--batch"),
    (["--target", "vicuna7b", "--method", "medusa9"], "--method"),
])
def test_bad_input_is_one_line_and_status_2(argv, named, capsys):
    script = load_script("train_memory")
    assert exit_code(script, argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0] and captured.out == ""


def test_prediction_prints_every_part(capsys):
    script = load_script("train_memory")
    assert exit_code(script, ["--target", "qwen2_5_7b_instruct", "--method", "eagle3", "--batch", "2",
                              "--seq", "2048", "--ttt-steps", "7"]) == 0
    out = capsys.readouterr().out
    for part in ("target weights", "trained weights", "gradients", "optimizer state", "activations", "logits",
                 "saved attention", "peak"):
        assert part in out


@pytest.mark.slow
def test_measured_peak_is_within_15_percent():
    """A real medusa1 and eagle3 step (2 steps each) of a random Llama, through the script's subprocess."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_memory.py"), "--measure", "--shape",
                             "hidden=256,layers=2,heads=4,intermediate=512,vocab=8192", "--method", "medusa1,eagle3",
                             "--batch", "2", "--seq", "256", "--ttt-steps", "3", "--dtype", "fp32"],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    errors = [float(e) for e in re.findall(r"([+-]\d+\.\d)%", result.stdout)]
    assert len(errors) == 2 and all(abs(e) < 15 for e in errors), result.stdout


def test_cllm_measurement_batches_are_the_collators_rows_of_seq_tokens():
    """Unpacked: prompt + J - 1 fixed points + the last block's state, T = seq, and the AR row as long; packed:
    prompt + answer + every state less its last token, also T = seq, every block valid."""
    from train.memory_measure import cllm_batch

    shape = Shape("s", 64, 2, 4, 4, 128, 500)
    unpacked = cllm_batch(shape, TrainSetup("cllm", batch=3, seq=100, steps=1, block_size=8), torch.device("cpu"), 0)
    assert unpacked["input_ids"].shape == unpacked["ar_input_ids"].shape == (3, 100)
    assert (unpacked["block_start"] == 92).all() and unpacked["attention_mask"].all()
    packed = cllm_batch(shape, TrainSetup("cllm", batch=3, seq=100, steps=1, block_size=8, packing=True),
                        torch.device("cpu"), 0)
    assert packed["input_ids"].shape == (3, 100) and packed["visible"].shape == (3, 100, 100)
    assert packed["block_valid"].shape == (3, 3) and packed["block_valid"].all()  # 50 // 15 blocks of 8


@pytest.mark.slow
@pytest.mark.parametrize("packing", [[], ["--packing"]])
def test_measured_cllm_peak_is_within_15_percent(packing):
    """Two real CLLM steps (LoRA, CE) of a random Llama on random trajectories, unpacked and packed."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_memory.py"), "--measure", "--shape",
                             "hidden=256,layers=2,heads=4,intermediate=512,vocab=8192", "--method", "cllm",
                             "--batch", "2", "--seq", "256", "--dtype", "fp32", *packing],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    errors = [float(e) for e in re.findall(r"([+-]\d+\.\d)%", result.stdout)]
    assert len(errors) == 1 and abs(errors[0]) < 15, result.stdout
