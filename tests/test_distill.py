"""Draft-model distillation: each divergence equals a naive reference (values and gradients), the on-policy sampler
labels only sampled tokens, and `python -m train distill` writes a checkpoint the inference engine serves."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.chat import IGNORE_INDEX
from tests.conftest import build_tiny_lm
from tests.model_support import save_tiny_model
from train.distill import DIVERGENCES, acceptance, divergence, sample_responses
from tests.data_support import random_chats, write_sharegpt

ROOT = Path(__file__).resolve().parents[1]


def naive(p_logits: list[float], q_logits: list[float], kind: str, beta: float, tau: float) -> float:
    """Textbook formulas over python floats, one position."""
    def softmax(xs):
        e = [math.exp(x / tau) for x in xs]
        return [v / sum(e) for v in e]

    p, q = softmax(p_logits), softmax(q_logits)
    kl = lambda a, b: sum(x * math.log(x / y) for x, y in zip(a, b))  # noqa: E731
    if kind == "fkl":
        return kl(p, q)
    if kind == "rkl":
        return kl(q, p)
    if kind == "jsd":
        m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
        return beta * kl(p, m) + (1 - beta) * kl(q, m)
    return 0.5 * sum(abs(x - y) for x, y in zip(p, q))


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_divergence_matches_naive_reference(kind):
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(5, 11, generator=g, dtype=torch.float64) * 2
    student = (torch.randn(5, 11, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    beta, tau = 0.3, 1.7
    got = divergence(teacher, student, kind, beta, tau)
    want = [naive(t.tolist(), s.tolist(), kind, beta, tau) for t, s in zip(teacher, student.detach())]
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)
    assert bool((got >= -1e-6).all())
    # Gradients: autograd through the fused form equals central differences of the naive formula.
    got.sum().backward()
    eps, row, col = 1e-5, 2, 4
    plus, minus = student.detach().clone(), student.detach().clone()
    plus[row, col] += eps
    minus[row, col] -= eps
    numeric = (naive(teacher[row].tolist(), plus[row].tolist(), kind, beta, tau)
               - naive(teacher[row].tolist(), minus[row].tolist(), kind, beta, tau)) / (2 * eps)
    assert student.grad[row, col].item() == pytest.approx(numeric, rel=1e-2, abs=1e-4)


def test_equal_distributions_have_zero_divergence_and_full_acceptance():
    logits = torch.randn(3, 7)
    for kind in DIVERGENCES:
        assert torch.allclose(divergence(logits, logits, kind), torch.zeros(3), atol=1e-6)
    assert torch.allclose(acceptance(logits, logits), torch.ones(3))
    p, q = torch.softmax(logits, -1), torch.softmax(logits.flip(-1), -1)
    assert torch.allclose(acceptance(logits, logits.flip(-1)), torch.minimum(p, q).sum(-1), atol=1e-6)


def test_sample_responses_labels_only_sampled_tokens():
    model = build_tiny_lm("llama", seed=0)
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 10, 11, 0, 0]])  # right-padded; prompts of 3 and 2 tokens
    labels = torch.tensor([[IGNORE_INDEX] * 3 + [8, 9, IGNORE_INDEX], [IGNORE_INDEX] * 2 + [10, 11] + [IGNORE_INDEX] * 2])
    torch.manual_seed(0)
    out, mask, new_labels = sample_responses(model, ids, labels, 6, 1.0, pad_token_id=0, eos_token_id=2)
    assert out.shape == mask.shape == new_labels.shape and out.shape[1] == 3 + 6
    assert out[0, :3].tolist() == [5, 6, 7] and out[1, 1:3].tolist() == [5, 6] and mask[1, 0] == 0
    assert bool((new_labels[:, :3] == IGNORE_INDEX).all())
    for row in range(2):
        gen, lab = out[row, 3:].tolist(), new_labels[row, 3:].tolist()
        end = gen.index(2) + 1 if 2 in gen else len(gen)
        assert lab[:end] == gen[:end] and all(x == IGNORE_INDEX for x in lab[end:])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    return save_tiny_model(root / "target", seed=0), save_tiny_model(root / "draft", seed=1)


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory) -> Path:
    return write_sharegpt(tmp_path_factory.mktemp("data") / "chats.json", random_chats(24))


def run_distill(target: Path, draft: Path, data: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "train", "distill", "+model=tiny", f"model.path={target}", "model.dtype=fp32", "data.self_distill=false",
        f"method.draft={draft}", "data=sharegpt", f"data.path={data}", "data.max_length=48",
        "data.validation_fraction=0.25", "training.max_steps=3", "training.per_device_train_batch_size=2",
        "training.logging_steps=1", "training.learning_rate=5e-3", "eval.greedy_prompts=0", "logger=none",
        f"output_dir={out}", *overrides,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def test_distill_run_writes_a_served_draft_model(models, sharegpt_file, tmp_path):
    from inference.api import load
    from inference.drafters.draft_model import DraftModelDrafter

    target, draft = models
    out = tmp_path / "run"
    result = run_distill(target, draft, sharegpt_file, out, "method.divergence=jsd", "method.on_policy_fraction=0.5",
                         "method.max_new_tokens=8")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "alpha = 1 - TV" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["drafter_type"] == "draft_model" and config["base_model_name_or_path"] == str(target)
    metrics = config["training"]["metrics"]
    assert 0 <= metrics["eval_initial_alpha"] <= 1 and 0 <= metrics["eval_alpha"] <= 1
    assert metrics["eval_alpha"] != metrics["eval_initial_alpha"]  # the draft trained
    engine = load(out, dtype="fp32")
    assert isinstance(engine.drafter, DraftModelDrafter)
    plain = load(base=str(target), dtype="fp32")
    prompt = [5, 6, 7, 8]
    assert engine.generate(prompt, 10, ignore_eos=True).sequences == plain.generate(prompt, 10, ignore_eos=True).sequences


@pytest.mark.parametrize("override, message", [
    ({"jsd_beta": 1.0}, "method.jsd_beta=1.0: must be in (0, 1)"),
    ({"on_policy_fraction": 1.5}, "method.on_policy_fraction=1.5: must be in [0, 1]"),
    ({"temperature": 0.0}, "method.temperature=0.0: must be > 0"),
])
def test_bad_settings_name_the_key(override, message):
    from omegaconf import OmegaConf

    from train.cli import UsageError
    from train.config import DistillConfig
    from train.distill import Method

    cfg = OmegaConf.create({"seed": 0, "method": OmegaConf.structured(DistillConfig(**override))})
    with pytest.raises(UsageError) as info:
        Method(cfg)
    assert str(info.value) == message


def test_draft_from_a_model_config_name():
    from train.distill import draft_path

    assert draft_path("tiny-draft") == "builtin:tiny-draft"  # conf/model/tiny-draft.yaml
    assert draft_path("/some/dir") == "/some/dir" and draft_path("org/model") == "org/model"


def test_response_logits_equal_the_full_forwards_response_positions():
    """The lm_head applied to the response positions only gives the full forward's logits there (left padding
    included)."""
    from train.distill import plain_readout, response_logits

    model = build_tiny_lm("llama", seed=3)
    assert plain_readout(model)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [5, 6, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, 5:], labels[1, 3:6] = ids[0, 5:], ids[1, 3:6]
    from models.backbone import padded_position_ids

    full = model(input_ids=ids, attention_mask=mask, position_ids=padded_position_ids(mask)).logits  # [B, T, V]
    expected = torch.cat([full[0, 4:6], full[1, 2:5]])  # positions t predicting labelled t + 1
    got = response_logits(model, ids, mask, labels)
    assert got.shape == expected.shape == (5, model.config.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_frozen_early_exit_draft_shares_the_targets_embeddings(sharegpt_file, tmp_path, monkeypatch):
    """method.freeze_embeddings=true on an early-exit draft: the embeddings/lm_head stay the target's, the checkpoint
    leaves them out (shared_with_target), serving takes the target's own tensor, the result decodes exactly like the
    target, the bare draft/ folder is refused, and a resumed run finds its checkpoint loadable."""
    from safetensors import safe_open

    from inference.api import load
    from inference.drafters.draft_model import DraftModelDrafter
    from models.checkpoint import DrafterMismatchError
    from models.draft_model import load_draft_model

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    target = save_tiny_model(tmp_path / "target", seed=0, layers=3, tied=True, initializer_range=0.2)
    out = tmp_path / "run"
    args = (f"method.draft=early_exit:{target}:1", "method.freeze_embeddings=true", "training.save_steps=2")
    result = run_distill(target, target, sharegpt_file, out, *args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    config = json.loads((out / "config.json").read_text())
    shared = config["draft_model"]["shared_with_target"]
    assert "model.embed_tokens.weight" in shared
    metrics = config["training"]["metrics"]
    assert metrics["eval_alpha"] != metrics["eval_initial_alpha"]  # the decoder layer trained
    with safe_open(str(out / "draft" / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert stored and not stored & set(shared) and "lm_head.weight" not in stored

    engine = load(out, dtype="fp32")
    assert isinstance(engine.drafter, DraftModelDrafter)
    assert engine.drafter.model.get_input_embeddings().weight is engine.model.get_input_embeddings().weight
    plain = load(base=str(target), dtype="fp32")
    prompt = [5, 6, 7, 8]
    assert engine.generate(prompt, 10, ignore_eos=True).sequences == plain.generate(prompt, 10, ignore_eos=True).sequences
    with pytest.raises(DrafterMismatchError, match="load the checkpoint folder above it"):
        load_draft_model(out / "draft", engine.model, torch.device("cpu"))

    resumed = run_distill(target, target, sharegpt_file, out, *args, "training.max_steps=4",
                          "training.resume_from_checkpoint=auto")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    assert json.loads((out / "config.json").read_text())["training"]["global_step"] == 4


def test_shared_tensor_of_another_model_is_refused(tmp_path):
    """A checkpoint that takes its embeddings from its target refuses a target whose embeddings differ."""
    from models.shared_tensors import DrafterMismatchError, attach_shared, shared_with_target

    target, other = build_tiny_lm("llama", seed=0), build_tiny_lm("llama", seed=1)
    draft = build_tiny_lm("llama", seed=2)
    draft.get_input_embeddings().weight = target.get_input_embeddings().weight
    shared = shared_with_target(draft, target)
    assert list(shared) == ["model.embed_tokens.weight"]  # its own lm_head is stored
    attach_shared(draft, target.to(torch.bfloat16).float(), shared, "ckpt")  # a bf16 round trip still matches
    with pytest.raises(DrafterMismatchError, match="ckpt: the draft takes model.embed_tokens.weight"):
        attach_shared(draft, other, shared, "ckpt")
