"""One ordered list of work items answered by every rank of a launch, shared through files, with no collective.

The one mechanism behind every collector that runs under a launcher (torchrun / deepspeed set RANK and WORLD_SIZE):
self-distillation in a trainer and in `python -m train features` (train.self_distill), Jacobi trajectories
(inference.collect.jacobi_trajectories). Items are JSONL records with an "id" (json.dumps of a dict whose first key
is "id", so a line starts with RECORD_START).

Layout in one folder (`RankFiles`): rank r appends its records to `<prefix>rank{r:03d}.jsonl` and the ids it decided
not to write (a prompt too long, an empty answer) to `<prefix>rank{r:03d}.skipped`, one {"id", "reason"} a line.

    1. `claim`: the ids in every rank file and skip file there (of any world size: an earlier run's too) and in
       any `also` file (a merged output); a torn last line of a file nobody appends to in this run is cut first;
    2. `share`: rank r takes items r, r + W, r + 2W, ... of the full ordered list, less the done ones. The split does
       not depend on what is done, so ranks that read the folder at different moments (others already appending)
       still never take the same item; an interrupted run's done items are spread evenly, so a resumed run under
       another world size stays balanced;
    3. `wait_until_done`: poll the files (only the bytes appended since the last look) until every id of the list is
       done. A rank that finishes early waits here, on the filesystem: no NCCL / gloo collective (30-minute default
       timeout) ever waits on another rank's generation. A crashed rank ends the launch (torchrun stops the others),
       so the wait needs no timeout of its own; it logs what is left every `log_every` seconds. Every rank must see
       the same folder: one node always does; several need it on a shared filesystem.
    4. `merge` (collectors with one output file): the output's records, then every rank file's new ones in list
       order, written atomically; the rank files go after it, so a reader never misses an id.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch

from data.atomic import write_file
from data.errors import UsageError

log = logging.getLogger("draftsmith")

RECORD_START = b'{"id": '  # json.dumps of a record dict starts so (its first key is "id")
POLL_SECONDS = 5.0
LOG_EVERY_SECONDS = 300.0


@dataclass(frozen=True)
class World:
    """This process's place in a launch: rank in [0, size). RANK / WORLD_SIZE as torchrun and deepspeed set them."""

    rank: int = 0
    size: int = 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> World:
        try:
            rank, size = int(environ.get("RANK", "0")), int(environ.get("WORLD_SIZE", "1"))
        except ValueError:
            raise UsageError(f"RANK={environ.get('RANK')!r} / WORLD_SIZE={environ.get('WORLD_SIZE')!r}: expected "
                             "integers (a launcher sets them)") from None
        if not 0 <= rank < size:
            raise UsageError(f"RANK={rank} is outside WORLD_SIZE={size}")
        return cls(rank, size)


