"""The one `name:key=value` parser and the one test that tells a registered drafter name from a path."""

import pytest

from data.errors import UsageError
from inference.drafter_spec import DrafterSpec
from inference.jacobi import JacobiOptions
from inference.session import drafter_spec
from inference.training_free import NAMED_DRAFTERS, build_from_spec, named_spec


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
    assert set(NAMED_DRAFTERS) == {"jacobi", "lookahead", "prompt_lookup"}
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
