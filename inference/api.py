"""One call to serve any drafter: `engine = load(drafter_path); engine.generate(prompt_ids)`.

The checkpoint's config.json names the drafter type ("drafter_type") and the base model it was trained for
("base_model_name_or_path"); `load` resolves the argument and builds the drafter through the one registry,
inference.registry.DRAFTERS, so a new drafter type adds one entry there and keeps this call unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from data.collate import left_pad
from inference.devices import input_device
from inference.drafters import Drafter
from inference.generate import DecodeConfig, GenerationOutput, generate
from inference.registry import API, MEDUSA_TOPK, DrafterRequest, LoadOptions, resolve
from inference.tree import TreeBuffers
from inference.verify import SamplingParams
from models.checkpoint import load_drafter_target
from models.backbone import eos_token_ids
from models.builtin import model_settings
from models.loading import load_target

class Engine:
    """A target model and its drafter, ready to generate. Build with `load`."""

    def __init__(self, model: torch.nn.Module, drafter: Drafter, drafter_config: dict[str, Any] | None = None,
                 cpu_kernel: bool = True) -> None:
        self.model = model
        self.drafter = drafter
        self.drafter_config = drafter_config
        self.cpu_kernel = cpu_kernel  # few-row bf16 CPU linears through inference.cpu_kernels (False: stock only)

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
            cpu_kernel=self.cpu_kernel,
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
    drafter_path: str | Path | DrafterRequest | None = None,
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
    """Load a base model and (optionally) a drafter into an Engine.

    `drafter_path` is anything inference.registry.resolve names: a draftsmith checkpoint directory, a plain causal
    LM sharing the base's tokenizer (a model directory, "builtin:<name>" or "early_exit:<model>:<N>": it drafts as a
    draft model; `tree="chain:<n>"` sets the draft length), a drafter spec ("prompt_lookup", "jacobi:n=32", ...),
    None for plain autoregressive decoding through the same loop (the baseline), or a request already resolved.
    `base` defaults to the checkpoint's base_model_name_or_path; a model name of conf/model ("tiny", "smollm2",
    "vicuna7b") means what it means on the command line. `tree` is a tree spec for tree drafters (see
    inference.tree.load_tree); None uses the shipped default for the drafter's head count. `tp_plan="auto"` under
    torchrun shards the target tensor-parallel across the processes (`device` is then each process's own device);
    every process runs the same loop and returns the same tokens. `device_map` ("auto", "balanced", a dict or a JSON
    file, see models.loading.resolve_device_map) splits a target too big for one device across several (accelerate
    dispatch; "disk" entries need `offload_folder`); `device` is then unused: the engine works on the input
    embeddings' device and Medusa heads sit on the lm_head's. `draft_stop` (draft models only: "fixed",
    "confidence:<t>", "learned[:<t>]", see inference.draft_stop) sets when drafting stops; by default a checkpoint's
    learned stopper is used when it has one. `head_vocab=S` (Medusa heads only) lets the heads draft only the S
    tokens most frequent in their training data (the checkpoint's token_counts.safetensors): a cheaper projection,
    the same lossless verification. Every argument is checked before any model loads."""
    request = drafter_path if isinstance(drafter_path, DrafterRequest) else resolve(drafter_path, base, API)
    options = LoadOptions(tree=tree, topk=topk, draft_stop=draft_stop, head_vocab=head_vocab)
    request.check(options, API)
    if device_map is not None and tp_plan is not None:
        raise ValueError("load: device_map and tp_plan are exclusive (pipeline split vs tensor parallel)")
    target_kwargs = dict(dtype=dtype, quantization=quantization, attn_implementation=attn_implementation,
                         trust_remote_code=trust_remote_code, tp_plan=tp_plan, device_map=device_map,
                         offload_folder=offload_folder)
    base = model_settings(base or request.base)["path"]  # a model name ("tiny", "smollm2") as the command line takes it
    if request.config is not None and request.config.get("backbone"):  # a fine-tuned target (Medusa-2, CLLM)
        model = load_drafter_target(request.path, base, **target_kwargs)
    else:
        model = load_target(base, **target_kwargs)
    if quantization in (None, "none") and tp_plan is None and device_map is None:  # those place the weights themselves
        model.to(device)
    return attach(request, model, options)


def attach(request: DrafterRequest, model: torch.nn.Module, options: LoadOptions | None = None) -> Engine:
    """An Engine for a target already loaded (`model`, e.g. shared by several drafters in one benchmark) and the
    drafter `request` names; a request whose checkpoint carries its own fine-tuned target needs `load` instead."""
    options = options or LoadOptions()
    request.check(options, API)
    drafter = request.build(model, options, input_device(model))
    config = request.config if request.config is not None or request.type == "none" else {"drafter_type": request.label}
    return Engine(model, drafter, config)
