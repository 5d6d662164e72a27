"""models.refs: every model name is parsed once into a ModelRef (one "is it local" rule, data.locations) and located
by one memoised function, with one offline policy for hub ids whoever names them (--base, --drafter, an early-exit
source)."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import pytest

from data.errors import UsageError
from data.locations import is_local, written_as_path
from inference.cli import main as inference_main
from inference.drafters.registry import CLI, resolve
from inference.session import EXIT_USAGE
from models import refs
from models.builtin import ModelLoadError
from models.loading import model_config
from models.refs import (BuiltinRef, ConfRef, EarlyExitRef, HubRef, LocalRef, ModelSettings, at_revision,
                         builtin_names, locate, model_settings, parse_model)
from tests.model_support import save_tiny_model


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name, ref", [
    ("./tiny", LocalRef("./tiny")),
    ("/abs/model", LocalRef("/abs/model")),
    ("~/models/x", LocalRef("~/models/x")),
    ("a/b/c", LocalRef("a/b/c")),  # more slashes than a hub id has: local even when missing
    ("builtin:tiny", BuiltinRef("tiny")),
    ("builtin:smollm2", BuiltinRef("smollm2")),
    ("tiny", ConfRef("tiny", BuiltinRef("tiny"), "fp32", None)),
    ("vicuna7b", ConfRef("vicuna7b", HubRef("lmsys/vicuna-7b-v1.3"), "bf16", "vicuna_v1.1")),
    ("org/name", HubRef("org/name")),
    ("gpt2", HubRef("gpt2")),
    ("early_exit:builtin:tiny:2", EarlyExitRef(BuiltinRef("tiny"), 2)),
    ("early_exit:./m:3", EarlyExitRef(LocalRef("./m"), 3)),
    ("early_exit:org/name:4", EarlyExitRef(HubRef("org/name"), 4)),
])
def test_every_kind_parses_and_prints_as_written(in_tmp, name, ref):
    parsed = parse_model(name)
    assert parsed == ref and str(parsed) == name


def test_an_early_exit_of_a_conf_name_keeps_the_conf():
    ref = parse_model("early_exit:smollm2:8")
    assert isinstance(ref, EarlyExitRef) and ref.layers == 8
    assert isinstance(ref.source, ConfRef) and ref.source.model == BuiltinRef("smollm2")
    assert str(ref) == "early_exit:smollm2:8"
    assert model_settings("smollm2-draft").ref == ref  # conf/model/smollm2-draft.yaml names the same draft


def test_home_is_expanded_only_where_the_folder_is_read():
    ref = parse_model("~/models/x")
    assert ref.text == "~/models/x" and ref.path == Path.home() / "models" / "x"


def test_an_existing_path_is_local_a_missing_one_slash_name_is_a_hub_id(in_tmp):
    assert parse_model("dir/sub") == HubRef("dir/sub")
    (in_tmp / "dir" / "sub").mkdir(parents=True)
    assert parse_model("dir/sub") == LocalRef("dir/sub")


def test_a_folder_in_the_working_directory_wins_over_a_conf_name(in_tmp):
    """The order of the module docstring: --base and --drafter agree (they used to disagree: --base read the conf,
    --drafter the folder)."""
    assert isinstance(parse_model("tiny-draft"), ConfRef)
    save_tiny_model(in_tmp / "tiny-draft")
    assert parse_model("tiny-draft") == LocalRef("tiny-draft")
    assert model_settings("tiny-draft") == ModelSettings(LocalRef("tiny-draft"))
    request = resolve("tiny-draft", "builtin:tiny", CLI)
    assert request.type == "draft_model" and request.path == Path("tiny-draft")


@pytest.mark.parametrize("name, message", [
    ("", "empty model name"),
    ("builtin:nope", "unknown built-in model 'builtin:nope'; choose one of builtin:tiny, builtin:tiny-draft, "
                     "builtin:smollm2"),
    ("early_exit:smollm2", "expected early_exit:<model>:<layers>"),
    ("early_exit:smollm2:x", "expected early_exit:<model>:<layers>"),
    ("early_exit:smollm2-draft:2", "early_exit:smollm2-draft:2: the source is itself an early-exit draft"),
    ("early_exit:early_exit:smollm2:8:2", "the source is itself an early-exit draft"),
])
def test_malformed_names_are_one_line(name, message):
    with pytest.raises(ModelLoadError) as info:
        parse_model(name)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_one_local_rule():
    assert all(written_as_path(p) for p in ("./x", "../x", "/x", "~/x", ".hidden", "a/b/c"))
    assert not any(written_as_path(p) for p in ("org/name", "gpt2", "builtin:tiny"))
    assert is_local(__file__) and not is_local("org/name")


def test_model_settings_come_from_the_conf_file_for_its_own_builtin_only():
    assert model_settings("builtin:tiny") == model_settings("tiny") == ModelSettings(BuiltinRef("tiny"), "fp32")
    assert model_settings("org/model") == ModelSettings(HubRef("org/model"))
    assert model_settings(BuiltinRef("smollm2")).chat_template == model_settings("smollm2").chat_template


def test_locate_a_local_path_as_given(in_tmp):
    save_tiny_model(in_tmp / "m")
    assert locate("m") == Path("m") and locate(LocalRef("./m")) == Path("./m")
    with pytest.raises(ModelLoadError, match=r"^model path './gone' does not exist$"):
        locate("./gone")


def test_locate_builds_once_per_cache_root(tmp_path, monkeypatch):
    """The builder registered for a kind runs once per process and cache root; a conf name locates its model."""
    built = []

    def fake_build() -> Path:
        built.append(refs.cache_root())
        return tmp_path / "built"

    monkeypatch.setitem(refs.BUILTINS, "tiny", fake_build)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "one"))
    assert locate("builtin:tiny") == locate(BuiltinRef("tiny")) == locate("tiny") == tmp_path / "built"
    assert len(built) == 1
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "two"))
    locate("builtin:tiny")
    assert built == [tmp_path / "one", tmp_path / "two"]


def test_a_tiny_model_never_built_is_refused_in_one_line_naming_its_build_step(tmp_path, monkeypatch, capsys):
    """models/ does not train: locating a tiny model in an empty cache fails at once, writes nothing into the cache
    (a build would lock and stage there first), and `python -m inference` prints that one line."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=r"^builtin:tiny is not built: run `python scripts/build_tiny_models\.py` "
                                             r"once \(about 13 minutes on 2 CPU cores\), or any `python -m train` "
                                             r"command that uses it .*, which builds it first$"):
        locate("tiny")
    assert inference_main(["generate", "--base", "builtin:tiny-draft", "--prompt", "hi"]) == EXIT_USAGE
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert "builtin:tiny-draft is not built: run `python scripts/build_tiny_models.py` once" in err[0]
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name, names", [
    ("builtin:tiny", ["tiny"]), ("tiny", ["tiny"]), ("early_exit:tiny-draft:2", ["tiny-draft"]),
    ("smollm2-draft", ["smollm2"]), ("org/name", []), ("early_exit:org/name:2", []), ("/abs/model", []),
])
def test_builtin_names_follow_conf_names_and_early_exit_sources(name, names):
    assert builtin_names(parse_model(name)) == names


