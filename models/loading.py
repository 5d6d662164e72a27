"""Loading a target model and its tokenizer from any model name or ModelRef (a directory, hub id, conf/model name,
builtin:<name>, early_exit:<model>:<N>): models.refs parses and locates it, `from_pretrained` reads the folder, so
built-in, derived and hub models share one code path.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from data.extras import require
from data.templates import resolve_template
from models.builtin import (  # noqa: F401  (re-exported: the names callers know models.loading by)
    DTYPES, QUANTIZATIONS, STOCK_MODULES, TOKENIZER_FILES, ModelLoadError, has_tokenizer, torch_dtype,
)
from models.refs import ModelRef, at_revision, locate, parse_model

log = logging.getLogger(__name__)

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def model_config(name_or_path: str | ModelRef, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    """A model's config from its config.json alone (no weights): for checks that must run before anything loads.
    ModelLoadError naming the model when it cannot be read."""
    from transformers import AutoConfig

    path = located(name_or_path, ("config.json",), revision)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    try:
        return AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0]
        raise ModelLoadError(f"cannot read the config of model {str(name_or_path)!r}: {first}") from None


def located(name_or_path: str | os.PathLike | ModelRef, needs: tuple[str, ...] = (), revision: str | None = None) -> Path:
    """The model's folder (models.refs.locate: one line when a local path does not exist or a hub id is not
    available; a hub model at `revision`), checked to hold at least one of the files `needs` lists."""
    ref = name_or_path if isinstance(name_or_path, ModelRef) else parse_model(name_or_path)
    path = locate(at_revision(ref, revision))
    if needs and path.is_dir() and not any((path / n).is_file() for n in needs):
        raise ModelLoadError(f"model path {str(name_or_path)!r} has no {' or '.join(needs)}")
    return path


def resolve_device_map(device_map: Any) -> Any:
    """A `device_map` for from_pretrained: None; a strategy ("auto", "balanced", "balanced_low_0", "sequential"); one
    device ("cpu", "cuda:1", or a GPU index); a dict {module name: device}; or a JSON object of that dict, given
    literally ('{"model.layers.0": 0, ...}') or as a *.json file. Devices are GPU indices, "cpu", "disk" (then pass
    offload_folder) or device strings. Raises ValueError naming what is wrong."""
    if device_map is None or (isinstance(device_map, int) and not isinstance(device_map, bool)):
        return device_map
    if isinstance(device_map, Path) or (isinstance(device_map, str) and device_map.endswith(".json")):
        return _device_map_dict(_read_device_map_file(Path(device_map)), str(device_map))
    if isinstance(device_map, dict):
        return _device_map_dict(device_map, "device_map")
    if not isinstance(device_map, str):
        raise ValueError(f"device_map: expected a string, a dict or a JSON file, got {type(device_map).__name__}")
    if device_map.lstrip().startswith("{"):
        try:
            return _device_map_dict(json.loads(device_map), "device_map")
        except json.JSONDecodeError as e:
            raise ValueError(f"device_map: not a valid JSON object ({e.msg})") from None
    if device_map in DEVICE_MAP_STRATEGIES:
        return device_map
    return _device_name(device_map, f"device_map {device_map!r}")


def _read_device_map_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except OSError as e:
        raise ModelLoadError(f"device_map {path}: cannot read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"device_map {path}: not valid JSON ({getattr(e, 'msg', e)})") from None


def _device_map_dict(data: Any, source: str) -> dict[str, int | str]:
    """Check a {module name: device} mapping; "" names the whole model."""
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{source}: expected a non-empty object mapping module names to devices")
    out: dict[str, int | str] = {}
    for name, device in data.items():
        if not isinstance(name, str):
            raise ValueError(f"{source}: module names must be strings, got {name!r}")
        if isinstance(device, int) and not isinstance(device, bool):
            if device < 0:
                raise ValueError(f"{source}: {name!r}: a GPU index must be >= 0, got {device}")
            out[name] = device
        elif isinstance(device, str):
            out[name] = device if device == "disk" else _device_name(device, f"{source}: {name!r}")
        else:
            raise ValueError(f"{source}: {name!r}: expected a GPU index, \"cpu\", \"disk\" or a device string, "
                             f"got {device!r}")
    return out


def _device_name(device: str, where: str) -> str:
    try:
        torch.device(device)
    except RuntimeError:
        strategies = ", ".join(DEVICE_MAP_STRATEGIES)
        raise ValueError(f"{where}: not a device (\"cpu\", \"cuda:1\", ...), a strategy ({strategies}) or a "
                         "JSON file") from None
    return device


def check_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device this process can place a model on: ModelLoadError in one line for a name torch
    does not know, or a CUDA / MPS device this machine (or this torch build) does not have. Asked before any model
    loads, so a typo or a CPU-only install fails at once, not after the weights are read."""
    try:
        placed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"device {str(device)!r}: not a device (\"cpu\", \"cuda\", \"cuda:1\", \"mps\", ...)") from None
    if placed.type == "cuda":
        if not torch.cuda.is_available():
            build = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ModelLoadError(f"device {str(device)!r}: {build} (torch {torch.__version__}); use \"cpu\"")
        count = torch.cuda.device_count()
        if placed.index is not None and placed.index >= count:
            raise ModelLoadError(f"device {str(device)!r}: this machine shows {count} CUDA device(s), numbered from 0")
    elif placed.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"device {str(device)!r}: MPS is not available on this machine; use \"cpu\"")
    return placed


