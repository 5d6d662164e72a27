"""Output locations checked before the work that fills them: one rule for `output_dir=` (training) and `--out`
(bench), so a file in the way or a read-only folder fails in one line before any model loads, and nothing is
created for a run that is refused."""

from __future__ import annotations

import os
from pathlib import Path

from data.errors import UsageError


def check_writable_dir(path: str | os.PathLike, key: str) -> None:
    """The nearest existing ancestor of `path` must be a writable directory; `key` names the setting ("output_dir",
    "--out") in the one-line UsageError. Creates nothing."""
    target = Path(path).expanduser().absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"{key}={path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{key}={path}: {existing} is not writable")
