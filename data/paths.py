"""Output locations checked before the work that fills them: one rule for `output_dir=` (training) and `--out`
(bench), so a file in the way or a read-only folder fails in one line before any model loads, and nothing is
left for a run that is refused."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from data.errors import UsageError


def check_writable_dir(path: str | os.PathLike, key: str) -> None:
    """The nearest existing ancestor of `path` must be a directory a folder can be made in; `key` names the setting
    ("output_dir", "--out") in the one-line UsageError. Leaves nothing behind: permission bits do not tell a
    read-only mount or a pseudo filesystem (root may write anywhere by its bits), so a folder is made there and
    removed at once."""
    target = Path(path).expanduser().absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"{key}={path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{key}={path}: {existing} is not writable")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".draftsmith-probe-", dir=existing))
    except OSError as e:
        raise UsageError(f"{key}={path}: cannot create a folder in {existing} ({e.strerror or e})") from None
