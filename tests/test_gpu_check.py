"""scripts/gpu_check.py on the CPU, so the GPU check cannot rot before a GPU runs it: the dry run (--device cpu
--small) end to end with a packed tiny bundle, the JSON's figures against the plan they were measured on, and bad
arguments refused in one line before any model is built."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.checkpoint import save_drafter
from models.medusa import MedusaConfig, MedusaHeads
from tests.cpu_kernel_support import needs_compiler
from tests.data_support import tiny_tokenizer
from tests.model_support import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
QUESTIONS = [{"question_id": i, "category": c, "turns": [t]} for i, (c, t) in enumerate(
    [("writing", "Write a poem about the sea."), ("math", "What is 2 + 3?"), ("stem", "Describe making crepes.")])]


def run_script(*args: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a tiny model on a shared machine: one thread, no spin-waiting
    # ~30 s on a quiet 2-core machine; the limit only catches a hang (a crowded machine has taken 12 minutes)
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=1800, cwd=ROOT, env=env)


def positive(x: object) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """--pack-tiny of a tiny random target with 2 Medusa heads copied from its lm_head, and 3 questions."""
    root = tmp_path_factory.mktemp("gpu_check")
    model = save_tiny_model(root / "model")
    tokenizer = tiny_tokenizer()
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=32, vocab_size=len(tokenizer)))
    heads.init_from_base(AutoModelForCausalLM.from_pretrained(model).lm_head)
    save_drafter(root / "ckpt", heads, str(model), tokenizer=tokenizer)
    (root / "ckpt" / "checkpoints" / "checkpoint-1").mkdir(parents=True)  # trainer state: stays home
    questions = root / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    result = run_script("--pack-tiny", root / "bundle", "--tiny-drafter", root / "ckpt", "--questions", questions)
    assert result.returncode == 0, result.stderr
    return root / "bundle"


def test_pack_copies_checkpoint_base_and_questions_only(bundle):
    assert (bundle / "medusa1" / "drafter.safetensors").is_file() and not (bundle / "medusa1" / "checkpoints").exists()
    assert (bundle / "base" / "config.json").is_file() and (bundle / "base" / "tokenizer.json").is_file()
    assert len((bundle / "question.jsonl").read_text().splitlines()) == len(QUESTIONS)


@pytest.mark.slow
def test_cpu_dry_run_measures_every_section(bundle, tmp_path):
    out = tmp_path / "out"
    result = run_script("--device", "cpu", "--small", "--out", out, "--tiny", bundle, "--sections",
                        "train,nf4,engine,drafters,tiny")  # recipes: its own test below
    assert result.returncode == 0, result.stderr[-4000:]
    r = json.loads((out / "gpu_check.json").read_text())
    assert set(r) == {"meta", "train", "nf4", "engine", "drafters", "tiny"}
    plan = r["meta"]["plan"]
    assert r["meta"]["nonfinite"] == []

    # Training: every timed figure finite; the bound from the plan's shapes; GPU memory null with its reason.
    h, i, v, k = plan["hidden"], plan["intermediate"], plan["vocab"], plan["medusa_heads"]
    backbone = plan["layers"] * (4 * h * h + 3 * h * i) + h * v  # q, k, v, o; gate, up, down; lm_head
    heads = k * (h * h + h * v)
    for section, variants in (("train", ("fp32_heads", "bf16_autocast")), ("nf4", ("fp32_heads",))):
        t = r[section]["throughput"]
        for name in variants:
            assert positive(t[name]["train_tok_s"]) and positive(t[name]["forward_tok_s"])
            assert t[name]["ratio"] == pytest.approx(t[name]["train_tok_s"] / t[name]["forward_tok_s"])
        assert (t["bound"]["backbone_macs"], t["bound"]["heads_macs"]) == (backbone, heads)
        assert t["bound"]["ratio"] == pytest.approx(backbone / (backbone + 3 * heads))
        memory = r[section]["memory"]
        assert memory["peak_mib"] is None and "CUDA" in memory["reason"] and math.isfinite(memory["last_loss"])
    assert r["nf4"]["nf4_over_bf16_peak"] is None

    # Engine: the cost curve, the heads' draft time, one row per tree size with its phase times.
    e = r["engine"]
    sizes = [str(s) for s in plan["tree_sizes"]]
    assert list(e["cost_ms"]) == ["1", *sizes] and all(positive(x) for x in e["cost_ms"].values())
    assert len(e["head_ms"]) == plan["medusa_heads"] and all(positive(x) for x in e["head_ms"])
    assert list(e["trees"]) == sizes
    for size, row in e["trees"].items():
        assert row["nodes"] == int(size) and row["tau"] >= 1.0
        assert all(positive(row[key]) for key in ("tokens_per_s", "speedup_vs_ar", "engine_efficiency"))
        assert all(math.isfinite(ms) and ms >= 0 for ms in row["per_step_ms"].values())
    assert positive(e["plain"]["per_step_ms"]["forward"]) and positive(e["hf"]["tokens_per_s"])

    # Greedy identity: every prompt of every pair counted once, none a real mismatch.
    pairs = e["greedy_identity"]["pairs"]
    assert len(pairs) == 2 * len(sizes) + 1
    for counts in pairs.values():
        assert counts["identical"] + counts["near_tie"] + counts["mismatch"] == plan["prompts"]
        assert counts["mismatch"] == 0
    assert all(d["near_tie"] for d in e["greedy_identity"]["divergences"])
    assert e["dtype"] == "bfloat16"  # the run's dtype, not the one the identity check leaves the model in

    # Every drafter kind through inference.load: all rows identical to plain greedy, some drafts accepted.
    d = r["drafters"]
    kinds = {"medusa", "eagle3", "eagle3_dynamic", "draft_model", "prompt_lookup", "lookahead", "jacobi"}
    assert d["mismatched"] == [] and kinds <= set(d)
    assert all(d[k]["identical_rows"] == d["prompts"] == len(plan["drafter_prompts"]) for k in kinds)
    assert all(d[k]["sampled_tokens"] == d["prompts"] * d["new_tokens"] for k in kinds)
    assert max(d[k]["tau"] for k in kinds) > 1.2

    # The tiny bench, through `python -m inference bench` on the bundle.
    s = r["tiny"]["summary"]
    assert s["config"]["num_questions"] == plan["tiny_limit"] and s["greedy_check"]["identical"] is True
    assert s["tau"] >= 1.0 and positive(s["engine_efficiency"])
    assert (out / "tiny_bench" / "summary.json").is_file()

    report = (out / "gpu_check.txt").read_text()
    assert "greedy identity" in report and "tiny Medusa-1 bench" in report and "FAILED" not in report
    assert "rows identical to plain greedy: medusa 2/2" in report


@pytest.mark.slow
def test_recipes_run_the_real_commands_and_report_their_figures(tmp_path):
    """Section recipes with --small on the CPU: both trainers and both exports as subprocesses, each with its wall
    time and peak; the trainers with their tokens/s and the memory model's prediction."""
    out = tmp_path / "out"
    result = run_script("--device", "cpu", "--small", "--out", out, "--sections", "recipes")
    assert result.returncode == 0, result.stderr[-4000:]
    r = json.loads((out / "gpu_check.json").read_text())["recipes"]
    commands = r["commands"]
    assert list(commands) == ["medusa1", "vllm-export", "eagle3", "eagle3-export", "collect_jacobi", "cllm"]
    assert r["shape"] == "small"
    for name, row in commands.items():
        assert positive(row["wall_s"]) and row["peak_rss_bytes"] > 0 and row["cuda_peak_bytes"] is None
        assert row["command"].startswith("python scripts/collect_jacobi.py" if name == "collect_jacobi" else
                                         "python -m " + ("train " + name if "export" not in name else "models.convert"))
    collect = commands["collect_jacobi"]
    assert collect["trajectories"] > 0 and collect["answer_tokens"] > 0 and positive(collect["tokens_per_s"])
    for name in ("medusa1", "eagle3", "cllm"):
        row = commands[name]
        assert positive(row["tokens_per_s"]) and row["steps"] == r["plan"]["steps"]
        assert 0 < row["predicted"]["peak_bytes"] <= row["bound"]["peak_bytes"]
        assert row["bound"]["seq"] == r["plan"]["max_length"]
    assert {"config.json", "model.safetensors"} <= set(commands["eagle3-export"]["files"])
    assert {"config.json", "model.safetensors"} <= set(commands["vllm-export"]["files"])
    report = (out / "gpu_check.txt").read_text()
    assert "recipes on a random small" in report and "eagle3-export" in report and "FAILED" not in report
    assert "answer tok/s" in report


