"""flowsim.common.io: a write either completes or leaves the previous file untouched."""

import json
import os

import numpy as np
import pytest

from flowsim.common import io as atomic


def test_writes_replace_the_file_whole(tmp_path):
    path = tmp_path / "deep" / "file.json"
    atomic.write_atomic_json(path, {"a": np.float64(0.5), "b": [1, 2]})
    assert json.loads(path.read_text()) == {"a": 0.5, "b": [1, 2]} and path.read_text().endswith("\n")
    atomic.write_atomic_npz(tmp_path / "arrays.npz", {"x": np.arange(3.0)})
    with np.load(tmp_path / "arrays.npz") as data:
        np.testing.assert_array_equal(data["x"], np.arange(3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arrays.npz", "deep"]  # no temporary files left


def test_an_interrupted_write_keeps_the_previous_version(tmp_path, monkeypatch):
    path = tmp_path / "meta.json"
    atomic.write_atomic_text(path, "old\n")

    def interrupted(source, target):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic.write_atomic_text(path, "new\n")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]  # the temporary file is removed


def test_json_is_strict_nan_and_infinities_become_null(tmp_path):
    path = tmp_path / "row.json"
    atomic.write_atomic_json(path, {"a": float("nan"), "b": [np.inf, 1.5], "c": np.float32(2.0), "d": np.arange(2)})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    # a strict parser (no NaN constants) reads it back
    assert json.loads(text, parse_constant=lambda name: pytest.fail(f"non-strict constant {name}")) == \
        {"a": None, "b": [None, 1.5], "c": 2.0, "d": [0, 1]}


@pytest.mark.parametrize("damage", ["truncated", "empty", "not_npz", "missing_array"])
def test_a_damaged_npz_raises_one_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "trajectory.npz"
    atomic.write_atomic_npz(path, {"t": np.arange(1000.0), "loss": np.ones(1000)})
    whole = path.read_bytes()
    content = {"truncated": whole[: len(whole) // 2], "empty": b"", "not_npz": b"hello",
               "missing_array": None}[damage]
    if content is None:
        atomic.write_atomic_npz(path, {"t": np.arange(3.0)})
    else:
        path.write_bytes(content)
    with pytest.raises(atomic.DamagedFileError) as error:
        atomic.read_npz(path, required=("t", "loss"), remedy="do this")
    assert str(path) in str(error.value) and str(error.value).endswith("do this") and "\n" not in str(error.value)


def test_a_damaged_json_file_raises_one_error(tmp_path):
    path = tmp_path / "meta.json"
    path.write_text('{"status_na')
    with pytest.raises(atomic.DamagedFileError, match="meta.json is damaged"):
        atomic.read_json(path)


def test_file_digest_changes_with_any_byte(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"abc" * 1000)
    first = atomic.file_digest(path)
    path.write_bytes(b"abc" * 999 + b"abd")
    assert atomic.file_digest(path) != first and len(first) == 64


def test_a_written_file_gets_the_mode_open_would_give_it(tmp_path):
    """Run directories, rows and figures are readable by others as files made by open() are (0644 under umask 022),
    not 0600 like the temporary file they are written through."""
    import os
    import stat

    atomic.write_atomic_bytes(tmp_path / "a.json", b"{}")
    plain = tmp_path / "b.json"
    plain.write_bytes(b"{}")
    assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == stat.S_IMODE(os.stat(plain).st_mode)


def test_every_cache_follows_one_rule(monkeypatch, tmp_path):
    """FLOWSIM_<NAME>_CACHE: a folder, or off; unset: under XDG_CACHE_HOME (the predictions' cache reads the same)."""
    from flowsim.common.caches import cache_dir
    from flowsim.runs.predictions import prediction_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("FLOWSIM_PREDICTION_CACHE", raising=False)
    assert prediction_cache_dir() == tmp_path / "xdg" / "flowsim" / "predictions"
    assert cache_dir("FLOWSIM_COMPILATION_CACHE_UNSET", "xla") == str(tmp_path / "xdg" / "flowsim" / "xla")
    for off in ("off", "OFF ", "0", "false", ""):
        monkeypatch.setenv("FLOWSIM_PREDICTION_CACHE", off)
        assert prediction_cache_dir() is None
    monkeypatch.setenv("FLOWSIM_PREDICTION_CACHE", str(tmp_path / "mine"))
    assert prediction_cache_dir() == tmp_path / "mine"
