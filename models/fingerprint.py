"""Fingerprints that tie stored features to the model and tokenizer that made them, read from files (no model loads).

A target's fingerprint is its config (as a dict, minus the keys that name a path or a library version) and a hash of
its weight files: each file's name, size and header, plus 16 evenly spaced 64 KiB blocks of its bytes. Sampling keeps
it to a few MiB read for a 70B checkpoint, and any fine-tune that moves the weights moves the sampled bytes. Files
that live in the Hugging Face cache are named by their content hash already; the sample hash is the same for them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from models.loading import model_config, located

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_VOLATILE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash", "_attn_implementation")
SAMPLES, BLOCK = 16, 64 * 1024


def weights_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"{folder}: no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for i in range(SAMPLES):
                f.seek(0 if i == 0 else max(0, (size - BLOCK) * i // (SAMPLES - 1)))
                digest.update(f.read(BLOCK))
    return digest.hexdigest()


def target_fingerprint(name_or_path: str, trust_remote_code: bool = False, revision: str | None = None) -> dict[str, Any]:
    """{"path", "model_type", "config" (sha256 of the canonical config), "weights" (sha256 sample of the files)}."""
    config = model_config(name_or_path, trust_remote_code, revision).to_dict()
    stable = {k: v for k, v in config.items() if k not in _VOLATILE}
    weights = weights_hash(located(name_or_path, revision=revision))  # a hub model's folder is its snapshot
    return {
        "path": name_or_path,
        "model_type": config.get("model_type"),
        "config": hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest(),
        "weights": weights,
    }


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the vocabulary, the special tokens and the chat template: what decides the token ids of a chat."""
    digest = hashlib.sha256()
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    digest.update(json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]).encode())
    digest.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return digest.hexdigest()
