"""What a target forward costs by drafted nodes (inference.engine.step_cost, scripts/step_cost.py): the curve's
parsing, interpolation and break-even, its measurement on a tiny target as the loop runs it, and the script's output
and one-line refusals. Nothing here asserts a speed."""

from __future__ import annotations

import pytest
import torch

from inference.engine.step_cost import StepCost, measure_step_cost
from tests.model_support import save_tiny_model
from tests.script_support import load_script

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_curve_reads_its_text_form_interpolates_and_gives_the_break_even():
    cost = StepCost.parse("0:100,1:150,4:180,8:220")
    assert cost.points == ((0, 100.0), (1, 150.0), (4, 180.0), (8, 220.0))
    assert StepCost.parse(str(cost)) == cost
    assert cost.ms(0) == 100 and cost.ms(2) == pytest.approx(160) and cost.ms(6) == pytest.approx(200)
    assert cost.ms(12) == pytest.approx(260)  # past the last point: the last two points' slope (10 ms a node)
    assert StepCost(((0, 50.0),)).ms(7) == 50.0
    # a step of 8 nodes costs 2.2 plain ones: it must accept 1.2 drafts on average to make tokens as fast
    assert cost.break_even(8) == pytest.approx(1.2) and cost.break_even(0) == 0
    for bad, needle in (("1:100,2:150", "ascending from 0"), ("0:100,0:120", "ascending from 0"),
                        ("0:100,1:0", "milliseconds > 0"), ("0:100,1:nan", "milliseconds > 0"),
                        ("0:100,x", "expected K:MS items"), ("0:100,1.5:120", "expected K:MS items"), ("", "K:MS")):
        with pytest.raises(ValueError, match=needle):
            StepCost.parse(bad)


def test_the_measurement_times_each_size_and_leaves_the_target_as_it_was(tiny_lm):
    ids = torch.tensor([[3, 4, 5, 6]])
    before = tiny_lm(ids).logits
    seen = []
    cost = measure_step_cost(tiny_lm, (0, 1, 3), repeats=2, context=16, progress=lambda k, ms: seen.append(k))
    assert [k for k, _ in cost.points] == [0, 1, 3] == seen
    assert all(ms > 0 for _, ms in cost.points)
    assert torch.equal(tiny_lm(ids).logits, before)


def test_the_script_prints_the_curve_and_refuses_bad_input_in_one_line(tmp_path, capsys, monkeypatch):
    script = load_script("step_cost")
    target = save_tiny_model(tmp_path / "target", initializer_range=0.2)
    base = ["--base", str(target), "--dtype", "fp32", "--threads", "1"]
    assert script.main([*base, "--nodes", "0,2,5", "--repeats", "1", "--context", "8", "--quiet"]) == 0
    out = capsys.readouterr()
    curve = out.out.strip().splitlines()[-1]  # (a library's import notice may come first in this process)
    assert [k for k, _ in StepCost.parse(curve).points] == [0, 2, 5]
    assert out.err.count("drafted nodes:") == 3  # a progress line a size
    assert script.main([*base, "--nodes", "0,4", "--repeats", "1", "--context", "8"]) == 0
    table = capsys.readouterr().out
    assert "| 0 (plain) |" in table and "| 4 |" in table and "break-even" in table
    assert "plain steps (least squares): prompt lookup's --drafter-option node_cost=" in table
    assert script.main([*base, "--nodes", "0,3", "--repeats", "1", "--context", "8", "--modes", "eager,stock,static",
                        "--rounds", "2"]) == 0
    out = capsys.readouterr()
    rows = [line for line in out.out.splitlines() if line.startswith("| 3 |")]
    assert len(rows) == 1 and len(rows[0].split("|")) == 10  # each other mode's ms and ratio beside the curve's own
    assert out.err.count("stock") == 2 and out.err.count("drafted nodes:") == 2 * 3 * 2
    assert "plain step eager" in out.out and "the floor" in out.out
    monkeypatch.setattr(script, "open_session", lambda *a, **k: pytest.fail("the model loaded"))
    for argv, needle in (([*base, "--nodes", "1,2"], "--nodes takes whole numbers ascending from 0"),
                         ([*base, "--nodes", "0,x"], "--nodes takes whole numbers ascending from 0"),
                         ([*base, "--repeats", "0"], "--repeats, --context and --rounds must be >= 1"),
                         ([*base, "--modes", "eager,stock", "--rounds", "0"],
                          "--repeats, --context and --rounds must be >= 1"),
                         ([*base, "--modes", "eager,fast"], "--modes takes distinct names among eager, stock"),
                         ([*base, "--drafter", "prompt_lookup"], "--drafter: this script times the target alone")):
        assert script.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {needle}") and err.count("\n") == 1, err


