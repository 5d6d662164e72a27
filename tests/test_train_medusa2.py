"""Medusa-2 end to end: the quality guard leaves a QLoRA backbone trainable, the checkpoint (heads + adapter or merged
backbone) round-trips and loads as the trained target, and `python -m train medusa2` runs for LoRA, QLoRA and full
fine-tuning on a tiny random model."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data.chat import encode_chat, encode_prompt
from data.collate import ChatCollator
from models.checkpoint import BackboneWriter, backbone_folder, load_drafter, load_drafter_target, save_drafter
from models.loading import load_target, load_tokenizer
from models.medusa import MedusaConfig, MedusaHeads
from tests.medusa2_support import medusa2_config
from tests.model_support import save_tiny_model
from tests.data_support import random_chats

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def nf4_model_dir(tmp_path_factory) -> Path:
    """Hidden 64: every 4-bit layer's width is a multiple of bitsandbytes' 64-value quantisation block."""
    return save_tiny_model(tmp_path_factory.mktemp("models") / "llama64", hidden_size=64)


def chats(n: int, seed: int = 0) -> list[list[dict]]:
    return random_chats(n, seed=seed)


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory) -> Path:
    records = [{"id": str(i), "conversations": [{"from": "human", "value": c[0]["content"]},
                                                {"from": "gpt", "value": c[1]["content"]}]}
               for i, c in enumerate(chats(40))]
    path = tmp_path_factory.mktemp("data") / "chats.json"
    path.write_text(json.dumps(records))
    return path


def batches_and_prompts(tokenizer, n: int = 4):
    samples = [encode_chat(tokenizer, c, max_length=64) for c in chats(n, seed=1)]
    collate = ChatCollator(tokenizer.pad_token_id)
    batches = [collate([{"input_ids": s.input_ids, "labels": s.labels} for s in samples[i : i + 2]]) for i in range(0, n, 2)]
    return batches, [encode_prompt(tokenizer, c[:1]) for c in chats(2, seed=2)]


def build(model_dir: Path, *overrides: str, dtype: str = "fp32", quantization: str | None = None):
    from train.medusa2 import Method

    cfg = medusa2_config(f"model.path={model_dir}", f"model.dtype={dtype}", f"model.quantization={quantization or 'null'}",
                         "method.num_heads=2", "method.lora_r=4", "eval.greedy_prompts=2", "eval.greedy_new_tokens=4",
                         "training.per_device_eval_batch_size=2", *overrides)
    method = Method(cfg)
    tokenizer = load_tokenizer(str(model_dir))
    model = method.build(load_target(str(model_dir), dtype=dtype, quantization=quantization), tokenizer)
    return method, model, tokenizer


def test_guard_keeps_qlora_trainable(nf4_model_dir):
    """No forward of the guard, the evaluation or the KL teacher runs a Linear4bit layer in the mode that repacks its
    weight (eval mode, input without grad); afterwards a training step still reaches every LoRA layer. With fresh
    adapters (B = 0) the backbone IS the original: the guard must report identical numbers."""
    bnb = pytest.importorskip("bitsandbytes")
    method, model, tokenizer = build(nf4_model_dir, "method.lm_loss=kl", dtype="bf16", quantization="nf4")
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    repack_mode = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda m, args: repack_mode.append(not m.training and not args[0].requires_grad))
    batches, prompts = batches_and_prompts(tokenizer)

    model.eval()  # as DraftTrainer.evaluate calls it
    metrics = method.evaluate(model, batches, tokenizer, prompts)
    model.train()
    out = method.forward_loss(model, batches[0])
    out.loss.backward()

    assert layers and repack_mode and not any(repack_mode)
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    assert metrics["guard_loss_after"] == pytest.approx(metrics["guard_loss_before"], abs=1e-6)
    assert metrics["guard_greedy_agreement"] == 1.0 and out.metrics["lm_kl"].abs() < 1e-6
    lora_b = [(n, p) for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in lora_b), "a LoRA layer got no gradient"
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.heads.parameters() if p.ndim == 2)


def perturb(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_checkpoint_round_trip(model_dir, tmp_path):
    out = tmp_path / "run"
    method, model, tokenizer = build(model_dir, f"output_dir={out}")
    perturb(model)
    method.save(model, out, tokenizer, {"method": "medusa2"})
    assert backbone_folder(out) == ("lora_adapter", out / "adapter")
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    for a, b in zip(load_drafter(out).heads.parameters(), model.heads.parameters()):
        assert torch.equal(a, b)

    ids = torch.randint(3, 300, (2, 8))
    model.target.eval()
    served = load_drafter_target(out, dtype="fp32")  # the engine's loader: base + adapter, merged
    torch.testing.assert_close(logits(served, ids), logits(model.target, ids), rtol=1e-4, atol=1e-4)

    method2, model2, _ = build(model_dir, f"output_dir={out}")
    method2.load(model2, out)  # resume
    for (name, a), (_, b) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(a, b), name

    merged_method, _, _ = build(model_dir, f"output_dir={out}", "method.merge_adapter=true")
    merged_method.save(model, out, tokenizer, {"method": "medusa2"})  # final directory: merged into a full backbone
    assert backbone_folder(out) == ("merged", out / "backbone")
    served = load_drafter_target(out, dtype="fp32")
    torch.testing.assert_close(logits(served, ids), logits(model.target, ids), rtol=1e-4, atol=1e-4)


def test_full_checkpoint_round_trip(model_dir, tmp_path):
    method, model, tokenizer = build(model_dir, "method.backbone=full")
    perturb(model)
    method.save(model, tmp_path / "ckpt", tokenizer, {})
    assert backbone_folder(tmp_path / "ckpt") == ("merged", tmp_path / "ckpt" / "backbone")
    method2, model2, _ = build(model_dir, "method.backbone=full")
    method2.load(model2, tmp_path / "ckpt")
    for (name, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), name


def test_backbone_subfolder_is_replaced_whole(tmp_path):
    heads = MedusaHeads(MedusaConfig(num_heads=1, num_layers=1, hidden_size=4, vocab_size=5))

    def writer(files: dict[str, str]) -> BackboneWriter:
        return BackboneWriter("lora_adapter", lambda folder: [(folder / k).write_text(v) for k, v in files.items()])

    save_drafter(tmp_path / "ckpt", heads, "base", backbone=writer({"a.txt": "1", "stale.txt": "x"}))
    save_drafter(tmp_path / "ckpt", heads, "base", backbone=writer({"a.txt": "2"}))
    assert sorted(p.name for p in (tmp_path / "ckpt" / "adapter").iterdir()) == ["a.txt"]
    assert (tmp_path / "ckpt" / "adapter" / "a.txt").read_text() == "2"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporaries left
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["backbone"] == {"format": "lora_adapter", "path": "adapter"}


def train(model_dir: Path, data: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "train", "medusa2", "+model=tiny", f"model.path={model_dir}", "model.dtype=fp32", "data.self_distill=false",
        "data=sharegpt", f"data.path={data}", "data.max_length=64", "data.validation_fraction=0.25",
        "training.max_steps=3", "training.per_device_train_batch_size=2", "training.logging_steps=1",
        "method.num_heads=2", "method.lora_r=4", "eval.greedy_prompts=2", "eval.greedy_new_tokens=6", "logger=none",
        f"output_dir={out}", *overrides,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def test_lora_two_stages_with_self_distillation_loss(model_dir, sharegpt_file, tmp_path):
    """Stage 1 from a medusa1 checkpoint's heads (2 residual layers, unlike the method's 1), one more heads-only
    step, then joint steps with the KL-to-original LM term and a linear head schedule."""
    stage1 = tmp_path / "stage1"
    torch.manual_seed(0)
    save_drafter(stage1, MedusaHeads(MedusaConfig(num_heads=2, num_layers=2, hidden_size=32, vocab_size=400)), str(model_dir))
    out = tmp_path / "lora"
    result = train(model_dir, sharegpt_file, out, f"method.init_heads={stage1}", "method.heads_warmup_steps=1",
                   "method.lm_loss=kl", "method.head_schedule=linear")
    assert_ok(result)
    assert "base-model quality guard" in result.stdout and "greedy agreement with original" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["backbone"] == {"format": "lora_adapter", "path": "adapter"} and config["num_layers"] == 2
    metrics = config["training"]["metrics"]
    assert metrics["eval_guard_ppl_before"] > 1 and 0.0 <= metrics["eval_guard_greedy_agreement"] <= 1.0
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert all(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)  # the joint steps trained the backbone
    logged = [float(w) for w in re.findall(r"'head_term_weight': '([-0-9.e]+)'", result.stdout + result.stderr)]
    assert logged == [0.0, 0.1]  # step 1 heads only; then c · s with s linear over the 2 joint steps: 0, 1/2
    assert "'lm_kl'" in result.stdout + result.stderr


def test_qlora_evaluates_midway_keeps_training_and_merges(nf4_model_dir, sharegpt_file, tmp_path):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "qlora"
    result = train(nf4_model_dir, sharegpt_file, out, "model.quantization=nf4", "model.dtype=bf16",
                   "training.eval_steps=2", "training.save_steps=1", "method.merge_adapter=true",
                   "training.learning_rate=1e-2")
    assert_ok(result)
    # Step 3 ran after the step-2 evaluation: every LoRA layer still moved.
    before = load_file(str(out / "checkpoints" / "checkpoint-2" / "adapter" / "adapter_model.safetensors"))
    after = load_file(str(out / "checkpoints" / "checkpoint-3" / "adapter" / "adapter_model.safetensors"))
    moved = [not torch.equal(before[k], after[k]) for k in before if "lora_B" in k]
    assert moved and all(moved)
    assert backbone_folder(out) == ("merged", out / "backbone")
    served = load_drafter_target(out, dtype="fp32")  # the adapter merged into unquantized weights: a plain model
    assert not any("4bit" in type(m).__name__ or "lora" in type(m).__module__ for m in served.modules())


def test_full_finetuning_warns_when_perplexity_rises(model_dir, sharegpt_file, tmp_path):
    """Gradient ascent on the LM loss (λ0 < 0) must trip the guard's loud warning."""
    out = tmp_path / "full"
    result = train(model_dir, sharegpt_file, out, "method.backbone=full", "method.lm_weight=-1.0",
                   "training.learning_rate=1e-2", "training.warmup_steps=0")
    assert_ok(result)
    metrics = json.loads((out / "config.json").read_text())["training"]["metrics"]
    assert metrics["eval_guard_ppl_increase"] > 0.02
    assert "WARNING !!! base-model perplexity rose" in result.stdout
    assert backbone_folder(out) == ("merged", out / "backbone")
