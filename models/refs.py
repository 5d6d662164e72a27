"""The one owner of model names: every string that names a model is parsed here, once, into a ModelRef, and every
ModelRef is located here, by one function.

    ./runs/x  /abs  ~/m  a/b/c    LocalRef     written as a path, or the name of an existing file or folder
                                                (data.locations.is_local: the one "is it local" rule)
    builtin:<name>                BuiltinRef   a model draftsmith makes itself (models.builtin.BUILTINS)
    early_exit:<model>:<N>        EarlyExitRef the first N decoder layers of <model> (any other model name but an
                                                early-exit one), cut once into the cache (models.early_exit)
    <name> of conf/model          ConfRef      that config's model, dtype and chat_template ("tiny", "smollm2")
    org/name, gpt2                HubRef       a Hugging Face hub repository

The order of that table is the order of the tests: an explicit prefix first, then a local path (so a folder called
"tiny" in the working directory is that folder), then a conf/model name, and anything else is a hub id.

`locate(ref)` gives the directory `from_pretrained` reads. Building and fetching are done by one locator per kind
(`LOCATORS`); none of them parses a string. Located directories are memoised per process (and per cache root), so a
name followed from `inference.api.load` to the loaded target builds or looks up its model once.

One offline policy for hub ids, the same for `--base`, `--drafter`, `method.draft` and an early-exit source: a
complete snapshot in the local Hugging Face cache (config.json and weights) is used as is; otherwise the snapshot
is downloaded (`huggingface_hub.snapshot_download`, what `hf download` does) unless the hub is offline
(HF_HUB_OFFLINE=1), in which case ModelLoadError names the `hf download` command to run.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

from data.cache import cache_root
from data.locations import is_local
from models.builtin import BUILTINS, ModelLoadError
from models.buildcache import hub_snapshot
from models.early_exit import ensure_early_exit

BUILTIN_PREFIX = "builtin:"
EARLY_EXIT_PREFIX = "early_exit:"


class ModelRef:
    """A parsed model name; `str(ref)` is the name as written (so messages quote what the user typed)."""


@dataclass(frozen=True)
class LocalRef(ModelRef):
    text: str  # as given; `path` expands "~"

    @property
    def path(self) -> Path:
        return Path(self.text).expanduser()

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class HubRef(ModelRef):
    repo_id: str
    revision: str | None = None  # a branch, tag or commit (model.revision); None: the default branch

    def __str__(self) -> str:
        return self.repo_id


@dataclass(frozen=True)
class BuiltinRef(ModelRef):
    name: str  # a key of models.builtin.BUILTINS

    def __str__(self) -> str:
        return BUILTIN_PREFIX + self.name


@dataclass(frozen=True)
class EarlyExitRef(ModelRef):
    source: ModelRef  # never an early-exit ref, even through a conf/model name
    layers: int

    def __str__(self) -> str:
        return f"{EARLY_EXIT_PREFIX}{self.source}:{self.layers}"


@dataclass(frozen=True)
class ConfRef(ModelRef):
    """conf/model/<name>.yaml: its model.path (parsed) and the settings a loader takes from it."""

    name: str
    model: ModelRef  # never a ConfRef
    dtype: str | None = None
    chat_template: str | None = None

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class ModelSettings:
    """What a command line or `load` takes from a model name: the model itself (a conf/model name's model) and the
    dtype and chat template its conf/model file sets (None when no file applies)."""

    ref: ModelRef  # never a ConfRef
    dtype: str | None = None
    chat_template: str | None = None

    @property
    def path(self) -> str:
        """The model as a name (`str(ref)`), for messages, configs and comparisons."""
        return str(self.ref)


# -- parsing -------------------------------------------------------------------------------------------------------

def parse_model(name: str | os.PathLike) -> ModelRef:
    """The one parser of model names (see the module docstring for the kinds and their order). Raises
    ModelLoadError (one line) for an empty name, an unknown builtin, a malformed early_exit name or an early-exit
    source that is itself an early-exit draft."""
    text = os.fspath(name)
    if not text:
        raise ModelLoadError("empty model name")
    if text.startswith(BUILTIN_PREFIX):
        return _builtin(text.removeprefix(BUILTIN_PREFIX))
    if text.startswith(EARLY_EXIT_PREFIX):
        return _early_exit(text)
    if is_local(text):
        return LocalRef(text)
    conf = _conf(text)
    return conf if conf is not None else HubRef(text)


def model_settings(name: str | os.PathLike | ModelRef) -> ModelSettings:
    """A model name's model and settings: a conf/model name gives its model, dtype and chat_template;
    "builtin:<name>" gets conf/model/<name>.yaml's settings when that file's model is the same builtin; anything
    else is its own model with no settings."""
    ref = name if isinstance(name, ModelRef) else parse_model(name)
    conf = ref if isinstance(ref, ConfRef) else _conf(ref.name) if isinstance(ref, BuiltinRef) else None
    if conf is None or (isinstance(ref, BuiltinRef) and conf.model != ref):
        return ModelSettings(ref)
    return ModelSettings(conf.model, conf.dtype, conf.chat_template)


def at_revision(ref: ModelRef, revision: str | None) -> ModelRef:
    """`ref` with the hub model it names pinned to `revision` (model.revision); other kinds have no revisions."""
    if revision is None:
        return ref
    if isinstance(ref, HubRef):
        return replace(ref, revision=revision)
    if isinstance(ref, ConfRef):
        return replace(ref, model=at_revision(ref.model, revision))
    return ref


def builtin_names(ref: ModelRef) -> list[str]:
    """The built-in models `ref` rests on: the one it names, a conf/model name's, or an early-exit draft's source's
    (so a training run can build them before anything locates them: train.task)."""
    if isinstance(ref, BuiltinRef):
        return [ref.name]
    if isinstance(ref, ConfRef):
        return builtin_names(ref.model)
    if isinstance(ref, EarlyExitRef):
        return builtin_names(ref.source)
    return []


def _builtin(name: str) -> BuiltinRef:
    if name not in BUILTINS:
        choices = ", ".join(BUILTIN_PREFIX + n for n in BUILTINS)
        raise ModelLoadError(f"unknown built-in model {BUILTIN_PREFIX + name!r}; choose one of {choices}")
    return BuiltinRef(name)


def _early_exit(text: str) -> EarlyExitRef:
    """`early_exit:<model>:<layers>`: the layer count is the last `:` field, so <model> may hold colons
    (`early_exit:builtin:tiny:2`)."""
    source, sep, layers = text.removeprefix(EARLY_EXIT_PREFIX).rpartition(":")
    if not sep or not source or not layers.isdigit():  # the range is checked against the model (early_exit)
        raise ModelLoadError(f"{text!r}: expected {EARLY_EXIT_PREFIX}<model>:<layers>, "
                             f"e.g. {EARLY_EXIT_PREFIX}smollm2:8")
    ref = parse_model(source)
    model = ref.model if isinstance(ref, ConfRef) else ref
    if isinstance(model, EarlyExitRef):
        raise ModelLoadError(f"{text}: the source is itself an early-exit draft; name its own model with the layer "
                             f"count you want")
    return EarlyExitRef(ref, int(layers))


def _conf(name: str) -> ConfRef | None:
    """conf/model/<name>.yaml as a ConfRef, or None when there is no such file (a name with a slash never is one)."""
    if "/" in name:
        return None
    file = resources.files("conf").joinpath("model", f"{name}.yaml")
    if not file.is_file():
        return None
    c = OmegaConf.load(str(file))
    model = c.model if "model" in c else c  # tiny.yaml is a global package: its model keys sit under `model`
    target = parse_model(str(model.path))
    if isinstance(target, ConfRef):
        raise ModelLoadError(f"conf/model/{name}.yaml: model.path {target.name!r} names another conf/model; name its "
                             f"model instead")
    return ConfRef(name, target, model.get("dtype"), model.get("chat_template"))


# -- locating ------------------------------------------------------------------------------------------------------

def locate(ref: ModelRef | str | os.PathLike) -> Path:
    """The directory holding the model `ref` names (a string is parsed first, by `parse_model`): a local path as
    given ("~" expanded; ModelLoadError when it does not exist), anything else built or fetched once by its kind's
    locator and memoised for the process."""
    ref = ref if isinstance(ref, ModelRef) else parse_model(ref)
    if isinstance(ref, LocalRef):
        if not ref.path.exists():
            raise ModelLoadError(f"model path {ref.text!r} does not exist")
        return ref.path
    return _located(ref, str(cache_root()), _hub_cache())


@functools.lru_cache(maxsize=None)
def _located(ref: ModelRef, cache: str, hub_cache: str) -> Path:
    """`locate` for built and fetched models; the cache roots are part of the key (tests and tools switch them)."""
    return LOCATORS[type(ref)](ref)


def _hub_cache() -> str:
    import huggingface_hub.constants

    return str(huggingface_hub.constants.HF_HUB_CACHE)


def locate_hub(ref: HubRef) -> Path:
    """The one offline policy for hub ids (module docstring): the cached snapshot, else a download unless offline."""
    import huggingface_hub.constants

    snapshot = hub_snapshot(ref.repo_id, ref.revision)
    if snapshot is not None:
        return snapshot
    not_cached = (f"not a local directory, and the Hugging Face cache holds no complete snapshot of {ref.repo_id} "
                  f"(config.json and weights)")
    if huggingface_hub.constants.is_offline_mode():
        raise ModelLoadError(f"{not_cached} and the hub is offline (HF_HUB_OFFLINE=1); fetch it first, e.g. "
                             f"`hf download {ref.repo_id}`")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref.repo_id, revision=ref.revision))
    except Exception as e:  # noqa: BLE001 - no such repository, gated, no network: one line either way
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{not_cached}, and downloading it failed ({first}); fetch it first, e.g. "
                             f"`hf download {ref.repo_id}`") from None


def locate_early_exit(ref: EarlyExitRef) -> Path:
    """The cached early-exit draft, cut from its source's folder; a source that cannot be located is named with
    the whole early_exit name."""
    try:
        source = locate(ref.source)
    except ModelLoadError as e:
        raise ModelLoadError(f"{ref}: {e}") from None
    return ensure_early_exit(ref, source)


LOCATORS: dict[type, Callable[[ModelRef], Path]] = {
    BuiltinRef: lambda ref: BUILTINS[ref.name](),
    EarlyExitRef: locate_early_exit,
    ConfRef: lambda ref: locate(ref.model),
    HubRef: locate_hub,
}