def quantization_config(quantization: str | None, double_quant: bool, compute_dtype: torch.dtype) -> Any:
    if quantization in (None, "none"):
        return None
    if quantization != "nf4":
        raise ValueError(f"unknown quantization {quantization!r}; choose one of none, nf4")
    require("bitsandbytes", "quantization nf4")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
    )


# bitsandbytes' 4-bit layout on CPU: one absmax per 64 consecutive input values of a row (Params4bit's default
# blocksize), and, on CPUs with AVX-512-bf16, weights repacked in blocks of 32 output rows on the first no-grad
# forward (`_convert_weight_packed_for_cpu`), which fails for any other shape.
NF4_BLOCK = 64
NF4_CPU_ROW_BLOCK = 32


def places_on_cpu(device_map: Any) -> bool:
    """Whether a resolved device_map (see `resolve_device_map`) puts any weights on the CPU; None means the default
    placement (the first GPU when there is one)."""
    if device_map is None or device_map in DEVICE_MAP_STRATEGIES:
        return not torch.cuda.is_available()
    if isinstance(device_map, dict):
        return any(places_on_cpu(device) for device in device_map.values() if device != "disk")
    if isinstance(device_map, int):
        return False
    return torch.device(device_map).type == "cpu"


def nf4_layer_problem(name: str, in_features: int, out_features: int) -> str | None:
    """Why bitsandbytes' CPU backend cannot run a 4-bit Linear of this shape on every x86 CPU, or None."""
    if in_features % NF4_BLOCK:
        return f"layer {name} has in_features={in_features}, not a multiple of the {NF4_BLOCK}-value quantisation block"
    if out_features % NF4_CPU_ROW_BLOCK:
        return f"layer {name} has out_features={out_features}, not a multiple of {NF4_CPU_ROW_BLOCK}"
    return None


def check_nf4_on_cpu(name_or_path: str | ModelRef, trust_remote_code: bool = False, revision: str | None = None
                     ) -> None:
    """Raise ModelLoadError (one line naming model.quantization, the first bad layer and the block size) when a layer
    that NF4 quantisation would replace has a shape bitsandbytes' CPU backend cannot handle. Refused on every CPU,
    not only on AVX-512-bf16 ones where the repacking crashes, so a config behaves the same on any x86 machine.
    Reads config.json only: the layers are built on the meta device, with transformers' own choice of the modules it
    leaves unquantised (the output embeddings, ...)."""
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.quantizers import AutoHfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    path = located(name_or_path, ("config.json", "adapter_config.json"), revision)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError):
        return  # from_pretrained reports an unreadable config itself, in load_target
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    quantization_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    skip = AutoHfQuantizer.from_config(quantization_config).get_modules_to_not_convert(
        model, quantization_config.llm_int8_skip_modules, model._keep_in_fp32_modules)
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and should_convert_module(name, skip):
            problem = nf4_layer_problem(name, module.in_features, module.out_features)
            if problem:
                raise ModelLoadError(
                    f"model.quantization=nf4: {name_or_path}: {problem}; bitsandbytes' CPU backend needs in_features "
                    f"in multiples of {NF4_BLOCK} and out_features in multiples of {NF4_CPU_ROW_BLOCK}: load this "
                    f"model unquantised (model.quantization=none)")


