"""The figure modules on a tiny configuration: files written, plotted data equal to the
run directory's arrays, cached runs reused, corrupt inputs refused clearly."""

import importlib

import numpy as np
import pytest

from figures import FIGURE_MODULES, build_figures
from figures.runs import FigureInputError
from flowsim.observables import Observables


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("figures")
    results = build_figures(root / "out", root / "cache", tiny=True, report=lambda line: None)
    return root, {result.name: result for result in results}


def test_every_figure_is_written_with_its_caption(built):
    root, results = built
    assert sorted(results) == sorted(importlib.import_module(f"figures.{m}").NAME for m in FIGURE_MODULES)
    for name, result in results.items():
        assert result.png.stat().st_size > 10_000 and result.pdf.stat().st_size > 1_000, name
        assert (root / "out" / f"{name}.txt").read_text().strip() == result.caption


def test_plotted_data_is_the_run_directorys(built):
    root, results = built
    for name, result in results.items():
        assert result.data, name
        for key, value in result.data.items():
            run, column = key.split(":")
            if column == "t":
                continue
            times = result.data[f"{run}:t"]
            if column.startswith("pathwise."):  # theory.pathwise's arrays, cached beside the run
                with np.load(root / "cache" / run / "pathwise.npz") as stored:
                    all_times, stored_value = stored["t"], stored[column.split(".", 1)[1]]
            else:
                observables = Observables.load(root / "cache" / run)
                all_times, stored_value = observables.t, observables[column]
            rows = np.flatnonzero(np.isin(all_times, times))
            assert len(rows) == len(times), name
            np.testing.assert_array_equal(value, stored_value[rows], err_msg=f"{name}: {key}")


def test_a_second_build_only_redraws_and_corrupt_inputs_are_refused(built):
    root, _ = built
    trajectory = root / "cache" / "default-tiny" / "trajectory.npz"
    before = trajectory.stat().st_mtime_ns
    build_figures(root / "again", root / "cache", only=["fig06_embedding_norms"], tiny=True, report=lambda line: None)
    assert trajectory.stat().st_mtime_ns == before  # the cached run was reused
    trajectory.write_bytes(b"not an npz file")
    with pytest.raises(FigureInputError, match="delete the folder"):
        build_figures(root / "again", root / "cache", only=["fig01_loss_stages"], tiny=True, report=lambda line: None)
    with pytest.raises(ValueError, match="unknown figure"):
        build_figures(root / "again", root / "cache", only=["fig99"], tiny=True)
