"""data.atomic: files and folders appear whole or not at all, with ordinary permissions, and failures leave nothing."""

import json
import os
import stat

import pytest

from data.atomic import staged_dir, write_file, write_json, write_text


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def test_files_replace_the_old_one_with_ordinary_permissions(tmp_path):
    path = tmp_path / "a.json"
    write_text(path, "old")
    write_json(path, {"b": 1, "a": [2]})
    assert path.read_text() == '{\n  "a": [\n    2\n  ],\n  "b": 1\n}\n'
    assert json.loads(path.read_text()) == {"a": [2], "b": 1}
    assert mode(path) == 0o666 & ~umask()  # not mkstemp's private 0600
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_a_failed_file_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(b"old")

    def half_then_fail(tmp):
        tmp.write_bytes(b"ha")
        raise RuntimeError("disk trouble")

    with pytest.raises(RuntimeError, match="disk trouble"):
        write_file(path, half_then_fail)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["shard.bin"]


def test_a_replaced_folder_loses_its_old_files(tmp_path):
    target = tmp_path / "cache" / "model"
    with staged_dir(target) as tmp:
        (tmp / "old.txt").write_text("1")
    with staged_dir(target) as tmp:
        assert target.is_dir() and not list(tmp.iterdir())  # the old one stays readable while the new one is built
        (tmp / "new.txt").write_text("2")
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    assert mode(target) == 0o777 & ~umask()  # not mkdtemp's private 0700
    assert [p.name for p in target.parent.iterdir()] == ["model"]


def test_a_merged_folder_keeps_other_files_and_moves_the_marker_last(tmp_path, monkeypatch):
    target = tmp_path / "run"
    target.mkdir()
    (target / "train.log").write_text("log")
    (target / "sub").mkdir()
    (target / "sub" / "stale").write_text("x")
    (target / "done").write_text("old marker")
    real_replace, moved = os.replace, []

    def recording_replace(src, dst):
        if not moved:
            assert not (target / "done").exists()  # the old marker goes before anything is replaced
        moved.append(os.path.basename(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    with staged_dir(target, marker="done") as tmp:
        (tmp / "done").write_text("new marker")
        (tmp / "weights").write_text("w")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "fresh").write_text("y")
    assert moved[-1] == "done" and moved.count("done") == 1
    assert sorted(p.name for p in target.iterdir()) == ["done", "sub", "train.log", "weights"]
    assert [p.name for p in (target / "sub").iterdir()] == ["fresh"]  # a written subfolder replaces the old whole
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_a_failed_folder_write_leaves_nothing(tmp_path):
    target = tmp_path / "out"
    for marker in (None, "config.json"):
        with pytest.raises(RuntimeError, match="boom"):
            with staged_dir(target, marker=marker) as tmp:
                (tmp / "half").write_text("x")
                raise RuntimeError("boom")
        assert list(tmp_path.iterdir()) == []


def test_a_file_in_the_way_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="file is a file, not a directory"):
        with staged_dir(tmp_path / "file" / "run", marker="config.json"):
            pass
