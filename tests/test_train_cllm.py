"""Jacobi trajectory collection (resumable) and `python -m train cllm` end to end on a tiny random model; the
checkpoint serves through `inference.load` with Jacobi output == greedy."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.jacobi import read_records
from inference import Engine, NoDrafter, load
from inference.collect.jacobi_trajectories import main as collect_main
from tests.model_support import save_tiny_model
from tests.data_support import random_chats, write_sharegpt

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cllm")
    chats = write_sharegpt(root / "chats.json", random_chats(16))
    return {"model": save_tiny_model(root / "model"), "chats": chats, "root": root}


def collect(setup, output: Path, *extra: str) -> int:
    return collect_main(["--model", str(setup["model"]), "--output", str(output), "--data", "sharegpt",
                         f"data.path={setup['chats']}", "--block-size", "4", "--max-new-tokens", "8",
                         "--max-prompts", "8", "--batch-size", "4", *extra])


def test_collection_resumes_and_reproduces_greedy(setup, single_thread, capsys):
    output = setup["root"] / "resume.jsonl"
    assert collect(setup, output, "--max-prompts", "3") == 0
    lines = output.read_text().splitlines()
    output.write_text("\n".join(lines[:2]) + "\n" + lines[2][:20])  # an interrupted write
    assert collect(setup, output) == 0
    records = read_records(output)
    assert [r["id"] for r in records] == [f"train:{i}" for i in range(8)]
    out = capsys.readouterr().out
    assert "3 new records" in out and "6 new records" in out  # the torn one was redone, the 2 done ones skipped
    engine = load(None, base=str(setup["model"]), dtype="fp32")
    for record in records[:3]:
        answer = [t for b in record["blocks"] for t in b["states"][-1]]
        greedy = engine.generate(record["prompt_ids"], max_new_tokens=len(answer), ignore_eos=True).sequences[0]
        assert answer == greedy  # the fixed points are the greedy continuation
        assert all(len(b["states"]) <= 5 for b in record["blocks"])
    jacobi = load("jacobi:n=3,init=repeat", base=str(setup["model"]), dtype="fp32")  # by name, for any model
    prompts = [r["prompt_ids"] for r in records[:3]]
    assert (jacobi.generate(prompts, max_new_tokens=10, ignore_eos=True).sequences
            == engine.generate(prompts, max_new_tokens=10, ignore_eos=True).sequences)
    with pytest.raises(ValueError, match="needs a base model; pass base="):
        load("jacobi")


def test_train_cllm_few_steps_and_serve(setup, single_thread, tmp_path):
    trajectories = tmp_path / "traj.jsonl"
    assert collect(setup, trajectories) == 0
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "train", "cllm", "+model=tiny", f"model.path={setup['model']}", "model.dtype=fp32", "data.self_distill=false",
        f"method.trajectories={trajectories}", "method.lora_r=4", "method.consistency=local", "method.ar_loss=kl",
        "method.divergence=soft_ce", "data=sharegpt", f"data.path={setup['chats']}", "data.validation_fraction=0.25",
        "training.max_steps=2", "training.per_device_train_batch_size=4", "training.logging_steps=1",
        "eval.greedy_prompts=1", "eval.greedy_new_tokens=8", "logger=none", f"output_dir={out}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "Jacobi tokens per step" in result.stdout and "validation perplexity" in result.stdout
    assert "AR KL to the original" in result.stdout  # LoRA: the teacher is the model with adapters disabled
    config = json.loads((out / "config.json").read_text())
    assert config["drafter_type"] == "cllm" and config["block_size"] == 4
    assert config["backbone"]["format"] == "lora_adapter" and config["training"]["global_step"] == 2
    engine = load(out, dtype="fp32")
    greedy = load(None, base=str(setup["model"]), dtype="fp32")
    prompts = [[1, 5, 206, 80, 90], [1, 5, 206, 80, 90, 228, 349]]
    jacobi = engine.generate(prompts, max_new_tokens=12, ignore_eos=True)
    plain = Engine(engine.model, NoDrafter()).generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert jacobi.sequences == plain.sequences
    assert engine.drafter.options.block_size == 4
    # the adapter is applied: the served model is the fine-tuned one, not the base (some weight differs)
    base_sd, tuned_sd = greedy.model.state_dict(), engine.model.state_dict()
    assert any(not torch.equal(base_sd[k], tuned_sd[k]) for k in base_sd)
    # the quality guard reads the checkpoint; data.key=value overrides may follow the options
    guard = [sys.executable, "scripts/quality_guard.py", str(out), "--data", "sharegpt", f"data.path={setup['chats']}",
             "--prompts", "1", "--new-tokens", "4", "data.validation_fraction=0.25", "--batches", "1", "--threads", "1"]
    result = subprocess.run(guard, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "perplexity  original" in result.stdout and "greedy agreement with the original" in result.stdout
    assert "perplexity, original" in result.stderr and "perplexity, fine-tuned" in result.stderr  # progress
    assert "greedy agreement: the original answers 1 prompts" in result.stderr


def test_train_cllm_packed_full_fine_tuning(setup, single_thread, tmp_path):
    """method.packing=true with full fine-tuning, the KL teacher and reply rows trains, evaluates and serves."""
    trajectories = tmp_path / "traj.jsonl"
    assert collect(setup, trajectories) == 0
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "train", "cllm", "+model=tiny", f"model.path={setup['model']}", "model.dtype=fp32",
        f"method.trajectories={trajectories}", "method.packing=true", "method.backbone=full", "method.ar_loss=kl",
        "method.ar_source=both", "data=sharegpt", f"data.path={setup['chats']}", "data.validation_fraction=0.25",
        "training.max_steps=2", "training.per_device_train_batch_size=2", "training.learning_rate=1e-3",
        "training.logging_steps=1", "eval.greedy_prompts=1", "eval.greedy_new_tokens=8", "logger=none",
        f"output_dir={out}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "AR KL to the original" in result.stdout and "Jacobi tokens per step" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["training"]["global_step"] == 2 and config["backbone"]["format"] != "lora_adapter"
    engine = load(out, dtype="fp32")
    prompts = [[1, 5, 206, 80, 90]]
    assert (engine.generate(prompts, max_new_tokens=12, ignore_eos=True).sequences
            == Engine(engine.model, NoDrafter()).generate(prompts, max_new_tokens=12, ignore_eos=True).sequences)
    base_sd, tuned_sd = load(None, base=str(setup["model"]), dtype="fp32").model.state_dict(), engine.model.state_dict()
    assert any(not torch.equal(base_sd[k], tuned_sd[k]) for k in base_sd)


@pytest.mark.parametrize("override,message", [
    ("method.trajectories=null", "method.trajectories is not set"),
    ("method.ar_weight=0 method.ar_loss=kl", "trains no KL term"),
    ("method.packing=true method.consistency=local", "method.packing=true trains global consistency only"),
    ("method.backbone=full method.ar_loss=kl deepspeed=zero3", "method.ar_loss=kl with method.backbone=full under "
                                                              "deepspeed=zero3"),
])
def test_bad_method_settings_fail_in_one_line(override, message):
    from hydra import compose, initialize_config_module

    from train.cli import UsageError
    from train.cllm import check_options
    from train.config import register_configs

    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["method=cllm", "+model=tiny", "method.trajectories=t.jsonl",
                                                      *override.split()])
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        check_options(cfg)


@pytest.mark.parametrize("override,message", [
    ("method.divergence=js", "method.divergence=js: choose one of kl, soft_ce"),
    ("method.consistency=both", "method.consistency=both: choose one of global, local"),
    ("method.ar_source=gold", "method.ar_source=gold: choose one of ground_truth, target_output, both"),
    ("method.ar_loss=mse", "method.ar_loss=mse: choose one of ce, kl"),
    ("method.init=zeros", "method.init=zeros: choose one of random, pad, repeat"),
    ("method.backbone=adapter", "method.backbone=adapter: choose one of lora, full"),
])
def test_bad_method_choices_fail_at_composition(override, message):
    """The choices are Enum-typed in train.config: the command line is refused before Hydra runs the job."""
    from train.cli import UsageError, parse
    from train.config import register_configs

    register_configs()
    with pytest.raises(UsageError) as info:
        parse(["cllm", "+model=tiny", "method.trajectories=t.jsonl", override])
    assert str(info.value) == message


def test_full_fine_tuning_kl_teacher_is_a_frozen_copy(setup, single_thread):
    """method.backbone=full + ar_loss=kl: the teacher is a frozen copy of the original loaded once; at the start the
    KL is zero, after a weight changes it is positive, and only the trained model gets gradients."""
    from hydra import compose, initialize_config_module

    from data.jacobi import PromptSample, TrajectoryCollator, TrajectoryDataset, trajectory_record
    from models.loading import load_target
    from train.cllm import Method
    from train.config import register_configs

    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "method=cllm", "+model=tiny", f"model.path={setup['model']}", "model.dtype=fp32",
            "method.trajectories=t.jsonl", "method.backbone=full", "method.ar_loss=kl"])
    method = Method(cfg)
    model = method.build(load_target(str(setup["model"]), dtype="fp32"), tokenizer=None)
    teacher = method.frozen_original
    assert teacher is not None and teacher is not model and not any(p.requires_grad for p in teacher.parameters())
    record = trajectory_record(PromptSample("r", (1, 5, 7)), [[[3, 3, 3, 3], [10, 11, 12, 13]]], 4, "random", 0)
    batch = TrajectoryCollator(0)([TrajectoryDataset([record])[0]])
    assert float(method.forward_loss(model, batch).metrics["ar_kl"]) == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(1.5)
    out = method.forward_loss(model, batch)
    assert float(out.metrics["ar_kl"]) > 1e-4
    out.loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert model.get_output_embeddings().weight.grad is not None


def test_own_data_methods_are_the_provides_data_ones():
    import importlib

    from train.method import ProvidesData
    from train.checks import OWN_DATA_METHODS

    methods = [p.stem for p in (Path(__file__).parents[1] / "conf" / "method").glob("*.yaml")]
    assert {m for m in methods if issubclass(importlib.import_module(f"train.{m}").Method, ProvidesData)} \
        == OWN_DATA_METHODS


@pytest.mark.parametrize("method, refused", [("cllm", False), ("medusa2", True)])
def test_model_data_recipe_self_distill_does_not_refuse_cllm(method, refused):
    """+model=smollm2 selects data=instructions with self_distill on; cllm trains on its own trajectories (the data
    recipe never runs), so QLoRA (model.quantization=nf4) must pass the self-distillation check for it, while
    medusa2, which would generate through the 4-bit model it trains, is still refused."""
    from hydra import compose, initialize_config_module

    from data.errors import UsageError
    from train.checks import check_self_distill
    from train.config import register_configs

    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"method={method}", "+model=smollm2", "model.quantization=nf4",
                                                      *(["method.trajectories=t.jsonl"] if method == "cllm" else [])])
    assert cfg.data.self_distill
    if refused:
        with pytest.raises(UsageError, match="only for medusa1"):
            check_self_distill(cfg)
    else:
        check_self_distill(cfg)
