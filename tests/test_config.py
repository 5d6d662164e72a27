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


@pytest.mark.parametrize("model", available("model"))
def test_bf16_targets_train_their_modules_in_bf16(model):
    """A target loaded in bf16 (the GPU models) autocasts what it trains: fp32 heads over a 32k vocabulary made a
    medusa1 step 2.5x slower on an H200 (docs/results.md). The CPU models keep fp32 (bf16 is slow on AVX2 hosts)."""
    cfg = composed("method=medusa1", f"+model={model}")
    assert cfg.training.bf16 == (cfg.model.dtype == "bf16")


def test_vicuna_uses_hub_id_and_shipped_template():
    cfg = composed("method=medusa1", "+model=vicuna7b")
    assert cfg.model.path == "lmsys/vicuna-7b-v1.3"
    assert cfg.model.chat_template == "vicuna_v1.1"


GPU_TARGETS = {  # the 7-8B conf/model targets: decoder layers (num_hidden_layers of their config.json)
    "llama2_7b_chat": 32, "llama3_8b_instruct": 32, "llama3_1_8b_instruct": 32, "mistral7b_instruct": 32,
    "qwen2_5_7b_instruct": 28, "qwen3_8b": 36, "zephyr7b": 32, "vicuna7b": 32,
}


@pytest.mark.parametrize("model", sorted(GPU_TARGETS))
def test_gpu_targets_default_to_self_distilled_sharegpt_v3_and_their_own_layers(model):
    """Every 7-8B target trains on the ShareGPT V3 recipe the project ships, answered by itself (not the 999-prompt
    demo set), and the feature recipes store EAGLE-3's layers for its own depth, not SmolLM2's."""
    from models.eagle3 import default_layers, fused_layers

    for method in ("medusa1", "eagle3", "features"):
        cfg = composed(f"method={method}", f"+model={model}")
        assert (cfg.data.name, cfg.data.self_distill) == ("sharegpt_v3", True)
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    for experiment in ("sharegpt_features", "selfdistill_features"):
        cfg = composed("method=features", f"+model={model}", f"+experiment={experiment}")
        assert cfg.data.name == "sharegpt_v3" and cfg.method.layers is None
        assert fused_layers(cfg.method.layers, GPU_TARGETS[model]) == default_layers(GPU_TARGETS[model])
    eagle3 = composed("method=eagle3", f"+model={model}", "+experiment=sharegpt_eagle3")
    assert fused_layers(eagle3.method.layers or None, GPU_TARGETS[model]) == default_layers(GPU_TARGETS[model])


def test_fused_layers_follow_the_targets_depth():
    """EAGLE-3's 2, N/2, N-3; SmolLM2 (30 layers) keeps the layers its existing caches hold; a list is kept."""
    from models.eagle3 import fused_layers

    cfg = composed("method=features", "+model=smollm2", "+experiment=sharegpt_features")
    assert fused_layers(cfg.method.layers, 30) == (2, 15, 27)
    assert [fused_layers(None, n) for n in (32, 36, 28)] == [(2, 16, 29), (2, 18, 33), (2, 14, 25)]
    assert fused_layers([1, 5], 32) == (1, 5)
    assert composed("method=eagle3", "+model=tiny", "method.layers=null").method.layers is None
    assert composed("method=features", "+model=tiny").method.layers == []  # plain features: no extra layers


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


def numeric_fields(schema: type) -> list[str]:
    import dataclasses
    import typing

    hints = typing.get_type_hints(schema)
    numeric = (int, float, typing.Optional[int], typing.Optional[float])
    return [f.name for f in dataclasses.fields(schema) if hints[f.name] in numeric]


def test_every_numeric_key_has_a_range():
    from train.config import METHOD_SCHEMAS, RANGES, DataConfig, EvalConfig, TrainConfig, TrainingConfig

    for schema in (TrainConfig, DataConfig, TrainingConfig, EvalConfig, *METHOD_SCHEMAS.values()):
        assert sorted(RANGES.get(schema, {})) == sorted(numeric_fields(schema)), schema.__name__


@pytest.mark.parametrize("method", available("method"))
def test_shipped_configs_are_in_range(method):
    from train.config import out_of_range

    overrides = [["+model=tiny"], ["+model=vicuna7b"]] + [["+model=tiny", f"data={d}"] for d in available("data")]
    for extra in overrides if method == "medusa1" else overrides[:2]:
        assert out_of_range(composed(f"method={method}", *extra)) is None, extra


