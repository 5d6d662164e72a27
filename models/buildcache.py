"""The cache of models draftsmith makes itself (built-in tiny models, converted GGUF checkpoints), and lookups in the
Hugging Face hub's own local cache (`hub_snapshot`).

Root: data.cache.cache_root() ($DRAFTSMITH_CACHE, else platformdirs.user_cache_dir("draftsmith")), re-exported here
for the model builders; data/ fetches its wheels into the same cache. A directory is complete iff it holds
COMPLETE_MARKER: it is written in a sibling temp dir and swapped in (`atomic_dir`), so readers never see half a build.
Builds of one name are serialised with a lock file beside it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from data.atomic import staged_dir
from data.cache import cache_root  # noqa: F401 - re-exported: models.* and tools import it from here

COMPLETE_MARKER = ".draftsmith-complete"


def is_complete(path: Path, format_version: int | None = None) -> bool:
    """Whether `path` holds a finished build (of `format_version`, when given: older recipes are rebuilt)."""
    marker = Path(path) / COMPLETE_MARKER
    if not marker.is_file():
        return False
    if format_version is None:
        return True
    try:
        return json.loads(marker.read_text()).get("format_version") == format_version
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def atomic_dir(target: Path, format_version: int) -> Iterator[Path]:
    """Yield an empty temp dir beside `target`; on success mark it complete (with `format_version`) and swap it in,
    replacing `target` whole (data.atomic.staged_dir): a cache directory belongs to its build alone, so a stale or
    older-recipe build leaves nothing behind. Its contents are Hugging Face folders whose config.json is written
    early, so completion is a separate marker that also records the recipe's `format_version`."""
    with staged_dir(target) as tmp:
        yield tmp
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"format_version": format_version}) + "\n")


@contextlib.contextmanager
def build_lock(directory: Path, name: str) -> Iterator[None]:
    """Exclusive inter-process lock for building `name` in `directory`."""
    from filelock import FileLock  # a dependency of huggingface_hub, hence of transformers

    Path(directory).mkdir(parents=True, exist_ok=True)
    with FileLock(str(Path(directory) / f".{name}.lock")):
        yield


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The local hub cache's snapshot of `repo_id` (at `revision`, default the main branch) when it holds a config
    and weights; never goes online."""
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (LocalEntryNotFoundError) or no usable cache: fall through
        return None
    has_weights = any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))
    return folder if (folder / "config.json").is_file() and has_weights else None
