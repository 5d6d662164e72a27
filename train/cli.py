"""`python -m train <method> +model=<name> [hydra overrides]`.

The first word picks conf/method/<method>.yaml; the rest are ordinary Hydra overrides (multirun, --cfg job, ...).
Before Hydra runs the job, the overrides are composed once here so that an unknown method, model or key ends in
one readable line and exit code 2 instead of a multi-line Hydra report.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import errno
import logging
import os
import re
import sys
import typing
from enum import Enum
from collections.abc import Iterator
from importlib import resources

from hydra import compose, initialize_config_module
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from data.errors import UsageError
from train import config as schema
from train.checks import check_data_sources, check_values
from train.config import register_configs

CONFIG_MODULE = "conf"
CONFIG_NAME = "train"
USAGE = "usage: python -m train <method> +model=<name> [key=value ...]"
# Config groups outside the primary config's defaults, added with "+<group>=<name>" after +model (so their overrides
# win over the model's data recipe): conf/experiment/<name>.yaml holds a whole recipe (model x method x data).
APPENDED_GROUPS = frozenset({"experiment"})
_LOCAL_RANK = re.compile(r"^--local[_-]rank=(\d+)$")
# OSErrors of the storage (not of the program): reported as one line naming the file.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.ENOTDIR)


def available(group: str) -> list[str]:
    folder = resources.files(CONFIG_MODULE).joinpath(group)
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def pop_local_rank(argv: list[str]) -> list[str]:
    """The deepspeed launcher appends --local_rank=N; move it into LOCAL_RANK where HF/accelerate look for it."""
    kept = []
    for arg in argv:
        match = _LOCAL_RANK.match(arg)
        if match:
            os.environ.setdefault("LOCAL_RANK", match.group(1))
        else:
            kept.append(arg)
    return kept


def _causes(e: BaseException | None) -> Iterator[BaseException]:
    """`e`, then the exception it was raised from, and so on (Hydra wraps OmegaConf's errors)."""
    while e is not None:
        yield e
        e = e.__cause__


def _one_line(e: BaseException) -> str:
    parts = []
    for cause in _causes(e):
        text = str(cause).strip()
        if text:
            lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(("full_key", "object_type", "reference_type"))]
            parts.append("; ".join(lines))
    return ": ".join(dict.fromkeys(parts))  # drop repeats, keep order


def check_overrides(plain: list[str]) -> None:
    """Compose the config once, turning composition failures into UsageError with one line."""
    chosen_model = any(re.match(r"^\+{0,2}model=", o) for o in plain)
    if not chosen_model:
        raise UsageError(f"no model chosen: add +model=<name>; available: {', '.join(available('model'))}")
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            cfg = compose(config_name=CONFIG_NAME, overrides=plain)
    except MissingConfigException as e:
        raise UsageError(missing_option_message(e) or _one_line(e)) from None
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise UsageError(choice_message(e) or unknown_key_from(e) or _one_line(e)) from None
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise UsageError(f"incomplete config: {_one_line(e)}") from None
    for override in plain:  # "+key=value" adds a key even to a structured node: only schema keys may be added
        key = override.lstrip("+").partition("=")[0]
        if override.startswith("+") and key not in APPENDED_GROUPS and not _has_field(cfg, key):
            raise UsageError(unknown_key_message(key, _schema_of(cfg, key).__name__))
    check_values(cfg, asked=[o.lstrip("+").partition("=")[0] for o in plain])


def missing_option_message(e: MissingConfigException) -> str | None:
    """"unknown <group> '<name>'; available: ..." from the exception's missing_cfg_file ("model/gpt5"), else None
    (e.g. a missing primary config)."""
    group, _, name = (e.missing_cfg_file or "").partition("/")
    if not name or group not in ("model", "method", "data", "logger", "deepspeed", "experiment"):
        return None
    return f"unknown {group} '{name}'; available: {', '.join(available(group))}"  # not e.options: lists *_schema


def unknown_key_from(e: BaseException) -> str | None:
    """"unknown config key ..." when `e` (or an exception it was raised from) is OmegaConf refusing a key that its
    structured node lacks: taken from that exception's full_key and object_type (the schema), else None."""
    for e in _causes(e):
        if isinstance(e, (ConfigKeyError, ConfigAttributeError)) and e.full_key and dataclasses.is_dataclass(e.object_type):
            return unknown_key_message(e.full_key, e.object_type.__name__)
    return None


def choice_message(e: BaseException) -> str | None:
    """"<key>=<value>: choose one of ..." when `e` (or an exception it was raised from) is OmegaConf refusing a value
    of an Enum-typed schema field (train.config's choices), else None. Built from the ValidationError's full_key, key,
    value and object_type, and the field's type hint: not from the message's text."""
    for e in _causes(e):
        if isinstance(e, ValidationError) and dataclasses.is_dataclass(e.object_type) and e.full_key:
            hint = typing.get_type_hints(e.object_type).get(str(e.key))
            kinds = typing.get_args(hint) if typing.get_origin(hint) is typing.Union else (hint,)
            enum = next((k for k in kinds if isinstance(k, type) and issubclass(k, Enum)), None)
            if enum is not None:
                allowed = (["null"] if type(None) in kinds else []) + [m.value for m in enum]
                return f"{e.full_key}={e.value}: choose one of {', '.join(allowed)}"
    return None