def test_stopper_draft_length_bound_is_the_engines():
    from inference.drafters.draft_model import MAX_GAMMA
    from models.draft_limits import MAX_DRAFT_TOKENS
    from train.config import out_of_range

    assert MAX_GAMMA == MAX_DRAFT_TOKENS  # one owner: models.draft_limits
    assert out_of_range(composed("method=stopper", "+model=tiny", f"method.max_gamma={MAX_DRAFT_TOKENS}")) is None
    message = out_of_range(composed("method=stopper", "+model=tiny", f"method.max_gamma={MAX_DRAFT_TOKENS + 1}"))
    assert message is not None and str(MAX_DRAFT_TOKENS) in message


@pytest.mark.parametrize("method,override,message", [
    ("medusa1", "method.decay=-1", "method.decay=-1.0: must be in (0, 1]"),
    ("medusa1", "method.decay=1.5", "method.decay=1.5: must be in (0, 1]"),
    ("medusa2", "method.decay=0", "method.decay=0.0: must be in (0, 1]"),
    ("medusa1", "training.max_steps=-5", "training.max_steps=-5: must be >= 1, or -1 to train for "
                                         "training.num_train_epochs"),
    ("medusa1", "training.max_steps=0", "training.max_steps=0: must be >= 1, or -1 to train for "
                                        "training.num_train_epochs"),
    ("medusa1", "training.learning_rate=nan", "training.learning_rate=nan: must be > 0"),
    ("medusa1", "training.warmup_steps=-0.1", "training.warmup_steps=-0.1: must be >= 0"),
    ("medusa1", "training.eval_steps=0", "training.eval_steps=0: must be >= 1 or null"),
    ("medusa1", "data.validation_fraction=1", "data.validation_fraction=1.0: must be in [0, 1)"),
    ("medusa1", "data.seed=-3", "data.seed=-3: must be in [0, 4294967295]"),
    ("medusa1", "seed=-1", "seed=-1: must be in [0, 4294967295]"),
    ("medusa1", "eval.greedy_new_tokens=0", "eval.greedy_new_tokens=0: must be >= 1"),
    ("medusa2", "method.lora_dropout=1", "method.lora_dropout=1.0: must be in [0, 1)"),
    ("medusa2", "method.heads_lr_multiplier=0", "method.heads_lr_multiplier=0.0: must be > 0"),
    ("cllm", "method.block_size=0", "method.block_size=0: must be >= 1 or null"),
    ("cllm", "method.ar_weight=-1", "method.ar_weight=-1.0: must be >= 0"),
    ("distill", "method.jsd_beta=1", "method.jsd_beta=1.0: must be in (0, 1)"),
    ("distill", "method.temperature=inf", "method.temperature=inf: must be > 0"),
    ("stopper", "method.max_gamma=33", "method.max_gamma=33: must be in [2, 32]"),
    ("stopper", "method.draft_cost=-0.5", "method.draft_cost=-0.5: must be >= 0 or null"),
])
def test_out_of_range_values_name_the_key_and_the_range(method, override, message):
    with pytest.raises(UsageError) as info:
        parse([method, "+model=tiny", override])
    assert str(info.value) == message


def test_in_range_edges_and_the_epochs_sentinel_pass():
    for override in ("training.max_steps=-1", "method.decay=1", "training.max_grad_norm=0", "eval.greedy_prompts=0",
                     "data.validation_fraction=0", "method.lm_weight=-1"):
        parse(["medusa2" if "lm_weight" in override else "medusa1", "+model=tiny", override])


def test_a_multirun_job_checks_its_own_values(tmp_path, monkeypatch):
    """`-m method.decay=0.8,-1` skips the check before Hydra: each job's run() refuses its own bad value."""
    from train.task import run

    cfg = composed("method=medusa1", "+model=tiny", "method.decay=-1", f"output_dir={tmp_path / 'out'}")
    with pytest.raises(UsageError, match=r"^method.decay=-1.0: must be in \(0, 1\]$"):
        run(cfg)
    assert not (tmp_path / "out").exists()


def test_choices_match_the_values_their_consumers_accept():
    """train.config repeats other layers' value sets (the schema loads without torch): keep them equal."""
    from data.config import DataFormat
    from data.jacobi import AR_SOURCES
    from data.readers import FORMATS
    from inference.drafters.jacobi import INITS
    from models.builtin import DTYPES, QUANTIZATIONS
    from train.config import ArSource, Dtype, JacobiInit, Quantization

    assert list(Dtype) == list(DTYPES)
    assert [None, *Quantization] == list(QUANTIZATIONS)
    assert list(DataFormat) == ["builtin", *FORMATS]
    assert list(JacobiInit) == list(INITS)
    assert sorted(ArSource) == sorted(AR_SOURCES)