def rank_device(environ: Mapping[str, str] = os.environ) -> torch.device:
    """This rank's GPU (cuda:LOCAL_RANK, as launchers set it; cuda:0 without one) when CUDA is available, else the
    CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(environ.get("LOCAL_RANK", "0")))


@dataclass(frozen=True)
class RankFiles:
    """Every rank's files in `folder`: `<prefix>rank{NNN}.jsonl` (records) and `<prefix>rank{NNN}.skipped`."""

    folder: Path
    prefix: str = ""

    def records(self, rank: int) -> Path:
        return self.folder / f"{self.prefix}rank{rank:03d}.jsonl"

    def skipped(self, rank: int) -> Path:
        return self.folder / f"{self.prefix}rank{rank:03d}.skipped"

    def ranks(self) -> list[int]:
        """The ranks with a file here, of any world size (an earlier run's included), ascending."""
        found = set()
        for path in self.folder.glob(f"{self.prefix}rank*"):
            number = path.name[len(self.prefix) + len("rank"):].split(".")[0]
            if number.isdigit() and path.suffix in (".jsonl", ".skipped"):
                found.add(int(number))
        return sorted(found)

    def all_files(self) -> list[Path]:
        return [p for r in self.ranks() for p in (self.records(r), self.skipped(r)) if p.is_file()]

    def skip(self, rank: int, record_id: str, reason: str) -> None:
        """Note that `rank` will not write `record_id` (flushed at once: a resumed run does not retry it)."""
        with open(self.skipped(rank), "a", encoding="utf-8") as f:
            f.write(json.dumps({"id": record_id, "reason": reason}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def cut_torn_tail(path: Path) -> None:
    """Cut a torn last line (an interrupted write: no newline) off `path`, after checking it is a record's start;
    anything else is not our file and is left alone (ValueError)."""
    if not path.is_file():
        return
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end == len(data):
        return
    tail = data[end:]
    if not (tail.startswith(RECORD_START) or RECORD_START.startswith(tail)):
        raise ValueError(f"{path}: its last line is not a record; move the file away or choose another output")
    log.warning("%s: cutting a torn last line (%d bytes) left by an interrupted run", path, len(data) - end)
    with open(path, "r+b") as f:
        f.truncate(end)


class IdScan:
    """The ids in the complete lines of some files, read incrementally: each `update` reads only the bytes appended
    since the last one (a file replaced or shrunk is read again from its start; a missing one is passed over)."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self._seen: dict[Path, tuple[int, int, int]] = {}  # path -> (inode, bytes read, lines read)

    def update(self, paths: Iterable[Path]) -> set[str]:
        for path in paths:
            try:
                with open(path, "rb") as f:
                    inode, size = os.fstat(f.fileno()).st_ino, os.fstat(f.fileno()).st_size
                    old_inode, start, lines = self._seen.get(path, (inode, 0, 0))
                    if old_inode != inode or size < start:
                        start, lines = 0, 0
                    f.seek(start)
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1
            for number, line in enumerate(data[:end].split(b"\n")[:-1], start=lines + 1):
                if line.strip():
                    self.ids.add(record_id(line, path, number))
            self._seen[path] = (inode, start + end, lines + data[:end].count(b"\n"))
        return self.ids


def record_id(line: bytes, path: Path, number: int) -> str:
    try:
        value = json.loads(line)["id"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        value = None
    if not isinstance(value, str):
        raise ValueError(f"{path}:{number}: not a record with an \"id\"; move the file away or choose another output")
    return value


def done_ids(path: Path) -> set[str]:
    """The ids of one record file, its torn last line cut first (the caller owns the file)."""
    cut_torn_tail(path)
    return IdScan().update([path])


def share(ids: Sequence[str], world: World, done: set[str]) -> list[int]:
    """The positions in `ids` this rank answers: every size-th from its rank, less those done (module docstring)."""
    return [i for i in range(world.rank, len(ids), world.size) if ids[i] not in done]


def claim(files: RankFiles, world: World, also: Sequence[Path] = ()) -> set[str]:
    """Step 1 of the module docstring: the ids done already, after this rank's own torn lines are cut (rank 0 also
    cuts those of ranks outside this world, which nobody appends to now). Rank files are read before `also`: a
    merge writes the output before it removes them, so no id is missed while one runs."""
    files.folder.mkdir(parents=True, exist_ok=True)
    owned = [world.rank] + ([r for r in files.ranks() if r >= world.size] if world.rank == 0 else [])
    for rank in owned:
        cut_torn_tail(files.records(rank))
        cut_torn_tail(files.skipped(rank))
    scan = IdScan()
    scan.update(files.all_files())
    return scan.update(also)


def wait_until_done(files: RankFiles, ids: Sequence[str], also: Sequence[Path] = (), poll: float = POLL_SECONDS,
                    log_every: float = LOG_EVERY_SECONDS, sleep: Callable[[float], None] = time.sleep) -> None:
    """Step 3 of the module docstring: return once every id of `ids` is in a rank file, a skip file or `also`."""
    scan = IdScan()
    wanted = set(ids)
    last_log = time.monotonic()
    while True:
        scan.update(files.all_files())
        left = wanted - scan.update(also)
        if not left:
            return
        if time.monotonic() - last_log >= log_every:
            log.info("%s: waiting for the other ranks: %d of %d items left (every rank writes here: on several nodes "
                     "this folder must be on a shared filesystem)", files.folder, len(left), len(wanted))
            last_log = time.monotonic()
        sleep(poll)


def merge(files: RankFiles, output: Path, ids: Sequence[str]) -> int:
    """Step 4 of the module docstring: `output` = its own records, then each rank file's records whose id is new, in
    the order of `ids` (others after), written atomically; then the rank and skip files are removed. Returns the
    records added. Every record is copied byte for byte (no re-encoding)."""
    cut_torn_tail(output)
    have = IdScan().update([output])
    where: dict[str, tuple[Path, int, int]] = {}  # id -> (file, start, end) of its line
    for rank in files.ranks():
        path = files.records(rank)
        if not path.is_file():
            continue
        offset = 0
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if line.endswith(b"\n") and line.strip():
                    key = record_id(line, path, number)
                    if key not in have and key not in where:
                        where[key] = (path, offset, offset + len(line))
                offset += len(line)
    position = {key: i for i, key in enumerate(ids)}
    new = sorted(where, key=lambda key: (position.get(key, len(position)), key))

    def write(tmp: Path) -> None:
        sources = {path: open(path, "rb") for path, _, _ in where.values()}
        try:
            with open(tmp, "wb") as out:
                if output.is_file():
                    with open(output, "rb") as old:
                        while chunk := old.read(1 << 20):
                            out.write(chunk)
                for key in new:
                    path, start, end = where[key]
                    sources[path].seek(start)
                    out.write(sources[path].read(end - start))
        finally:
            for f in sources.values():
                f.close()

    output.parent.mkdir(parents=True, exist_ok=True)
    write_file(output, write)
    for path in files.all_files():
        path.unlink(missing_ok=True)
    return len(new)
