"""The two private methods of transformers' Trainer that draftsmith overrides, and only these, kept here.

Neither has a public equivalent in transformers 5.24:

* `_load_from_checkpoint(resume_from_checkpoint, model=None)`: `Trainer.train(resume_from_checkpoint=...)` is the only
  public way to restore the optimizer, scheduler, RNG and trainer state, and it loads the model's weights through
  this method, which looks for HF's whole-model files. A drafter checkpoint holds the trainable modules only, in the
  draftsmith format (models.checkpoint), so the weights load through `TrainMethod.load` instead. Loading them before
  `train()` does not help: `train()` would still call this method and fail on the missing HF files. (Under DeepSpeed
  Trainer loads DeepSpeed's own checkpoint instead and never calls it.)
* `_init_training_state(...)`: a run resumed from a checkpoint written at training.max_steps, when max_steps ends
  mid-epoch, trains one step past it: the step loop checks for the end only after a step, and no callback runs
  between the state restore and that step that could stop it (`on_step_begin` cannot skip the step). Skipping
  `train()` for such a checkpoint would leave a DeepSpeed engine uninitialised (ZeRO-3 evaluation needs it).

tests/test_resume.py checks the behaviour; tests/test_trainer_hooks.py fails loudly when transformers renames these
methods, changes their parameters, or stops calling them (an override that is silently not called would resume
wrongly without an error). `check_private_hooks` makes the same signature check at run time.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from transformers import Trainer

# The parameters (after self) of each overridden private method, as transformers 5.24 declares them.
PRIVATE_HOOKS: dict[str, tuple[str, ...]] = {
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_init_training_state": ("max_steps", "num_update_steps_per_epoch", "num_train_epochs", "resume_from_checkpoint",
                             "trial"),
}


def private_hook_mismatch() -> str | None:
    """Which overridden private Trainer method is gone or takes other parameters than PRIVATE_HOOKS says, or None."""
    for name, expected in PRIVATE_HOOKS.items():
        method = getattr(Trainer, name, None)
        if method is None:
            return f"transformers.Trainer.{name} no longer exists"
        found = tuple(inspect.signature(method).parameters)[1:]
        if found != expected:
            return f"transformers.Trainer.{name}{found} takes other parameters than {expected}"
    return None


def check_private_hooks() -> None:
    """Refuse to train with a transformers whose private Trainer methods changed (resume would silently misbehave)."""
    problem = private_hook_mismatch()
    if problem:
        import transformers

        raise RuntimeError(f"{problem} (transformers {transformers.__version__}): train.trainer_hooks needs updating")


class ResumeHooks(Trainer):
    """Trainer with the two private overrides; the subclass says how its weights load (`load_resumed_weights`)."""

    def load_resumed_weights(self, checkpoint_dir: Path) -> None:
        raise NotImplementedError(f"{type(self).__name__} must say how a checkpoint's weights load")

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self.load_resumed_weights(Path(resume_from_checkpoint))

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                             trial) -> tuple[int, int]:
        """Resumed at (or past) max_steps: report every epoch done, so the loop trains no more (a run killed after
        its last checkpoint then resumes to the same weights)."""
        epochs, steps = super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs,
                                                     resume_from_checkpoint, trial)
        if resume_from_checkpoint is not None and self.state.global_step >= max_steps:
            return num_train_epochs, 0
        return epochs, steps
