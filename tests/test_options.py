"""Options are declared once (inference.engine.options): `inference.load`'s keywords, the command line's flags, a bench
plan's args and the checks all read the same fields, so none can drift from another."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass, fields

import pytest

from data.errors import UsageError
from inference import load
from inference.api import Engine
from inference.bench.methods import Sampling
from inference.bench.suite import Plan, bench_namespace
from inference.cli import build_parser
from inference.drafters.options import OPTIONAL, LoadOptions, takers
from inference.drafters.registry import DRAFTERS
from inference.engine.loop import SAMPLING_GROUPS
from inference.engine.options import (CLI, Naming, add_flags, check, flag, from_args, keywords, option, options_of,
                                      signature_of, split_keywords, whole)
from inference.options import TargetOptions, load_keywords
from models.builtin import DTYPES, QUANTIZATIONS

# the keywords `load` took before its options were declared once: users' code passes these
LOAD_KEYWORDS_BEFORE = (
    "dtype", "device", "tree", "topk", "quantization", "attn_implementation", "trust_remote_code", "tp_plan",
    "device_map", "offload_folder", "draft_stop", "head_vocab", "tokenizer", "chat_template", "lookup",
    "lookup_budget", "datastore", "datastore_grow", "datastore_smoothing", "datastore_request_weight")
# flags the commands' shared parsers add that are not serving or sampling options: the drafter and base (load's
# positional arguments), --drafter-option (folded into the drafter's spec), and the run's own settings
NOT_OPTIONS = {"--drafter", "--drafter-option", "--base", "--seed", "--threads", "--no-cpu-kernel"}


def subparser(command: str) -> argparse.ArgumentParser:
    actions = build_parser()._subparsers._group_actions[0]  # the subcommands
    return actions.choices[command]


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def test_load_signature_is_the_description():
    """load(drafter_path, base, **options): every field a keyword-only parameter with the field's default, and every
    keyword load took before still there."""
    params = inspect.signature(load).parameters
    assert list(params)[:2] == ["drafter_path", "base"]
    described = {name: p.default for name, p in params.items() if p.kind == p.KEYWORD_ONLY}
    assert described == load_keywords() == keywords(TargetOptions, LoadOptions)
    assert set(LOAD_KEYWORDS_BEFORE) <= set(described)
    assert described["device"] == "cpu" and described["topk"] == 10 and described["attn_implementation"] == "sdpa"
    for name in described:  # its help in load's docstring, from the same field
        assert f"    {name}: " in load.__doc__


def test_load_refuses_an_unknown_keyword_as_python_does():
    with pytest.raises(TypeError, match="load\\(\\) got an unexpected keyword argument 'lookup_budgett'"):
        load("prompt_lookup", base="builtin:tiny", lookup_budgett=8)


def test_load_checks_a_target_option_before_any_model_loads(tmp_path):
    """A bad dtype or quantization is one line naming the keyword, before the base (a folder that is not there)
    is even looked at."""
    missing = str(tmp_path / "no-model")
    with pytest.raises(UsageError, match=r"^dtype= must be one of bf16, fp16, fp32, fp64, got 'fp8'$"):
        load(None, base=missing, dtype="fp8")
    with pytest.raises(UsageError, match=r"^quantization= must be one of none, nf4, got 'int8'$"):
        load(None, base=missing, quantization="int8")
    with pytest.raises(UsageError, match=r"^lookup_budget= does not apply to drafter 'prompt_lookup'"):
        load("prompt_lookup", base=missing, lookup_budget=8)


@pytest.mark.parametrize("command", ["generate", "bench", "build-tree"])
def test_every_cli_flag_of_the_shared_options_is_a_field(command):
    """The commands' serving flags are exactly the command-line fields of the description (plus the sampling ones
    where the command samples), and each parses into its field."""
    parser = subparser(command)
    serving = {flag(f.name) for group in (TargetOptions, LoadOptions) for f, opt in options_of(group) if opt.cli}
    sampling = {flag(f.name) for group in SAMPLING_GROUPS for f, opt in options_of(group) if opt.cli}
    assert serving <= flags_of(parser)
    if command != "build-tree":
        assert sampling <= flags_of(parser)
    shared = flags_of(parser) & (serving | sampling | NOT_OPTIONS)
    for name in shared - NOT_OPTIONS:
        field_name = name[2:].replace("-", "_")
        assert any(f.name == field_name for group in (TargetOptions, LoadOptions, *SAMPLING_GROUPS)
                   for f, _ in options_of(group)), name


def test_flags_parse_into_the_fields():
    parser = subparser("generate")
    args = parser.parse_args(["--prompt", "hi", "--lookup", "4", "--lookup-budget", "8", "--datastore", "a,b",
                              "--datastore-grow", "100", "--datastore-request-weight", "2.5", "--dtype", "fp32",
                              "--top-k", "5", "--acceptance", "typical", "--max-new-tokens", "7"])
    options = from_args(LoadOptions, args)
    assert (options.lookup, options.lookup_budget, options.datastore, options.datastore_grow,
            options.datastore_request_weight, options.topk) == (4, 8, "a,b", 100, 2.5, 10)
    target = from_args(TargetOptions, args)
    assert (target.dtype, target.quantization, target.device) == ("fp32", "none", None)
    assert (args.top_k, args.acceptance, args.max_new_tokens, args.temperature) == (5, "typical", 7, 0.0)


def test_a_bench_plan_entry_reads_the_same_fields(tmp_path):
    """A plan's `args` are bench flags: the same fields, checked the same way, the error naming the plan."""
    plan = Plan(tmp_path / "plan.yaml", ("--base", "builtin:tiny"), (), (), ())
    args = bench_namespace(plan, ["--drafter", "prompt_lookup", "--datastore-grow", "100", "--temperature", "0.5"],
                           "methods.pl")
    assert from_args(LoadOptions, args).datastore_grow == 100 and args.temperature == 0.5
    with pytest.raises(UsageError, match=r"plan\.yaml: methods\.pl: --top-p must be in \(0, 1\], got 0\.0"):
        bench_namespace(plan, ["--drafter", "prompt_lookup", "--top-p", "0"], "methods.pl")


