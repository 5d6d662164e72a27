"""Several processes (CPU, gloo): DeepSpeed ZeRO-2/3 under torchrun and the deepspeed launcher equal one process.

Equivalence, not examples: two processes × batch 2 must give the losses and the heads of one process × batch 4.
Every conversation has the same number of trained tokens (the same words in another order), so the mean of the two
ranks' mean losses is the one-process mean exactly, up to float reduction order.
The first DeepSpeed run on a machine JIT-compiles DeepSpeed's CPU shared-memory comm op (cached afterwards).
"""

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from models.checkpoint import load_drafter
from tests.model_support import save_tiny_model
from train.distributed import ensure_launch_env, gathered, resolve_deepspeed_config

ROOT = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta".split()
STEPS = 4
LOSS_RTOL = 1e-4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    rng = random.Random(0)
    records = []
    for i in range(24):
        words = rng.sample(WORDS, len(WORDS))
        records.append({"id": str(i), "conversations": [{"from": "human", "value": "say " + " ".join(words[:3])},
                                                         {"from": "gpt", "value": "ok " + " ".join(words)}]})
    path = tmp_path_factory.mktemp("data") / "chats.json"
    path.write_text(json.dumps(records))
    return path


def train(launcher: list[str], model_dir: Path, data: Path, out: Path, batch: int, *overrides: str,
          method: str = "medusa1") -> str:
    """Run to completion; returns stdout + stderr."""
    cmd = [
        *launcher, method, "+model=tiny", f"model.path={model_dir}", "model.dtype=fp32", "data=sharegpt", "data.self_distill=false",
        f"data.path={data}", "data.max_length=64", "data.validation_fraction=0.25", f"training.max_steps={STEPS}",
        "training.logging_steps=1", "training.save_steps=2", "training.warmup_steps=0", "training.learning_rate=0.01",
        f"training.per_device_train_batch_size={batch}", "method.num_heads=2", "eval.greedy_prompts=2",
        "eval.greedy_new_tokens=4", "logger=none", f"output_dir={out}", *overrides,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def one_process() -> list[str]:
    return [sys.executable, "-m", "train"]


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "train"]


def deepspeed_launcher() -> list[str]:
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus=2", f"--master_port={free_port()}", "--module", "train"]


