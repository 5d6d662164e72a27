"""Lean installs: the core install serves and trains in full precision; a feature whose optional package is missing
stops in one line that names the setting and the extra to install (data.extras), before any model loads."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from data.extras import EXTRA_OF, MissingExtra, require
from train.checks import check_extras
from tests.test_config import composed

ROOT = Path(__file__).resolve().parents[1]
# Runs `python -m <module> ARGS` with `importlib.util.find_spec` blind to the modules named in argv[1] (comma list),
# as on a core install without their extras.
WITHOUT = (
    "import importlib.util as u, runpy, sys\n"
    "hidden, find = set(sys.argv.pop(1).split(',')), u.find_spec\n"
    "u.find_spec = lambda name, *a, **k: None if name.split('.')[0] in hidden else find(name, *a, **k)\n"
    "module = sys.argv.pop(1)\n"
    "runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
)


def hide(monkeypatch, *modules: str) -> None:
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name.split(".")[0] in modules else find(name, *a, **k))


def expand(extras: dict[str, list[str]], name: str) -> set[str]:
    """The requirements an extra brings, following its "draftsmith[a,b]" self-references."""
    found = set()
    for req in extras[name]:
        if req.startswith("draftsmith["):
            for inner in req[len("draftsmith["):-1].split(","):
                found |= expand(extras, inner)
        else:
            found.add(req)
    return found


def test_every_optional_module_is_in_the_extra_that_names_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras, core = project["optional-dependencies"], project["dependencies"]
    distribution = {"llama_cpp": "llama-cpp-python"}  # module -> the name pip installs it by, where they differ
    outside_dev = {"llama_cpp"}  # compiles llama.cpp when installed (minutes): its one test skips without it
    for module, extra in EXTRA_OF.items():
        name = distribution.get(module, module)
        assert any(req.startswith(name) for req in extras[extra]), (module, extra)
        assert not any(req.startswith(name) for req in core), module  # optional means not in the core
        in_dev = any(req.startswith(name) for req in expand(extras, "dev"))
        assert in_dev != (module in outside_dev), module  # the tests run with all of them but those
    assert {r.split(">")[0] for r in expand(extras, "train")} == {"bitsandbytes", "deepspeed", "wandb", "datasets"}


def test_require_names_the_feature_and_the_extra(monkeypatch):
    require("torch", "anything")  # installed: nothing happens
    hide(monkeypatch, "bitsandbytes")
    with pytest.raises(MissingExtra, match=r"model.quantization=nf4 needs bitsandbytes.*\.\[qlora\]"):
        require("bitsandbytes", "model.quantization=nf4")


@pytest.mark.parametrize("override, module, extra", [
    ("model.quantization=nf4", "bitsandbytes", "qlora"),
    ("deepspeed=zero2", "deepspeed", "deepspeed"),
    ("logger=wandb", "wandb", "wandb"),
])
def test_training_settings_check_their_extra(monkeypatch, override, module, extra):
    cfg = composed("method=medusa1", "+model=tiny", override)
    asked = [override.partition("=")[0]]
    check_extras(cfg, asked)  # installed here ([dev] brings every extra)
    hide(monkeypatch, module)
    with pytest.raises(MissingExtra) as err:
        check_extras(cfg, asked)
    message = str(err.value)
    assert override.split("=")[0] in message and f"[{extra}]" in message and "\n" not in message


def test_core_settings_need_no_extra(monkeypatch, caplog):
    """The default logger is wandb: on a core install a run that did not ask for it logs to the console instead."""
    from train.logger import configure_logger

    hide(monkeypatch, *EXTRA_OF)
    cfg = composed("method=medusa1", "+model=tiny")
    check_extras(cfg, asked=["+model"])
    check_extras(composed("method=eagle3", "+model=tiny"))
    assert cfg.logger.name == "wandb" and configure_logger(cfg) == []
    assert "wandb is not installed" in caplog.text and "[wandb]" in caplog.text


def test_serving_nf4_names_the_extra(monkeypatch):
    from models.loading import quantization_config

    hide(monkeypatch, "bitsandbytes")
    assert quantization_config("none", False, None) is None
    with pytest.raises(MissingExtra, match=r"quantization nf4 needs bitsandbytes"):
        quantization_config("nf4", False, None)


def test_a_hub_dataset_names_the_extra(monkeypatch):
    from data.readers import _iter_hub

    hide(monkeypatch, "datasets")
    with pytest.raises(MissingExtra, match=r"data.path=someone/chats \(a hub dataset\) needs datasets.*\[hub\]"):
        next(_iter_hub("someone/chats", "train"))


def test_train_command_without_the_extra_is_one_line(tmp_path):
    """The whole command line, as a user without wandb sees it: one line, exit 2, no output folder."""
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT, "wandb", "train", "medusa1", "+model=tiny", "logger=wandb",
         f"output_dir={out}"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: logger=wandb needs wandb"), result.stderr
    assert not out.exists()
