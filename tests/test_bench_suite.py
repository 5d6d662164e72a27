"""scripts/bench_suite.py (inference.bench.suite): several methods and shared baselines in one alternating run, one
summary per method, one table; every plan error is one line before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data.errors import UsageError
from inference.bench.suite import bench_namespace, check_plan, main, read_plan
from tests.test_bench import data_dir, models  # noqa: F401  (fixtures: prompt sets, tiny target + draft)

pytestmark = pytest.mark.usefixtures("single_thread")


def write_plan(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    return path


def test_suite_runs_every_method_against_shared_baselines(models, data_dir, tmp_path, capsys):
    plan = write_plan(tmp_path, f"""
common: --base {models['target']} --dtype fp32 --max-new-tokens 8 --warmup 0 --questions mt_bench:1
baselines: {{run: [ar, hf, hf_pld]}}
methods:
  pld: {{args: --drafter prompt_lookup, versus: [ar, hf, hf_pld], label: prompt lookup}}
  draft: {{args: --drafter {models['draft']}, own_ar: true, categories: [gsm8k]}}
""")
    out = tmp_path / "out"
    assert main([str(plan), "--out", str(out), "--questions", "gsm8k:2,humaneval:1:spread"]) == 0
    printed, err = capsys.readouterr()
    suite = json.loads((out / "suite.json").read_text())
    assert suite["num_questions"] == 3 and list(suite["methods"]) == ["pld", "draft"]
    pld, draft = suite["methods"]["pld"], suite["methods"]["draft"]
    assert set(pld["speedup_vs"]) == {"ar", "hf", "hf_pld"} and pld["config"]["num_questions"] == 3
    # own_ar: the method's own loop is its ar (greedy reference); the category filter keeps the gsm8k questions
    assert draft["config"]["ar_is_own_loop"] and draft["config"]["num_questions"] == 2
    assert (pld["config"]["label"], draft["config"]["label"]) == ("prompt lookup", None)  # results_table's row names
    assert set(draft["categories"]) == {"gsm8k"} and set(draft["speedup_vs"]) == {"ar", "hf"}
    for s in (pld, draft):  # lossless: every greedy answer equals the plain loop's
        assert s["greedy_check"]["identical"] is True and s["greedy_check"]["lossless"] is True
        assert s["tau"] >= 1.0 and s["bandwidth"]["floor_ms"] > 0
    assert set(suite["baselines"]["methods"]) == {"ar", "hf", "hf_pld"}
    answers = [json.loads(line) for line in (out / "draft" / "draft.ar.jsonl").read_text().splitlines()]
    assert [a["question_id"] for a in answers] == ["gsm8k/0", "gsm8k/1"]
    table = (out / "table.md").read_text()
    assert table.splitlines()[0].startswith("| method | questions | tok/s | τ | × ar | × hf | × hf_pld")
    assert "| pld | 3 |" in table and "| draft | 2 |" in table and "3 same / 0 verified near-tie / 0 mismatch" in table
    provenance = next(line for line in table.splitlines() if line.startswith("Host: "))  # under the table
    assert "threads" in provenance and "code: " in provenance and "command: `" in provenance
    # 3 baselines x 3 questions + pld x 3 + draft and its own loop x 2 gsm8k questions, one progress count
    assert table.strip() in printed and "bench-suite: 16/16 answers" in err


@pytest.mark.parametrize("text, needle", [
    ("methods: {a: {args: --drafter prompt_lookup, colour: red}}", "methods.a.colour: unknown key"),
    ("methods: {}", "methods: expected a mapping"),
    ("common: --base x\nextra: 1\nmethods: {a: --drafter prompt_lookup}", ": extra: unknown key"),
    ("baselines: [ar, hf]\nmethods: {a: --drafter prompt_lookup}", ": baselines: "),  # a section of the wrong shape
    ("methods: {a: {args: --drafter prompt_lookup, categories: [null]}}", "methods.a.categories[0]: "),
    ("baselines: {run: [ar, hf_fast]}\nmethods: {a: --drafter prompt_lookup}", "baselines.run: distinct names"),
    ("methods: {a: {args: --drafter prompt_lookup, versus: [hf_pld]}}", "methods.a.versus: 'hf_pld' is not in"),
    ("methods: {ar: --drafter prompt_lookup}", "methods.ar: the name is a baseline's"),
    ("methods: {a: {args: --drafter prompt_lookup, own_ar: maybe}}", "methods.a.own_ar: Value 'maybe' is not a valid bool"),
    ("methods: [a, b", ":1: not valid YAML"),
])
def test_plan_errors_name_the_file_and_key(tmp_path, text, needle):
    with pytest.raises(UsageError, match=None) as e:
        read_plan(write_plan(tmp_path, text))
    assert str(e.value).startswith(str(tmp_path / "plan.yaml")) and needle in str(e.value)


@pytest.mark.parametrize("methods, needle", [
    ("a: --drafter prompt_lookup --colour red", "methods.a: '--colour' is not an option"),
    ("a: --tree chain", "methods.a: needs --drafter"),
    ("a: --drafter {tmp}/no-such-checkpoint", "methods.a: --drafter {tmp}/no-such-checkpoint: no such checkpoint"),
    ("a: --drafter nobody/not-cached", "methods.a: --drafter nobody/not-cached: not a local directory, and the "
                                       "Hugging Face cache holds no complete snapshot"),
    ("a: --drafter prompt_lookup --tree {tmp}/no-tree.json", "methods.a: --tree {tmp}/no-tree.json: not found"),
    ("a: --drafter prompt_lookup --tree chain", "methods.a: --tree does not apply to drafter 'prompt_lookup'"),
    ("a: {{args: --drafter prompt_lookup, categories: [writing]}}", "methods.a.categories ['writing']: no such"),
    ("a: --drafter prompt_lookup\nb: --drafter prompt_lookup --temperature -1", "methods.b: --temperature"),
])
def test_bad_plans_fail_in_one_line_before_any_model_loads(data_dir, tmp_path, capsys, methods, needle):
    """The base is a folder whose config.json holds no model: reaching a model load would fail with another
    message."""
    (tmp_path / "no-model").mkdir()
    (tmp_path / "no-model" / "config.json").write_text("{}")
    plan = write_plan(tmp_path, f"common: --base {tmp_path}/no-model --questions gsm8k:2\nmethods:\n  "
                      + methods.format(tmp=tmp_path).replace("\n", "\n  ") + "\n")
    assert main([str(plan), "--out", str(tmp_path / "out")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and needle.format(tmp=tmp_path) in err[0]
    assert not (tmp_path / "out").exists()


def test_a_method_base_that_does_not_exist_fails_before_the_baselines_load(data_dir, models, tmp_path, capsys):
    """The baselines' target exists; a method's own --base does not: one line naming the method, nothing loaded."""
    plan = write_plan(tmp_path, f"common: --base {models['target']} --questions gsm8k:2\nmethods:\n"
                      f"  a: --base {tmp_path}/gone/backbone --drafter jacobi\n")
    assert main([str(plan), "--out", str(tmp_path / "out")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [f"error: {plan}: methods.a: model path '{tmp_path}/gone/backbone' does not exist"]
    assert not (tmp_path / "out").exists()


def test_a_plain_loop_variant_is_a_method_when_it_says_drafter_none(data_dir, models, tmp_path):
    """`--drafter none` said outright: our plain loop with other engine options (here stock linears) beside the
    baselines; only a method that names no drafter at all is refused."""
    plan = read_plan(write_plan(tmp_path, f"common: --base {models['target']} --questions gsm8k:2\nmethods:\n"
                                          f"  ar_stock: --drafter none --no-cpu-kernel\n"))
    _, method_args = check_plan(plan)
    assert method_args["ar_stock"].drafter == "none" and method_args["ar_stock"].no_cpu_kernel


def test_only_picks_methods_and_names_unknown_ones(data_dir, tmp_path, capsys):
    plan = write_plan(tmp_path, "methods: {a: --drafter prompt_lookup}")
    assert main([str(plan), "--only", "b", "--out", str(tmp_path / "out")]) == 2
    assert "--only b: not a method of" in capsys.readouterr().err


def test_methods_share_the_baselines_target_when_it_is_the_same(models):
    from inference.cli import build_parser
    from inference.session import open_session

    def args(*flags):
        return build_parser().parse_args(["generate", "--prompt", "x", "--base", str(models["target"]), *flags])

    base = open_session(args("--dtype", "fp32"))
    pld = open_session(args("--dtype", "fp32", "--drafter", "prompt_lookup"), share=base)
    draft = open_session(args("--dtype", "fp32", "--drafter", str(models["draft"])), share=base)
    assert pld.engine.model is base.engine.model and draft.engine.model is base.engine.model
    assert draft.engine.drafter.model is not base.engine.model  # the draft model is its own
    other = open_session(args("--dtype", "bf16", "--drafter", "prompt_lookup"), share=base)
    assert other.engine.model is not base.engine.model  # another dtype: another copy
    # --no-cpu-kernel is the engine's own setting: the weights are still shared, the kernels not
    stock = open_session(args("--dtype", "fp32", "--drafter", "prompt_lookup", "--no-cpu-kernel"), share=base)
    assert stock.engine.model is base.engine.model and not stock.engine.cpu_kernel and base.engine.cpu_kernel


@pytest.mark.parametrize("plan_file", sorted((Path(__file__).resolve().parents[1] / "conf" / "bench").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_plan_reads_and_its_flags_are_bench_flags(plan_file):
    """The plans in conf/bench: keys, names and every method's flags as `python -m inference bench` parses them
    (the checkpoints they name come from the README's commands and need not exist here)."""
    plan = read_plan(plan_file)
    assert plan.methods and {"ar", "hf"} <= set(plan.baselines)
    for method in plan.methods:
        args = bench_namespace(plan, method.args, f"methods.{method.name}")
        # a method with its own weights (own_ar) may name them as its base (CLLM's backbone under plain Jacobi)
        assert args.drafter and (args.base == "smollm2" or method.own_ar) and args.max_new_tokens == 128
