"""One call to serve any drafter: `engine = load(drafter_path); engine.generate(prompt_ids)`.

The checkpoint's config.json names the drafter type ("drafter_type") and the base model it was trained for
("base_model_name_or_path"); `load` dispatches on the type through `DRAFTER_BUILDERS`, so new drafter types add
one builder and keep this call unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from data.collate import left_pad
from inference.devices import input_device, output_device
from inference.draft_model import build_draft_model_drafter, is_plain_model, plain_model_config
from inference.drafters import Drafter, MedusaDrafter, NoDrafter
from inference.generate import DecodeConfig, GenerationOutput, generate
from inference.jacobi import DEFAULT_BLOCK_SIZE, JacobiDrafter, JacobiOptions
from inference.tree import TreeBuffers, load_tree
from inference.training_free import NAMED_DRAFTERS, build_from_spec, named_spec  # noqa: F401  (re-exported)
from inference.verify import SamplingParams
from models.checkpoint import (
    CONFIG_NAME, CheckpointError, check_compatible, head_vocabulary, load_drafter, load_drafter_target,
    read_drafter_config,
)
from models.backbone import eos_token_ids
from models.loading import load_target

MEDUSA_TOPK = 10  # candidates kept per head: the largest rank a tree may use is MEDUSA_TOPK - 1


@dataclass(frozen=True)
class DrafterOptions:
    """What `load` passes every DRAFTER_BUILDERS entry; a builder refuses, in one line, an option its type lacks."""

    tree: Any = None  # tree drafters: a tree spec (inference.tree.load_tree); draft models: "chain:<n>" etc.
    topk: int = MEDUSA_TOPK
    draft_stop: str | None = None  # draft models only (inference.draft_stop)
    head_vocab: int | None = None  # Medusa heads only: draft from the S most frequent training tokens

    def refuse(self, drafter_type: str, *names: str) -> None:
        given = [n for n in names if getattr(self, n) is not None]
        if given:
            raise ValueError(f"load: {given[0]}= does not apply to drafter_type {drafter_type!r}")


def _medusa(path: Path, model: torch.nn.Module, options: DrafterOptions, device: torch.device) -> Drafter:
    """Heads on the lm_head's device (they read the same final hidden state), the tree on the input `device`;
    `head_vocab` keeps the S most frequent tokens of the heads' training data (the checkpoint's token_counts)."""
    options.refuse("medusa", "draft_stop")
    loaded = load_drafter(path, device=output_device(model), dtype=model.get_input_embeddings().weight.dtype)
    check_compatible(loaded.config, model.config)
    buffers = load_tree(options.tree, num_heads=loaded.heads.config.num_heads, topk=options.topk, device=device)
    base_lm_head = model.get_output_embeddings() if loaded.heads.config.share_lm_head else None
    vocab = None if options.head_vocab is None else head_vocabulary(path, options.head_vocab, buffers.topk)
    return MedusaDrafter(loaded.heads, buffers, base_lm_head, vocab)


def _draft_model(path: Path, model: torch.nn.Module, options: DrafterOptions, device: torch.device) -> Drafter:
    options.refuse("draft_model", "head_vocab")
    return build_draft_model_drafter(path, model, options.tree, options.topk, device, options.draft_stop)


DRAFTER_BUILDERS: dict[str, Callable[[Path, torch.nn.Module, DrafterOptions, torch.device], Drafter]] = {
    "medusa": _medusa,
    "draft_model": _draft_model,
}


def _jacobi(path: Path, model: torch.nn.Module, options: DrafterOptions, device: torch.device) -> Drafter:
    """A "cllm" checkpoint: the fine-tuned target (its backbone, loaded by `load`) decoded by Jacobi iteration with
    the block size and initialisation it was trained for (config.json "block_size", "init")."""
    if options.tree is not None:
        raise ValueError("load: tree= does not apply to Jacobi decoding (its draft is always a chain)")
    options.refuse("cllm", "draft_stop", "head_vocab")
    config = read_drafter_config(path)
    jacobi = JacobiOptions(block_size=int(config.get("block_size", DEFAULT_BLOCK_SIZE)), init=config.get("init", "random"))
    return JacobiDrafter(jacobi, pad_token_id=model.config.pad_token_id or 0)


DRAFTER_BUILDERS.update(cllm=_jacobi)
# Drafters without a checkpoint, for any base (load("jacobi:n=32,init=pad", base=...)): inference.training_free's
# NAMED_DRAFTERS, imported above.


class Engine:
    """A target model and its drafter, ready to generate. Build with `load`."""

    def __init__(self, model: torch.nn.Module, drafter: Drafter, drafter_config: dict[str, Any] | None = None) -> None:
        self.model = model
        self.drafter = drafter
        self.drafter_config = drafter_config

    @property
    def device(self) -> torch.device:
        """Where prompts go: the input embeddings' device (the first device of a target split by device_map)."""
        return input_device(self.model)

    @property
    def tree(self) -> TreeBuffers | None:
        return getattr(self.drafter, "tree", None)

    def generate(
        self,
        prompt_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        acceptance: str = "exact",
        stop: Sequence[Sequence[int]] = (),
        ignore_eos: bool = False,
        stream: Callable[[int, list[int]], bool | None] | None = None,
        seed: int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> GenerationOutput:
        """Generate from one prompt ([T] ids) or a batch ([B, T] tensor, or a list of id lists of any lengths,
        left-padded here). acceptance="exact" is lossless (greedy at temperature 0, rejection sampling above);
        "typical" is Medusa's LOSSY typical acceptance. Stops at the model's EOS ids unless `ignore_eos`, and after
        any `stop` id sequence, or where `stream(row, new_tokens)` returns True."""
        input_ids, attention_mask = self._batch(prompt_ids, attention_mask)
        eos = () if ignore_eos else eos_token_ids(self.model)
        config = DecodeConfig(
            max_new_tokens=max_new_tokens,
            sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
            acceptance=acceptance,
            eos_token_ids=eos,
            stop_sequences=tuple(tuple(int(t) for t in s) for s in stop),
        )
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        return generate(self.model, input_ids, self.drafter, config, attention_mask, stream, generator)

    def _batch(self, prompt_ids: Any, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(prompt_ids, torch.Tensor):
            ids = prompt_ids if prompt_ids.dim() == 2 else prompt_ids[None]
            return ids.to(self.device), None if attention_mask is None else attention_mask.to(self.device)
        rows = [list(prompt_ids)] if prompt_ids and isinstance(prompt_ids[0], int) else [list(r) for r in prompt_ids]
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("prompt_ids: every prompt needs at least one token")
        return left_pad(rows, 0, self.device)


def load(
    drafter_path: str | Path | None = None,
    base: str | None = None,
    dtype: str = "bf16",
    device: str | torch.device = "cpu",
    tree: str | Path | Sequence[Sequence[int]] | None = None,
    topk: int = MEDUSA_TOPK,
    quantization: str | None = None,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    tp_plan: Any = None,
    device_map: Any = None,
    offload_folder: str | Path | None = None,
    draft_stop: str | None = None,
    head_vocab: int | None = None,
) -> Engine:
    """Load a base model and (optionally) a drafter checkpoint into an Engine.

    `drafter_path` may also be a plain causal LM (a Hugging Face model directory or "builtin:<name>") sharing the
    base's tokenizer: it drafts as a draft model (then `base` is required; `tree="chain:<n>"` sets the draft length).
    `base` defaults to the checkpoint's base_model_name_or_path. Without a drafter the engine decodes
    autoregressively through the same loop (the baseline). `tree` is a tree spec for tree drafters (see
    inference.tree.load_tree); None uses the shipped default for the drafter's head count. `tp_plan="auto"` under
    torchrun shards the target tensor-parallel across the processes (`device` is then each process's own device);
    every process runs the same loop and returns the same tokens. `device_map` ("auto", "balanced", a dict or a JSON
    file, see models.loading.resolve_device_map) splits a target too big for one device across several (accelerate
    dispatch; "disk" entries need `offload_folder`); `device` is then unused: the engine works on the input
    embeddings' device and Medusa heads sit on the lm_head's. `draft_stop` (draft models only: "fixed",
    "confidence:<t>", "learned[:<t>]", see inference.draft_stop) sets when drafting stops; by default a checkpoint's
    learned stopper is used when it has one. `head_vocab=S` (Medusa heads only) lets the heads draft only the S
    tokens most frequent in their training data (the checkpoint's token_counts.safetensors): a cheaper projection,
    the same lossless verification."""
    config = None
    named = named_spec(drafter_path)
    if named is not None:
        if base is None or tree is not None or draft_stop is not None or head_vocab is not None:
            raise ValueError(f"load: drafter {drafter_path!r} needs base= (the model to decode) and takes no tree=, "
                             f"draft_stop= or head_vocab=")
        named_text, drafter_path = drafter_path, None
    if drafter_path is not None:
        plain = is_plain_model(drafter_path)  # a causal LM dir or builtin:<name>: a draft model for `base`
        drafter_path = Path(drafter_path)
        config = plain_model_config(drafter_path, base) if plain else read_drafter_config(drafter_path)
        if config["drafter_type"] not in DRAFTER_BUILDERS:
            known = ", ".join(sorted(DRAFTER_BUILDERS))
            raise CheckpointError(
                f"{drafter_path / CONFIG_NAME}: drafter_type {config['drafter_type']!r} is not served (known: {known})"
            )
        base = base or config.get("base_model_name_or_path")
        if not base:
            raise CheckpointError(f"{drafter_path / CONFIG_NAME}: no base_model_name_or_path; pass base=")
    elif base is None:
        raise ValueError("load: pass drafter_path (a draftsmith checkpoint) or base (a model to decode alone)")
    elif tree is not None:
        raise ValueError("load: tree= needs a tree drafter; pass drafter_path")
    elif draft_stop is not None:
        raise ValueError("load: draft_stop= needs a draft model; pass drafter_path")
    elif head_vocab is not None:
        raise ValueError("load: head_vocab= needs Medusa heads; pass drafter_path")
    if device_map is not None and tp_plan is not None:
        raise ValueError("load: device_map and tp_plan are exclusive (pipeline split vs tensor parallel)")
    target_kwargs = dict(dtype=dtype, quantization=quantization, attn_implementation=attn_implementation,
                         trust_remote_code=trust_remote_code, tp_plan=tp_plan, device_map=device_map,
                         offload_folder=offload_folder)
    if config is not None and config.get("backbone"):  # a fine-tuned target (Medusa-2, CLLM) ships with the drafter
        model = load_drafter_target(drafter_path, base, **target_kwargs)
    else:
        model = load_target(base, **target_kwargs)
    if quantization in (None, "none") and tp_plan is None and device_map is None:  # those place the weights themselves
        model.to(device)
    device = input_device(model)
    if named is not None:
        return Engine(model, build_from_spec(named, model), {"drafter_type": named_text})
    if config is None:
        return Engine(model, NoDrafter())
    options = DrafterOptions(tree=tree, topk=topk, draft_stop=draft_stop, head_vocab=head_vocab)
    drafter = DRAFTER_BUILDERS[config["drafter_type"]](drafter_path, model, options, device)
    return Engine(model, drafter, config)
