"""The one `name:key=value` parser, the one test that tells a registered drafter name from a path, and the one
registry's option checks (inference.drafters.registry: what `load` and the command line both refuse before a model
loads)."""

import json
from pathlib import Path

import pytest

from data.errors import UsageError
from inference.drafters.jacobi import JacobiOptions
from inference.drafters.registry import (API, CLI, DRAFTERS, LoadOptions, build_from_spec, named_spec,
                                         names_draft_model, resolve, spec_names)
from inference.drafters import registry
from inference.drafters.spec import DrafterSpec, parse_value
from inference.session import drafter_spec
from models.checkpoint import CheckpointError


def test_parse_and_render_round_trip():
    spec = DrafterSpec.parse("jacobi:n=32,init=pad")
    assert spec == DrafterSpec("jacobi", (("n", "32"), ("init", "pad")))
    assert str(spec) == "jacobi:n=32,init=pad"
    assert DrafterSpec.parse("prompt_lookup") == DrafterSpec("prompt_lookup") and str(DrafterSpec("x")) == "x"


@pytest.mark.parametrize("text", ["lookahead:draft_nodes", "lookahead:=3", "jacobi:n=4,seed"])
def test_parse_rejects_items_without_key_or_value(text):
    with pytest.raises(UsageError, match="expected key=value"):
        DrafterSpec.parse(text)


def test_command_line_pairs_append_to_the_spec():
    assert drafter_spec("jacobi:n=8", ["init=pad"]) == "jacobi:n=8,init=pad"
    assert drafter_spec("prompt_lookup", ["num_draft=4"]) == "prompt_lookup:num_draft=4"
    with pytest.raises(UsageError, match="expected KEY=VALUE"):
        drafter_spec("jacobi", ["n=4,seed=1"])
    with pytest.raises(UsageError, match="applies to registered drafters"):
        drafter_spec("outputs/medusa1/tiny", ["n=4"])


def test_a_name_is_a_drafter_unless_a_path_holds_it(tmp_path, monkeypatch):
    assert spec_names() == ["none", "jacobi", "lookahead", "prompt_lookup"]
    assert {n for n, k in DRAFTERS.items() if k.checkpoint} == {"medusa", "draft_model", "eagle3", "cllm"}
    assert named_spec("lookahead:draft_nodes=31") == DrafterSpec("lookahead", (("draft_nodes", "31"),))
    assert named_spec("builtin:tiny") is None and named_spec(None) is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "jacobi").mkdir()  # a checkpoint folder that happens to carry a drafter's name
    assert named_spec("jacobi") is None


def test_every_reader_uses_the_same_parser():
    assert JacobiOptions.parse("jacobi:n=32,init=pad,seed=3") == JacobiOptions(32, "pad", 3)
    drafter = build_from_spec("jacobi:n=4")
    assert drafter.options == JacobiOptions(block_size=4)
    with pytest.raises(UsageError, match="unknown drafter 'medusa'"):
        build_from_spec("medusa")


def test_resolve_tells_every_kind_of_argument_apart(tmp_path):
    assert resolve(None, "builtin:tiny").type == "none" and resolve("none", "builtin:tiny").type == "none"
    looked = resolve("lookahead:draft_nodes=31", "builtin:tiny")
    assert looked.type == "lookahead" and looked.spec.options == (("draft_nodes", "31"),)
    plain = resolve("builtin:tiny-draft", "builtin:tiny")
    assert plain.type == "draft_model" and plain.plain_model and plain.path is not None
    ckpt = tmp_path / "heads"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"drafter_type": "medusa", "base_model_name_or_path": "builtin:tiny"}))
    heads = resolve(str(ckpt))
    assert heads.type == "medusa" and heads.base == "builtin:tiny"  # the checkpoint's base by default
    assert resolve(str(ckpt), "other").base == "other"


