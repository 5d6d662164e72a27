"""Section `recipes` of the GPU check: the real training commands, as subprocesses, on a random target saved first.

    python -m train medusa1 +model=tiny model.path=<target> data=default data.self_distill=true ...   then
    python -m models.convert vllm-export <medusa1 run> <export>
    python -m train eagle3 +model=tiny model.path=<target> data=default data.self_distill=true ...    then
    python -m models.convert eagle3-export <eagle3 run> <export>
    python scripts/collect_jacobi.py --model <target> --data default ... --output traj.jsonl            then
    python -m train cllm +model=tiny model.path=<target> data=default method.trajectories=traj.jsonl ...  (LoRA)

The target is a random Llama of the recipe shape's sizes (`RECIPE_SHAPES`: Llama-3.1-8B's on a GPU, a 1.7B Llama on
a CPU, a tiny one with --small), saved with a byte-level BPE tokenizer trained on a slice of the built-in corpus
(train.tiny_build, offline); the lm_head rows of ids past the tokenizer's are zero, so the target's greedy answers
are text the tokenizer can decode (the shapes, and so memory and time, are the real model's). `+model=tiny` supplies
the built-in model's chat defaults; model.path points at the saved target, so nothing is built or downloaded;
data=default is the bundled corpus, whose prompts the target answers itself (self-distillation) before training.
Each command runs under gpu_check_peak.py, which records the child's peak memory (torch.cuda.max_memory_allocated on
a GPU; peak resident set on a CPU, the interpreter and libraries included). Per command: wall time, the trainer's
tokens/s (the collector's: answer tokens / wall time, model load included), the peak, and train/memory_model.py's prediction at the recipe's batch for rows of the mean length the
trainer saw (its tokens / steps / batch), and at data.max_length (the bound: no row is longer). The model counts
every token as trained; self-distilled rows train the answer only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from train.memory_model import SHAPES, Shape  # the standard library only: no package check needed

ROOT = Path(__file__).resolve().parents[1]
PEAK = Path(__file__).resolve().parent / "gpu_check_peak.py"


@dataclass(frozen=True)
class RecipeShape:
    """The random target's sizes (train.memory_model's Shape, so the prediction reads the same numbers) and the
    recipe's counts."""

    target: Shape
    batch: int  # training.per_device_train_batch_size
    max_length: int  # data.max_length
    steps: int  # training.max_steps
    prompts: int  # data.self_distill_samples: prompts the target answers before training (of 4x as many read)
    new_tokens: int  # data.self_distill_new_tokens
    medusa_heads: int = 5
    ttt_steps: int = 7
    tokenizer_vocab: int = 2048
    tokenizer_chars: int = 400_000  # built-in corpus characters the tokenizer learns from

    def plan(self) -> dict:
        """The shape and counts as one flat record (the JSON's `plan`)."""
        counts = {k: v for k, v in asdict(self).items() if k != "target"}
        return {**asdict(self.target), **counts}


RECIPE_SHAPES = {
    "llama3_1_8b": RecipeShape(SHAPES["llama3_1_8b"], batch=2, max_length=2048, steps=6, prompts=48, new_tokens=128),
    "llama_1_7b": RecipeShape(Shape("llama_1_7b", 2048, 24, 16, 16, 8192, 32000), batch=1, max_length=512, steps=3,
                              prompts=24, new_tokens=32),
    "small": RecipeShape(Shape("small", 64, 8, 4, 4, 128, 2048), batch=2, max_length=256, steps=2, prompts=8,
                         new_tokens=8, medusa_heads=2, ttt_steps=2, tokenizer_vocab=512, tokenizer_chars=20_000),
}


