"""What every `python -m inference` subcommand shares: the model options and one `Session` (base model, drafter,
tokenizer) opened from them, after checking every option that can be checked before a model loads.

Bad input raises data.errors.UsageError (one line); inference.cli prints it and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, NoReturn, Sequence

import torch

from data.chat import encode_prompt
from data.errors import UsageError
from data.templates import TEMPLATES, ChatTemplateError
from inference.api import attach, config_before_loading, load_text_side, serve, step_options, trained_setting
from inference.drafters.options import LoadOptions
from inference.drafters.registry import DrafterRequest, named_spec, resolve, spec_names
from inference.drafters.spec import DrafterSpec
from inference.engine.context import check_context
from inference.engine.loop import SAMPLING_GROUPS
from inference.engine.options import CLI, add_flags, check_values, from_args
from inference.options import TargetOptions, add_serving_flags
from models.loading import check_device, located
from models.refs import LocalRef, model_settings


# How every command line here (python -m inference, scripts/bench_suite.py) reports bad input: one line, status 2.
EXIT_USAGE = 2
TRACEBACK_ENV = "DRAFTSMITH_TRACEBACK"  # set to get the traceback instead of the one-line error


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of usage + message
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename:  # output folder not writable, disk full
        return f"{err.filename}: {err.strerror or err}"
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@dataclass(frozen=True)
class Session:
    """What every subcommand works with. `engine.drafter` is the chosen drafter (NoDrafter for none)."""

    engine: Any  # inference.api.Engine
    tokenizer: Any
    chat_template: str | None  # None: the tokenizer's own
    base: str  # the base model's name or path, as given
    drafter_name: str  # --drafter as given ("none" when absent)
    drafter_config: dict[str, Any] | None  # the checkpoint's config.json
    target: tuple | None = None  # what the target was loaded from and how (`open_session(..., share=)` compares it)


def add_model_args(p: argparse.ArgumentParser, drafter_required: bool = False) -> None:
    p.add_argument("--drafter", required=drafter_required,
                   help=f"a draftsmith checkpoint directory, a draft model (dir, builtin:<name>, or "
                        f"early_exit:<model>:<layers>, that model's first layers; with --base), or "
                        f"a registered drafter ({', '.join(spec_names())}[:key=value,...]); default: none")
    p.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                   help="option for a registered drafter; repeatable")
    p.add_argument("--base", help="base model: hub id, local dir, builtin:tiny, or a conf/model name "
                                  "(default: the checkpoint's base_model_name_or_path)")
    add_serving_flags(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--no-cpu-kernel", action="store_true",
                   help="run CPU linears on stock PyTorch only (default: bf16 decode steps of up to 4 rows, or "
                        "32 with AMX or AVX-512-BF16, use the engine's own kernel on x86 CPUs with AVX2 or AVX-512, "
                        "and fp32 ones of up to 32 rows on AVX2 CPUs; inference.kernels.cpu_linear)")


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """A flag for every sampling parameter (inference.engine.loop.SAMPLING_GROUPS), --max-new-tokens defaulting to
    the command's own `max_new_tokens`."""
    for group in SAMPLING_GROUPS:
        add_flags(p, group, {"max_new_tokens": max_new_tokens})


def check_sampling(args: argparse.Namespace) -> None:
    """The sampling flags' values, each refused in one line naming its flag."""
    for group in SAMPLING_GROUPS:
        check_values(group, vars(args), CLI.arg)


def drafter_spec(name: str, pairs: Sequence[str]) -> str:
    """--drafter plus --drafter-option pairs as one `inference.api.load` spec ("name:key=value,...")."""
    extra = DrafterSpec("").with_pairs(pairs)  # checks each pair, whatever the drafter
    if not pairs:
        return name
    spec = named_spec(name)
    if spec is None:
        raise UsageError(f"--drafter-option applies to registered drafters ({', '.join(spec_names()[1:])}); "
                         f"--drafter {name} carries its own settings")
    return str(DrafterSpec(spec.name, (*spec.options, *extra.options)))


def check_model_args(args: argparse.Namespace) -> tuple[DrafterRequest, LoadOptions]:
    """Every model option (see `add_model_args`) that can be checked without loading a model: the drafter resolved
    (inference.drafters.registry) and the options its type takes, a base path that does not exist, threads, placement, a
    --max-new-tokens beyond the base model's context (its config.json). Raises UsageError or ValueError (one line)."""
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.device is not None:
        check_device(args.device)
    request = resolve(drafter_spec(args.drafter or "none", args.drafter_option), args.base, CLI)
    options = from_args(LoadOptions, args)
    request.check(options, CLI)
    base = model_settings(request.base).ref if request.base else None
    if isinstance(base, LocalRef):  # a base directory that is not there: its one line now, not after other models load
        located(base, needs=("config.json", "adapter_config.json"))
    base_config = config_before_loading(base) if base is not None else None
    if base_config is not None:  # a drafter trained for another base: before its weights load
        request.check_target(base_config)
    max_new_tokens = getattr(args, "max_new_tokens", None)  # generate and bench take --max-new-tokens
    if base is not None and max_new_tokens is not None:  # beyond the context even for a 1-token prompt: before loading
        check_context(base_config, 1, max_new_tokens, "--max-new-tokens", request.base)
    if args.device_map is not None and args.device is not None:
        raise UsageError("--device and --device-map are exclusive: the device map places every layer")
    if args.offload_folder is not None and args.device_map is None:
        raise UsageError("--offload-folder needs --device-map (it holds the modules the map puts on \"disk\")")
    return request, options


def open_session(args: argparse.Namespace, share: Session | None = None) -> Session:
    """Load base model, drafter and tokenizer from the common options (see `add_model_args`). With `share`, a
    session whose target was loaded from the same model with the same dtype, quantization and placement lends it
    (one copy of the weights for several drafters in one benchmark); a drafter that ships its own fine-tuned target
    (Medusa-2, CLLM) always loads that one."""
    request, options = check_model_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    name = args.drafter or "none"
    config = request.config
    settings = model_settings(request.base)
    dtype = args.dtype or trained_setting(config, "dtype", ("model",)) or settings.dtype or "bf16"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target_options = from_args(TargetOptions, args, dtype=dtype, device=device)
    own_target = bool((config or {}).get("backbone"))
    target = None if own_target else (settings.path, dtype, args.quantization, device, args.device_map)
    if share is not None and target is not None and share.target == target:
        text = load_text_side(request, settings, base_overridden=args.base is not None,
                              tokenizer=target_options.tokenizer, chat_template=target_options.chat_template)
        engine = attach(request, share.engine.model, options, *text)
        step_options(engine, target_options)
    else:
        engine = serve(request, args.base, target_options, options, CLI)
    engine.cpu_kernel = not getattr(args, "no_cpu_kernel", False)
    return Session(engine, engine.tokenizer, engine.chat_template, request.base, name, config, target)


def encode_messages(session: Session, messages: list[dict[str, str]], raw_hint: bool = False) -> list[int]:
    """Prompt ids of a conversation with the session's chat template and generation prompt."""
    try:
        return encode_prompt(session.tokenizer, messages, session.chat_template)
    except ChatTemplateError as err:
        if session.chat_template is None and not getattr(session.tokenizer, "chat_template", None):
            raise UsageError(f"the tokenizer has no chat template: pass --chat-template "
                             f"({', '.join(sorted(TEMPLATES))}){' or --raw' if raw_hint else ''}") from None
        raise UsageError(str(err)) from None
