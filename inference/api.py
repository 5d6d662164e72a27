"""One call to serve any drafter: `engine = load(drafter_path)`, then text in, text out.

    engine = load("outputs/medusa1/tiny")            # base model, tokenizer and chat template from the checkpoint
    engine.generate("Write a haiku about tea.")       # -> str (the chat template applied; raw=True skips it)
    engine.generate([{"role": "user", "content": "Hi"}])  # a conversation -> str
    engine.generate(["First prompt", "Second prompt"])    # a batch -> list[str]
    for piece in engine.stream("Tell me a story"): ...   # text as it is decoded
    engine.generate(prompt_ids)                        # token ids in -> GenerationOutput (ids and stats)

The checkpoint's config.json names the drafter type ("drafter_type") and the base model it was trained for
("base_model_name_or_path"); `load` resolves the argument and builds the drafter through the one registry,
inference.drafters.registry.DRAFTERS, so a new drafter type adds one entry there and keeps this call unchanged.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from data.chat import encode_prompt
from data.collate import left_pad
from data.templates import TEMPLATES, resolve_template
from inference.drafters.options import LoadOptions
from inference.drafters.registry import DrafterRequest, resolve
from inference.engine.devices import input_device
from inference.engine.drafter import Drafter
from inference.engine.loop import DecodeConfig, GenerationOutput, generate
from inference.engine.options import API, Naming, signature_of, split_keywords
from inference.engine.tree import TreeBuffers
from inference.engine.verify import SamplingParams
from inference.options import TargetOptions, check_target, options_help
from inference.textstream import TextStream
from models.backbone import eos_token_ids
from models.checkpoint import load_drafter_target
from models.loading import check_device, has_tokenizer, load_target, load_tokenizer, model_config
from models.refs import BuiltinRef, EarlyExitRef, LocalRef, ModelRef, ModelSettings, model_settings

Message = dict[str, str]
TextPrompt = str | Sequence[Message]  # one user message, or a conversation of {"role", "content"} messages
_DONE = object()  # Engine.stream's end-of-generation marker


def is_text_prompt(prompt: Any) -> bool:
    """A user message (str) or a conversation (a non-empty list of {"role", "content"} dicts), not token ids."""
    return isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and len(prompt) > 0
                                       and all(isinstance(m, dict) for m in prompt))


class Engine:
    """A target model, its drafter, and the tokenizer and chat template that turn text into prompts. Build with
    `load`. `generate` takes text (a prompt, a conversation, or a list of either) and returns text; it takes token
    ids too and then returns a GenerationOutput, ids and statistics, as the engine's loop makes them."""

    def __init__(self, model: torch.nn.Module, drafter: Drafter, drafter_config: dict[str, Any] | None = None,
                 cpu_kernel: bool = True, tokenizer: Any = None, chat_template: str | None = None,
                 slot_cache: bool = True, compile: bool = False, static_cache: bool = False,
                 sync_phases: bool = False, cache_slots: int | None = None) -> None:
        self.model = model
        self.drafter = drafter
        self.drafter_config = drafter_config
        self.cpu_kernel = cpu_kernel  # few-row bf16 CPU linears through kernels.cpu_linear (False: stock only)
        self.tokenizer = tokenizer  # None: ids only
        self.chat_template = chat_template  # a shipped template name or Jinja string; None: the tokenizer's own
        self.slot_cache = slot_cache  # the KV cache in preallocated slots (False: stock concatenation, a baseline)
        self.compile = compile  # the target's decoding step compiled (inference.engine.compiled)
        self.static_cache = static_cache  # a fixed-capacity cache, fixed step shapes (inference.engine.static)
        self.sync_phases = sync_phases  # right per-phase times on CUDA, for benchmarks (DecodeConfig.sync_phases)
        self.cache_slots = cache_slots  # the static cache's fixed capacity (DecodeConfig.cache_slots)

    @property
    def device(self) -> torch.device:
        """Where prompts go: the input embeddings' device (the first device of a target split by device_map)."""
        return input_device(self.model)

    @property
    def tree(self) -> TreeBuffers | None:
        return getattr(self.drafter, "tree", None)

    def generate(
        self,
        prompt: TextPrompt | Sequence[TextPrompt] | torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        acceptance: str = "exact",
        stop: Sequence[str | Sequence[int]] = (),
        ignore_eos: bool = False,
        stream: Callable[[int, list[int]], bool | None] | None = None,
        seed: int | None = None,
        attention_mask: torch.Tensor | None = None,
        raw: bool = False,
        return_output: bool = False,
        streamer: Any = None,
    ) -> str | list[str] | GenerationOutput:
        """Generate a reply.

        Text in, text out: `prompt` is a user message (str), a conversation ([{"role", "content"}, ...]) or a list of
        those (a batch, any lengths); the chat template is applied (`raw=True`: a str prompt is plain text instead)
        and the reply comes back as a str, or a list of str for a list. `stop` strings end a reply where its text
        holds one, whatever tokens spell it; the text ends before it. `return_output=True` returns the
        GenerationOutput instead, its `texts` filled in. `streamer`: a Hugging Face streamer (`TextStreamer`,
        `TextIteratorStreamer`, any `BaseStreamer`) for one text prompt, fed as `model.generate(streamer=...)` feeds
        it: the prompt's ids first (`skip_prompt=True` drops them), then each step's accepted tokens, then `end()`.

        Token ids in ([T] ids, a [B, T] tensor, or a list of id lists of any lengths, left-padded here): the
        GenerationOutput, `stop` then holds id sequences and `stream(row, new_tokens)` sees each row's tokens as they
        are committed (returning True stops that row).

        acceptance="exact" is lossless (greedy at temperature 0, rejection sampling above); "typical" is Medusa's
        LOSSY typical acceptance. Stops at the model's EOS ids unless `ignore_eos`."""
        kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                      acceptance=acceptance, ignore_eos=ignore_eos, seed=seed)
        if not self._is_text(prompt):
            if raw or return_output or any(isinstance(s, str) for s in stop):
                raise ValueError("generate: raw=, return_output= and stop strings apply to text prompts; "
                                 "token ids take stop id sequences")
            return self.generate_ids(prompt, stop=stop, stream=stream, attention_mask=attention_mask, **kwargs)
        if stream is not None or attention_mask is not None:
            raise ValueError("generate: stream= and attention_mask= apply to token ids; "
                             "engine.stream(prompt) streams text")
        batched = not is_text_prompt(prompt)
        if streamer is not None and batched:
            raise ValueError("generate: streamer= takes one prompt (Hugging Face streamers are batch-1)")
        rows = [self.encode(p, raw) for p in (prompt if batched else [prompt])]
        stops = self._stop_strings(stop)
        streams = [TextStream(self.tokenizer, stops) for _ in rows]

        def stream_row(row: int, ids: list[int]) -> bool:
            stop_here = streams[row](row, ids)
            if streamer is not None:
                streamer.put(torch.tensor(ids))
            return stop_here

        if streamer is not None:
            streamer.put(torch.tensor([rows[0]]))  # as model.generate does: the prompt first
        try:
            out = self.generate_ids(rows, stop=self.stop_ids(stop), stream=stream_row, **kwargs)
        finally:
            if streamer is not None:
                streamer.end()
        finished = [s.finish(ids) for s, ids in zip(streams, out.sequences)]
        texts = [text for text, _ in finished]
        if return_output:
            return replace(out, sequences=[ids for _, ids in finished], texts=texts)
        return texts if batched else texts[0]

    def stream(self, prompt: TextPrompt, raw: bool = False, stop: Sequence[str] = (), **kwargs: Any) -> Iterator[str]:
        """Yield the reply to one text prompt (as `generate` takes it) piece by piece, as its tokens are accepted:
        only text that can no longer change (no half of a multi-byte character, nothing that may become a stop
        string). The loop runs in a worker thread; leaving the iteration early stops it after its current step.
        Keyword arguments are `generate`'s sampling options (max_new_tokens, temperature, seed, ...)."""
        if not is_text_prompt(prompt):
            raise ValueError("stream: takes one text prompt (a str or a list of messages); "
                             "generate(prompt_ids, stream=callback) streams token ids")
        ids = self.encode(prompt, raw)
        pieces: queue.Queue = queue.Queue()
        text = TextStream(self.tokenizer, self._stop_strings(stop), emit=pieces.put)
        cancelled = threading.Event()

        def work() -> None:
            try:
                out = self.generate_ids([ids], stop=self.stop_ids(stop),
                                        stream=lambda row, new: text(row, new) or cancelled.is_set(), **kwargs)
                text.finish(out.sequences[0])
            except BaseException as err:  # handed to the caller's thread
                pieces.put(err)
            finally:
                pieces.put(_DONE)

        worker = threading.Thread(target=work, name="draftsmith-stream", daemon=True)
        worker.start()
        try:
            while (item := pieces.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()
            worker.join()

    def generate_ids(
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
        """`generate` for token ids: see there."""
        input_ids, attention_mask = self._batch(prompt_ids, attention_mask)
        eos = () if ignore_eos else eos_token_ids(self.model)
        config = DecodeConfig(
            max_new_tokens=max_new_tokens,
            sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
            acceptance=acceptance,
            eos_token_ids=eos,
            stop_sequences=tuple(tuple(int(t) for t in s) for s in stop),
            cpu_kernel=self.cpu_kernel,
            slot_cache=self.slot_cache,
            static_cache=self.static_cache,
            compile=self.compile,
            sync_phases=self.sync_phases,
            cache_slots=self.cache_slots,
        )
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        return generate(self.model, input_ids, self.drafter, config, attention_mask, stream, generator)

    def encode(self, prompt: TextPrompt, raw: bool = False) -> list[int]:
        """Prompt ids of a user message or a conversation, with the chat template and its generation prompt
        (`raw=True`: a str as plain text, the tokenizer's special tokens added)."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass token ids, or load(..., tokenizer=PATH)")
        if raw:
            if not isinstance(prompt, str):
                raise ValueError("raw=True takes a str prompt, not a conversation")
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(f"the tokenizer has no chat template: load(..., chat_template=NAME) "
                                 f"({', '.join(sorted(TEMPLATES))} or a Jinja string), or generate(..., raw=True)")
            ids = encode_prompt(self.tokenizer, messages, self.chat_template)
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        return ids

    def _is_text(self, prompt: Any) -> bool:
        if is_text_prompt(prompt):
            return True
        return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(is_text_prompt(p) for p in prompt)

    @staticmethod
    def _stop_strings(stop: Sequence[Any]) -> list[str]:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop: text prompts take non-empty stop strings")
        return list(stop)

    def stop_ids(self, stop: Sequence[str]) -> list[list[int]]:
        """Each stop string's own tokens, so the loop ends a row there too when the model spells it that way."""
        encoded = (self.tokenizer(s, add_special_tokens=False)["input_ids"] for s in stop)
        return [list(ids) for ids in encoded if ids]

    def _batch(self, prompt_ids: Any, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(prompt_ids, torch.Tensor):
            ids = prompt_ids if prompt_ids.dim() == 2 else prompt_ids[None]
            return ids.to(self.device), None if attention_mask is None else attention_mask.to(self.device)
        rows = [list(prompt_ids)] if prompt_ids and isinstance(prompt_ids[0], int) else [list(r) for r in prompt_ids]
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("prompt_ids: every prompt needs at least one token")
        return left_pad(rows, 0, self.device)


def load(drafter_path: str | Path | DrafterRequest | None = None, base: str | None = None, **options: Any) -> Engine:
    """Load a base model, its tokenizer and (optionally) a drafter into an Engine.

    `drafter_path` is anything inference.drafters.registry.resolve names: a draftsmith checkpoint directory, a plain
    causal LM sharing the base's tokenizer (a model directory, "builtin:<name>" or "early_exit:<model>:<N>": it drafts
    as a draft model; `tree="chain:<n>"` sets the draft length), a drafter spec ("prompt_lookup", "jacobi:n=32", ...),
    None for plain autoregressive decoding through the same loop (the baseline), or a request already resolved.
    `base` defaults to the checkpoint's base_model_name_or_path; a model name of conf/model ("tiny", "smollm2",
    "vicuna7b") means what it means on the command line. `dtype` defaults to the one the drafter was trained in, else
    the conf/model's, else bf16; `tokenizer` to the checkpoint's own (when `base` is not overridden), else the base
    model's; `chat_template` to the conf/model's, else the one the drafter was trained with, else the tokenizer's own.
    `device_map` and `tp_plan` place the weights themselves: `device` is then unused, and the engine works on the
    input embeddings' device (Medusa heads sit on the lm_head's).

    The keywords are the serving options, declared once with their help in inference.options.TargetOptions and
    inference.drafters.options.LoadOptions (listed below); the command line's flags are the same fields. Every
    argument is checked, and the tokenizer and the datastore loaded, before the model loads."""
    target, drafter_options = split_keywords(options, "load", TargetOptions, LoadOptions)
    return serve(drafter_path, base, target, drafter_options)


load.__signature__ = signature_of(load, TargetOptions, LoadOptions)  # the keywords `**options` takes, for help()
load.__doc__ = (load.__doc__ or "") + "\n\n" + options_help()  # None under python -OO


def serve(drafter: str | Path | DrafterRequest | None, base: str | None, target: TargetOptions,
          options: LoadOptions, naming: Naming = API) -> Engine:
    """`load` with its options in their groups (`naming`: how errors name the arguments)."""
    request = drafter if isinstance(drafter, DrafterRequest) else resolve(drafter, base, naming)
    request.check(options, naming)
    check_target(target, naming)
    if target.device_map is None:
        check_device(target.device)
    settings = model_settings(base or request.base)  # a model name ("tiny", "smollm2") as the command line takes it
    base_config = config_before_loading(settings.ref)
    if base_config is not None:
        request.check_target(base_config)
    text = load_text_side(request, settings, base_overridden=base is not None, tokenizer=target.tokenizer,
                          chat_template=target.chat_template, trust_remote_code=target.trust_remote_code)
    options = options.with_datastore(text[0], naming)
    dtype = target.dtype or trained_setting(request.config, "dtype", ("model",)) or settings.dtype or "bf16"
    target_kwargs = dict(dtype=dtype, quantization=target.quantization,
                         attn_implementation=target.attn_implementation, trust_remote_code=target.trust_remote_code,
                         tp_plan=target.tp_plan, device_map=target.device_map, offload_folder=target.offload_folder)
    if request.config is not None and request.config.get("backbone"):  # a fine-tuned target (Medusa-2, CLLM)
        model = load_drafter_target(request.path, settings.ref, **target_kwargs)
    else:
        model = load_target(settings.ref, **target_kwargs)
    if target.quantization in (None, "none") and target.tp_plan is None and target.device_map is None:
        model.to(target.device)  # quantization, tp_plan and device_map place the weights themselves
    engine = attach(request, model, options, *text)
    step_options(engine, target)
    return engine


def step_options(engine: Engine, target: TargetOptions) -> None:
    """The target options that shape the decoding step (a compiled step, a static cache), onto `engine`."""
    engine.compile, engine.static_cache, engine.cache_slots = target.compile, target.static_cache, target.cache_slots


def attach(request: DrafterRequest, model: torch.nn.Module, options: LoadOptions | None = None,
           tokenizer: Any = None, chat_template: str | None = None) -> Engine:
    """An Engine for a target already loaded (`model`, e.g. shared by several drafters in one benchmark) and the
    drafter `request` names; a request whose checkpoint carries its own fine-tuned target needs `load` instead.
    Without a `tokenizer` the engine takes token ids only."""
    options = options or LoadOptions()
    request.check(options, API)
    drafter = request.build(model, options.with_datastore(tokenizer, API), input_device(model))
    config = request.config if request.config is not None or request.type == "none" else {"drafter_type": request.label}
    return Engine(model, drafter, config, tokenizer=tokenizer, chat_template=chat_template)


def load_text_side(request: DrafterRequest, settings: ModelSettings, base_overridden: bool,
                   tokenizer: str | Path | None = None, chat_template: str | None = None,
                   trust_remote_code: bool = False) -> tuple[Any, str | None]:
    """(tokenizer, chat template) for the engine `load` builds: the given ones, else the checkpoint's own tokenizer
    (unless the base was overridden: the base's then), else the base model's; the template of the conf/model, else
    the drafter's training run, else None (the tokenizer's own). A base folder with no tokenizer files gives no
    tokenizer: that engine takes token ids only (its text calls say so)."""
    template = chat_template or settings.chat_template \
        or trained_setting(request.config, "chat_template", ("model", "data"))
    if tokenizer is None:
        own = request.config is not None and not base_overridden and request.path is not None \
            and has_tokenizer(Path(request.path))
        tokenizer = request.path if own else settings.ref
        if isinstance(tokenizer, LocalRef) and not has_tokenizer(tokenizer.path):
            return None, template  # a bare model folder (weights and config only): the engine takes token ids
    loaded = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code)
    if template is not None:
        resolve_template(loaded, template)  # an unknown name or a missing file: one line before the model loads
    return loaded, template


def config_before_loading(ref: ModelRef) -> Any:
    """The base model's config when it can be read cheaply before loading (its context length, its widths against a
    drafter's): a folder's or a hub id's config.json. A built-in or early-exit model (whose first use builds it) and
    a config that does not read give None: the load reports those in its own words, and `generate()` checks the
    loaded model's context before decoding."""
    if isinstance(ref, (BuiltinRef, EarlyExitRef)):
        return None
    try:
        return model_config(ref)
    except ValueError:  # ModelLoadError: the load reports it in its own words
        return None


def trained_setting(config: dict[str, Any] | None, key: str, groups: Sequence[str]) -> str | None:
    """A setting of the run that trained the drafter (its checkpoint's training.config), first group that has it:
    the dtype its backbone was in, the chat template its data was rendered with."""
    trained = ((config or {}).get("training") or {}).get("config") or {}
    for group in groups:
        value = (trained.get(group) or {}).get(key)
        if value:
            return str(value)
    return None
