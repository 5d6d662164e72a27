"""Bad inputs at the real entry points, and storage failures (the corpus of bad inputs, each refused with one exact
line through the call that must refuse it, is tests/test_bad_inputs.py).

The entry points: `python -m train ...` and `python -m inference ...` in a subprocess refuse a user error with one
stderr line, its exit code and no traceback, before any model loads. The storage tests check that a failed save is
one line and leaves no half-written output.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from models.checkpoint import CheckpointError, load_drafter, save_drafter
from tests.bad_inputs_support import CASES_DIR, ROOT, Workspace, composed, tiny_heads, two_head_run
from tests.bad_inputs_support import saved_model  # noqa: F401 (a fixture)
from tests.model_support import save_tiny_model, tiny_config
from train.config import register_configs
from train.resume import resolve_resume


def test_cli_exit_codes_and_single_line(tmp_path):
    """The real entry point: a config error is one stderr line and exit code 2, before anything is written."""
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "train", "medusa1", "+model=tiny", "training.lerning_rate=1", f"output_dir={out}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert lines == ["error: unknown config key 'training.lerning_rate'; did you mean 'training.learning_rate'?"], lines
    assert not out.exists()


def entry_point_errors(ws: Workspace) -> dict[str, tuple[list[str], int, str]]:
    """User errors at the entry points: id -> (argv after `python`, exit code, text of the one error line). Each
    is refused before any model loads, so none writes to its output_dir but Hydra's own log."""
    model = str(ws.model)
    draft = ws.tmp / "draft"
    tiny_config(vocab_size=512).save_pretrained(draft)
    resumed = ws.tmp / "resumed"
    run = ["-m", "train", "medusa1", "+model=tiny", f"model.path={model}", "model.dtype=fp32", "logger=none"]
    return {
        "negative-decay": ([*run, "method.decay=-1", f"output_dir={ws.tmp / 'decay'}"], 2,
                           "method.decay=-1.0: must be in (0, 1]"),
        "bad-trajectories": (["-m", "train", "cllm", "+model=tiny", f"model.path={model}", "logger=none",
                              f"method.trajectories={CASES_DIR / 'trajectory_token_out_of_vocab.jsonl'}",
                              f"output_dir={ws.tmp / 'cllm'}"], 1, "trajectory_token_out_of_vocab.jsonl:3: "),
        "draft-vocab-before-self-distillation": (
            ["-m", "train", "distill", "+model=tiny", f"model.path={model}", f"method.draft={draft}", "logger=none",
             "data.self_distill=true", "data.self_distill_samples=2", f"output_dir={ws.tmp / 'distill'}"], 1,
            "the draft model has a vocabulary of 512 tokens"),
        "resume-other-head-count": ([*run, "method.num_heads=3", "training.resume_from_checkpoint=auto",
                                     f"output_dir={resumed}"], 1, "was trained with method.num_heads=2"),
        "data-file-missing": ([*run, "data=sharegpt", f"data.path={ws.tmp / 'nope.json'}",
                               f"output_dir={ws.tmp / 'nodata'}"], 1,
                              f"data.path={ws.tmp / 'nope.json'}: no such file or directory"),
        "inference-nf4-narrow-layers": (["-m", "inference", "generate", "--base", model, "--quantization", "nf4",
                                         "--prompt", "hi", "--device", "cpu"], 2,
                                        "in_features=32, not a multiple of the 64-value quantisation block"),
    }


ENTRY_POINT_CASES = ["negative-decay", "bad-trajectories", "draft-vocab-before-self-distillation",
                     "resume-other-head-count", "data-file-missing", "inference-nf4-narrow-layers"]