def test_names_draft_model_asks_the_registry_and_never_raises(tmp_path):
    """The bench's hf_assisted check: a plain causal LM or a draft_model checkpoint; anything else (including what
    `resolve` refuses) is not one."""
    draft, heads, broken = tmp_path / "draft", tmp_path / "heads", tmp_path / "broken"
    for path, kind in ((draft, "draft_model"), (heads, "medusa")):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"drafter_type": kind, "base_model_name_or_path": "builtin:tiny"}))
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert names_draft_model("builtin:tiny-draft") and names_draft_model(str(draft))
    for other in (str(heads), str(broken), str(tmp_path / "missing"), "prompt_lookup", "none", None):
        assert not names_draft_model(other), other


@pytest.mark.parametrize("drafter, base, naming, message", [
    (None, None, API, "no drafter: needs a base model; pass base= "),
    ("prompt_lookup", None, CLI, "--drafter prompt_lookup: needs a base model; pass --base "),
    ("outputs/no/such/dir", "builtin:tiny", CLI, "--drafter outputs/no/such/dir: no such checkpoint or model "
                                                 "directory, and not a registered drafter (none, jacobi, lookahead"),
])
def test_resolve_failures_are_one_line_naming_the_argument(drafter, base, naming, message):
    with pytest.raises(UsageError) as err:
        resolve(drafter, base, naming)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_checkpoint_of_an_unserved_type_names_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"drafter_type": "lookahead", "base_model_name_or_path": "b"}))
    with pytest.raises(CheckpointError, match=r"config\.json: drafter_type 'lookahead' is not served \(known: cllm, "
                                               r"draft_model, eagle3, medusa\)"):
        resolve(str(tmp_path))


