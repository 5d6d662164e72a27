"""Every drafter the engine serves, in one registry, and the one place that tells what a drafter argument names.

    a draftsmith checkpoint directory   its config.json's "drafter_type": medusa, draft_model, eagle3, cllm
    a plain causal LM                   a model directory, builtin:<name> or early_exit:<model>:<N>: a draft_model
    a spec "name[:key=value,...]"       a drafter without a checkpoint: jacobi, lookahead, prompt_lookup
    a hub id "org/name"                 either of the first two, located by models.refs' one hub policy (the
                                        local cache's snapshot; downloaded unless HF_HUB_OFFLINE=1), as --base is
    a model config name (conf/model)    that config's model ("smollm2-draft": early_exit:smollm2:8), as --base and
                                        training's method.draft read it (models.refs.model_settings)
    None or "none"                      plain autoregressive decoding through the same loop

`resolve` reads at most a config.json (no model loads) and returns a `DrafterRequest`; `DrafterRequest.check`
refuses, in one line, a load option (inference.drafters.options.LoadOptions) the drafter's type does not take or a
value it cannot use (before any model loads); `DrafterRequest.build` makes the Drafter for a loaded target.
`inference.api.load` and the command line (`inference.session`) both go through here, each naming the arguments its
own way (`tree=` or `--tree`, see inference.engine.options.Naming). A new drafter type adds one `DRAFTERS` entry,
and its name to the `drafters` of the load options it takes.

    load("prompt_lookup", base=...)
    load("lookahead:draft_nodes=31,branch_length=10", base=...)
    load("jacobi:n=32,init=pad", base=...)           # Jacobi decoding of the target itself
    python -m inference generate --drafter lookahead --drafter-option draft_nodes=31 ...

Specs are parsed once (inference.drafters.spec). lookahead's and prompt_lookup's option names are their constructor
keywords, values converted to the type of the keyword's default; jacobi takes n (block size), init and seed.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from data.errors import UsageError
from data.locations import is_local
from inference.drafters.datastore import Datastore
from inference.drafters.draft_model import build_draft_model_drafter
from inference.drafters.draft_stop import check_stop_spec
from inference.drafters.eagle3 import Eagle3Drafter, check_fits, eagle3_tree
from inference.drafters.jacobi import DEFAULT_BLOCK_SIZE, JacobiDrafter, JacobiOptions
from inference.drafters.lookahead import LookaheadDrafter
from inference.drafters.medusa import MedusaDrafter
from inference.drafters.options import OPTIONAL, LoadOptions, check_options
from inference.drafters.prompt_lookup import PromptLookupDrafter
from inference.drafters.spec import DrafterSpec, parse_value
from inference.drafters.with_lookup import WithLookup
from inference.engine.devices import output_device
from inference.engine.drafter import Drafter, NoDrafter
from inference.engine.options import API, CLI, Naming  # noqa: F401 (CLI: callers name the command line's way)
from inference.engine.tree import load_tree
from models.builtin import ModelLoadError
from models.checkpoint import (
    CheckpointError, check_compatible, head_vocabulary, load_drafter, read_drafter_config, read_token_counts,
)
from models.draft_model import checkpoint_stopper, is_plain_model
from models.eagle3 import load_eagle3, read_eagle3_config
from models.refs import BuiltinRef, EarlyExitRef, HubRef, LocalRef, locate, model_settings

@dataclass(frozen=True)
class DrafterRequest:
    """A drafter argument, resolved without loading a model. `type` is a key of DRAFTERS."""

    type: str
    label: str  # the argument as given ("none" for no drafter)
    base: str  # the model to decode: as given, else the checkpoint's base_model_name_or_path
    spec: DrafterSpec | None = None  # drafters named by a spec
    path: Path | None = None  # checkpoints and plain causal LMs
    config: dict[str, Any] | None = None  # the checkpoint's config.json (a plain causal LM: a draft_model entry)

    @property
    def plain_model(self) -> bool:
        return self.type == "draft_model" and self.config is not None and "draft_model_path" in self.config

    def describe(self) -> str:
        if self.type == "none":
            return "plain decoding (no drafter)"
        if self.spec is not None:
            return f"drafter {self.type!r}"
        return "a plain causal LM (a draft model)" if self.plain_model else f"drafter_type {self.type!r}"

    def check(self, options: LoadOptions, naming: Naming = API) -> None:
        """Refuse, in one line, an option this type does not take or a value it cannot use (`check_options`); reads
        at most small files of the checkpoint (its stopper entry, its token counts); a spec-named drafter is built
        once without a target, so its options are checked too."""
        kind = DRAFTERS[self.type]
        check_options(options, self.type, self.describe(), naming)
        if options.draft_stop is not None:
            has_stopper = self.path is not None and checkpoint_stopper(self.path)[0] is not None
            check_stop_spec(options.draft_stop, has_stopper)
        if options.head_vocab is not None:
            read_token_counts(self.path)  # raises CheckpointError naming the missing or unreadable file
        if kind.check is not None:
            kind.check(self, options)
        if self.spec is not None:  # its options and their values, as its builder takes them: no target needed; an
            # empty datastore stands in for one given (read when the drafter is built), for options that need one
            has_store = options.datastore is not None or options.datastore_grow is not None
            stand_in = Datastore([], max_served=1) if has_store else None
            kind.build(self, None, replace(options, datastore=stand_in), None)

    def check_target(self, target_config: Any) -> None:
        """A checkpoint trained for another base (hidden size, vocabulary), refused from the base's config alone,
        before its weights load (the builders check the loaded model again); a checkpoint that carries its own
        fine-tuned target (Medusa-2, CLLM) brings its own."""
        if self.config is not None and not self.config.get("backbone"):
            check_compatible(self.config, target_config.get_text_config())

    def build(self, model: torch.nn.Module, options: LoadOptions, device: torch.device) -> Drafter:
        """The drafter for the loaded target `model` (`device`: where prompts go, the input embeddings'); with
        `options.lookup`, its trees carry a prompt-lookup chain too (inference.drafters.with_lookup), and the
        datastore's tree with `options.datastore` (a path is read here, ids only; `load` reads it with the
        tokenizer before the model loads)."""
        options = options.with_datastore(None, API)
        if isinstance(options.datastore, Datastore):
            vocab = model.config.get_text_config().vocab_size
            if options.datastore.max_id >= vocab:
                raise UsageError(f"datastore: token id {options.datastore.max_id} is outside the target's vocabulary "
                                 f"[0, {vocab})")
        drafter = DRAFTERS[self.type].build(self, model, options, device)
        if options.lookup is None:
            return drafter
        return WithLookup(drafter, num_draft=options.lookup, datastore=options.datastore, budget=options.lookup_budget)


@dataclass(frozen=True)
class DrafterType:
    # (request, target, options, input device); spec-named drafters may get no target or device (build_from_spec)
    build: Callable[[DrafterRequest, torch.nn.Module | None, LoadOptions, torch.device | None], Drafter]
    checkpoint: bool = False  # named by a checkpoint's drafter_type; else by a spec
    # what of the options can be refused from the checkpoint's small files, before any model loads (its tree)
    check: Callable[[DrafterRequest, LoadOptions], None] | None = None


# -- builders -----------------------------------------------------------------------------------------------------

def _none(request: DrafterRequest, model: torch.nn.Module, options: LoadOptions, device: torch.device) -> Drafter:
    if request.spec is not None and request.spec.options:
        raise UsageError(f"drafter spec {str(request.spec)!r}: plain decoding takes no options")
    return NoDrafter()


def _medusa(request: DrafterRequest, model: torch.nn.Module, options: LoadOptions, device: torch.device) -> Drafter:
    """Heads on the lm_head's device (they read the same final hidden state), the tree on the input `device`;
    `head_vocab` keeps the S most frequent tokens of the heads' training data (the checkpoint's token_counts)."""
    loaded = load_drafter(request.path, device=output_device(model), dtype=model.get_input_embeddings().weight.dtype)
    check_compatible(loaded.config, model.config)
    buffers = load_tree(options.tree, num_heads=loaded.heads.config.num_heads, topk=options.topk, device=device)
    base_lm_head = model.get_output_embeddings() if loaded.heads.config.share_lm_head else None
    vocab = None if options.head_vocab is None else head_vocabulary(request.path, options.head_vocab, buffers.topk)
    return MedusaDrafter(loaded.heads, buffers, base_lm_head, vocab)


def _medusa_check(request: DrafterRequest, options: LoadOptions) -> None:
    """The tree for the checkpoint's head count (config.json), and head_vocab against its top-k: a bad --tree fails
    in one line before the target loads."""
    num_heads = (request.config or {}).get("num_heads")
    if num_heads is None:
        return
    buffers = load_tree(options.tree, num_heads=int(num_heads), topk=options.topk, device="cpu")
    if options.head_vocab is not None:
        head_vocabulary(request.path, options.head_vocab, buffers.topk)


def _draft_model(request: DrafterRequest, model: torch.nn.Module, options: LoadOptions, device: torch.device
                 ) -> Drafter:
    return build_draft_model_drafter(request.path, model, options.tree, options.topk, device, options.draft_stop)


def _eagle3(request: DrafterRequest, model: torch.nn.Module, options: LoadOptions, device: torch.device) -> Drafter:
    """An EAGLE-3 draft in the target's dtype beside its input embeddings; `tree` defaults to the tree its measured
    per-depth acceptance favours (inference.drafters.eagle3.default_tree); "dynamic[:...]" grows EAGLE-2's tree."""
    embed = model.get_input_embeddings()
    draft = load_eagle3(request.path, device=embed.weight.device, dtype=embed.weight.dtype,
                        target_vocab_size=model.config.get_text_config().vocab_size)
    check_compatible(request.config, model.config.get_text_config())
    tree = eagle3_tree(options.tree, draft.config.acceptance, device, draft.config.draft_vocab_size)
    return Eagle3Drafter(draft, tree, embed)