def test_an_early_exit_source_that_is_missing_is_named_with_the_whole_name():
    with pytest.raises(ModelLoadError, match=r"^early_exit:/no/model:2: model path '/no/model' does not exist$"):
        locate("early_exit:/no/model:2")


# -- one offline policy for hub ids ---------------------------------------------------------------------------------

def _snapshot(hub: Path, repo_id: str) -> Path:
    """models--<org>--<name>/{refs/main, snapshots/<commit>} holding a tiny model, as huggingface_hub lays it out."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return save_tiny_model(repo / "snapshots" / commit)


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(folder))
    return folder


def test_a_cached_hub_id_is_its_snapshot_for_base_and_drafter_alike(hub):
    snapshot = _snapshot(hub, "org/cached")
    assert locate("org/cached") == snapshot
    assert model_config("org/cached").vocab_size == 400  # --base reads the same folder
    request = resolve("org/cached", "org/cached", CLI)  # --drafter too
    assert request.type == "draft_model" and request.path == snapshot


def test_offline_an_uncached_hub_id_is_one_line_for_base_and_drafter(hub):
    assert huggingface_hub.constants.is_offline_mode()  # conftest: HF_HUB_OFFLINE=1
    with pytest.raises(ModelLoadError, match=r"holds no complete snapshot of org/missing .*offline.*"
                                             r"`hf download org/missing`$"):
        model_config("org/missing")
    with pytest.raises(UsageError, match=r"^--drafter org/missing: not a local directory, .*"
                                         r"`hf download org/missing`$"):
        resolve("org/missing", "builtin:tiny", CLI)


def test_online_an_uncached_hub_id_is_downloaded_for_base_and_drafter_alike(hub, tmp_path, monkeypatch):
    """Before: a drafter hub id was only ever read from the cache, while --base was fetched online."""
    fetched = []
    real = huggingface_hub.snapshot_download

    def fake_download(repo_id, revision=None, local_files_only=False, **kwargs):
        if local_files_only:
            return real(repo_id, revision=revision, local_files_only=True, **kwargs)
        fetched.append((repo_id, revision))
        return str(save_tiny_model(tmp_path / "downloaded" / repo_id))

    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert model_config(at_revision(parse_model("org/base"), "v1")).vocab_size == 400
    request = resolve("org/draft", "org/base", CLI)
    assert request.type == "draft_model" and request.path == tmp_path / "downloaded" / "org" / "draft"
    assert fetched == [("org/base", "v1"), ("org/draft", None)]


def test_a_revision_pins_the_hub_model_of_a_conf_name():
    ref = at_revision(parse_model("vicuna7b"), "abc")
    assert ref.model == HubRef("lmsys/vicuna-7b-v1.3", "abc")
    assert at_revision(BuiltinRef("tiny"), "abc") == BuiltinRef("tiny")


def test_a_drafter_naming_an_unknown_builtin_is_refused_before_loading():
    """Before: accepted as a plain draft model, refused only when loading."""
    with pytest.raises(UsageError, match=r"^--drafter builtin:nope: unknown built-in model 'builtin:nope'"):
        resolve("builtin:nope", "builtin:tiny", CLI)


def test_a_draft_model_named_by_a_cached_hub_id_loads_without_resolve(hub):
    """bench's --assistant reaches load_draft_model directly. Before: a hub id there was taken for a checkpoint
    folder and refused; now it is located like every hub id."""
    from models.draft_model import load_draft_model
    from tests.conftest import build_tiny_lm

    _snapshot(hub, "org/assistant")
    target = build_tiny_lm("llama", vocab_size=400)
    draft = load_draft_model("org/assistant", target, target.device)
    assert draft.config.vocab_size == target.config.vocab_size and draft.config.num_hidden_layers == 2
