"""Loading a target model and its tokenizer: hub id, local directory, or a built-in tiny model.

"builtin:<name>" names a model that draftsmith builds itself, offline (see models.tiny); every other string goes
to `from_pretrained` unchanged, so built-in and hub models share one code path.
"""

from __future__ import annotations

import os
from typing import Any

import torch

BUILTIN_PREFIX = "builtin:"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUANTIZATIONS = (None, "none", "nf4")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")  # any one will do


class ModelLoadError(ValueError):
    """The model could not be found or loaded; the message names the path and the reason."""


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_model_path(name_or_path: str) -> str:
    """Map "builtin:<name>" to the directory of the built model (building it on first use)."""
    if name_or_path.startswith(BUILTIN_PREFIX):
        from models.tiny import ensure_built

        return str(ensure_built(name_or_path[len(BUILTIN_PREFIX):]))
    return name_or_path


def _check_reachable(path: str, needs: tuple[str, ...] = ()) -> None:
    """Fail early with one line when a path-looking string does not exist (instead of a hub lookup traceback), or
    when a local directory holds none of the files `needs` lists."""
    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1  # hub ids are "org/name"
    local = os.path.expanduser(path)
    if looks_local and not os.path.isdir(local):
        raise ModelLoadError(f"model path {path!r} does not exist")
    if needs and os.path.isdir(local) and not any(os.path.isfile(os.path.join(local, n)) for n in needs):
        raise ModelLoadError(f"model path {path!r} has no {' or '.join(needs)}")


def quantization_config(quantization: str | None, double_quant: bool, compute_dtype: torch.dtype) -> Any:
    if quantization in (None, "none"):
        return None
    if quantization != "nf4":
        raise ValueError(f"unknown quantization {quantization!r}; choose one of none, nf4")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def load_target(
    name_or_path: str,
    dtype: str = "bf16",
    quantization: str | None = None,
    double_quant: bool = True,
    attn_implementation: str = "sdpa",
    device_map: Any = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    frozen: bool = True,
    tp_plan: Any = None,
):
    """Load a causal LM through `AutoModelForCausalLM.from_pretrained`. Frozen models come back in eval mode with
    requires_grad off. `tp_plan="auto"` (or a plan dict) shards the weights tensor-parallel over the process group of a
    launcher (torchrun): every process runs the same forward and gets the full logits."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    _check_reachable(path, needs=("config.json", "adapter_config.json"))
    compute_dtype = torch_dtype(dtype)
    kwargs: dict[str, Any] = dict(
        dtype=compute_dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    if revision is not None:
        kwargs["revision"] = revision
    quant = quantization_config(quantization, double_quant, compute_dtype)
    if quant is not None:
        kwargs["quantization_config"] = quant
        kwargs["device_map"] = device_map or ("cuda:0" if torch.cuda.is_available() else "cpu")
    elif device_map is not None:
        kwargs["device_map"] = device_map
    if tp_plan is not None:
        from transformers import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_plan=tp_plan)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except SafetensorError as e:  # a truncated or corrupted *.safetensors file
        raise ModelLoadError(f"cannot load model {name_or_path!r}: corrupted safetensors weights ({e})") from None
    except (OSError, ValueError) as e:  # missing files; unrecognised config, unsupported attention or quantization
        first = str(e).strip().splitlines()[0]
        raise ModelLoadError(f"cannot load model {name_or_path!r}: {first}") from None
    if frozen:
        model.eval().requires_grad_(False)
    return model


def load_tokenizer(name_or_path: str, chat_template: str | None = None, trust_remote_code: bool = False):
    """Load the tokenizer; `chat_template` names a shipped template (data.templates) for models without one."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    _check_reachable(path, needs=TOKENIZER_FILES)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as e:
        first = str(e).strip().splitlines()[0]
        raise ModelLoadError(f"cannot load tokenizer {name_or_path!r}: {first}") from None
    if chat_template is not None:
        from data.templates import get_template

        tokenizer.chat_template = get_template(chat_template)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    return tokenizer
