"""What travels to the GPU machine for sections `tiny` and `smollm2` of scripts/gpu_check.py (made here by --pack-tiny
and --pack-smollm2), and those two sections: `python -m inference bench` on what travelled.

tiny     the tiny target's Medusa-1 checkpoint, its base model and the questions (~40 MiB): one folder, one call.
smollm2  the builtin smollm2's Q4_1 GGUF (98 MB; the engine dequantises it, so these are the weights it serves) and a
         trained EAGLE-3 drafter do not fit one call's 64 MiB. --pack-smollm2 writes part1/, part2/, ..., each at most
         PART_BYTES: the drafter (weights in bf16, the dtype the section runs in: models.eagle3.load_eagle3 casts to
         the target's; not its tokenizer, which the base brings), the questions, MANIFEST (the GGUF's size, sha256 and
         pieces) and the GGUF cut into pieces. Carry one part a call while the machine stays warm (what an earlier
         call carried stays there). The section joins the pieces in a scratch cache ($DRAFTSMITH_CACHE, offline),
         checks the sha256, and benches the drafter against our plain loop and HF `generate` in bf16, eager and with
         --compile (CUDA graphs on a GPU); the GGUF's one-time conversion happens first and is not timed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

TINY_FILES = ("medusa1/config.json", "medusa1/drafter.safetensors", "base/config.json", "question.jsonl")
PART_BYTES = 58 * 2**20  # + the working tree (~3 MiB) stays under a call's 64 MiB
SMOLLM2_QUESTIONS = "mt_bench:8:spread,gsm8k:4:spread,humaneval:4:spread"  # the README table's (conf/bench)
MANIFEST = "smollm2.json"
DRAFTER_FILES = ("config.json", "drafter.safetensors", "chat_template.jinja")  # what loading an EAGLE-3 drafter reads
T = TypeVar("T")
CACHE_SLOTS = 1024  # --compile: one cache size for every question, so each shape compiles once


def pack(args: Any) -> str:
    """--pack-tiny / --pack-smollm2 of scripts/gpu_check.py: the bundle written, and the line that says what to carry;
    ValueError in one line naming the flag when something is missing."""
    from data.errors import UsageError  # deferred: after the package checks
    from inference.bench.prompt_sets import default_questions, load_questions  # deferred: after the package checks
    from models.smollm2 import SourceUnavailable, gguf_file  # deferred: after the package checks

    flag = "--pack-tiny" if args.pack_tiny is not None else "--pack-smollm2"
    dest = Path(args.pack_tiny or args.pack_smollm2)
    if dest.exists():
        raise ValueError(f"{flag} {dest}: already exists (choose a new folder)")
    if not dest.parent.is_dir():
        raise ValueError(f"{flag} {dest}: parent folder {dest.parent} does not exist")
    if args.pack_tiny is not None:
        drafter = Path(args.tiny_drafter)
        if not (drafter / "config.json").is_file():
            raise ValueError(f"--tiny-drafter {drafter}: no config.json (train it: python -m train medusa1 "
                             "+model=tiny)")
        questions = Path(args.questions) if args.questions else default_questions()
        if not questions.is_file():
            raise ValueError(f"--questions {questions}: not a file")
        size = whole(dest, lambda out: pack_tiny(drafter, out, questions))
        return f"packed {size / 2**20:.1f} MiB into {dest}: carry it and pass --tiny {dest}"
    drafter = Path(args.smollm2_drafter)
    if not (drafter / "drafter.safetensors").is_file():
        raise ValueError(f"--smollm2-drafter {drafter}: no drafter.safetensors (docs/eagle3.md's CPU recipe trains it)")
    try:
        chosen, _ = load_questions(args.questions or SMOLLM2_QUESTIONS)
        gguf = gguf_file(progress=True)
    except (UsageError, SourceUnavailable) as e:
        raise ValueError(str(e)) from None
    records = [{"question_id": q.question_id, "category": q.category, "turns": list(q.turns)} for q in chosen]
    sizes = whole(dest, lambda out: pack_smollm2(drafter, gguf, out, records))
    parts = ", ".join(f"part{i + 1} {b / 2**20:.1f} MiB" for i, b in enumerate(sizes))
    return f"packed {dest} ({parts}): carry one part a call, the machine still warm, then pass --smollm2 {dest}"


def whole(dest: Path, write: Callable[[Path], T]) -> T:
    """write(folder) into a scratch folder beside `dest`, renamed to `dest` once it is done: a pack that fails
    leaves nothing behind."""
    scratch = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        result = write(scratch / dest.name)
        (scratch / dest.name).rename(dest)
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def pack_tiny(drafter: Path, dest: Path, questions: Path) -> int:
    """Copy the medusa1 checkpoint (its top-level files: not checkpoints/, the trainer state), its base model and the
    question file into `dest` (medusa1/, base/, question.jsonl); returns the bytes copied."""
    from models.checkpoint import read_drafter_config  # deferred: after the package checks
    from models.refs import locate  # deferred: after the package checks

    base = locate(read_drafter_config(drafter)["base_model_name_or_path"])
    dest.mkdir()
    for source, name in ((drafter, "medusa1"), (base, "base")):
        (dest / name).mkdir()
        for f in source.iterdir():
            if f.is_file():
                shutil.copy2(f, dest / name / f.name)
    shutil.copy2(questions, dest / "question.jsonl")
    return folder_bytes(dest)


def pack_smollm2(drafter: Path, gguf: Path, dest: Path, questions: list[dict[str, Any]],
                 part_bytes: int = PART_BYTES) -> list[int]:
    """Write the parts (module docstring) into `dest`, a new folder, `questions` as question.jsonl records; returns
    each part's bytes."""
    from safetensors import SafetensorError, safe_open  # deferred: after the package checks
    from safetensors.torch import load_file, save_file  # deferred: after the package checks

    dest.mkdir()
    first = dest / "part1"
    (first / "drafter").mkdir(parents=True)
    for name in DRAFTER_FILES:
        if name == "drafter.safetensors":
            try:
                with safe_open(str(drafter / name), framework="pt") as f:
                    metadata = f.metadata()
                state = load_file(str(drafter / name))
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{drafter / name}: unreadable safetensors ({e})") from None
            save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()},
                      str(first / "drafter" / name), metadata=metadata)
        elif (drafter / name).is_file():
            shutil.copy2(drafter / name, first / "drafter" / name)
    (first / "question.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    digest, pieces, size = hashlib.sha256(), [], gguf.stat().st_size
    room = part_bytes - folder_bytes(first) - 4096  # and the manifest's
    if room < 0:
        raise ValueError(f"{drafter}: the drafter and questions take {folder_bytes(first) / 2**20:.1f} MiB, over a "
                         f"part's {part_bytes / 2**20:.1f} MiB")
    part, room = (1, room) if room > 0 else (2, part_bytes)
    with open(gguf, "rb") as src:
        while chunk := src.read(room):
            name = f"part{part}/gguf.{len(pieces):03d}"
            (dest / name).parent.mkdir(exist_ok=True)
            (dest / name).write_bytes(chunk)
            digest.update(chunk)
            pieces.append({"file": name, "bytes": len(chunk)})
            part, room = part + 1, part_bytes
    manifest = {"gguf": gguf.name, "bytes": size, "sha256": digest.hexdigest(), "pieces": pieces}
    (first / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return [folder_bytes(p) for p in sorted(dest.iterdir())]


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def smollm2_missing(bundle: Path) -> str | None:
    """What the smollm2 bundle still lacks here (a missing part names the part to carry), or None."""
    manifest = bundle / "part1" / MANIFEST
    if not manifest.is_file():
        return f"no part1/{MANIFEST} (make the bundle with --pack-smollm2 and carry part1)"
    for piece in json.loads(manifest.read_text())["pieces"]:
        path = bundle / piece["file"]
        if not path.is_file() or path.stat().st_size != piece["bytes"]:
            return f"no complete {piece['file']} (carry {piece['file'].split('/')[0]} too)"
    return None


def join_gguf(bundle: Path, downloads: Path) -> Path:
    """The GGUF rebuilt from its pieces in `downloads`, its sha256 checked against the manifest."""
    manifest = json.loads((bundle / "part1" / MANIFEST).read_text())
    downloads.mkdir(parents=True, exist_ok=True)
    out, digest = downloads / manifest["gguf"], hashlib.sha256()
    with open(out, "wb") as dst:
        for piece in manifest["pieces"]:
            data = (bundle / piece["file"]).read_bytes()
            digest.update(data)
            dst.write(data)
    if digest.hexdigest() != manifest["sha256"]:
        raise ValueError(f"{bundle}: the joined GGUF's sha256 is not the manifest's (a piece was damaged in transit)")
    return out


def bench(argv: list[str], out: Path) -> dict[str, Any]:
    """`python -m inference bench` with `argv` (its --out is `out`), in this process: the command and summary.json."""
    from inference.cli import main as inference_main  # deferred: after the package checks

    argv = ["bench", *argv, "--out", str(out)]
    code = inference_main(argv)
    if code != 0:
        raise RuntimeError(f"python -m inference bench exited with status {code} (its error line is above)")
    summary = json.loads((out / "summary.json").read_text())
    return {"command": "python -m inference " + " ".join(argv), "summary": summary}


def tiny_section(bundle: Path, out: Path, plan: Any, device: torch.device) -> dict:
    argv = ["--drafter", str(bundle / "medusa1"), "--base", str(bundle / "base"), "--questions",
            str(bundle / "question.jsonl"), "--dtype", "fp32", "--device", str(device), "--max-new-tokens",
            str(plan.tiny_new_tokens)]
    argv += [] if plan.tiny_limit is None else ["--limit", str(plan.tiny_limit)]
    return bench(argv, out / "tiny_bench")


def smollm2_section(bundle: Path, out: Path, plan: Any, device: torch.device) -> dict:
    """The trained EAGLE-3 drafter on smollm2 in bf16 against our plain loop and HF `generate`, eager and compiled."""
    from models.smollm2 import ensure_smollm2  # deferred: after the package checks

    saved = {k: os.environ.get(k) for k in ("DRAFTSMITH_CACHE", "DRAFTSMITH_OFFLINE")}
    with tempfile.TemporaryDirectory(prefix="gpu_check_smollm2_") as cache:
        os.environ.update(DRAFTSMITH_CACHE=cache, DRAFTSMITH_OFFLINE="1")
        try:
            join_gguf(bundle, Path(cache) / "downloads")
            ensure_smollm2()  # the one-time conversion, before any timing
            argv = ["--drafter", str(bundle / "part1" / "drafter"), "--base", "smollm2", "--questions",
                    str(bundle / "part1" / "question.jsonl"), "--dtype", "bf16", "--device", str(device),
                    "--max-new-tokens", str(plan.tiny_new_tokens)]
            argv += [] if plan.tiny_limit is None else ["--limit", str(plan.tiny_limit)]
            compiled = [*argv, "--compile", "--cache-slots", str(CACHE_SLOTS)]
            return {"eager": bench(argv, out / "smollm2_eager"), "compiled": bench(compiled, out / "smollm2_compiled")}
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