def load_target(
    name_or_path: str | ModelRef,
    dtype: str = "bf16",
    quantization: str | None = None,
    double_quant: bool = True,
    attn_implementation: str = "sdpa",
    device_map: Any = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    frozen: bool = True,
    tp_plan: Any = None,
    offload_folder: str | os.PathLike | None = None,
):
    """Load a causal LM through `AutoModelForCausalLM.from_pretrained`. Frozen models come back in eval mode with
    requires_grad off. `tp_plan="auto"` (or a plan dict) shards the weights tensor-parallel over the process group of a
    launcher (torchrun): every process runs the same forward and gets the full logits. `device_map` (see
    `resolve_device_map`) splits the layers across devices with accelerate, which places the weights itself: do not
    `.to()` the model afterwards. Modules mapped to "disk" are stored in `offload_folder`."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    path = located(name_or_path, ("config.json", "adapter_config.json"), revision)
    compute_dtype = torch_dtype(dtype)
    kwargs: dict[str, Any] = dict(
        dtype=compute_dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        **STOCK_MODULES,
    )
    device_map = resolve_device_map(device_map)
    if device_map is not None and tp_plan is not None:
        raise ValueError("device_map and tp_plan are exclusive: tensor parallelism places the shards itself")
    if isinstance(device_map, dict) and "disk" in device_map.values() and offload_folder is None:
        disk = ", ".join(name for name, device in device_map.items() if device == "disk")
        raise ValueError(f"device_map puts {disk} on \"disk\": pass offload_folder (a directory for those weights)")
    if offload_folder is not None:
        kwargs["offload_folder"] = str(offload_folder)
    quant = quantization_config(quantization, double_quant, compute_dtype)
    if quant is not None:
        kwargs["quantization_config"] = quant
        default = "cuda:0" if torch.cuda.is_available() else "cpu"
        kwargs["device_map"] = device_map if device_map is not None else default
        if places_on_cpu(kwargs["device_map"]):
            check_nf4_on_cpu(name_or_path, trust_remote_code, revision)
    elif device_map is not None:
        kwargs["device_map"] = device_map
    if tp_plan is not None:
        from transformers import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_plan=tp_plan)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except SafetensorError as e:  # a truncated or corrupted *.safetensors file
        raise ModelLoadError(f"cannot load model {str(name_or_path)!r}: corrupted safetensors weights ({e})") from None
    except (OSError, ValueError) as e:  # missing files; unrecognised config, unsupported attention or quantization
        first = str(e).strip().splitlines()[0]
        raise ModelLoadError(f"cannot load model {str(name_or_path)!r}: {first}") from None
    if quant is not None and places_on_cpu(kwargs["device_map"]):
        log.info("model.quantization=nf4 on CPU: %s", nf4_cpu_path(model))
    if frozen:
        model.eval().requires_grad_(False)
    return model


def nf4_cpu_path(model: torch.nn.Module) -> str:
    """Which of bitsandbytes' two CPU code paths the model's 4-bit layers take (each layer decides when it is built)."""
    if any(getattr(m, "support_avx512bf16_for_cpu", False) for m in model.modules()):
        return "packed AVX-512-bf16 kernels (weights repacked on the first no-grad forward)"
    return "dequantise-then-matmul (no AVX-512-bf16)"


def load_tokenizer(name_or_path: str | os.PathLike | ModelRef, chat_template: str | None = None, trust_remote_code: bool = False):
    """Load the tokenizer; `chat_template` (a shipped template's name, a .jinja file or Jinja text, data.templates)
    replaces its own."""
    from transformers import AutoTokenizer

    path = located(name_or_path, needs=TOKENIZER_FILES)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as e:
        first = str(e).strip().splitlines()[0]
        raise ModelLoadError(f"cannot load tokenizer {str(name_or_path)!r}: {first}") from None
    if chat_template is not None:
        tokenizer.chat_template = resolve_template(tokenizer, chat_template)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    return tokenizer
