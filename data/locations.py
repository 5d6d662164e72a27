"""The one rule for "is this string a local path?", shared by model names (models.refs) and data sources
(data.readers): it sits in the lowest layer so both can use it.

A string is local when it is written like a path (".", "/" or "~" first; more slashes than a hub repository id
"org/name" has) or when a file or folder of that name exists. Anything else may be a hub id: a hub repository never
starts with ".", "/" or "~" and has at most one slash.
"""

from __future__ import annotations

from pathlib import Path


def written_as_path(text: str) -> bool:
    """Whether `text` can only be a local path, whatever exists on disk: ".", "/" or "~" first, or two slashes or
    more."""
    return text.startswith((".", "/", "~")) or text.count("/") > 1


def is_local(text: str) -> bool:
    """Whether `text` names a local path: written as one (`written_as_path`), or the name of an existing file or
    folder (so "runs/draft" is the folder when it exists, a hub id when it does not)."""
    return written_as_path(text) or Path(text).expanduser().exists()
