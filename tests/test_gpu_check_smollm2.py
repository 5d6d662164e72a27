"""scripts/gpu_check_bundles.py's smollm2 bundle, on the offline SmolLM2 stand-in (tests/smollm2_support.py): the
parts stay under their size and rejoin to the GGUF byte for byte, a missing or damaged piece is named, and the section
benches an EAGLE-3 drafter on what travelled, eager and compiled, on the CPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from inference.bench.engine_check import lm_head_eagle3
from models.eagle3 import save_eagle3
from tests.cpu_kernel_support import needs_compiler
from tests.script_support import load_script
from tests.smollm2_support import isolated, source  # noqa: F401 (fixtures; isolated is autouse)

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [{"question_id": 1, "category": "writing", "turns": ["Write a line about the sea."]},
             {"question_id": 2, "category": "math", "turns": ["What is 2 + 3?"]}]


@pytest.fixture
def drafter(source, tmp_path) -> Path:  # noqa: F811 (the fixture above)
    model, _ = source
    return save_eagle3(tmp_path / "eagle3", lm_head_eagle3(model), "builtin:smollm2")


def test_parts_stay_under_their_size_rejoin_to_the_gguf_and_name_what_is_missing(source, drafter,  # noqa: F811
                                                                                   tmp_path):
    bundles = load_script("gpu_check_bundles")
    _, gguf = source
    part = 256 * 1024
    sizes = bundles.pack_smollm2(drafter, gguf, tmp_path / "bundle", QUESTIONS, part_bytes=part)
    bundle = tmp_path / "bundle"
    pieces = json.loads((bundle / "part1" / "smollm2.json").read_text())["pieces"]
    assert all(size <= part for size in sizes) and len(sizes) == len(pieces) >= 3
    assert sum(p["bytes"] for p in pieces) == gguf.stat().st_size
    with safe_open(str(bundle / "part1" / "drafter" / "drafter.safetensors"), framework="pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16 and f.metadata()["drafter_type"] == "eagle3"
    assert [json.loads(line) for line in (bundle / "part1" / "question.jsonl").read_text().splitlines()] == QUESTIONS
    assert bundles.smollm2_missing(bundle) is None
    joined = bundles.join_gguf(bundle, tmp_path / "downloads")
    assert joined.read_bytes() == gguf.read_bytes()

    last = sorted(bundle.glob("part*"))[-1]
    for piece in last.iterdir():
        piece.rename(tmp_path / piece.name)
    missing = f"no complete {last.name}/gguf.{len(sizes) - 1:03d} (carry {last.name} too)"
    assert bundles.smollm2_missing(bundle) == missing
    for piece in tmp_path.glob("gguf.*"):
        piece.rename(last / piece.name)
    damaged = bundle / "part2" / "gguf.001"
    data = bytearray(damaged.read_bytes())
    data[0] ^= 1
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256 is not the manifest's"):
        bundles.join_gguf(bundle, tmp_path / "again")


def test_pack_refuses_a_drafter_larger_than_a_part_and_the_check_an_incomplete_bundle(source, drafter,  # noqa: F811
                                                                                         tmp_path):
    bundles = load_script("gpu_check_bundles")
    with pytest.raises(ValueError, match="over a part's"):
        bundles.whole(tmp_path / "small", lambda out: bundles.pack_smollm2(drafter, source[1], out, QUESTIONS,
                                                                           part_bytes=4096))
    assert list(tmp_path.iterdir()) == [drafter]  # a pack that fails leaves nothing behind
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "drafter.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="drafter.safetensors: unreadable safetensors"):
        bundles.whole(tmp_path / "never", lambda out: bundles.pack_smollm2(broken, source[1], out, QUESTIONS))
    shutil.rmtree(broken)
    assert list(tmp_path.iterdir()) == [drafter]
    bundles.pack_smollm2(drafter, source[1], tmp_path / "bundle", QUESTIONS, part_bytes=256 * 1024)
    (tmp_path / "bundle" / "part2" / "gguf.001").unlink()
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--small",
                             "--out", str(tmp_path / "out"), "--sections", "smollm2", "--smollm2",
                             str(tmp_path / "bundle")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 2 and not (tmp_path / "out").exists()
    assert result.stderr.strip() == (f"error: --smollm2 {tmp_path / 'bundle'}: no complete part2/gguf.001 "
                                     f"(carry part2 too)")


@pytest.mark.slow
@needs_compiler
def test_the_section_benches_the_drafter_eager_and_compiled_on_what_travelled(source, drafter, tmp_path):  # noqa: F811
    bundles = load_script("gpu_check_bundles")
    bundles.pack_smollm2(drafter, source[1], tmp_path / "bundle", QUESTIONS, part_bytes=256 * 1024)
    plan = SimpleNamespace(tiny_limit=None, tiny_new_tokens=12)
    result = bundles.smollm2_section(tmp_path / "bundle", tmp_path, plan, torch.device("cpu"))
    for mode in ("eager", "compiled"):
        s = result[mode]["summary"]
        assert set(s["methods"]) == {"drafter", "ar", "hf"} and s["config"]["num_questions"] == len(QUESTIONS)
        assert s["tau"] >= 1.0 and s["config"]["dtype"] == "bfloat16"
        assert s["greedy_check"]["lossless"] is True  # answers differ from the plain loop only at verified near ties
    assert "--compile" in result["compiled"]["command"] and "--compile" not in result["eager"]["command"]
    lines = load_script("gpu_check_report").smollm2_lines(result)
    assert len(lines) == 3 and all("lossless (no real mismatch): True" in line for line in lines[1:])
