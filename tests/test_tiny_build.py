"""Building the built-in tiny models (train.tiny_build): a miniature build through the real code path (small
tokenizer corpus, a few steps), and the training entry point building the ones a run uses (train.task)."""

import json

import pytest
import torch
from hydra import compose, initialize_config_module
from transformers import AutoModelForCausalLM, AutoTokenizer

from data.chat import IGNORE_INDEX, encode_chat
from models import tiny
from models.buildcache import COMPLETE_MARKER, atomic_dir, is_complete
from tests.model_support import save_tiny_model
from train import task, tiny_build
from train.config import register_configs
from train.tiny_build import TinySpec, TokenizerSpec

MINI = TinySpec(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
    pretrain_steps=4, pretrain_batch=4, pretrain_seq_len=16, lr=1e-3, long_seq_len=32, long_fraction=0.5,
    sft_steps=2, sft_batch=2, sft_seq_len=64, sft_lr=1e-3, warmup_steps=1, eval_tokens=256, threads=1,
)
MINI_TOKENIZER = TokenizerSpec(vocab_size=384, max_corpus_chars=150_000)
MAX_CONVERSATIONS = 24


def _mini_build(models_dir, name="tiny"):
    tokenizer_dir = tiny_build.ensure_tokenizer(models_dir / tiny_build.TOKENIZER_DIR, MINI_TOKENIZER, progress=False)
    with atomic_dir(models_dir / name, tiny.FORMAT_VERSION) as tmp:
        tiny_build.build(name, tmp, tokenizer_dir, spec=MINI, progress=False, max_conversations=MAX_CONVERSATIONS)
    return models_dir / name


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _mini_build(tmp_path_factory.mktemp("cache") / "models")


def test_build_loads_through_from_pretrained_and_generates(built):
    model = AutoModelForCausalLM.from_pretrained(built).eval()
    tokenizer = AutoTokenizer.from_pretrained(built)
    assert type(model).__name__ == "LlamaForCausalLM" and (built / "model.safetensors").is_file()
    assert model.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(tiny_build.EOS)
    assert model.config.vocab_size == len(tokenizer)
    prompt = tokenizer("def f(x):", return_tensors="pt")
    assert prompt["input_ids"][0, 0].item() == tokenizer.bos_token_id
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 5)


def test_build_info_and_completion_marker(built):
    info = tiny_build.load_build_info(built)
    assert (built / COMPLETE_MARKER).is_file()
    assert info.name == "tiny" and info.pretrain_steps == 4 and info.sft_steps == 2
    assert info.params == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(built).parameters())
    assert 0 < info.val_loss < 10 and 0 <= info.val_top1 <= 1 and 0 <= info.chat_val_top1 <= 1
    assert info.sample_prompt.startswith("Write") and isinstance(info.sample_completion, str)
    assert json.loads((built / "build_info.json").read_text())["spec"]["hidden_size"] == 32


