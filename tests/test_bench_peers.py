"""scripts/bench_peers.py without the peers' venvs: the export to FasterDecoding/Medusa's layout (read back the way
its loader reads it, and by our importer), the cartesian tree <-> medusa_choices conversion, the table from a recorded
run, and the argument checks that must fail in one line before anything loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from inference.bench.peers import PeerBenchError, cartesian_choices, cartesian_paths, format_table, summarize
from inference.engine.tree import build_tree
from models.checkpoint import CheckpointError, save_drafter
from models.interop import export_medusa, import_medusa
from models.medusa import MedusaConfig, MedusaHeads
from tests.script_support import exit_code, load_script
from tests.test_interop import (D, OriginalResBlock, base_dir, base_lm_head,  # noqa: F401  (fixtures)
                                per_head_logits)

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "bench_peers.py"


def random_heads(K: int, L: int, V: int, shared: bool) -> MedusaHeads:
    torch.manual_seed(3)
    heads = MedusaHeads(MedusaConfig(num_heads=K, num_layers=L, hidden_size=D, vocab_size=V, share_lm_head=shared))
    for p in heads.parameters():
        nn.init.normal_(p, std=0.5)
    return heads


def original_loader(directory: Path, K: int, L: int, V: int) -> nn.ModuleList:
    """FasterDecoding/Medusa's `medusa_head` (Sequential(ResBlock * L, Linear(D, V)) per head) loaded from the export,
    strictly, as its MedusaModel.from_pretrained would (it reads medusa_lm_head.pt with torch.load)."""
    config = json.loads((directory / "config.json").read_text())
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (K, L)
    heads = nn.ModuleList([nn.Sequential(*([OriginalResBlock(D)] * L), nn.Linear(D, V, bias=False)) for _ in range(K)])
    heads.load_state_dict(torch.load(directory / "medusa_lm_head.pt", map_location="cpu"), strict=True)
    return heads


@pytest.mark.parametrize("shared", [True, False], ids=["shared-lm-head", "per-head-lm-head"])
def test_export_medusa_round_trip(tmp_path, base_dir, base_lm_head, shared):
    K, L = 3, 1
    V = base_lm_head.weight.shape[0]
    heads = random_heads(K, L, V, shared)
    save_drafter(tmp_path / "ckpt", heads, str(base_dir))
    export_medusa(tmp_path / "ckpt", tmp_path / "medusa", base_model_name_or_path="/some/hf/folder")
    config = json.loads((tmp_path / "medusa" / "config.json").read_text())
    assert config["base_model_name_or_path"] == "/some/hf/folder"
    lm_head = base_lm_head if shared else None
    hidden = torch.randn(2, 4, D)  # [B, T, D]
    with torch.no_grad():
        expected = per_head_logits(heads, hidden, lm_head)  # [K, B, T, V]
        original = original_loader(tmp_path / "medusa", K, L, V)
        assert torch.equal(torch.stack([h(hidden) for h in original]), expected)
        imported, base = import_medusa(tmp_path / "medusa")
        assert base == "/some/hf/folder" and not imported.config.share_lm_head  # each head got its own copy
        assert torch.equal(per_head_logits(imported, hidden, None), expected)


def test_export_medusa_refuses_what_its_layout_cannot_hold(tmp_path, base_dir):
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=D, vocab_size=64, draft_vocab_size=8))
    heads.set_draft_vocab(torch.arange(8))
    save_drafter(tmp_path / "vocab", heads, str(base_dir))
    with pytest.raises(CheckpointError, match="draft vocabulary"):
        export_medusa(tmp_path / "vocab", tmp_path / "out1")
    save_drafter(tmp_path / "blocks", random_heads(2, 2, 64, False), str(base_dir))  # two different blocks per head
    with pytest.raises(CheckpointError, match="block 1 differs"):
        export_medusa(tmp_path / "blocks", tmp_path / "out2")
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()


def test_cartesian_tree_both_ways():
    paths = cartesian_paths([1, 2, 3])
    assert paths == [(0,), (1,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert len(cartesian_paths([1, 3, 2, 1])) == 3 + 6 + 6  # medusa-llm's sum of cumulative products, less the root
    assert cartesian_choices(list(reversed(paths))) == [1, 2, 3]
    assert cartesian_choices(cartesian_paths([1, 3, 2, 1])) == [1, 3, 2, 1]
    assert build_tree(paths, num_heads=2, topk=10).num_nodes == 1 + len(paths)
    with pytest.raises(PeerBenchError, match=r"lacks node \[1, 2\]"):
        cartesian_choices(paths[:-1])
    with pytest.raises(PeerBenchError, match="expected"):
        cartesian_paths([2, 3])
    with pytest.raises(PeerBenchError, match="no nodes"):
        cartesian_choices([])


def turn(tokens: list[int], wall: float, forwards: int, times: bool = False) -> dict:
    t = {"tokens": tokens, "wall": wall, "forwards": forwards, "accepted": [0] * (forwards - 1), "times": None}
    if times:
        t["times"] = {"prefill": 0.1, "draft": 0.2, "forward": 0.4, "verify": 0.1, "cache": 0.1, "other": 0.1}
    return t


def recorded_run() -> dict:
    """Two prompts, 8 tokens each; the figures are chosen so every ratio is exact."""
    a, b = list(range(8)), list(range(10, 18))
    methods = {
        "ar": [turn(a, 1.0, 8, True), turn(b, 1.0, 8, True)],  # 8 tok/s
        "medusa_greedy": [turn(a, 2.0, 8), turn(b, 2.0, 8)],  # 4 tok/s
        "medusa": [turn(a, 1.0, 4, True), turn([0] * 8, 1.0, 4, True)],  # 8 tok/s, one answer differs
        "ours_medusa": [turn(a, 0.25, 2, True), turn(b, 0.25, 2, True)],  # 32 tok/s: 4x Medusa's engine
        "hf": [turn(a, 2.0, 8), turn(b, 2.0, 8)],  # 4 tok/s
        "hf_pld": [turn(a, 1.0, 5), turn(b, 1.0, 5)],  # 8 tok/s
        "ours_pld": [turn(a, 0.5, 5, True), turn(b, 0.5, 5, True)],  # 16 tok/s
    }
    return {"config": {}, "versions": {}, "patches": {}, "unavailable": {"eagle": "no head"},
            "methods": {name: {"turns": turns} for name, turns in methods.items()}}


def test_table_from_a_recorded_run():
    record = recorded_run()
    rows = summarize(record)
    assert rows["medusa"].identical_own == 1 and rows["ours_medusa"].identical_ours == 2
    assert rows["ours_medusa"].tau == 4.0 and rows["medusa"].tau == 2.0
    table = format_table(record)
    medusa_line = next(line for line in table.splitlines() if line.startswith("| Medusa engine"))
    assert "| 8.00 | 2.00 | 2.00 | — | 1/2 | 1/2 |" in medusa_line  # 8 tok/s, τ 2, 2x its own greedy
    ours_line = next(line for line in table.splitlines() if line.startswith("| draftsmith Medusa"))
    assert "| 32.00 | 4.00 | 4.00 | 4.00 | 2/2 | 2/2 |" in ours_line
    # the 5x goal; τ also over the one answer both wrote identically (a: 8 tokens in 2 vs 4 forwards)
    assert "4.00×, τ 4.00 vs 2.00 (on the 1 identical answers: 4.00 vs 2.00) — MISSED" in table
    assert "draftsmith prompt_lookup ≥ 1× HF prompt-lookup decoding: 2.00× — met" in table
    assert "eagle not run: no head" in table


def run_script(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--venv-dir", str(tmp_path / "venvs"), *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_from_record_prints_the_table(tmp_path):
    path = tmp_path / "peers.json"
    record = recorded_run()
    record["config"] = {"base": "builtin:tiny", "num_prompts": 2, "prompts": "x", "max_new_tokens": 8,
                        "dtype": "bf16", "threads": 1}
    record["versions"] = {"ours": {"torch": "2.13.0"}}
    path.write_text(json.dumps(record))
    done = run_script("--from-record", str(path), tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "| draftsmith Medusa, same heads+tree | ours | 32.00 |" in done.stdout
    assert "ours: torch 2.13.0" in done.stdout


@pytest.mark.parametrize("args,message", [
    (["--peers", "hf_pld,vllm"], "--peers"),
    (["--peers", "hf_pld", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--peers", "medusa"], "needs --heads"),
    (["--peers", "medusa", "--heads", "{ckpt}", "--medusa-choices", "2,3"], "expected [1, k_1"),
    (["--peers", "medusa", "--heads", "{ckpt}", "--medusa-choices", "1,3,2,1"], "one k per head"),
    (["--peers", "medusa", "--heads", "{vocab}", "--medusa-choices", "1,3"], "full vocabulary"),
    (["--peers", "hf_assisted", "--draft", "/no/such/model"], "--draft /no/such/model"),
    (["--peers", "hf_pld", "--prompts", "nosuchset:3"], "--prompts"),
    (["--peers", "hf_assisted", "--draft-stop", "sometimes"], "--draft-stop"),
])
def test_bad_arguments_fail_in_one_line(tmp_path, capsys, args, message):
    """In the test process (`main(argv)`); the next test takes one case through the command line."""
    ckpt, vocab = tmp_path / "ckpt", tmp_path / "vocab"
    save_drafter(ckpt, random_heads(2, 1, 64, True), "builtin:tiny")
    heads = MedusaHeads(MedusaConfig(num_heads=1, num_layers=1, hidden_size=D, vocab_size=64, draft_vocab_size=8))
    save_drafter(vocab, heads, "builtin:tiny")
    args = [a.format(ckpt=ckpt, vocab=vocab) for a in args]
    code = exit_code(load_script("bench_peers"), ["--venv-dir", str(tmp_path / "venvs"), *args, "--out",
                                                   str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "out").exists() and not (tmp_path / "venvs").exists()


def test_a_bad_argument_fails_in_one_line_from_the_command_line(tmp_path):
    done = run_script("--peers", "hf_pld,vllm", "--out", str(tmp_path / "out"), tmp_path=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--peers" in lines[0], done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "venvs").exists()


def test_build_ours_serves_every_method_on_one_target_losslessly(tmp_path):
    """The script's own side (no peer venv): every runner of ours and of Hugging Face on one tiny target, the heads
    and draft checked and served the way a real run serves them, each greedy answer equal to our plain loop's."""
    from tests.model_support import save_tiny_model

    script = load_script("bench_peers")
    target = save_tiny_model(tmp_path / "target", seed=0, initializer_range=0.2)
    draft = save_tiny_model(tmp_path / "draft", seed=1, initializer_range=0.2)
    config = json.loads((target / "config.json").read_text())
    torch.manual_seed(5)
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=config["hidden_size"],
                                     vocab_size=config["vocab_size"]))
    save_drafter(tmp_path / "heads", heads, base_model_name_or_path=str(target))
    args = script.parse_args(["--base", str(target), "--heads", str(tmp_path / "heads"), "--medusa-choices", "1,2,2",
                              "--draft", str(draft), "--dtype", "fp32", "--peers", "medusa,hf_assisted,hf_pld"])
    peers, choices = script.check_args(args)
    record = {"config": {}}
    runners, session = script.build_ours(args, peers, choices, record)
    assert set(runners) == {"ar", "hf", "ours_medusa", "hf_assisted", "ours_draft", "hf_pld", "ours_pld"}
    assert record["config"]["tree_nodes"] == 1 + 2 + 2 * 2  # the cartesian tree of 1,2,2
    prompt = session.tokenizer("the cat sat on the mat and the cat")["input_ids"]
    reference = runners["ar"](prompt, 10)
    assert len(reference["tokens"]) > 0 and reference["forwards"] >= 1
    for name, run in runners.items():
        turn = run(prompt, 10)
        assert turn["tokens"] == reference["tokens"], name
        assert turn["wall"] > 0 and turn["forwards"] >= 1


def test_learned_draft_stop_follows_the_draft_checkpoint(tmp_path, capsys):
    """`--draft-stop learned` is refused for a draft without a stopper and taken for a draft_model checkpoint that
    has one (checked through the registry, before anything loads)."""
    from models.checkpoint import save_draft_model
    from models.stopper import StopperModel, stopper_entry
    from tests.test_checkpoint_writer import tiny_lm

    script = load_script("bench_peers")
    stopper = StopperModel(4)
    save_draft_model(tmp_path / "with-stopper", tiny_lm(), "builtin:tiny", stopper=stopper,
                     stopper_config=stopper_entry(stopper, 0.5, 4))
    save_draft_model(tmp_path / "without", tiny_lm(), "builtin:tiny")
    args = script.parse_args(["--peers", "hf_assisted", "--draft", str(tmp_path / "with-stopper"),
                              "--draft-stop", "learned", "--prompts", "mt_bench:1"])
    assert script.check_args(args) == (["hf_assisted"], None)
    args.draft = str(tmp_path / "without")
    with pytest.raises(SystemExit) as exit_:
        script.check_args(args)
    assert exit_.value.code == 2 and "has no stopper" in capsys.readouterr().err