def _eagle3_check(request: DrafterRequest, options: LoadOptions) -> None:
    """The tree from the checkpoint's config.json (its acceptance table, its draft vocabulary), built on the CPU:
    a bad --tree fails in one line before the target loads."""
    config = read_eagle3_config(request.path)
    tree = eagle3_tree(options.tree, config.acceptance, "cpu", config.draft_vocab_size)
    check_fits(tree, config.draft_vocab_size)


def _cllm(request: DrafterRequest, model: torch.nn.Module, options: LoadOptions, device: torch.device) -> Drafter:
    """A "cllm" checkpoint: the fine-tuned target (its backbone, loaded by `load`) decoded by Jacobi iteration with
    the block size and initialisation it was trained for (config.json "block_size", "init")."""
    config = request.config
    jacobi = JacobiOptions(block_size=int(config.get("block_size", DEFAULT_BLOCK_SIZE)), init=config.get("init", "random"))
    return JacobiDrafter(jacobi, pad_token_id=model.config.pad_token_id or 0)


def _jacobi(request: DrafterRequest, model: torch.nn.Module | None, options: LoadOptions, device: torch.device | None
            ) -> Drafter:
    pad = 0 if model is None else model.config.pad_token_id or 0
    return JacobiDrafter(JacobiOptions.from_spec(request.spec), pad_token_id=pad)