@pytest.mark.parametrize("case", ["cuda", "out_parent", "bundle", "sections", "recipe_shape"])
def test_bad_arguments_end_in_one_line_before_any_model(tmp_path, case):
    if case == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here: --device cuda is a valid argument")
    out = tmp_path / "out"
    args = {"cuda": ("--device", "cuda", "--small", "--out", out),
            "out_parent": ("--device", "cpu", "--small", "--out", tmp_path / "missing" / "out"),
            "bundle": ("--device", "cpu", "--small", "--out", out, "--tiny", tmp_path),
            "sections": ("--device", "cpu", "--small", "--out", out, "--sections", "train,gpu"),
            "recipe_shape": ("--device", "cpu", "--small", "--out", out, "--recipe-shape", "llama9")}[case]
    result = run_script(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert not out.exists() and result.stdout == ""


def test_nonfinite_figures_become_null_and_are_named():
    sys.path.insert(0, str(SCRIPT.parent))
    from gpu_check import strict_json

    bad: list[str] = []
    clean = strict_json({"train": {"ratio": float("nan"), "ms": [1.0, float("inf")]}, "n": 3}, "", bad)
    assert clean == {"train": {"ratio": None, "ms": [1.0, None]}, "n": 3}
    assert bad == ["train.ratio", "train.ms[1]"]
    json.dumps(clean, allow_nan=False)


@pytest.mark.slow
@needs_compiler
def test_the_compiled_section_times_both_steps_and_compiled_fp32_answers_equal_eager(tmp_path):
    out = tmp_path / "out"
    result = run_script("--device", "cpu", "--small", "--out", out, "--sections", "compiled")
    assert result.returncode == 0, result.stderr[-4000:]
    c = json.loads((out / "gpu_check.json").read_text())["compiled"]
    assert positive(c["floor_ms"])
    for mode in ("eager", "compiled"):
        assert list(c["step_ms"][mode]) == ["0", "8", "15"]
        assert all(positive(v) for v in c["step_ms"][mode].values())
        assert c[f"{mode}_plain_over_floor"] == pytest.approx(c["step_ms"][mode]["0"] / c["floor_ms"])
    assert all(positive(c["step_wall_s"][mode]) for mode in ("eager", "compiled"))
    assert set(c["decode"]) == {f"{d}.{m}" for d in ("plain", "eagle3") for m in ("eager", "compiled")}
    assert positive(c["decode"]["eagle3.compiled"]["draft_ms"]) and c["shape"] == "small"
    assert all(positive(row["tokens_per_s"]) and row["tau"] >= 1.0 for row in c["decode"].values())
    assert c["decode"]["plain.eager"]["rows_equal_eager"] == 2  # --small: 2 prompts
    assert all(r["identical"] == r["rows"] == 2 for r in c["identical_fp32"].values())
    assert c["identical_fp32"]["eagle3"]["tau_compiled"] == c["identical_fp32"]["eagle3"]["tau_eager"] > 1.0
    assert "compiled step (static cache, CUDA graphs)" in (out / "gpu_check.txt").read_text()
    partial = json.loads((out / "compiled_partial.json").read_text())  # kept after each phase: a cut-off run's figures
    assert partial["floor_ms"] == c["floor_ms"] and set(partial["decode"]) == set(c["decode"])