def losses(out: Path, step: int = STEPS) -> dict[int, float]:
    state = json.loads((out / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


def heads(path: Path) -> dict[str, torch.Tensor]:
    return load_drafter(path).heads.state_dict()


def assert_same_heads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def assert_drafter_is_consolidated_zero_state(checkpoint: Path) -> None:
    """The heads rank 0 wrote == the fp32 master weights reassembled from every rank's ZeRO shard."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    prefix = "model.heads."  # LossModule.model -> MedusaTrainModule.heads
    masters = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    assert_same_heads(heads(checkpoint), masters, atol=0)


@pytest.fixture(scope="module")
def baseline(model_dir, data_file, tmp_path_factory) -> Path:
    """One process, no DeepSpeed, batch 4."""
    out = tmp_path_factory.mktemp("runs") / "one_process"
    train(one_process(), model_dir, data_file, out, 4)
    return out


@pytest.fixture(scope="module")
def zero3_run(model_dir, data_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "zero3"
    train(torchrun(), model_dir, data_file, out, 2, "deepspeed=zero3")
    return out


@pytest.mark.distributed
def test_zero3_torchrun_equals_one_process(baseline, zero3_run):
    expected = losses(baseline)
    assert len(expected) == STEPS
    got = losses(zero3_run)
    assert got.keys() == expected.keys()
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=LOSS_RTOL), (step, got, expected)
    assert_same_heads(heads(zero3_run), heads(baseline), atol=1e-4)
    assert_drafter_is_consolidated_zero_state(zero3_run / "checkpoints" / f"checkpoint-{STEPS}")
    config = load_drafter(zero3_run).config
    assert config["training"]["global_step"] == STEPS
    # evaluation runs the whole validation set in every process: the metrics equal one process's
    expected_metrics = load_drafter(baseline).config["training"]["metrics"]
    for key, value in expected_metrics.items():
        assert config["training"]["metrics"][key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.distributed
def test_soft_labels_under_zero3_equal_one_process(model_dir, data_file, tmp_path):
    """method.soft_labels reads the frozen target's lm_head (its draft-vocabulary rows), which ZeRO-3 partitions: read
    through the module, whose hooks gather it, the run equals one process (losses and heads)."""
    soft = ("method.soft_labels=1.0", "method.draft_vocab=64")
    one = train(one_process(), model_dir, data_file, tmp_path / "one", 4, *soft)
    three = train(torchrun(), model_dir, data_file, tmp_path / "zero3", 2, "deepspeed=zero3", *soft)
    assert "head1_soft_loss" in one and "head1_soft_loss" in three
    expected, got = losses(tmp_path / "one"), losses(tmp_path / "zero3")
    assert got.keys() == expected.keys()
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-4, abs=1e-5)
    assert_same_heads(heads(tmp_path / "zero3"), heads(tmp_path / "one"), atol=1e-4)


@pytest.mark.distributed
def test_zero3_resume_continues_exactly(model_dir, data_file, zero3_run, tmp_path):
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(zero3_run / "checkpoints" / "checkpoint-2", out / "checkpoints" / "checkpoint-2")
    log = train(torchrun(), model_dir, data_file, out, 2, "deepspeed=zero3", "training.resume_from_checkpoint=auto",
                "eval.greedy_prompts=0")
    assert f"resuming from {out / 'checkpoints' / 'checkpoint-2'}" in log
    # steps 3-4 ran in this process from the sharded optimizer state; they match the uninterrupted run
    resumed, full = losses(out), losses(zero3_run)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in resumed:
        assert resumed[step] == pytest.approx(full[step], rel=LOSS_RTOL), (step, resumed, full)
    assert_same_heads(heads(out), heads(zero3_run), atol=1e-6)


@pytest.mark.distributed
def test_medusa2_lora_steps_under_zero3_serve_in_the_engine(model_dir, data_file, tmp_path):
    # Joint training with the backbone's LoRA adapters and the heads partitioned across 2 processes.
    from inference.api import load
    from inference.engine.drafter import NoDrafter
    from inference.engine.loop import DecodeConfig, generate

    out = tmp_path / "medusa2_zero3"
    log = train(torchrun(), model_dir, data_file, out, 2, "deepspeed=zero3", "training.learning_rate=1e-3",
                method="medusa2")
    assert "greedy agreement with original" in log
    assert sorted(losses(out)) == list(range(1, STEPS + 1))
    assert load_drafter(out).config["training"]["global_step"] == STEPS
    engine = load(str(out), dtype="fp32")
    prompt = torch.tensor([[1, 5, 9, 14]])
    medusa = generate(engine.model, prompt, engine.drafter, DecodeConfig(max_new_tokens=8)).sequences[0]
    plain = generate(engine.model, prompt, NoDrafter(), DecodeConfig(max_new_tokens=8)).sequences[0]
    assert medusa == plain and len(medusa) == 8


LAUNCHERS = {"torchrun": torchrun, "deepspeed": deepspeed_launcher}


@pytest.mark.distributed
@pytest.mark.parametrize(("stage", "launcher"), [("zero2", "deepspeed"), ("zero2", "torchrun"), ("zero3", "deepspeed")])
def test_stage_under_launcher_equals_one_process(stage, launcher, baseline, model_dir, data_file, tmp_path):
    """Every ZeRO stage under both launchers (zero3 x torchrun is the zero3_run fixture, checked above)."""
    out = tmp_path / f"{stage}_{launcher}"
    train(LAUNCHERS[launcher](), model_dir, data_file, out, 2, f"deepspeed={stage}", "eval.greedy_prompts=0")
    expected, got = losses(baseline), losses(out)
    assert got.keys() == expected.keys()
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=LOSS_RTOL), (step, got, expected)
    assert_same_heads(heads(out), heads(baseline), atol=1e-4)
    assert_drafter_is_consolidated_zero_state(out / "checkpoints" / f"checkpoint-{STEPS}")
    assert load_drafter(out).config["training"]["global_step"] == STEPS  # the final checkpoint loads


@pytest.mark.distributed
def test_tensor_parallel_engine_decodes_like_one_process(model_dir, zero3_run, tmp_path):
    """The heads trained under ZeRO-3 serve a target sharded tensor-parallel over 2 processes (tp_plan="auto"):
    every rank's Medusa greedy tokens == one process's plain greedy tokens."""
    from inference import load
    from tests.tp_worker import NEW_TOKENS, PROMPT

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [*torchrun()[:-2], "-m", "tests.tp_worker", str(zero3_run), str(model_dir), str(tmp_path / "tokens")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    plain = load(None, base=str(model_dir), dtype="fp32").generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for rank in range(2):
        assert json.loads((tmp_path / f"tokens.{rank}.json").read_text()) == plain.sequences[0]


def test_hidden_size_autos_are_filled_and_the_rest_left_to_hf():
    config = OmegaConf.create({"train_batch_size": "auto", "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 7}})
    resolved = resolve_deepspeed_config(config, hidden_size=32)
    assert resolved["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 1024, "stage3_prefetch_bucket_size": 921,
                                             "stage3_param_persistence_threshold": 320, "stage3_max_live_parameters": 7}
    assert resolved["train_batch_size"] == "auto"
    assert resolve_deepspeed_config(None, hidden_size=32) is None


def test_launch_env_defaults_only_without_a_launcher():
    alone: dict[str, str] = {}
    assert ensure_launch_env(alone)
    assert alone["RANK"] == "0" and alone["WORLD_SIZE"] == "1" and alone["LOCAL_RANK"] == "0"
    assert alone["MASTER_ADDR"] == "127.0.0.1" and alone["MASTER_PORT"].isdigit()
    chosen_port = {"MASTER_PORT": "1234"}
    assert ensure_launch_env(chosen_port) and chosen_port["MASTER_PORT"] == "1234"
    launched = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "node-1", "MASTER_PORT": "29500"}
    assert not ensure_launch_env(launched) and launched["RANK"] == "3"
    assert not ensure_launch_env({"WORLD_SIZE": "2"})


def test_deepspeed_refuses_4bit_targets():
    from hydra import compose, initialize_config_module

    from train.cli import UsageError
    from train.config import register_configs
    from train.distributed import deepspeed_settings

    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["method=medusa1", "+model=tiny", "deepspeed=zero3",
                                                      "model.quantization=nf4"])
    with pytest.raises(UsageError, match="deepspeed=zero3 with model.quantization=nf4"):
        deepspeed_settings(cfg)


def test_gathered_is_a_no_op_for_ordinary_parameters():
    linear = torch.nn.Linear(3, 2)
    before = linear.weight.detach().clone()
    with gathered(linear.parameters()):
        assert linear.weight.shape == (2, 3)
    assert torch.equal(linear.weight, before)


def test_self_distillation_under_zero3_is_refused_only_when_the_gathered_target_would_not_fit():
    """Under ZeRO-3 the ranks gather the whole target to answer: weights over 90 % of a GPU's free memory are
    refused in one line naming both sizes; on a CPU (no free-memory figure) nothing is refused."""
    from train.cli import UsageError
    from train.distributed import GATHER_HEADROOM, check_gather_fits

    gib = 2**30
    check_gather_fits(int(GATHER_HEADROOM * 20 * gib), "zero3", free_bytes=20 * gib)
    with pytest.raises(UsageError, match=r"deepspeed=zero3 gathers the whole target .*\(16\.0 GiB of weights, "
                                         r"15\.0 GiB free\): write the answers first with scripts/self_distill.py"):
        check_gather_fits(16 * gib, "zero3", free_bytes=15 * gib)
    if not torch.cuda.is_available():
        check_gather_fits(10**15, "zero3")