def save_target(shape: RecipeShape, folder: Path, device: torch.device, seed: int) -> Path:
    """A random bf16 Llama of `shape` and the tokenizer, saved loadable by from_pretrained (built on `device`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig  # deferred: after the package checks

    from train.tiny_build import TokenizerSpec, build_tokenizer  # deferred: after the package checks

    tokenizer_dir = folder / "tokenizer_build"
    build_tokenizer(tokenizer_dir, TokenizerSpec(shape.tokenizer_vocab, shape.tokenizer_chars), progress=False)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sizes = shape.target
    config = LlamaConfig(vocab_size=sizes.vocab, hidden_size=sizes.hidden, intermediate_size=sizes.intermediate,
                         num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads,
                         num_key_value_heads=sizes.kv_heads, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # ids past the tokenizer's score 0: greedy answers (self-distillation's) decode to text
        model.get_output_embeddings().weight[len(tokenizer):].zero_()
    target = folder / "target"
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def train_command(method: str, shape: RecipeShape, target: Path, out: Path, on_gpu: bool) -> list[str]:
    k = f"method.num_heads={shape.medusa_heads}" if method == "medusa1" else f"method.ttt_steps={shape.ttt_steps}"
    return ["-m", "train", method, "+model=tiny", f"model.path={target}", "model.dtype=bf16", "data=default",
            f"data.max_samples={4 * shape.prompts}", "data.self_distill=true",
            f"data.self_distill_samples={shape.prompts}",
            f"data.self_distill_new_tokens={shape.new_tokens}", f"data.max_length={shape.max_length}",
            "data.validation_fraction=0.1", f"training.max_steps={shape.steps}",
            f"training.per_device_train_batch_size={shape.batch}", f"training.bf16={str(on_gpu).lower()}",
            "training.logging_steps=1", f"training.save_steps={shape.steps}", k, "eval.greedy_prompts=2",
            "eval.greedy_new_tokens=8", "eval.max_batches=1", "logger=none", f"output_dir={out}"]


def collect_command(shape: RecipeShape, target: Path, out: Path, on_gpu: bool) -> list[str]:
    """Jacobi trajectories of the recipe's prompts, blocks of 16, on the device (bf16 on a GPU)."""
    return ["scripts/collect_jacobi.py", "--model", str(target), "--data", "default", "--output", str(out),
            "--block-size", "16", "--max-new-tokens", str(shape.new_tokens), "--max-prompts", str(shape.prompts),
            "--batch-size", "8", "--device", "cuda" if on_gpu else "cpu", "--dtype", "bf16"]


def cllm_command(shape: RecipeShape, target: Path, trajectories: Path, out: Path, on_gpu: bool) -> list[str]:
    """CLLM with LoRA (the 7-8B default) on those trajectories, packed rows."""
    return ["-m", "train", "cllm", "+model=tiny", f"model.path={target}", "model.dtype=bf16", "data=default",
            f"method.trajectories={trajectories}", "method.backbone=lora", "method.packing=true",
            f"data.max_length={shape.max_length}", "data.validation_fraction=0.1", f"training.max_steps={shape.steps}",
            f"training.per_device_train_batch_size={shape.batch}", f"training.bf16={str(on_gpu).lower()}",
            "training.logging_steps=1", f"training.save_steps={shape.steps}", "eval.greedy_prompts=2",
            "eval.greedy_new_tokens=8", "eval.max_batches=1", "logger=none", f"output_dir={out}"]


def cllm_figures(shape: RecipeShape, target: Path, folder: Path, logs: Path, on_gpu: bool, timeout: float,
                 say: Callable[[str], None]) -> dict[str, dict]:
    """The collector and the CLLM trainer, each with its figures (module docstring)."""
    trajectories = folder / "traj.jsonl"
    say("recipes: python scripts/collect_jacobi.py")
    collect = run(collect_command(shape, target, trajectories, on_gpu), folder / "collect.peak.json",
                  logs / "collect_jacobi.log", timeout)
    records = [json.loads(line) for line in trajectories.read_text().splitlines()]
    answered = sum(sum(len(b["states"][-1]) for b in r["blocks"]) for r in records)
    collect.update(trajectories=len(records), answer_tokens=answered, tokens_per_s=answered / collect["wall_s"])
    say("recipes: python -m train cllm")
    run_dir = folder / "cllm"
    train = run(cllm_command(shape, target, trajectories, run_dir, on_gpu), folder / "cllm.peak.json",
                logs / "cllm.log", timeout)
    return {"collect_jacobi": collect, "cllm": {**train, **trainer_figures("cllm", run_dir, shape, on_gpu)}}


