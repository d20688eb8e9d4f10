"""flowsim.plots: the run summary figure, with and without stage labels."""

import numpy as np
from matplotlib.image import imread

from flowsim.observables import Observables
from flowsim.plots import plot_run_summary
from flowsim.stages import detect_stages


def _observables():
    t = np.concatenate([[0.0], np.geomspace(0.1, 100.0, 200)])
    sv = np.column_stack([1e-3 + np.tanh(t / 10), 1e-3 + 0 * t])
    entropy = np.column_stack([np.log(2) - 0.6 * np.tanh(np.maximum(t - 40, 0) / 5), np.full_like(t, np.log(2))])
    attention_scale = np.column_stack([1e-3 + 0 * t, 1e-3 + 0 * t])
    columns = {"loss": np.log(2) - 0.3 * np.tanh(t / 10), "sv_W0": sv, "sv_W1": sv, "sv_W_Q": attention_scale,
               "sv_W_K": attention_scale, "attention_entropy": entropy}
    return Observables(t=t, columns=columns, constants={"pi": np.array([0.7, 0.3])})


def test_summary_figure_is_drawn_with_and_without_stages(tmp_path):
    observables = _observables()
    plain = plot_run_summary(observables, tmp_path / "plain.png", title="synthetic")
    labelled = plot_run_summary(observables, tmp_path / "labelled.png", title="synthetic", stages=detect_stages(observables))
    for path in (plain, labelled):
        image = imread(path)
        assert image.shape[0] > 200 and image.shape[1] > 200
    # the stage shading changes the picture
    assert not np.array_equal(imread(plain), imread(labelled))
