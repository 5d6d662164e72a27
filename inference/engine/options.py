"""Options declared once: a frozen dataclass per group, each field carrying an `Option` (its help, its command-line
conversion, what a valid value is, which drafter types take it), from which everything else reads.

    @dataclass(frozen=True)
    class LoadOptions:
        lookup: int | None = option(help="graft a prompt-lookup chain of up to N tokens", metavar="N", type=int,
                                    valid=whole(1, 64), must="a whole number of tokens in [1, 64]",
                                    drafters=("eagle3", "medusa"))

The command line's flag is the field's name with dashes (`lookup_budget` -> `--lookup-budget`), `add_flags` adds
every one of a group to a parser, `from_args` reads them back; the Python API's keyword is the field's name
(`keywords`, `signature_of`); `check` refuses a value its `valid` rejects, naming it the caller's way (`Naming`:
`lookup=` for inference.load, `--lookup` for the command line). Adding an option is one field and its
implementation.
"""

from __future__ import annotations

import argparse
import inspect
import math
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Callable, Iterator

from data.errors import UsageError

KEY = "draftsmith.option"  # the field metadata key an `Option` sits under
AS_FIELD = object()  # Option.cli_default's default: the command line's default is the field's


@dataclass(frozen=True)
class Option:
    """How one field is offered and checked. `must` completes "<name> must be ...", said when `valid` is False."""

    help: str
    metavar: str | None = None
    type: Callable[[str], Any] | None = None  # the command line's conversion (argparse `type`); None: text
    choices: tuple[Any, ...] | None = None  # the command line's choices (and a check, when `valid` is None)
    valid: Callable[[Any], bool] | None = None  # None: any value (or one of `choices`)
    must: str = ""
    cli: bool = True  # also a command-line flag (False: the Python API only)
    cli_default: Any = AS_FIELD  # the command line's default when it differs from the field's
    drafters: frozenset[str] | None = None  # the drafter types that take it; None: every one (or not a drafter's)
    needs: tuple[str, ...] = ()  # it applies only with one of these options set (the group's check says why)


def option(default: Any = None, *, drafters: tuple[str, ...] | None = None, **meta: Any) -> Any:
    """A dataclass field with its `Option` (keywords: Option's fields)."""
    taken = None if drafters is None else frozenset(drafters)
    return field(default=default, metadata={KEY: Option(drafters=taken, **meta)})


def options_of(group: type) -> Iterator[tuple[Field, Option]]:
    """The fields of `group` (a dataclass) that carry an Option, in declaration order."""
    for f in fields(group):
        if KEY in f.metadata:
            yield f, f.metadata[KEY]


def flag(name: str) -> str:
    """The command-line flag of the field `name`: the one spelling rule."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Naming:
    """How an error message names an argument: `drafter` and `base` as given, an option by its field name, as a
    keyword (`lookup=`, inference.load) or a flag (`--lookup`, the command line)."""

    drafter: str
    base: str
    cli: bool

    def arg(self, name: str) -> str:
        """`lookup=` or `--lookup`: the argument as a caller writes it."""
        return flag(name) if self.cli else f"{name}="

    def bare(self, name: str) -> str:
        """`lookup` or `--lookup`: the argument as a sentence names it."""
        return flag(name) if self.cli else name


API = Naming(drafter="load: drafter", base="base=", cli=False)
CLI = Naming(drafter="--drafter", base="--base", cli=True)


# -- validity -------------------------------------------------------------------------------------------------------

def whole(low: int, high: int | None = None) -> Callable[[Any], bool]:
    """A whole number (not a bool) in [low, high] (high None: no bound)."""
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v and (high is None or v <= high)


def number(low: float, finite: bool = True) -> Callable[[Any], bool]:
    """A real number (not a bool) >= low, finite unless `finite` is False."""
    def ok(v: Any) -> bool:
        return (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= low
                and (not finite or math.isfinite(v)))
    return ok


def check(values: Any, name: Callable[[str], str] = str, error: type[Exception] = UsageError) -> None:
    """Refuse the first field of the dataclass instance `values` that is set (not None) and not valid, in one line:
    "<name> must be <must>, got <value>" (`name`: a field's name as the caller spells it, e.g. `Naming.arg`)."""
    check_values(type(values), vars(values), name, error)


def check_values(group: type, values: Any, name: Callable[[str], str] = str,
                 error: type[Exception] = UsageError) -> None:
    """`check` for the fields of `group` in `values`, a mapping (a parsed command line's `vars(args)`); a field
    missing from it is not checked."""
    for f, opt in options_of(group):
        value = values.get(f.name)
        if value is None:
            continue
        valid = opt.valid if opt.valid is not None else (
            (lambda v: v in opt.choices) if opt.choices is not None else None)
        if valid is not None and not valid(value):
            must = opt.must or f"one of {', '.join(map(str, opt.choices or ()))}"
            raise error(f"{name(f.name)} must be {must}, got {value!r}")


# -- the command line -----------------------------------------------------------------------------------------------

def add_flags(parser: argparse.ArgumentParser | Any, group: type, defaults: dict[str, Any] | None = None) -> None:
    """A flag for every command-line field of `group`, its default the field's (or `defaults`', or the Option's
    cli_default)."""
    for f, opt in options_of(group):
        if not opt.cli:
            continue
        default = (defaults or {}).get(f.name, cli_default(f, opt))
        kwargs: dict[str, Any] = {"help": opt.help, "default": default}
        if isinstance(default, bool) and opt.type is None and opt.choices is None:  # a switch: --name turns it on
            kwargs["action"] = "store_true"
        if opt.type is not None:
            kwargs["type"] = opt.type
        if opt.choices is not None:
            kwargs["choices"] = opt.choices
        if opt.metavar is not None:
            kwargs["metavar"] = opt.metavar
        parser.add_argument(flag(f.name), **kwargs)


def from_args(group: type, args: argparse.Namespace, **given: Any) -> Any:
    """An instance of `group` from a parsed command line: each command-line field from its flag (`given` first);
    the rest keep their defaults."""
    values = {f.name: getattr(args, f.name) for f, opt in options_of(group) if opt.cli and hasattr(args, f.name)}
    return group(**{**values, **given})


# -- the Python API -------------------------------------------------------------------------------------------------

def keywords(*groups: type) -> dict[str, Any]:
    """Every field of `groups` that carries an Option -> its default: the keyword arguments they make."""
    return {f.name: _default(f) for group in groups for f, _ in options_of(group)}


def signature_of(function: Callable, *groups: type) -> inspect.Signature:
    """`function`'s signature with its `**options` replaced by a keyword-only parameter per field of `groups`."""
    signature = inspect.signature(function)
    fixed = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    extra = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_default(f), annotation=f.type)
             for group in groups for f, _ in options_of(group)]
    return signature.replace(parameters=[*fixed, *extra])


def split_keywords(given: dict[str, Any], where: str, *groups: type) -> list[Any]:
    """One instance per group from keyword arguments; an unknown keyword is a TypeError, as Python says it."""
    names = [{f.name for f, _ in options_of(group)} for group in groups]
    unknown = sorted(set(given) - set().union(*names))
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
    return [group(**{k: v for k, v in given.items() if k in own}) for group, own in zip(groups, names)]


def cli_default(f: Field, opt: Option) -> Any:
    """The command line's default of a field: the Option's `cli_default` when given, else the field's."""
    return opt.cli_default if opt.cli_default is not AS_FIELD else _default(f)


def _default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None