def trainer_figures(method: str, run_dir: Path, shape: RecipeShape, on_gpu: bool) -> dict:
    """A finished run's throughput (its config.json) and the memory model's peak at the mean row length it trained
    on and at data.max_length."""
    saved = json.loads((run_dir / "config.json").read_text())["training"]["throughput"]
    mean_row = round(saved["tokens"] / max(saved["steps"] * shape.batch, 1))  # tokens a row held, on average
    return {"tokens_per_s": saved["tokens_per_second"], "train_s": saved["seconds"], "steps": saved["steps"],
            "predicted": predicted_peak(method, shape, mean_row, on_gpu),
            "bound": predicted_peak(method, shape, shape.max_length, on_gpu)}


def run(args: list[str], peak_file: Path, log: Path, timeout: float) -> dict:
    """`python <args>` under gpu_check_peak.py -> wall seconds and the child's peak; RuntimeError with its log's tail
    when it fails."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    with log.open("w") as sink:
        code = subprocess.run([sys.executable, str(PEAK), str(peak_file), *args], stdout=sink, stderr=subprocess.STDOUT,
                              cwd=ROOT, env=env, timeout=timeout).returncode
    wall = time.perf_counter() - start
    if code != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"python {' '.join(args[:3])} ... exited with status {code}: {' | '.join(tail)}")
    return {"command": "python " + " ".join(args), "wall_s": wall, **json.loads(peak_file.read_text())}


def predicted_peak(method: str, shape: RecipeShape, seq: int, on_gpu: bool) -> dict:
    """train/memory_model.py's peak for rows of `seq` tokens, every one trained."""
    from train.memory_model import TrainSetup, predict  # deferred: after the package checks

    k = shape.medusa_heads if method == "medusa1" else shape.ttt_steps
    b = predict(shape.target, TrainSetup(method, shape.batch, max(seq, 3), k, autocast=on_gpu, foreach=on_gpu))
    return {"seq": seq, "peak_bytes": b.peak, "phase": b.peak_phase, "breakdown": dict(b.rows())}


def recipes_section(shape_name: str, folder: Path, out: Path, device: torch.device, seed: int,
                    say: Callable[[str], None], timeout: float = 900.0) -> dict:
    """Build the target, run both trainers and both exports; figures per command (module docstring)."""
    shape = RECIPE_SHAPES[shape_name]
    on_gpu = device.type == "cuda"
    say(f"recipes: saving a random Llama (hidden {shape.target.hidden} x {shape.target.layers} layers, vocab "
        f"{shape.target.vocab}) with a "
        f"tokenizer")
    start = time.perf_counter()
    target = save_target(shape, folder, device, seed)
    if on_gpu:
        torch.cuda.empty_cache()
    result: dict = {"shape": shape_name, "plan": shape.plan(), "save_s": time.perf_counter() - start, "commands": {}}
    logs = out / "recipes_logs"
    logs.mkdir(exist_ok=True)
    for method, export in (("medusa1", "vllm-export"), ("eagle3", "eagle3-export")):
        run_dir = folder / method
        say(f"recipes: python -m train {method}")
        figures = run(train_command(method, shape, target, run_dir, on_gpu), folder / f"{method}.peak.json",
                      logs / f"{method}.log", timeout)
        result["commands"][method] = {**figures, **trainer_figures(method, run_dir, shape, on_gpu)}
        say(f"recipes: python -m models.convert {export}")
        exported = folder / f"{method}_export"
        result["commands"][export] = run(["-m", "models.convert", export, str(run_dir), str(exported)],
                                         folder / f"{export}.peak.json", logs / f"{export}.log", timeout)
        result["commands"][export]["files"] = sorted(p.name for p in exported.iterdir())
    result["commands"].update(cllm_figures(shape, target, folder, logs, on_gpu, timeout, say))
    return result