def test_choices_read_and_serialise_as_plain_strings():
    """A typed choice compares, formats and JSON-encodes as its string; saved configs hold plain strings."""
    import json

    cfg = composed("method=cllm", "+model=tiny", "method.consistency=local", "data.on_error=skip")
    assert cfg.method.consistency == "local" and f"{cfg.method.consistency}" == "local"
    assert json.dumps({"c": cfg.method.consistency}) == '{"c": "local"}'
    assert {"local": 1}[cfg.method.consistency] == 1  # hashes like its string
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert type(plain["method"]["consistency"]) is str and type(plain["data"]["on_error"]) is str
    assert "consistency: local" in OmegaConf.to_yaml(cfg) and "on_error: skip" in OmegaConf.to_yaml(cfg)
    # a value written back (a saved config, a YAML file) composes again
    assert OmegaConf.merge(OmegaConf.structured(type(OmegaConf.to_object(cfg.method))), plain["method"]) == cfg.method


@pytest.mark.parametrize("args, message", [
    (["medusa1", "+model=tiny", "model.dtype=fp8"], "model.dtype=fp8: choose one of bf16, fp16, fp32, fp64"),
    (["medusa1", "+model=tiny", "data.on_error=ignore"], "data.on_error=ignore: choose one of raise, skip"),
    (["medusa1", "+model=tiny", "data.format=csv"], "data.format=csv: choose one of builtin, sharegpt, alpaca, gsm8k, text"),
    (["medusa1", "+model=tiny", "logger.name=tensorboard"], "logger.name=tensorboard: choose one of none, wandb"),
    (["medusa1", "+model=tiny", "logger.mode=sometimes"],
     "logger.mode=sometimes: choose one of null, online, offline, disabled"),
    (["medusa2", "+model=tiny", "method.head_schedule=cosine"],
     "method.head_schedule=cosine: choose one of constant, linear, sine"),
    (["distill", "+model=tiny", "method.divergence=kl2"], "method.divergence=kl2: choose one of fkl, rkl, jsd, tvd"),
    (["distill", "+model=tiny", "method.draft_dtype=int8"], "method.draft_dtype=int8: choose one of bf16, fp16, fp32, fp64"),
])
def test_bad_choice_names_the_key_and_the_choices(args, message):
    with pytest.raises(UsageError) as info:
        parse(args)
    assert str(info.value) == message


def test_bad_choice_on_the_command_line_is_one_line_and_exit_2():
    for args, line in [
        (["medusa1", "+model=tiny", "model.dtype=fp8"], "error: model.dtype=fp8: choose one of bf16, fp16, fp32, fp64"),
        (["cllm", "+model=tiny", "method.ar_loss=mse"], "error: method.ar_loss=mse: choose one of ce, kl"),
        (["medusa1", "+model=tiny", "training.on_nonfinite=ignore"],
         "error: training.on_nonfinite=ignore: choose one of stop, skip"),
    ]:
        result = run_cli(*args)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [line], result.stderr


def test_hydra_flags_are_separated_from_overrides():
    from train.cli import hydra_flags

    flags = hydra_flags(["method=medusa1", "+model=tiny", "method.decay=0.8,0.9", "-m"])
    assert flags.multirun and flags.overrides == ["method=medusa1", "+model=tiny", "method.decay=0.8,0.9"]
    flags = hydra_flags(["method=medusa1", "+model=tiny", "--cfg", "job", "--resolve", "--info"])
    assert (flags.cfg, flags.resolve, flags.info, flags.multirun) == ("job", True, "all", False)
    assert flags.overrides == ["method=medusa1", "+model=tiny"]
    with pytest.raises(UsageError, match=r"^unrecognized arguments: --nope; usage: "):
        hydra_flags(["method=medusa1", "--nope"])
    with pytest.raises(UsageError, match=r"^argument --cfg/-c: invalid choice: 'every'"):
        hydra_flags(["method=medusa1", "--cfg", "every"])


def test_a_multirun_sweep_is_left_to_hydra():
    """-m: values that sweep (0.8,-1) are not one config: each job checks its own (see the test above)."""
    assert parse(["medusa1", "+model=tiny", "method.decay=0.8,-1", "-m"])[-1] == "-m"


def test_our_hydra_flags_are_hydras():
    """train.cli keeps its own copy of Hydra's flags (no hydra._internal at run time); this test, only, reads the
    parser hydra.main uses, so that a Hydra upgrade adding, removing or changing a flag fails here."""
    from hydra._internal.utils import get_args_parser

    from train.cli import hydra_flag_parser

    def flags(parser):
        return {(tuple(sorted(a.option_strings)), a.nargs, tuple(a.choices or ()), a.const if a.nargs == "?" else None)
                for a in parser._actions if a.option_strings}  # arity 0 (store_true, version) or 1, or "?" (--info)

    assert flags(hydra_flag_parser()) == flags(get_args_parser())
    assert hydra_flag_parser().allow_abbrev == get_args_parser().allow_abbrev  # --multi means -m to both
