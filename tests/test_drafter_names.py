"""A model config name (conf/model/<name>.yaml) names the same model wherever a drafter is named: `--drafter`,
`load(...)`, bench's `--assistant` and training's `method.draft` all read it through models.refs.model_settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from data.errors import UsageError
from inference.cli import build_parser
from inference.drafters.registry import names_draft_model, resolve
from inference.session import check_model_args
from models.refs import model_settings
from tests.conftest import build_tiny_lm
from tests.model_support import save_tiny_model
from train.distill import draft_path


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("names") / "model")


@pytest.mark.parametrize("name, path", [("smollm2-draft", "early_exit:smollm2:8"),
                                        ("tiny-draft", "builtin:tiny-draft")])
def test_a_conf_model_name_resolves_to_its_draft_model(name, path):
    assert model_settings(name).path == path
    request = resolve(name, "smollm2")
    assert (request.type, request.label, str(request.path)) == ("draft_model", name, path)
    assert request.config["draft_model_path"] == path and request.plain_model
    assert names_draft_model(name)  # bench's --drafter / --assistant checks
    assert draft_path(name) == path  # training's method.draft: the same owner


def test_training_reads_global_package_model_configs_too():
    """conf/model/tiny.yaml keeps its keys under `model:` (a global package): method.draft=tiny is builtin:tiny."""
    assert draft_path("tiny") == "builtin:tiny"
    assert draft_path("/some/dir") == "/some/dir" and draft_path("org/model") == "org/model"


def test_cli_drafter_takes_a_conf_model_name(saved_model):
    args = build_parser().parse_args(["generate", "--drafter", "tiny-draft", "--base", str(saved_model),
                                      "--tree", "chain:3", "--prompt", "hi", "--max-new-tokens", "8"])
    request, options = check_model_args(args)  # nothing loads
    assert request.type == "draft_model" and str(request.path) == "builtin:tiny-draft"
    assert request.base == str(saved_model) and options.tree == "chain:3"


def test_load_draft_model_resolves_a_conf_model_name(monkeypatch):
    """bench's --assistant reaches load_draft_model without `resolve`: the name still means its model."""
    from models import draft_model

    class Loaded(Exception):
        pass

    def fake_load(source, **kwargs):
        raise Loaded(source)

    monkeypatch.setattr(draft_model, "load_target", fake_load)
    target = build_tiny_lm("llama")
    with pytest.raises(Loaded, match="^early_exit:smollm2:8$"):
        draft_model.load_draft_model("smollm2-draft", target, target.device)


def test_an_unknown_name_is_still_one_line():
    with pytest.raises(UsageError, match=r"^load: drafter no-such-model: no such checkpoint or model directory, and "
                                         r"not a registered drafter \(none, "):
        resolve("no-such-model", "tiny")
