"""conf/data/*.yaml: exactly the schema's keys, and each non-builtin group reads its fixture format."""

from dataclasses import fields, replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from data.datasets import DataConfigLike, load_conversations
from data.readers import DataError
from tests.data_support import DataCfg, FIXTURES

CONF = Path(__file__).resolve().parents[1] / "conf" / "data"
FIXTURE_FOR = {"sharegpt": "sharegpt.json", "alpaca": "alpaca.json", "gsm8k": "gsm8k.jsonl", "jsonl": "text.jsonl"}


def _load(name: str) -> DataCfg:
    return DataCfg(**OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml")))


@pytest.mark.parametrize("name", ["default", *FIXTURE_FOR])
def test_yaml_has_exactly_the_schema_keys(name):
    keys = set(OmegaConf.load(CONF / f"{name}.yaml").keys())
    assert keys == set(DataConfigLike.__annotations__) == {f.name for f in fields(DataCfg)}
    assert _load(name).name == name


@pytest.mark.parametrize("name", list(FIXTURE_FOR))
def test_group_reads_its_format(name):
    cfg = _load(name)
    with pytest.raises(DataError, match="data.path is required"):
        load_conversations(cfg, "train")
    conversations = load_conversations(replace(cfg, path=str(FIXTURES / FIXTURE_FOR[name]), validation_fraction=0.0),
                                       "train")
    assert conversations and all(c[-1]["role"] == "assistant" for c in conversations)


@pytest.mark.parametrize("override, message", [
    ("format=csv", "--data sharegpt: format: Invalid value 'csv', expected one of [builtin, sharegpt, alpaca, gsm8k, text]"),
    ("on_error=ignore", "--data sharegpt: on_error: Invalid value 'ignore', expected one of [raise, skip]"),
])
def test_a_bad_choice_outside_training_names_the_key(override, message):
    """Tools reading a conf/data file (build-tree, the Jacobi collector) get the schema's typed choices too."""
    from data.config import load_data_config
    from data.errors import UsageError

    with pytest.raises(UsageError) as info:
        load_data_config("sharegpt", [override])
    assert str(info.value) == message
