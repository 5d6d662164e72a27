"""Medusa-2's trainable backbone: LoRA / QLoRA through peft, or full fine-tuning; the original model for reference;
saving it next to the heads (models.checkpoint's `adapter/` or `backbone/` subfolder) and loading it back to resume.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors.torch import load_file
from torch import nn

from models.checkpoint import BackboneWriter, CheckpointError

ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class BackboneOptions:
    kind: str  # lora | full
    quantized: bool  # the target was loaded in 4-bit: LoRA on it is QLoRA
    lora_r: int = 32
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_target_modules: tuple[str, ...] | None = None  # None: every linear layer except lm_head
    gradient_checkpointing: bool = False

    @classmethod
    def from_config(cls, method: Any, model: Any) -> "BackboneOptions":
        """From a method config with train.config.BackboneTrainingConfig's keys (medusa2, cllm) and cfg.model."""
        return cls(
            kind=method.backbone,
            quantized=model.quantization not in (None, "none"),
            lora_r=method.lora_r,
            lora_alpha=method.lora_alpha,
            lora_dropout=method.lora_dropout,
            lora_target_modules=tuple(method.lora_target_modules) if method.lora_target_modules else None,
            gradient_checkpointing=method.gradient_checkpointing,
        )


def prepare_backbone(target: nn.Module, options: BackboneOptions) -> nn.Module:
    """The frozen target made trainable, in training mode: a peft LoRA model (kind "lora"; QLoRA on a 4-bit target,
    after peft's k-bit preparation) or the target itself with every floating-point weight trainable (kind "full")."""
    checkpointing = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if options.kind == "full":
        if options.quantized:
            raise ValueError("method.backbone=full cannot train 4-bit weights (model.quantization=nf4); use lora (QLoRA)")
        for p in target.parameters():
            p.requires_grad_(p.is_floating_point())
        if options.gradient_checkpointing:
            target.gradient_checkpointing_enable(**checkpointing)
        return target.train()
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if options.quantized:
        target = prepare_model_for_kbit_training(target, use_gradient_checkpointing=options.gradient_checkpointing,
                                                 **checkpointing)
    elif options.gradient_checkpointing:
        target.gradient_checkpointing_enable(**checkpointing)
    config = LoraConfig(
        r=options.lora_r,
        lora_alpha=options.lora_alpha,
        lora_dropout=options.lora_dropout,
        target_modules=list(options.lora_target_modules) if options.lora_target_modules else "all-linear",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(target, config).train()


def is_lora(backbone: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(backbone, PeftModel)


@contextmanager
def original_model(backbone: nn.Module, load_original: Callable[[], nn.Module]) -> Iterator[nn.Module]:
    """The model before training: the LoRA backbone with its adapters disabled (no copy), or, for full fine-tuning,
    a freshly loaded copy (`load_original()`) on the backbone's device, dropped on exit."""
    if is_lora(backbone):
        with backbone.disable_adapter():
            yield backbone
        return
    original = load_original().to(next(backbone.parameters()).device)
    try:
        yield original
    finally:
        del original


def backbone_writer(backbone: nn.Module, tokenizer: Any, load_base: Callable[[], nn.Module] | None = None) -> BackboneWriter:
    """How save_drafter stores the backbone. LoRA: the adapter (format "lora_adapter"), or, when `load_base` is given,
    the adapter merged into a freshly loaded unquantized base (`load_base()`), saved whole ("merged"). Full fine-tuning:
    the model whole ("merged"). A merged folder also gets the tokenizer, so it loads on its own. The checkpoint writer
    refuses a backbone with non-finite parameters (`module`)."""
    if is_lora(backbone) and load_base is None:
        return BackboneWriter("lora_adapter", lambda folder: backbone.save_pretrained(str(folder)), module=backbone)

    def write_merged(folder: Path) -> None:
        model = merged_copy(backbone, load_base()) if is_lora(backbone) else backbone
        model.save_pretrained(str(folder))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(folder))

    return BackboneWriter("merged", write_merged, module=backbone)


def merged_copy(backbone: nn.Module, base: nn.Module) -> nn.Module:
    """`base` (a fresh, unquantized load of the original model) with `backbone`'s trained LoRA weights merged in."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    config = copy.deepcopy(backbone.peft_config[backbone.active_adapter])
    config.inference_mode = True
    peft_copy = get_peft_model(base, config)
    set_peft_model_state_dict(peft_copy, get_peft_model_state_dict(backbone))
    return peft_copy.merge_and_unload()


def load_backbone_weights(backbone: nn.Module, fmt: str, folder: Path) -> None:
    """Load a saved backbone (from `backbone_writer`) into the training backbone in place, to resume."""
    if is_lora(backbone) != (fmt == "lora_adapter"):
        kind = "LoRA" if is_lora(backbone) else "full fine-tuning"
        raise CheckpointError(f"{folder}: a {fmt} backbone cannot resume {kind} (method.backbone changed?)")
    if fmt == "lora_adapter":
        from peft import set_peft_model_state_dict

        weights = folder / ADAPTER_WEIGHTS
        if not weights.is_file():
            raise CheckpointError(f"{weights}: missing")
        result = set_peft_model_state_dict(backbone, load_file(str(weights)))
        if result.unexpected_keys:
            raise CheckpointError(f"{weights}: adapter does not match this model ({result.unexpected_keys[0]})")
        return
    load_full_state(backbone, folder)


def load_full_state(model: nn.Module, folder: Path) -> None:
    """Load a `save_pretrained` folder (one file or shards) into `model` in place. Weights tied to a loaded weight
    (e.g. lm_head = embed_tokens) may be absent from the files; anything else missing or unexpected is an error."""
    index = folder / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    loaded: set[str] = set()
    for name in files:
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder / name}: missing")
        state = load_file(str(folder / name))
        result = model.load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise CheckpointError(f"{folder / name}: weights do not match this model ({result.unexpected_keys[0]})")
        loaded |= state.keys()
    current = model.state_dict()
    loaded_storage = {current[k].data_ptr() for k in loaded}
    missing = [k for k, t in current.items() if k not in loaded and t.data_ptr() not in loaded_storage]
    if missing:
        raise CheckpointError(f"{folder}: missing weights ({missing[0]}{', ...' if len(missing) > 1 else ''})")


def trainable(module: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]
