"""Self-speculative early-exit drafts (models.early_exit): the built draft IS the target truncated at layer N (logits
equal the target's final norm + lm_head on hidden_states[N]), weights are tied as in the target, builds are cached per
source and N, bad N is one line, and `early_exit:<model>:<N>` serves and distils like any draft model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from inference.api import load
from inference.cli import main
from inference.drafters.draft_model import DraftModelDrafter
from inference.engine.loop import DecodeConfig, generate
from models import early_exit
from models.draft_model import is_plain_model
from models.early_exit import build_early_exit_draft, ensure_early_exit
from models.loading import ModelLoadError
from models.refs import BuiltinRef, ConfRef, EarlyExitRef, LocalRef, locate, model_settings, parse_model
from tests.model_support import save_tiny_model
from tests.data_support import random_chats
from tests.test_distill import ROOT
from tests.test_draft_model import left_pad, plain_greedy

pytestmark = pytest.mark.usefixtures("single_thread")
LAYERS = 4


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test builds into its own draftsmith cache (subprocesses inherit it)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(root))
    return root


def ensure(name: str) -> Path:
    """ensure_early_exit for a name, uncached (models.refs.locate memoises): a changed source is seen."""
    ref = parse_model(name)
    return ensure_early_exit(ref, locate(ref.source), progress=False)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """4-layer random models with the tests' tokenizer: a Llama with tied embeddings, a Qwen2 and a Mistral without;
    peaked (initializer_range 0.2), so their greedy answers are not one repeated token."""
    root = tmp_path_factory.mktemp("ee")
    peaked = dict(layers=LAYERS, initializer_range=0.2)
    return {
        "llama": save_tiny_model(root / "llama", "llama", seed=0, hidden_size=64, tied=True, **peaked),
        "qwen2": save_tiny_model(root / "qwen2", "qwen2", seed=1, hidden_size=32, **peaked),
        "mistral": save_tiny_model(root / "mistral", "mistral", seed=2, hidden_size=32, **peaked),
    }


def load_lm(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_draft_logits_equal_the_target_truncated_at_layer_n(sources, tmp_path, arch, layers):
    target = load_lm(sources[arch])
    draft = load_lm(build_early_exit_draft(str(sources[arch]), layers, tmp_path / "draft"))
    assert draft.config.num_hidden_layers == layers and len(draft.model.layers) == layers
    ids = torch.randint(3, target.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(layers))
    with torch.no_grad():
        hidden = target(input_ids=ids, output_hidden_states=True).hidden_states  # L + 1 entries: embeddings first
        expected = target.lm_head(target.model.norm(hidden[layers]))  # [B, T, V]
        torch.testing.assert_close(draft(input_ids=ids).logits, expected)
        torch.testing.assert_close(target.model.layers[layers - 1].mlp.down_proj.weight,
                                   draft.model.layers[layers - 1].mlp.down_proj.weight)


def test_tied_embeddings_stay_tied_and_untied_heads_are_copied(sources, tmp_path):
    tied_target, untied_target = load_lm(sources["llama"]), load_lm(sources["qwen2"])
    tied = load_lm(build_early_exit_draft(str(sources["llama"]), 2, tmp_path / "tied"))
    untied = load_lm(build_early_exit_draft(str(sources["qwen2"]), 2, tmp_path / "untied"))
    assert tied.config.tie_word_embeddings and tied.lm_head.weight is tied.model.embed_tokens.weight
    torch.testing.assert_close(tied.lm_head.weight, tied_target.model.embed_tokens.weight, rtol=0, atol=0)
    assert not untied.config.tie_word_embeddings
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(untied.lm_head.weight, untied_target.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(untied.model.norm.weight, untied_target.model.norm.weight, rtol=0, atol=0)


def test_folder_carries_the_tokenizer_and_its_provenance(sources, tmp_path):
    from transformers import AutoTokenizer

    out = build_early_exit_draft(str(sources["qwen2"]), 3, tmp_path / "draft", dtype="bf16", label="qwen2")
    record = json.loads((out / early_exit.PROVENANCE_FILE).read_text())
    assert record["source"] == "qwen2" and record["source_path"] == str(sources["qwen2"])
    assert (record["layers_kept"], record["source_layers"], record["tokenizer"]) == (3, LAYERS, True)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(sources["qwen2"]).get_vocab()
    assert load_lm(out).config.layer_types == ["full_attention"] * 3  # per-layer lists cut with the layers
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_built_once_per_source_and_layer_count(sources, cache, tmp_path, monkeypatch):
    builds = []
    real = early_exit.build_early_exit_draft
    monkeypatch.setattr(early_exit, "build_early_exit_draft", lambda *a, **k: builds.append(a[1]) or real(*a, **k))
    name = f"early_exit:{sources['mistral']}:2"
    first = ensure(name)
    assert first.parent == cache / "models" / "early_exit" and re.fullmatch(r".*mistral-L2-[0-9a-f]{12}", first.name)
    assert locate(name) == first and ensure(name) == first
    assert builds == [2]  # the second and third calls reused the cached folder
    other = ensure(f"early_exit:{sources['mistral']}:3")
    assert other != first and builds == [2, 3]
    copy = save_tiny_model(tmp_path / "copy", "mistral", seed=5, hidden_size=32, layers=LAYERS)  # other weights
    copied = ensure(f"early_exit:{copy}:2")
    assert copied not in (first, other) and builds == [2, 3, 2]
    os.utime(copy / "model.safetensors", ns=(1, 1))  # the source changed (rewritten): a fresh build, not a stale one
    assert ensure(f"early_exit:{copy}:2") != copied and builds == [2, 3, 2, 2]


def test_model_names_resolve_like_base_models(sources, cache):
    """<model> is any model name, parsed the way `--base` is (models.refs: conf/model names too); the draft's
    provenance names the source as written."""
    ref = parse_model("early_exit:smollm2:8")
    assert isinstance(ref.source, ConfRef) and model_settings(ref.source).ref == BuiltinRef("smollm2")
    folder = locate(f"early_exit:{sources['llama']}:1")
    assert re.fullmatch(r".*llama-L1-[0-9a-f]{12}", folder.name)
    assert json.loads((folder / early_exit.PROVENANCE_FILE).read_text())["source"] == str(sources["llama"])


@pytest.mark.parametrize("name, message", [
    ("early_exit:{llama}:0", "early_exit:{llama}:0: layers must be in [1, 3] (the model has 4 decoder layers)"),
    ("early_exit:{llama}:4", "early_exit:{llama}:4: layers must be in [1, 3] (the model has 4 decoder layers)"),
    ("early_exit:{llama}", "'early_exit:{llama}': expected early_exit:<model>:<layers>, e.g. early_exit:smollm2:8"),
    ("early_exit:{llama}:two", "expected early_exit:<model>:<layers>"),
    ("early_exit:/no/such/model:2", "early_exit:/no/such/model:2: model path '/no/such/model' does not exist"),
])
def test_bad_layer_counts_are_one_line(sources, cache, name, message):
    name, message = name.format(**sources), message.format(**sources)
    with pytest.raises(ModelLoadError) as info:
        locate(name)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not (cache / "models" / "early_exit").exists() or not any((cache / "models" / "early_exit").iterdir())


def test_architecture_without_model_layers_is_refused(tmp_path):
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=LAYERS, n_head=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ModelLoadError) as info:
        build_early_exit_draft(str(tmp_path / "gpt2"), 2, tmp_path / "out")
    assert str(info.value) == (f"early_exit:{tmp_path / 'gpt2'}:2: GPT2LMHeadModel has no decoder stack at "
                               f".model.layers; early-exit drafts support Llama/Qwen2/Mistral-like models")
    assert not (tmp_path / "out").exists()


def test_stopper_and_distill_take_the_spelling(sources):
    from models.loading import load_target
    from train.distill import draft_path
    from train.stopper import resolve_draft

    name = f"early_exit:{sources['qwen2']}:2"
    assert draft_path(name) == resolve_draft(name) == name  # resolved (built) when loaded
    assert load_target(resolve_draft(name), dtype="fp32").config.num_hidden_layers == 2


def test_parse():
    assert parse_model("early_exit:smollm2:8") == EarlyExitRef(parse_model("smollm2"), 8)
    assert parse_model("early_exit:builtin:tiny:2") == EarlyExitRef(BuiltinRef("tiny"), 2)
    assert parse_model("early_exit:./m:3") == EarlyExitRef(LocalRef("./m"), 3)
    assert is_plain_model("early_exit:smollm2:8")


@pytest.mark.parametrize("gamma", [1, 3])
def test_engine_decoding_with_the_early_exit_draft_equals_plain_greedy(sources, gamma):
    """Batch of left-padded prompts through generate with the draft as DraftModelDrafter (per-row acceptance), and
    the same through load(drafter_path="early_exit:..."): both equal plain greedy, token for token."""
    target = load_lm(sources["llama"])
    draft = load_lm(ensure(f"early_exit:{sources['llama']}:3"))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20, 21]]
    ids, mask = left_pad(prompts)
    out = generate(target, ids, DraftModelDrafter(draft, gamma), DecodeConfig(max_new_tokens=16), mask)
    for row, prompt in enumerate(prompts):
        assert out.sequences[row] == plain_greedy(target, prompt, 16)
    engine = load(drafter_path=f"early_exit:{sources['llama']}:3", base=str(sources["llama"]), dtype="fp32",
                  tree=f"chain:{gamma}")
    assert isinstance(engine.drafter, DraftModelDrafter) and engine.drafter.model.config.num_hidden_layers == 3
    assert engine.generate(prompts[1], 16, ignore_eos=True).sequences[0] == plain_greedy(target, prompts[1], 16)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, "\n".join(ln for ln in out.err.splitlines() if ln.strip() and "Loading weights" not in ln
                                    and "Writing model shards" not in ln and "building the early-exit" not in ln)


def test_cli_drafter_spelling_and_its_one_line_error(sources, capsys):
    base = sources["qwen2"]
    args = ("generate", "--base", base, "--prompt", "hello world", "--max-new-tokens", "12", "--dtype", "fp32", "--json")
    code, out, err = run_cli(capsys, *args, "--drafter", f"early_exit:{base}:2", "--tree", "chain:3")
    assert code == 0, err
    code, plain, err = run_cli(capsys, *args)
    assert code == 0, err
    assert json.loads(out)["token_ids"] == json.loads(plain)["token_ids"]
    code, out, err = run_cli(capsys, *args, "--drafter", f"early_exit:{base}:9")
    assert code == 2 and out == "" and err == f"error: early_exit:{base}:9: layers must be in [1, 3] (the model " \
                                              f"has 4 decoder layers)"


@pytest.fixture(scope="module")
def alpaca_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "alpaca.json"
    path.write_text(json.dumps([{"instruction": q["content"], "input": "", "output": a["content"]}
                                for q, a in random_chats(24)]))
    return path


def test_distill_an_early_exit_draft_with_the_chat_models_recipe(sources, alpaca_file, tmp_path):
    """`+model=smollm2` (data=instructions, the target answers the prompts itself first) on a tiny 4-layer target
    with `method.draft=early_exit:<dir>:2`, 3 steps: the checkpoint holds a trained 2-layer draft (embeddings still
    tied) that serves exactly."""
    target, out = sources["llama"], tmp_path / "run"
    cmd = [
        sys.executable, "-m", "train", "distill", "+model=smollm2", f"model.path={target}",
        f"method.draft=early_exit:{target}:2", f"data.path={alpaca_file}", "data.self_distill_samples=12",
        "data.self_distill_new_tokens=8", "data.max_length=48", "data.validation_fraction=0.25",
        "training.max_steps=3", "training.per_device_train_batch_size=2", "training.logging_steps=1",
        "training.learning_rate=5e-3", "eval.greedy_prompts=0", "logger=none", f"output_dir={out}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert (out / "self_distill" / "rank000.jsonl").is_file()  # the recipe's replies are the target's own
    config = json.loads((out / "config.json").read_text())
    assert config["drafter_type"] == "draft_model"
    assert config["training"]["config"]["method"]["draft"] == f"early_exit:{target}:2"
    metrics = config["training"]["metrics"]
    assert metrics["eval_alpha"] != metrics["eval_initial_alpha"]  # the draft trained
    trained, built = load_lm(out / "draft"), load_lm(ensure(f"early_exit:{target}:2"))
    assert trained.config.num_hidden_layers == 2 and trained.lm_head.weight is trained.model.embed_tokens.weight
    assert not torch.equal(trained.model.layers[0].mlp.up_proj.weight, built.model.layers[0].mlp.up_proj.weight)
    engine = load(out, dtype="fp32")
    prompt = [5, 6, 7, 8]
    assert engine.generate(prompt, 10, ignore_eos=True).sequences[0] == plain_greedy(load_lm(target), prompt, 10)
