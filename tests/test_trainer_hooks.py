"""train.trainer_hooks overrides two private Trainer methods: fail loudly when transformers changes them.

tests/test_resume.py checks what the overrides do (resumed weights bit for bit, no step past max_steps); these tests
check that transformers still has, calls and declares them as the overrides assume, so an upgrade fails here
instead of resuming wrongly without an error."""

from __future__ import annotations

import inspect

import pytest
from transformers import Trainer

from train.trainer import DraftTrainer
from train.trainer_hooks import PRIVATE_HOOKS, ResumeHooks, check_private_hooks, private_hook_mismatch


def test_private_trainer_methods_keep_their_signatures():
    for name, expected in PRIVATE_HOOKS.items():
        assert tuple(inspect.signature(getattr(Trainer, name)).parameters)[1:] == expected, name
        ours = tuple(inspect.signature(getattr(ResumeHooks, name)).parameters)[1:]
        assert ours == expected, f"ResumeHooks.{name} must take Trainer's parameters"
    assert private_hook_mismatch() is None
    check_private_hooks()


def test_trainer_still_calls_the_private_methods():
    """train() loads the resumed weights through _load_from_checkpoint (outside DeepSpeed/FSDP), and the inner loop
    sets up the resumed state through _init_training_state: an override nobody calls would be silently inert."""
    assert "self._load_from_checkpoint(resume_from_checkpoint)" in inspect.getsource(Trainer.train)
    assert "self._init_training_state(" in inspect.getsource(Trainer._inner_training_loop)


def test_only_the_hooks_module_overrides_private_trainer_methods():
    """DraftTrainer overrides public Trainer methods only; the private ones live in ResumeHooks."""
    own = {n for n in vars(DraftTrainer) if n.startswith("_") and not n.startswith("__") and hasattr(Trainer, n)}
    assert own == set()
    assert {n for n in vars(ResumeHooks) if hasattr(Trainer, n) and not n.startswith("__")} == set(PRIVATE_HOOKS)


def test_a_changed_signature_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(PRIVATE_HOOKS, "_init_training_state", ("max_steps", "trial"))
    with pytest.raises(RuntimeError, match=r"^transformers.Trainer._init_training_state\(.*\) takes other parameters "
                                           r"than \('max_steps', 'trial'\) \(transformers .*\): train.trainer_hooks"):
        check_private_hooks()
