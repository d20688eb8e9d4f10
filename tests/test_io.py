"""flowsim.io: a write either completes or leaves the previous file untouched."""

import json
import os

import numpy as np
import pytest

from flowsim import io as atomic


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