@pytest.mark.parametrize("drafter, options, message", [
    (None, LoadOptions(tree="chain"), "--tree does not apply to plain decoding (no drafter); it applies to "
                                      "draft_model, eagle3, medusa"),
    ("lookahead", LoadOptions(draft_stop="fixed"), "--draft-stop does not apply to drafter 'lookahead'; it applies "
                                                   "to draft_model"),
    ("builtin:tiny-draft", LoadOptions(head_vocab=64), "--head-vocab does not apply to a plain causal LM (a draft "
                                                       "model); it applies to medusa"),
    ("jacobi:n=4", LoadOptions(tree="chain:3"), "--tree does not apply to drafter 'jacobi'"),
    ("builtin:tiny-draft", LoadOptions(lookup=4), "--lookup does not apply to a plain causal LM (a draft model); it "
                                                  "applies to eagle3, medusa"),
])
def test_each_type_refuses_the_options_it_does_not_take(drafter, options, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(drafter, "builtin:tiny", CLI).check(options, CLI)


def test_option_values_are_checked_before_a_model_loads(tmp_path):
    plain = resolve("builtin:tiny-draft", "builtin:tiny")
    with pytest.raises(UsageError, match="has no stopper"):
        plain.check(LoadOptions(draft_stop="learned"))
    plain.check(LoadOptions(tree="chain:3", draft_stop="confidence:0.4"))  # accepted: nothing raised
    (tmp_path / "config.json").write_text(json.dumps({"drafter_type": "medusa", "base_model_name_or_path": "b"}))
    with pytest.raises(CheckpointError, match="token_counts.safetensors: missing"):
        resolve(str(tmp_path)).check(LoadOptions(head_vocab=64))


@pytest.mark.parametrize("spec, message", [
    ("jacobi:n=0", r"drafter spec 'jacobi:n=0': Jacobi block_size must be >= 2, got 0"),
    ("jacobi:init=zeros", r"drafter spec 'jacobi:init=zeros': Jacobi init must be one of"),
    ("lookahead:depth=3", r"lookahead: unknown option 'depth'"),
    ("prompt_lookup:num_draft=many", r"prompt_lookup: option num_draft must be int, got 'many'"),
])
def test_spec_option_values_are_checked_without_a_model(spec, message):
    """`check` builds a spec-named drafter once without a target, so a value its constructor refuses is one line
    before any model loads (it used to come after the target had loaded)."""
    request = resolve(spec, "builtin:tiny", CLI)
    with pytest.raises(UsageError, match=message):
        request.check(LoadOptions(), CLI)
    resolve(spec.partition(":")[0], "builtin:tiny", CLI).check(LoadOptions(), CLI)  # its defaults pass


def _hub_snapshot(hub: Path, repo_id: str) -> Path:
    """models--<org>--<name>/{refs/main, snapshots/<commit>} in a hub cache folder, as huggingface_hub lays it out."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    return snapshot


def test_a_hub_id_resolves_to_its_snapshot_in_the_local_cache(tmp_path, monkeypatch):
    """`--drafter org/name` (a draft model or a draftsmith checkpoint on the hub) is read from the local Hugging Face
    cache, never online; one that is not there is one line saying how to fetch it; builtin:/early_exit: names and
    local paths with one slash are untouched."""
    import huggingface_hub.constants

    from tests.model_support import save_tiny_model

    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    draft = _hub_snapshot(hub, "org/tiny-draft")
    save_tiny_model(draft)
    request = resolve("org/tiny-draft", "builtin:tiny", CLI)
    assert (request.type, request.label, request.path) == ("draft_model", "org/tiny-draft", draft)
    assert request.config["draft_model_path"] == str(draft)
    heads = _hub_snapshot(hub, "org/medusa-heads")
    (heads / "config.json").write_text(json.dumps({"drafter_type": "medusa", "base_model_name_or_path": "b"}))
    (heads / "drafter.safetensors").write_bytes(b"")
    request = resolve("org/medusa-heads")
    assert (request.type, request.path, request.base) == ("medusa", heads, "b")
    with pytest.raises(UsageError, match=r"--drafter org/missing: not a local directory, and the Hugging Face cache "
                                         r"holds no complete snapshot .* `hf download org/missing`"):
        resolve("org/missing", "builtin:tiny", CLI)
    _hub_snapshot(hub, "org/config-only")  # a snapshot without weights (only small files fetched) is not complete
    with pytest.raises(UsageError, match="holds no complete snapshot"):
        resolve("org/config-only", "builtin:tiny", CLI)
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "runs" / "draft"
    save_tiny_model(local)
    assert resolve("runs/draft", "builtin:tiny", CLI).path == Path("runs/draft")  # a local path wins over the hub


@pytest.mark.parametrize("text, kind, value", [
    ("false", bool, False), ("No", bool, False), ("0", bool, False), ("true", bool, True), ("on", bool, True),
    ("8", int, 8), ("2.5", float, 2.5), ("pad", str, "pad"),
])
def test_option_values_take_their_keywords_type(text, kind, value):
    assert parse_value(text, kind) == value and type(parse_value(text, kind)) is kind


@pytest.mark.parametrize("text, kind", [("maybe", bool), ("3.5", int), ("", int), ("x", float)])
def test_option_values_of_the_wrong_type_are_refused(text, kind):
    with pytest.raises(ValueError):
        parse_value(text, kind)


def test_a_boolean_option_reads_false_as_false(monkeypatch):
    """`bool("false")` is True: a training-free drafter's bool keyword must not read it that way."""
    class Flagged:
        def __init__(self, greedy: bool = True, width: int = 4) -> None:
            self.greedy, self.width = greedy, width

    monkeypatch.setitem(registry.KEYWORD_DRAFTERS, "flagged", Flagged)
    built = registry.build_training_free("flagged", {"greedy": "false", "width": "6"})
    assert built.greedy is False and built.width == 6
    with pytest.raises(UsageError, match="flagged: option greedy must be bool, got 'perhaps'"):
        registry.build_training_free("flagged", {"greedy": "perhaps"})