def test_chat_template_ends_assistant_turns_with_eos(built):
    tokenizer = AutoTokenizer.from_pretrained(built)
    messages = [{"role": "user", "content": "Write `f()`"}, {"role": "assistant", "content": "def f():\n    pass"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|bos|><|user|>\nWrite `f()`<|end|>\n<|assistant|>\ndef f():\n    pass<|end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|assistant|>\n")
    encoded = encode_chat(tokenizer, messages, max_length=128)
    trained = [t for t, label in zip(encoded.input_ids, encoded.labels) if label != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "def f():\n    pass<|end|>"


def test_same_seed_same_weights(built, tmp_path):
    # Equivalence: a second build (fresh tokenizer training included) reproduces the first bit for bit.
    again = _mini_build(tmp_path / "models")
    assert (again.parent / tiny_build.TOKENIZER_DIR / "tokenizer.json").read_bytes() == (
        built.parent / tiny_build.TOKENIZER_DIR / "tokenizer.json").read_bytes()
    first = AutoModelForCausalLM.from_pretrained(built).state_dict()
    second = AutoModelForCausalLM.from_pretrained(again).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_ensure_built_reuses_a_complete_build(built, monkeypatch):
    cache_root = built.parent.parent
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(cache_root))
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert tiny_build.ensure_built("tiny", progress=False) == built
    from models.refs import locate

    assert locate("builtin:tiny") == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp


def test_failed_build_leaves_no_partial_directory(tmp_path):
    target = tmp_path / "models" / "tiny"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_dir(target, tiny.FORMAT_VERSION) as tmp:
            (tmp / "half-written").write_text("x")
            raise RuntimeError("boom")
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_unknown_name_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown built-in model 'huge'; choose one of tiny, tiny-draft"):
        tiny_build.ensure_built("huge", progress=False, cache_dir=tmp_path)


def test_a_build_of_an_older_recipe_is_rebuilt(built, monkeypatch, tmp_path):
    # Copy the mini build, stamp it with an older format version: ensure_built must rebuild it, not reuse it.
    import shutil

    models_dir = tmp_path / "models"
    shutil.copytree(built.parent, models_dir)
    marker = models_dir / "tiny" / COMPLETE_MARKER
    assert tiny.is_built("tiny", tmp_path)
    marker.write_text(json.dumps({"format_version": tiny.FORMAT_VERSION - 1}) + "\n")
    assert is_complete(models_dir / "tiny") and not tiny.is_built("tiny", tmp_path)
    rebuilt = []
    monkeypatch.setattr(tiny_build, "build", lambda name, out_dir, tokenizer_dir, progress: rebuilt.append(name))
    assert tiny_build.ensure_built("tiny", progress=False, cache_dir=tmp_path) == models_dir / "tiny"
    assert rebuilt == ["tiny"] and tiny.is_built("tiny", tmp_path)


# -- the training entry point builds the tiny models a run uses (train.task) ----------------------------------------

def composed(method: str, *overrides: str):
    """The run's config, as `python -m train <method> +model=tiny <overrides>` composes it."""
    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="train", overrides=[f"method={method}", "+model=tiny", *overrides])


@pytest.fixture
def fake_builds(tmp_path, monkeypatch) -> list[str]:
    """An empty cache and, in place of the builder, one that records the name and marks the model built."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    built = []

    def fake_ensure_built(name: str):
        built.append(name)
        with atomic_dir(tiny.model_dir(name), tiny.FORMAT_VERSION):
            pass
        return tiny.model_dir(name)

    monkeypatch.setattr(task, "ensure_built", fake_ensure_built)
    return built


def test_a_run_builds_the_tiny_models_it_uses_once(fake_builds, capsys):
    # distill's target is builtin:tiny (+model=tiny); its draft is an early-exit cut of tiny-draft (a conf/model name).
    task.build_tiny_models(composed("distill", "method.draft=early_exit:tiny-draft:1"))
    assert fake_builds == ["tiny", "tiny-draft"] and tiny.is_built("tiny") and tiny.is_built("tiny-draft")
    assert capsys.readouterr().err.splitlines() == [
        f"builtin:{name} is not built yet: building it now, once (about 13 minutes on 2 CPU cores; "
        f"`python scripts/build_tiny_models.py` is the same step on its own)" for name in ("tiny", "tiny-draft")]
    task.build_tiny_models(composed("distill"))  # both built now: nothing to do, nothing printed
    assert fake_builds == ["tiny", "tiny-draft"] and capsys.readouterr().err == ""


def test_a_run_on_its_own_model_builds_nothing(fake_builds, tmp_path):
    model = save_tiny_model(tmp_path / "model")
    task.build_tiny_models(composed("medusa1", f"model.path={model}"))
    task.build_tiny_models(composed("distill", f"model.path={model}", f"method.draft={model}"))
    assert fake_builds == []


def test_only_the_main_process_says_it_builds(fake_builds, monkeypatch, capsys):
    """Under a launcher every rank builds (the lock lets one do it, models.buildcache); rank 1 prints nothing."""
    monkeypatch.setenv("RANK", "1")
    task.build_tiny_models(composed("medusa1"))
    assert fake_builds == ["tiny"] and capsys.readouterr().err == ""


def test_the_task_builds_before_anything_reads_the_model(fake_builds, tmp_path, monkeypatch):
    """train.task.run reaches the build step before any model file is read: a builder that stops the run stops it
    there (a loader first would fail with `builtin:tiny is not built`)."""
    class Stop(Exception):
        pass

    def stop(name: str):
        raise Stop(name)

    monkeypatch.setattr(task, "ensure_built", stop)
    with pytest.raises(Stop, match="^tiny$"):
        task.run(composed("medusa1", "logger=none", f"output_dir={tmp_path / 'out'}"))
