"""`python -m inference bench`'s bookkeeping apart from any model run: the summary's arithmetic and depth acceptance,
the bandwidth floor and the host's name, and the progress lines for logs."""

from __future__ import annotations

import math
import re
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from inference.bench.bandwidth import cpu_name, read_bandwidth, weight_bytes
from inference.bench.run import progress_bar, still_running
from inference.bench.stats import Answer, TurnResult, bandwidth_floor, format_table, summarize
from inference.engine.loop import StepTimes


def turn(tokens, wall, forwards, accepted, forward_s=None):
    times = None if forward_s is None else StepTimes(0.0, 0.0, forward_s, 0.0, 0.0, 0.0)
    return TurnResult(tuple(tokens), "", wall, forwards, tuple(accepted), times)


def test_summary_arithmetic():
    """Drafter: 8 tokens in 4 forwards, 1 s; AR: the same 8 tokens in 8 forwards, 2 s; HF: other tokens, 4 s."""
    answers = {
        "drafter": [Answer(1, "a", (turn(range(8), 1.0, 4, (1, 1, 2), forward_s=0.6),))],
        "ar": [Answer(1, "a", (turn(range(8), 2.0, 8, (0,) * 7, forward_s=1.4),))],
        "hf": [Answer(1, "a", (turn([9] * 8, 4.0, 8, (0,) * 7),))],
    }
    s = summarize(answers, "drafter", greedy=True)
    assert s["tau"] == 2.0 and s["speedup_vs_ar"] == 2.0 and s["speedup_vs_hf"] == 4.0 and s["ar_vs_hf"] == 2.0
    ideal = 2.0 * (1.4 / 7) / (0.6 / 3)  # tau x t_AR_step / t_tree_forward
    assert s["ideal_speedup"] == pytest.approx(ideal) and s["engine_efficiency"] == pytest.approx(2.0 / ideal)
    assert s["speedup_vs"] == {"ar": 2.0, "hf": 4.0} and s["categories"]["a"]["speedup_vs"] == {"ar": 2.0, "hf": 4.0}
    check = s["greedy_check"]  # no judge: HF's differing turn counts as a mismatch
    assert check["reference"] == "ar" and set(check["methods"]) == {"drafter", "hf"}
    assert check["methods"]["drafter"]["identical"] == 1 and check["methods"]["drafter"]["mismatch"] == 0
    assert check["methods"]["hf"]["mismatch"] == 1 and check["methods"]["hf"]["divergences"][0]["position"] == 0
    assert check["identical"] is False and check["lossless"] is False
    assert s["categories"]["a"]["speedup"] == 2.0
    assert summarize(answers, "drafter", greedy=False)["greedy_check"] is None


def test_depth_acceptance_is_the_share_of_steps_that_accepted_at_least_d_drafts():
    """Steps accepting 0, 3, 1, 1 drafts: depth 1 reached by 3 of 4, depth 2 and 3 by 1 of 4; a plain loop
    (every step accepts none) has no depth; the report prints the main method's line."""
    turns = (TurnResult((1,) * 5, "", 1.0, 4, (0, 3), None), TurnResult((1,) * 3, "", 1.0, 2, (1, 1), None))
    plain = TurnResult((1,) * 4, "", 1.0, 4, (0, 0, 0, 0), None)
    summary = summarize({"drafter": [Answer(1, "a", turns)], "ar": [Answer(1, "a", (plain, plain))]}, "drafter",
                        greedy=False)
    assert summary["methods"]["drafter"]["accepted_at_depth"] == [0.75, 0.25, 0.25]
    assert summary["methods"]["ar"]["accepted_at_depth"] == []
    assert "d = 1..3: 0.750 / 0.250 / 0.250" in format_table(summary)


# --- bandwidth floor and host

def test_bandwidth_floor_arithmetic_and_weight_bytes(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert weight_bytes(model) == 4 * sum(p.numel() for p in model.parameters())
    assert weight_bytes(model) < 4 * sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert weight_bytes(model.to(torch.bfloat16)) == 2 * sum(p.numel() for p in model.parameters())
    rate = read_bandwidth("cpu", nbytes=2**20, repeats=2)
    assert math.isfinite(rate) and rate > 0
    summary = {"methods": {"ar": {"per_step_ms": {"total": 3.0}}}}
    floor = bandwidth_floor(2_000_000, 1e9, summary)
    assert floor["floor_ms"] == pytest.approx(2.0) and floor["ar_step_over_floor"] == pytest.approx(1.5)
    assert floor["read_gb_per_s"] == 1.0 and bandwidth_floor(1, 1.0, {"methods": {}})["ar_step_ms"] is None
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU @ 2.0GHz\nflags\t: avx2\n\nmodel name\t: other\n")
    assert cpu_name(info) == "Test CPU @ 2.0GHz" and cpu_name(tmp_path / "none") is None


# --- progress for logs

def test_progress_on_a_log_beats_while_an_answer_runs_and_stops_when_closed(capsys):
    """stderr not a terminal (captured): one slow answer still gives lines, naming what runs; the last line counts
    every answer; the heartbeat thread ends with the bar."""
    progress = progress_bar(2, "bench-suite", interval=0.05)
    progress.set_postfix_str("medusa1 on question 101", refresh=False)
    err, deadline = "", time.monotonic() + 10
    while "medusa1 on question 101" not in err and time.monotonic() < deadline:  # no update: only the heartbeat
        time.sleep(0.05)
        err += capsys.readouterr().err
    progress.update(1)
    progress.update(1)
    progress.close()
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", err + capsys.readouterr().err)  # other tests' open bars nest it
    lines = [line.strip() for line in re.split(r"[\r\n]", text) if line.strip()]
    assert any(line.startswith("bench-suite: 0/2 answers, 00:0") and line.endswith(", medusa1 on question 101")
               for line in lines), lines
    assert lines[-1].startswith("bench-suite: 2/2 answers, ") and "ETA 00:00" in lines[-1]
    deadline = time.monotonic() + 5
    while any(t.name == "bench-suite-progress" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "bench-suite-progress" for t in threading.enumerate())



def test_still_running_beats_during_one_long_call_and_stops_after_it(capsys):
    """One silent call (a batch's prefill) inside `still_running` gives a line every interval, naming it; the thread
    ends with the block, also when the block raises."""
    err, deadline = "", time.monotonic() + 10
    with still_running("32x1024: prefill", interval=0.05):
        while err.count("32x1024: prefill: ") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            err += capsys.readouterr().err
    assert re.search(r"^32x1024: prefill: \d+ s elapsed$", err, re.M), err
    with pytest.raises(RuntimeError), still_running("failing", interval=0.05):
        raise RuntimeError("boom")
    names = {"32x1024: prefill-progress", "failing-progress"}
    deadline = time.monotonic() + 5
    while any(t.name in names for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name in names for t in threading.enumerate())
