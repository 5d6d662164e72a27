"""Atomic writes: a reader finds the old file or folder, or the new one, never half of either.

Everything is written under a temporary sibling name, `.<name>.tmp-<random>` (a killed writer leaves only such
names, which cleanups glob for), flushed to disk (fsync), then renamed into place with os.replace. Files and folders
get the permissions an ordinary `open` / `mkdir` would give them (the umask's), not the private ones of a temporary.

    write_file(path, write)       write(tmp_path) fills a temporary file, which then replaces `path`
    write_text / write_json       the same for a string / a JSON value
    staged_dir(target, marker)    a context manager: fill the yielded temporary folder, which then replaces `target`
                                  whole (marker None), or is merged into it with `marker` as its completion file
On failure the temporary is removed and the exception propagates unchanged (an OSError for storage problems), so
each caller reports it in its own terms.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable


def _umask() -> int:
    """The process's umask, read without setting it where Linux shows it (setting it races with other threads)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
        return umask


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_file(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call write(tmp) on a fresh temporary sibling of `path` (an empty file), then move it over `path`."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp (and safetensors) make it private
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str, encoding: str | None = None) -> None:
    write_file(path, lambda tmp: tmp.write_text(text, encoding=encoding))


def write_json(path: str | os.PathLike, value: Any) -> None:
    """`value` as indented JSON with sorted keys, one trailing newline."""
    write_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def _refuse_file_in_the_way(folder: Path) -> None:
    """NotADirectoryError when `folder` or a parent of it is a file (mkdir's own error would not say which)."""
    in_the_way = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if in_the_way is not None and not in_the_way.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{in_the_way} is a file, not a directory")


@contextlib.contextmanager
def staged_dir(target: str | os.PathLike, marker: str | None = None) -> Iterator[Path]:
    """Yield an empty temporary sibling folder of `target`; when the block ends without an exception, fsync every
    file in it and move it into place. `target` is created only then (its parent at once).

    marker None: `target` is replaced whole, for a folder that belongs to one writer (a cache build): an old one is
    moved aside, the new one renamed in, the old one deleted.
    marker NAME: the folder's entries are merged into `target`, for a folder shared with other writers (a run's output
    folder also holds logs): `target/NAME` is removed before anything is replaced and moved in last, so a reader
    that finds NAME finds the rest complete. Entries the block did not write are left alone; a subfolder it wrote
    replaces the same-named one whole.
    """
    target = Path(target)
    _refuse_file_in_the_way(target if marker else target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        for path in [p for p in tmp.rglob("*") if p.is_file()]:
            _fsync(path)
        if marker:
            _merge(tmp, target, marker)
        else:
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private
            _swap(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _merge(tmp: Path, target: Path, marker: str) -> None:
    target.mkdir(exist_ok=True)
    (target / marker).unlink(missing_ok=True)
    for path in sorted(tmp.iterdir(), key=lambda p: p.name == marker):  # the marker last
        dest = target / path.name
        if dest.exists() and (path.is_dir() or dest.is_dir()):  # os.replace cannot overwrite a folder
            os.replace(dest, tmp / f".replaced-{path.name}")  # deleted with tmp
        os.replace(path, dest)


def _swap(tmp: Path, target: Path) -> None:
    if not target.exists():
        os.replace(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    try:
        os.replace(target, old / target.name)
        try:
            os.replace(tmp, target)
        except OSError:
            os.replace(old / target.name, target)  # put the old one back
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
