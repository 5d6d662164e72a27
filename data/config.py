"""The `data` config group: its schema (conf/data/*.yaml, checked by Hydra in training) and the one way tools read a
conf/data file outside a training run (build-tree, the Jacobi collector, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from typing import Any, Mapping, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.errors import UsageError


def choice(name: str, *values: str, module: str = __name__) -> type[StrEnum]:
    """A StrEnum for a config key with a fixed set of values: OmegaConf then refuses any other value at composition.
    Member names equal their values (OmegaConf converts a string by member NAME, and a member hashes like its name),
    so members compare, hash, format and JSON-encode as the plain strings; names may be keywords ("raise", "global")."""
    return StrEnum(name, [(v, v) for v in values], module=module, qualname=name)


DataFormat = choice("DataFormat", "builtin", "sharegpt", "alpaca", "gsm8k", "text")  # builtin + data.readers.FORMATS
OnError = choice("OnError", "raise", "skip")


@dataclass
class DataConfig:
    name: str = "default"
    format: DataFormat = DataFormat.builtin
    path: Optional[str] = None
    split: str = "train"
    validation_path: Optional[str] = None
    validation_fraction: float = 0.02
    max_length: int = 512
    packing: bool = False
    on_error: OnError = OnError("raise")  # skip: count and skip bad records
    max_samples: Optional[int] = None
    chat_template: Optional[str] = None
    system_prompt: Optional[str] = None
    text_field: str = "text"
    seed: int = 0
    # Curation (data.readers, data.curation): what is dropped is counted, and logged as one line.
    recover_truncated: bool = False  # a .json list cut off at its end: keep its complete records, drop the cut one
    require_user_first: bool = False  # drop conversations whose assistant speaks first (else: trim those replies)
    dedupe: bool = False  # drop records repeating an earlier record's id or conversation
    decontaminate: bool = True  # drop train conversations whose first user turn is an eval prompt (data.eval_sets)
    max_tokens: Optional[int] = None  # train split token budget: a seeded sample of conversations up to it
    # Self-distillation (Medusa paper, sec. 3.3): before training, replace the assistant turns of the train split
    # with the target's own answers (self_distill_turns of each conversation), generated through the engine and
    # cached resumably in <output_dir>/self_distill/ (a file per rank). Heads then learn what the target will actually say.
    self_distill: bool = False
    self_distill_samples: Optional[int] = 1200  # conversations to answer (seeded shuffle of the train split); None: all
    self_distill_new_tokens: int = 128
    self_distill_batch_size: int = 16
    # Answers per prompt: the first greedy, each further one sampled (self_distill_temperature, self_distill_top_p;
    # seeded with seed + n) and written under the id "<id>_<n>" (inference.collect.self_distill.answer_id).
    self_distill_answers: int = 1
    self_distill_temperature: float = 0.7
    self_distill_top_p: float = 0.95
    # Assistant turns regenerated per conversation, in order, each seeing the target's own earlier answers (1: the
    # first exchange; null: every turn). A conversation ends before a turn whose prompt would leave fewer than
    # self_distill_new_tokens of data.max_length.
    self_distill_turns: Optional[int] = 1
    # A feature cache (`python -m train features ... output_dir=DIR`, data/features.py): train from the target's stored
    # hidden states and soft labels instead of running it forward; the cache's own samples replace this recipe's.
    features: Optional[str] = None


def available_data_configs() -> list[str]:
    folder = resources.files("conf").joinpath("data")
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_data_config(name: str, overrides: Sequence[str] | Mapping[str, Any] = (), flag: str = "--data") -> Any:
    """conf/data/<name>.yaml on the DataConfig schema (a DictConfig) with overrides: `key=value` strings (values
    parsed as YAML) or a mapping (values kept as given, None skipped). An unknown name, key or value raises
    UsageError naming `flag` and the name."""
    conf = resources.files("conf").joinpath("data", f"{name}.yaml")
    if not conf.is_file():
        raise UsageError(f"{flag} {name}: unknown data config; available: {', '.join(available_data_configs())}")
    if isinstance(overrides, Mapping):
        changes = OmegaConf.create({k: v for k, v in overrides.items() if v is not None})
    else:
        bad = next((o for o in overrides if "=" not in o), None)
        if bad is not None:
            raise UsageError(f"{bad!r}: overrides look like <key>=<value>")
        changes = OmegaConf.from_dotlist(list(overrides))
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(str(conf)))
        return OmegaConf.merge(cfg, changes)
    except OmegaConfBaseException as e:
        key = f"{e.full_key}: " if getattr(e, "full_key", None) else ""  # the offending key, when OmegaConf knows it
        raise UsageError(f"{flag} {name}: {key}{str(e).strip().splitlines()[0]}") from None