def test_each_drafter_option_names_registered_drafters():
    """`drafters` of every optional load option names DRAFTERS' types (a typo there would silently refuse it)."""
    for name in OPTIONAL:
        assert takers(name) and set(takers(name)) <= set(DRAFTERS), name


def test_the_choices_are_declared_once():
    """The dtype, quantization and acceptance choices the command line offers are models.builtin's and the
    engine's own tuples."""
    parser = subparser("generate")
    choices = {a.dest: a.choices for a in parser._actions if a.choices}
    assert list(choices["dtype"]) == list(DTYPES)
    assert [None, *choices["quantization"]] == list(QUANTIZATIONS)
    from inference.engine.loop import ACCEPTANCE
    assert tuple(choices["acceptance"]) == ACCEPTANCE


def test_sampling_keywords_are_the_description():
    """Engine.generate / generate_ids take each sampling parameter under its field's name and default, and the
    bench's per-method Sampling holds fields of the same names."""
    described = keywords(*SAMPLING_GROUPS)
    assert set(described) == {"max_new_tokens", "acceptance", "temperature", "top_k", "top_p"}
    for method in (Engine.generate, Engine.generate_ids):
        params = inspect.signature(method).parameters
        assert {name: params[name].default for name in described} == described, method.__name__
    assert {f.name for f in fields(Sampling)} <= set(described)


def test_the_machinery_on_a_planted_group():
    """One field is a keyword, a flag, a check and a message, nothing else to edit."""

    @dataclass(frozen=True)
    class Planted:
        widget_count: int | None = option(type=int, metavar="N", valid=whole(1, 9), must="a whole number in [1, 9]",
                                          help="how many widgets")
        api_only: str = option("x", cli=False, help="not a flag")

    parser = argparse.ArgumentParser()
    add_flags(parser, Planted)
    assert flags_of(parser) == {"--widget-count"}
    assert from_args(Planted, parser.parse_args(["--widget-count", "3"])) == Planted(widget_count=3)
    with pytest.raises(UsageError, match=r"^--widget-count must be a whole number in \[1, 9\], got 0$"):
        check(Planted(widget_count=0), CLI.arg)
    with pytest.raises(UsageError, match=r"^widget_count= must be a whole number in \[1, 9\], got True$"):
        check(Planted(widget_count=True), Naming("d", "b", cli=False).arg)
    assert split_keywords({"widget_count": 2}, "f", Planted) == [Planted(widget_count=2)]
    with pytest.raises(TypeError, match="f\\(\\) got an unexpected keyword argument 'widgets'"):
        split_keywords({"widgets": 2}, "f", Planted)

    def f(a: int, **options: object) -> None: ...
    assert list(signature_of(f, Planted).parameters) == ["a", "widget_count", "api_only"]


def test_session_reads_the_description():
    """The command line refuses what `load` refuses, in the same words with flags for keywords."""
    from inference.session import check_model_args
    parser = subparser("generate")
    args = parser.parse_args(["--prompt", "hi", "--drafter", "prompt_lookup", "--base", "builtin:tiny",
                              "--lookup-budget", "8"])
    with pytest.raises(UsageError, match=r"^--lookup-budget does not apply to drafter 'prompt_lookup'"):
        check_model_args(args)