# Drafters whose spec options are their constructor's keywords (they read only token ids).
KEYWORD_DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "lookahead": LookaheadDrafter,
    "prompt_lookup": PromptLookupDrafter,
}


def build_training_free(name: str, options: Mapping[str, str], **loaded: Any) -> Drafter:
    """Drafter `name` of KEYWORD_DRAFTERS with `options` (key -> text) and `loaded` (keywords a load option supplies
    as an object, such as `datastore`, never a spec's). Unknown names, unknown keys and unparsable values raise
    UsageError naming the drafter and the key."""
    if name not in KEYWORD_DRAFTERS:
        raise UsageError(f"unknown training-free drafter {name!r} (known: {', '.join(sorted(KEYWORD_DRAFTERS))})")
    params = {key: p for key, p in inspect.signature(KEYWORD_DRAFTERS[name]).parameters.items()
              if key not in OPTIONAL}
    kwargs: dict[str, Any] = dict(loaded)
    for key, text in options.items():
        if key not in params:
            raise UsageError(f"{name}: unknown option {key!r} (known: {', '.join(params)})")
        kind = type(params[key].default)
        try:
            kwargs[key] = parse_value(text, kind)
        except ValueError:
            raise UsageError(f"{name}: option {key} must be {kind.__name__}, got {text!r}") from None
    return KEYWORD_DRAFTERS[name](**kwargs)


def _keyword(request: DrafterRequest, model: torch.nn.Module | None, options: LoadOptions, device: torch.device | None
             ) -> Drafter:
    loaded = {} if options.datastore is None else {"datastore": options.datastore}
    return build_training_free(request.spec.name, dict(request.spec.options), **loaded)


DRAFTERS: dict[str, DrafterType] = {
    "none": DrafterType(_none),
    "medusa": DrafterType(_medusa, checkpoint=True, check=_medusa_check),
    "draft_model": DrafterType(_draft_model, checkpoint=True),
    "eagle3": DrafterType(_eagle3, checkpoint=True, check=_eagle3_check),
    "cllm": DrafterType(_cllm, checkpoint=True),  # its draft is always a Jacobi chain of its trained block size
    "jacobi": DrafterType(_jacobi),
    **{name: DrafterType(_keyword) for name in KEYWORD_DRAFTERS},
}


def spec_names() -> list[str]:
    """The drafters a spec names ("none" first), for help texts and errors."""
    return ["none", *sorted(n for n, k in DRAFTERS.items() if not k.checkpoint and n != "none")]


# -- resolving an argument ------------------------------------------------------------------------------------------