def test_the_script_times_a_random_target_of_given_shapes_and_refuses_what_it_cannot_take(capsys, monkeypatch):
    """--shape builds a random Llama of a key=value spec (or a model name, or a config.json): the curve, and the floor
    from the read bandwidth measured after each curve; options a random target cannot take are one line, exit 2."""
    script = load_script("step_cost")
    spec = "hidden=64,layers=2,heads=4,kv_heads=2,intermediate=128,vocab=256"
    base = ["--shape", spec, "--dtype", "fp32", "--threads", "1", "--repeats", "1", "--context", "8"]
    assert script.main([*base, "--nodes", "0,2", "--modes", "eager,static", "--rounds", "2"]) == 0
    out = capsys.readouterr()
    assert "building a random shape target, 0.00B params in torch.float32" in out.err
    assert "| 0 (plain) |" in out.out and "| 2 |" in out.out
    floor = next(line for line in out.out.splitlines() if line.startswith("memory-bandwidth floor"))
    assert "the read bandwidth measured before and after each curve" in floor and "over 4 curves" in floor
    assert "plain step eager" in floor and "x the floor (each curve against its own floor" in floor
    monkeypatch.setattr(script, "random_target", lambda *a, **k: pytest.fail("a model was built"))
    for argv, needle in ((["--shape", spec, "--base", "smollm2"], "--shape builds a random target: drop --base"),
                         (["--shape", spec, "--quantization", "nf4"], "--shape builds a random target: drop --quant"),
                         (["--shape", "hidden=64,layers=2"], "--shape 'hidden=64,layers=2': give hidden, layers"),
                         (["--shape", "llama9"], "--shape llama9: unknown model"),
                         (["--shape", spec, "--threads", "0"], "--threads must be >= 1")):
        assert script.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {needle}") and err.count("\n") == 1, err


def test_step_cost_fits_the_cost_of_a_drafted_node():
    """StepCost.node_cost: the least-squares slope of t(k) / t(0) - 1 against k through the origin."""
    assert StepCost.parse("0:100,1:110,2:120,4:140").node_cost() == pytest.approx(0.1)
    assert StepCost.parse("0:100,2:110,4:150").node_cost() == pytest.approx((2 * 0.1 + 4 * 0.5) / 20)
    assert StepCost.parse("0:100,1:90").node_cost() == 0.0  # a drafted node that costs nothing: never negative
    assert StepCost.parse("0:100").node_cost() == 0.0


def test_the_draft_step_script_times_each_mode_against_the_first_and_refuses_bad_modes(tmp_path, capsys):
    """scripts/draft_step_cost.py on a random EAGLE-3 draft over a tiny target: a row per mode with its ratio to the
    first (the first's is 1.00); a bad --modes is one line and exit status 2, before any model loads."""
    script = load_script("draft_step_cost")
    target = save_tiny_model(tmp_path / "target", initializer_range=0.2)
    base = ["--base", str(target), "--dtype", "fp32", "--threads", "1", "--prompts", "1", "--new-tokens", "6",
            "--rounds", "1"]
    assert script.main([*base, "--modes", "eager,static"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| eager |")
            or line.startswith("| static |")]
    assert len(rows) == 2 and rows[0].split("|")[3].strip() == "1.00"
    assert script.main([*base, "--modes", "eager,warp"]) == 2
    assert "--modes takes distinct names among" in capsys.readouterr().err