def _schema_of(cfg: DictConfig, key: str) -> type | None:
    parent_key = key.rpartition(".")[0]
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    kind = OmegaConf.get_type(parent) if isinstance(parent, DictConfig) else None
    return kind if kind is not None and dataclasses.is_dataclass(kind) else None


def _has_field(cfg: DictConfig, key: str) -> bool:
    kind = _schema_of(cfg, key)
    return kind is None or key.rpartition(".")[2] in {f.name for f in dataclasses.fields(kind)}


def unknown_key_message(key: str, schema_name: str) -> str:
    """'unknown config key ...' with the closest existing key of the same node, when one is close."""
    kind = getattr(schema, schema_name, None)
    parent, _, name = key.rpartition(".")
    names = [f.name for f in dataclasses.fields(kind)] if dataclasses.is_dataclass(kind) else []
    close = difflib.get_close_matches(name, sorted(names), n=1)
    hint = f"; did you mean '{parent + '.' if parent else ''}{close[0]}'?" if close else ""
    return f"unknown config key '{key}'{hint}"


def parse(argv: list[str]) -> list[str]:
    """argv after `python -m train` -> Hydra overrides, with method=<first word> in front."""
    argv = pop_local_rank(argv)
    methods = available("method")
    if not argv or argv[0] in ("-h", "--help"):
        raise UsageError(f"{USAGE}; methods: {', '.join(methods)}; models: {', '.join(available('model'))}")
    method, rest = argv[0], argv[1:]
    if method not in methods:
        raise UsageError(f"unknown method '{method}'; available: {', '.join(methods)}")
    overrides = [f"method={method}", *rest]
    flags = hydra_flags(overrides)  # Hydra's own flags (--cfg job, -m, ...) stay in argv for Hydra
    if not flags.multirun:
        check_overrides(flags.overrides)
    return overrides


class _Refuse(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints usage and exits: one UsageError line instead
        raise UsageError(f"{message}; {USAGE}")


def hydra_flags(argv: list[str]) -> argparse.Namespace:
    """Hydra's command-line flags separated from the overrides, which come back as .overrides; .multirun says whether
    -m/--multirun was given. Only separating: argv reaches hydra.main unchanged, which parses and acts on the flags
    itself. Like Hydra's own parser, overrides come before the flags or after the last one."""
    return hydra_flag_parser().parse_args(argv)


def hydra_flag_parser() -> argparse.ArgumentParser:
    """Hydra's documented command-line flags (hydra.cc/docs/advanced/hydra-command-line-flags), with the same
    arities; tests/test_config.py keeps the list equal to the one hydra.main parses."""
    parser = _Refuse(add_help=False, prog="python -m train <method>")  # abbreviations (--multi) as Hydra takes them
    for names in (("--help", "-h"), ("--hydra-help",), ("--version",), ("--resolve",), ("--run", "-r"),
                  ("--multirun", "-m"), ("--shell-completion", "-sc")):
        parser.add_argument(*names, action="store_true")
    for names in (("--package", "-p"), ("--config-path", "-cp"), ("--config-name", "-cn"), ("--config-dir", "-cd"),
                  ("--experimental-rerun",)):
        parser.add_argument(*names)
    parser.add_argument("--cfg", "-c", choices=["job", "hydra", "all"])
    parser.add_argument("--info", "-i", nargs="?", const="all",
                        choices=["all", "config", "defaults", "defaults-tree", "plugins", "searchpath"])
    parser.add_argument("overrides", nargs="*")
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by input (data, paths, checkpoints, settings: all UsageErrors) and a diverging loss: reported
    as one line, exit code 1."""
    from train.trainer import NonFiniteLossError  # deferred: train.trainer pulls in transformers' Trainer (seconds)

    return (UsageError, NonFiniteLossError, PermissionError, FileNotFoundError, IsADirectoryError)


def run_task(cfg) -> None:
    """Hydra task: train, turning input errors into one line on stderr and exit code 1."""
    try:
        check_data_sources(cfg)  # before the Trainer's imports: seconds for a missing file
        from train import task  # deferred: transformers' Trainer (seconds), not needed to reject a bad command line

        task.run(cfg)
    except UsageError as e:  # ahead of user_errors(), which imports the Trainer to name its error type
        print(f"\nerror: {e}", file=sys.stderr, flush=True)  # the newline ends a progress bar's line
        raise SystemExit(1) from None
    except user_errors() as e:
        print(f"\nerror: {e}", file=sys.stderr, flush=True)  # the newline ends a progress bar's line
        raise SystemExit(1) from None
    except OSError as e:
        if e.errno not in STORAGE_ERRNOS:
            raise
        print(f"\nerror: {e.filename or cfg.output_dir}: {e.strerror}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        distributed = shutdown_distributed()
    if distributed:
        exit_without_destructors()


def shutdown_distributed() -> bool:
    """Tear the process group down (True if there was one) before the interpreter exits."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        return True
    return False


def exit_without_destructors() -> None:
    """End a finished multi-process run with exit code 0 without running C++ exit-time destructors: on CPU (gloo +
    DeepSpeed's shared-memory all-reduce) one rank was seen to abort with "terminate called without an active
    exception" (SIGABRT) after everything was saved, turning a good run into a failed launch. Python-level state is
    closed first: the wandb run, logging handlers, stdout and stderr."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    import hydra

    register_configs()
    try:
        overrides = parse(list(sys.argv[1:] if argv is None else argv))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.argv = [sys.argv[0], *overrides]
    hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME, version_base="1.3")(run_task)()