def named_spec(text: str | Path | None) -> DrafterSpec | None:
    """The spec when `text` names a registered drafter without a checkpoint (and is not an existing path), else
    None: the one test that tells a drafter name from a checkpoint or model path."""
    if not isinstance(text, str) or is_local(text):
        return None
    name = text.partition(":")[0]
    if name not in DRAFTERS or DRAFTERS[name].checkpoint or name == "none":
        return None
    return DrafterSpec.parse(text)


def resolve(drafter: str | Path | None, base: str | None = None, naming: Naming = API) -> DrafterRequest:
    """What `drafter` names (see the module docstring) and the base model to decode with, reading at most its
    config.json. Every failure is one line: an unknown name or missing path, a checkpoint that is incomplete or of an
    unserved type (CheckpointError naming its config.json), or no base model."""
    label = "none" if drafter is None else str(drafter)
    spec = named_spec(drafter)
    if drafter is None or label == "none":
        request = DrafterRequest("none", label, base or "")
    elif spec is not None:
        request = DrafterRequest(spec.name, label, base or "", spec=spec)
    elif isinstance(folder := drafter_folder(drafter, label, naming), str):  # builtin:/early_exit:, for `base`
        config = {"drafter_type": "draft_model", "base_model_name_or_path": base, "draft_model_path": folder}
        request = DrafterRequest("draft_model", label, base or "", path=Path(folder), config=config)
    elif is_plain_model(folder):  # a causal LM folder, drafting for `base`
        config = {"drafter_type": "draft_model", "base_model_name_or_path": base, "draft_model_path": str(folder)}
        request = DrafterRequest("draft_model", label, base or "", path=folder, config=config)
    else:
        path = folder
        config = read_drafter_config(path)  # raises CheckpointError naming what is missing or malformed
        kind = DRAFTERS.get(config["drafter_type"])
        if kind is None or not kind.checkpoint:
            known = ", ".join(sorted(n for n, k in DRAFTERS.items() if k.checkpoint))
            raise CheckpointError(f"{path / 'config.json'}: drafter_type {config['drafter_type']!r} is not served "
                                  f"(known: {known})")
        request = DrafterRequest(config["drafter_type"], label, base or config.get("base_model_name_or_path") or "",
                                 path=path, config=config)
        if not request.base:
            raise CheckpointError(f"{path / 'config.json'}: no base_model_name_or_path; pass {naming.base}")
    if not request.base:
        what = "no drafter" if request.type == "none" else f"{naming.drafter} {label}"
        role = "the target it drafts for" if request.plain_model else "the model to decode"
        raise UsageError(f"{what}: needs a base model; pass {naming.base} ({role})")
    return request


def drafter_folder(drafter: str | Path, label: str, naming: Naming) -> Path | str:
    """Where a drafter argument that is not a spec lives: the folder of a checkpoint, a local model or a hub id (by
    models.refs' one hub policy), or, for a model draftsmith makes (builtin:, early_exit:, or a conf/model name of
    one), its name, located when it loads. UsageError naming the argument when there is nothing there."""
    try:
        ref = model_settings(drafter).ref
    except ModelLoadError as e:  # an unknown builtin, a malformed early_exit name
        raise UsageError(f"{naming.drafter} {label}: {e}") from None
    if isinstance(ref, (BuiltinRef, EarlyExitRef)):
        return str(ref)
    try:
        return locate(ref)
    except ModelLoadError as e:
        if isinstance(ref, LocalRef) or (isinstance(ref, HubRef) and "/" not in ref.repo_id):  # a typo, most likely
            raise UsageError(f"{naming.drafter} {label}: no such checkpoint or model directory, and not a registered "
                             f"drafter ({', '.join(spec_names())})") from None
        raise UsageError(f"{naming.drafter} {label}: {e}") from None


def names_draft_model(drafter: str | Path | None) -> bool:
    """True when `drafter` resolves to a draft model (a plain causal LM or a draft_model checkpoint). Never raises:
    an argument `resolve` would refuse is simply not a draft model here (its own check reports it)."""
    if drafter is None:
        return False
    try:
        return resolve(drafter, base="(any)").type == "draft_model"
    except (UsageError, CheckpointError):
        return False


def build_from_spec(spec: str | DrafterSpec, model: torch.nn.Module | None = None) -> Drafter:
    """"name" or "name:key=value,key=value" of a drafter without a checkpoint -> that drafter (`model`: the target,
    for drafters that read its config)."""
    spec = DrafterSpec.parse(spec) if isinstance(spec, str) else spec
    if spec.name not in DRAFTERS or DRAFTERS[spec.name].checkpoint:
        raise UsageError(f"unknown drafter {spec.name!r} (known: {', '.join(spec_names()[1:])})")
    return DRAFTERS[spec.name].build(DrafterRequest(spec.name, str(spec), "", spec=spec), model, LoadOptions(), None)
