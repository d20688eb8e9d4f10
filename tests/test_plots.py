"""flowsim.runs.plots: the run summary figure, with and without stage labels."""

import numpy as np
import pytest
from matplotlib.image import imread

from flowsim.observe.observables import Observables
from flowsim.runs.plots import plot_run_summary
from flowsim.observe.stages import detect_stages


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


def test_summary_axes_say_what_they_show():
    """An ODE run's time is t and its loss the population loss; a torch run says validation loss and lr × steps."""
    import matplotlib.pyplot as plt

    from flowsim.runs.plots import summary_figure

    flow = summary_figure(_observables())
    assert flow.axes[0].get_ylabel() == "population loss" and flow.axes[2].get_xlabel() == "t"
    run = summary_figure(_observables(), loss_label="validation loss", time_label="t = learning rate × steps")
    assert run.axes[0].get_ylabel() == "validation loss" and run.axes[2].get_xlabel() == "t = learning rate × steps"
    plt.close(flow)
    plt.close(run)


def test_the_overlay_draws_both_sides_of_every_series(tmp_path):
    """Loss, σ(W0) and each query's entropy, the run solid and the ODE dashed, each the data it was given."""
    import matplotlib.pyplot as plt

    from flowsim.runs.plots import overlay_figure, plot_overlay

    run, ode = _observables(), _observables()
    ode.columns["loss"] = ode.columns["loss"] - 0.05
    figure = overlay_figure([("run", run), ("ODE", ode)], names=["a", "b"])
    for axis, series in zip(figure.axes, (1, 2, 2)):  # loss; two singular values; two queries
        styles = [line.get_linestyle() for line in axis.get_lines()]
        assert styles.count("-") == series and styles.count("--") == series
    solid, dashed = figure.axes[0].get_lines()
    np.testing.assert_array_equal(solid.get_ydata(), run["loss"][run.t > 0])
    np.testing.assert_array_equal(dashed.get_ydata(), ode["loss"][ode.t > 0])
    assert [text.get_text() for text in figure.axes[2].get_legend().get_texts()] == ["query 'a'", "query 'b'"]
    assert [text.get_text() for text in figure.axes[1].get_legend().get_texts()] == ["σ0", "σ1"]  # each colour named
    assert figure.axes[1].get_ylabel().endswith("run solid, ODE dashed")
    plt.close(figure)
    assert imread(plot_overlay([("run", run), ("ODE", ode)], tmp_path / "overlay.png")).shape[0] > 200
    with pytest.raises(ValueError, match="1 to 4 runs, got 5"):
        overlay_figure([("run", run)] * 5)


def test_the_summary_draws_the_bayes_loss_as_a_line_and_the_title_names_the_model():
    import matplotlib.pyplot as plt

    from flowsim.config import load_config
    from flowsim.assemble import bayes_loss, model_description, prepare
    from flowsim.runs.plots import summary_figure

    figure = summary_figure(_observables(), bayes_loss=0.25)
    line = [line for line in figure.axes[0].get_lines() if line.get_linestyle() == ":"]
    assert len(line) == 1 and np.all(np.asarray(line[0].get_ydata()) == 0.25)
    assert "Bayes loss 0.25" in [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    plt.close(figure)
    two_layer = load_config(None, ["model.kind='two_layer'", "model.ffn='mlp'", "model.m=4"])
    assert model_description(two_layer) == "two-layer Transformer (m = 4, k = 8, ffn = mlp), mean-field loss"
    induction = load_config(None, ["task.kind='induction'", "model.kind='two_layer'", "loss.kind='finite'", "loss.s=6"])
    assert model_description(induction).startswith("positional two-layer Transformer")
    assert bayes_loss(induction, prepare(induction).chain) == prepare(induction).chain.bayes_loss
    uniform_start = load_config(None, ["chain.start='uniform'", "loss.kind='finite'", "loss.s=4"])
    assert bayes_loss(uniform_start, prepare(uniform_start).chain) is None  # not the entropy rate there


def test_a_text_runs_summary_names_its_words_draws_four_sigmas_and_keeps_its_bars_off_the_curves():
    """Guards issue 84, item 7: queries were 'query 0 (π=0.7)' beside saved words, 16 σs shared 10 colours, and ten
    queries' focus bands stacked over the curves. Now the words label the queries, σ0-σ3 are drawn, and each focus is
    a bar in its query's strip below 0 (no band over the entropy panel)."""
    import matplotlib.pyplot as plt

    from flowsim.runs.plots import summary_figure

    observables = _observables()
    observables.columns["sv_W0"] = np.column_stack([observables["sv_W0"][:, 0] * (1 + 0.1 * i) for i in range(16)])
    observables.constants["type_names"] = np.array(["the", "other"])
    stages = detect_stages(observables)
    assert [i for i in stages.intervals if i.stage == "focus"]
    figure = summary_figure(observables, stages=stages)
    labels = [line.get_label() for line in figure.axes[2].get_lines()]
    assert "query 'the' 0 (π = 0.7)" in labels and "query 'other' 1 (π = 0.3)" in labels
    assert [line.get_label() for line in figure.axes[1].get_lines()] == ["σ0", "σ1", "σ2", "σ3"]
    assert not figure.axes[2].patches  # no band over the curves
    bars = [line for line in figure.axes[2].get_lines() if line.get_label().startswith("_") and max(line.get_ydata()) < 0]
    assert bars and figure.axes[2].get_ylim()[0] < min(min(bar.get_ydata()) for bar in bars)
    legend = [text.get_text() for text in figure.axes[2].get_legend().get_texts()]
    assert "focus (bar below 0, query's colour)" in legend
    plt.close(figure)


def test_the_phase_diagram_says_its_seeds_and_horizon():
    import matplotlib.pyplot as plt

    from flowsim.runs.plots import phase_diagram_figure

    rows = [{"init.eps": eps, "seed": seed, "status": "finished", "onset_focus": 90.0 + seed, "end_condensation": 12.0,
             "onset_dilution": None, "onset_restart": None, "config": {"time": {"t_end": 1000.0}}}
            for eps in (1e-3, 1e-2) for seed in (0, 1)]
    figure = phase_diagram_figure(rows, ["init.eps"])
    assert figure._suptitle.get_text() == "2 seed(s) per cell (init.seed = 0..1), each run to t = 1000"
    plt.close(figure)
