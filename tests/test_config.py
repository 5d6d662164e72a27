"""Every config group composes against the schema; bad command lines fail with one clear line."""

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from train.cli import UsageError, available, parse, pop_local_rank
from train.config import register_configs

register_configs()


def composed(*overrides: str):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("model", available("model"))
def test_every_model_composes(model):
    cfg = composed("method=medusa1", f"+model={model}")
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert cfg.model.name == model
    assert cfg.output_dir == f"outputs/medusa1/{model}"


@pytest.mark.parametrize("group", ["data", "logger", "deepspeed", "method"])
def test_every_group_option_composes(group):
    for option in available(group):
        cfg = composed("method=medusa1", "+model=tiny", f"{group}={option}")
        OmegaConf.to_container(cfg, resolve=True)


def test_vicuna_uses_hub_id_and_shipped_template():
    cfg = composed("method=medusa1", "+model=vicuna7b")
    assert cfg.model.path == "lmsys/vicuna-7b-v1.3"
    assert cfg.model.chat_template == "vicuna_v1.1"


def test_method_schema_rejects_misspelt_key():
    with pytest.raises(UsageError, match="num_hedas"):
        parse(["medusa1", "+model=tiny", "method.num_hedas=3"])


def test_top_level_schema_rejects_misspelt_key():
    with pytest.raises(UsageError, match="trainig"):
        parse(["medusa1", "+model=tiny", "trainig.learning_rate=1"])


def test_wrong_type_names_the_key():
    with pytest.raises(UsageError, match="num_heads"):
        parse(["medusa1", "+model=tiny", "method.num_heads=many"])


def test_missing_and_unknown_model_and_method():
    with pytest.raises(UsageError, match="no model chosen.*tiny"):
        parse(["medusa1"])
    with pytest.raises(UsageError, match="unknown model 'nope'; available: .*vicuna7b"):
        parse(["medusa1", "+model=nope"])
    with pytest.raises(UsageError, match="unknown method 'nope'; available: .*medusa1"):
        parse(["nope", "+model=tiny"])


def test_deepspeed_local_rank_is_tolerated(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "unset")  # registers the variable so teardown restores its absence
    monkeypatch.delenv("LOCAL_RANK")
    assert pop_local_rank(["medusa1", "+model=tiny", "--local_rank=3"]) == ["medusa1", "+model=tiny"]
    import os

    assert os.environ["LOCAL_RANK"] == "3"
    assert parse(["medusa1", "--local_rank=0", "+model=tiny"]) == ["method=medusa1", "+model=tiny"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train", *args], capture_output=True, text=True, timeout=120)


def test_cli_errors_are_one_line_and_nonzero():
    for args, needle in [
        (["medusa1", "+model=nope"], "unknown model 'nope'"),
        (["medusa1", "+model=tiny", "method.num_hedas=3"], "num_hedas"),
        (["nope"], "unknown method 'nope'"),
    ]:
        result = run_cli(*args)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr


def test_cfg_job_prints_config_without_network(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "train", "medusa1", "+model=vicuna7b", "--cfg", "job"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])},
    )
    assert result.returncode == 0, result.stderr
    printed = OmegaConf.create(result.stdout)
    assert printed.model.path == "lmsys/vicuna-7b-v1.3"
    assert printed.method.num_heads == 5
    assert not (tmp_path / "outputs").exists()