@pytest.mark.parametrize("case", ENTRY_POINT_CASES)
def test_entry_points_refuse_user_errors_in_one_line_without_traceback(case, saved_model, tmp_path):
    ws = Workspace(tmp=tmp_path, model=saved_model)
    argv, code, needle = entry_point_errors(ws)[case]
    if case == "resume-other-head-count":
        two_head_run(tmp_path / "resumed", f"model.path={saved_model}", "model.dtype=fp32", "logger=none")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    result = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    output = result.stdout + result.stderr
    assert result.returncode == code, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert "Loading weights" not in output  # refused before any model loaded
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert {p: b for p, b in after.items() if p in before} == before  # nothing overwritten
    new = [p.relative_to(tmp_path) for p in after if p not in before]
    assert all(".hydra" in p.parts or p.name == "train.log" for p in new), new  # no data generated, no checkpoint


# --- storage failures: one line, and no half-written output ---

def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_during_save_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr("models.checkpoint.save_file", _no_space)
    with pytest.raises(CheckpointError, match=r"^.*/out: cannot write checkpoint \(No space left on device\)$"):
        save_drafter(tmp_path / "out", tiny_heads(), "base")
    assert list(tmp_path.iterdir()) == []  # neither the checkpoint nor its temporary sibling


def test_disk_full_over_a_checkpoint_keeps_the_old_one(tmp_path, monkeypatch):
    old = save_drafter(tmp_path / "out", tiny_heads(num_heads=2), "base")
    monkeypatch.setattr("models.checkpoint.save_file", _no_space)
    with pytest.raises(CheckpointError):
        save_drafter(old, tiny_heads(num_heads=3), "base")
    assert load_drafter(old).heads.config.num_heads == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_save_under_a_regular_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError) as info:
        save_drafter(tmp_path / "file" / "out", tiny_heads(), "base")
    assert str(info.value) == f"{tmp_path}/file/out: cannot write checkpoint ({tmp_path}/file is a file, not a directory)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_storage_oserror_from_the_run_is_one_line(monkeypatch, capsys):
    """An OSError of the storage raised anywhere in the run (e.g. Trainer writing trainer_state.json) is one line."""
    from train.cli import run_task

    def full_disk(cfg):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/checkpoints/checkpoint-4/trainer_state.json")

    cfg = composed("medusa1")
    monkeypatch.setattr("train.task.run", full_disk)
    with pytest.raises(SystemExit) as exit_info:
        run_task(cfg)
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.strip() == (
        "error: /runs/x/checkpoints/checkpoint-4/trainer_state.json: No space left on device")

    def bug(cfg):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))  # not the storage: a program error keeps its traceback

    monkeypatch.setattr("train.task.run", bug)
    with pytest.raises(OSError):
        run_task(cfg)


def test_disk_full_during_a_training_run(tmp_path, monkeypatch, capsys):
    """End to end in-process (Hydra task function): the first trainer checkpoint hits ENOSPC -> one line, exit 1, and
    no checkpoint that resume=auto would pick up."""
    from hydra import compose, initialize_config_module

    from train.resume import checkpoint_problem
    from train.cli import run_task

    model = save_tiny_model(tmp_path / "model")
    out = tmp_path / "run"
    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "method=medusa1", "+model=tiny", f"model.path={model}", "model.dtype=fp32", "data=sharegpt", "data.self_distill=false",
            f"data.path={CASES_DIR / 'one_too_long.jsonl'}", "data.validation_fraction=0", "data.max_length=32",
            "training.max_steps=2", "training.save_steps=1", "training.per_device_train_batch_size=1",
            "method.num_heads=1", "eval.greedy_prompts=0", "logger=none", f"output_dir={out}",
        ])
    monkeypatch.setattr("models.checkpoint.save_file", _no_space)
    with pytest.raises(SystemExit) as exit_info:
        run_task(cfg)
    assert exit_info.value.code == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {out}/checkpoints/checkpoint-1: cannot write checkpoint (No space left on device)"]
    assert not list((out / "checkpoints").glob(".*tmp*")) and not (out / "config.json").exists()
    assert resolve_resume("auto", out / "checkpoints") is None
    assert all(checkpoint_problem(p) for p in (out / "checkpoints").glob("checkpoint-*"))
