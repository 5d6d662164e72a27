"""Resuming a run: which trainer checkpoint is complete, which one `training.resume_from_checkpoint` names, and
whether it was written with the values this run has (train.config.RESUME_KEYS)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from models.checkpoint import CheckpointError, read_drafter_config
from train.config import RESUME_KEYS
from train.distributed import is_main_process

log = logging.getLogger("draftsmith")


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a complete trainer checkpoint, or None when it is.

    HF Trainer writes a checkpoint in this order: weights (our atomic save, config.json last), optimizer, scheduler,
    RNG state, then trainer_state.json last (tests/test_resume.py pins that order). So a checkpoint is complete when
    config.json exists and trainer_state.json parses (a kill can cut its non-atomic write short) and names the step.
    """
    if not path.is_dir():
        return "no such directory"
    if not (path / "config.json").is_file():
        return "no config.json (the weights were not completely written)"
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except FileNotFoundError:
        return "no trainer_state.json (the checkpoint was not completely written)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"trainer_state.json is unreadable ({e})"
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return "trainer_state.json has no global_step"
    return None


def resolve_resume(setting: str | None, checkpoints_dir: Path) -> str | None:
    """"auto" -> newest complete trainer checkpoint (see `checkpoint_problem`), else None; a path -> that path,
    which must be complete. Torn checkpoints are skipped with a warning; on the main process, temporary directories
    left by a killed write (of a checkpoint, or of the final output next to `checkpoints_dir.parent`) are removed."""
    if setting in (None, "", "none"):
        return None
    if setting != "auto":
        problem = checkpoint_problem(Path(setting))
        if problem:
            raise CheckpointError(f"training.resume_from_checkpoint={setting}: not a complete checkpoint ({problem})")
        return setting
    if is_main_process():
        output_dir = checkpoints_dir.parent
        for stale in [*checkpoints_dir.glob(".checkpoint-*.tmp-*"), *output_dir.parent.glob(f".{output_dir.name}.tmp-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # models.checkpoint.atomic_write_dir temporaries
    found = [p for p in checkpoints_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    steps = {p: int(p.name.split("-")[-1]) for p in found}
    for path in sorted(steps, key=steps.get, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        log.warning("not resuming from %s: %s", path, problem)
    return None


def check_resume(cfg: DictConfig, checkpoint: Path) -> None:
    """Refuse, in one line and before any model loads, to resume a trainer checkpoint written with other values of
    the keys that fix what it holds (train.config.RESUME_KEYS); a checkpoint without a recorded config passes (its
    weights then fail to load with their own message)."""
    saved = read_drafter_config(checkpoint).get("training", {}).get("config")
    if not isinstance(saved, dict):
        return
    current = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    for key in RESUME_KEYS.get(cfg.method.name, ()):
        old, new = _lookup(saved, key), _lookup(current, key)
        if old != new and not (key == "model.path" and _same_directory(old, new)):
            raise CheckpointError(
                f"{checkpoint} was trained with {key}={_override_value(old)}, this run has {key}="
                f"{_override_value(new)}: pass {key}={_override_value(old)} to resume it, or choose another output_dir")


def _lookup(config: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def _same_directory(a: Any, b: Any) -> bool:
    paths = [Path(str(p)).expanduser() for p in (a, b)]
    return all(p.is_dir() for p in paths) and paths[0].resolve() == paths[1].resolve()


def _override_value(value: Any) -> str:
    """How the value is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    return str(value)
