"""The figure modules on a tiny configuration: files written, plotted data equal to the
run directory's arrays, cached runs reused, corrupt inputs refused clearly."""

import importlib
import json
import re
import shutil

import numpy as np
import pytest

from figures import build_figures, figure_names
from figures.runs import FigureInputError, default_run
from flowsim.observe.observables import Observables

try:
    from flowsim.bridge.data import default_data_dir
except ImportError:  # no torch: the figures that train torch models are left out
    default_data_dir = None

TEXT_FIGURE = "fig13_text_attention"  # reads the WikiText-2 and TinyStories files
CYCLE_FIGURE = "fig18_text_cycle"  # so does this one
TORCH_FIGURES = {TEXT_FIGURE, CYCLE_FIGURE, "fig14_sgd_against_the_flow", "fig16_gpt_study"}
HAS_CORPORA = default_data_dir is not None and default_data_dir() is not None
AVAILABLE = [name for name in figure_names()
             if name not in TORCH_FIGURES or (default_data_dir is not None and (name not in (TEXT_FIGURE, CYCLE_FIGURE, "fig16_gpt_study") or HAS_CORPORA))]
# the tiny set's costliest (an induction run, two-layer runs, torch on both corpora): built by a slow check alone
SLOW_FIGURES = [name for name in ("fig10_premature_specialisation", "fig11_pathwise_factors", TEXT_FIGURE, "fig17_induction_task",
                                   CYCLE_FIGURE)
                if name in AVAILABLE]
BUILT = [name for name in AVAILABLE if name not in SLOW_FIGURES]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("figures")
    results = build_figures(root / "out", root / "cache", only=BUILT, tiny=True, report=lambda line: None)
    return root, {result.name: result for result in results}


def test_every_figure_is_written_with_its_caption(built):
    root, results = built
    assert sorted(results) == sorted(BUILT) and len(AVAILABLE) >= (18 if HAS_CORPORA else 15 if default_data_dir is not None else 14)
    assert_written_with_captions(root, results)


@pytest.mark.slow
def test_the_slow_figures_are_written_with_their_captions_and_the_run_directorys_data(tmp_path):
    results = {result.name: result for result in build_figures(tmp_path / "out", tmp_path / "cache", only=SLOW_FIGURES,
                                                                  tiny=True, report=lambda line: None)}
    assert sorted(results) == sorted(SLOW_FIGURES)
    assert_written_with_captions(tmp_path, results)
    assert_plotted_data_is_the_run_directorys(tmp_path, results)


def assert_written_with_captions(root, results):
    """Each figure's PNG, PDF and caption file, and its manifest entry naming runs that are in the cache."""
    manifest = json.loads((root / "out" / "manifest.json").read_text())
    for name, result in results.items():
        assert result.png.stat().st_size > 10_000 and result.pdf.stat().st_size > 1_000, name
        assert (root / "out" / f"{name}.txt").read_text().strip() == result.caption
        assert manifest["figures"][name]["caption"] == result.caption
        assert all((root / "cache" / run).is_dir() for run in manifest["figures"][name]["runs"]), name


def test_plotted_data_is_the_run_directorys(built):
    assert_plotted_data_is_the_run_directorys(*built)


def assert_plotted_data_is_the_run_directorys(root, results):
    """Every plotted series equals the run directory's arrays (or compare.json's and stages.json's stage times)."""
    for name, result in results.items():
        assert result.data, name
        for key, value in result.data.items():
            run, column = key.split(":")
            if column == "t":
                continue
            if column.startswith("compare.") or column == "onsets":  # stage times, not time series
                check_stage_times(root / "cache" / run, column, value)
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


def check_stage_times(run_dir, column, value):
    """Figure 9's (formula, reduced, measured) against compare.json; figure 15's onsets against stages.json."""
    if column.startswith("compare."):
        rows = json.loads((run_dir / "compare.json").read_text())["rows"]
        stage, direction = re.fullmatch(r"([a-z]+)(\d*)", column.split(".", 1)[1]).groups()  # e.g. restart1: σ1's
        row = next(r for r in rows if r["stage"] == stage and r["query"] in (None, 0)
                   and r["direction"] == (int(direction) if direction else None))
        number = lambda x: np.nan if x is None else x  # noqa: E731
        np.testing.assert_array_equal(value, [number(row["formula"]), number(row["predicted"]), number(row["measured"])])
        return
    intervals = json.loads((run_dir / "stages.json").read_text())["intervals"]
    condensation = [i["t_end"] for i in intervals if i["stage"] == "condensation"]
    focus = [i["t_start"] for i in intervals if i["stage"] == "focus" and i["query"] == 0]
    expected = [condensation[0] if condensation and condensation[0] else np.nan, focus[0] if focus else np.nan]
    np.testing.assert_allclose(value, expected, rtol=1e-12)


def test_a_second_build_only_redraws_and_corrupt_inputs_are_refused(built, tmp_path):
    root, _ = built
    trajectory = default_run(root / "cache", tiny=True) / "trajectory.npz"
    before = trajectory.stat().st_mtime_ns
    build_figures(tmp_path / "again", root / "cache", only=["fig06_embedding_norms"], tiny=True, report=lambda line: None)
    assert trajectory.stat().st_mtime_ns == before  # the cached run was reused
    copied = tmp_path / "cache" / trajectory.parent.name  # damage a copy: the shared cache stays whole
    shutil.copytree(trajectory.parent, copied)
    (copied / "trajectory.npz").write_bytes(b"not an npz file")
    with pytest.raises(FigureInputError, match=f"{copied}.*delete the folder"):
        build_figures(tmp_path / "again", tmp_path / "cache", only=["fig01_loss_stages"], tiny=True, report=lambda line: None)
    with pytest.raises(ValueError, match="unknown figure"):
        build_figures(tmp_path / "again", root / "cache", only=["fig99"], tiny=True)


def test_a_figure_without_its_inputs_is_named_and_the_others_are_still_built(built, tmp_path, monkeypatch):
    """Without the corpora (and without torch) the text figure is named and the others built."""
    root, _ = built
    monkeypatch.setenv("FLOWSIM_DATA_DIR", str(tmp_path / "no-corpora-here"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "no-user-data"))  # nor in the rest of the search order
    import flowsim.corpora
    monkeypatch.setattr(flowsim.corpora, "repository_data_dir", lambda: tmp_path / "no-repository-data")
    run = default_run(root / "cache", tiny=True)
    shutil.copytree(run, tmp_path / "cache" / run.name)
    reason = "no-corpora-here" if default_data_dir is not None else "bridge extra"
    with pytest.raises(FigureInputError, match=f"1 figure.*{TEXT_FIGURE}.*{reason}"):
        build_figures(tmp_path / "out", tmp_path / "cache", only=[TEXT_FIGURE, "fig06_embedding_norms"], tiny=True,
                      report=lambda line: None)
    assert (tmp_path / "out" / "fig06_embedding_norms.png").stat().st_size > 10_000


def test_an_interrupted_run_draws_no_figure_and_the_next_build_completes_it(built, tmp_path, monkeypatch):
    """A stop request during a figure's run (SIGINT) ends the build with KeyboardInterrupt before anything is drawn
    from the cut-short run; the same build afterwards runs it to its end and draws the figure from that."""
    from flowsim.common.interrupts import StopRequest
    from flowsim.runs.rundir import read_meta

    root, _ = built
    cache = tmp_path / "cache"
    with monkeypatch.context() as patched:
        patched.setattr(StopRequest, "__call__", lambda self: True)  # as if SIGINT came at the first poll
        with pytest.raises(KeyboardInterrupt):
            build_figures(tmp_path / "out", cache, only=["fig06_embedding_norms"], tiny=True, report=lambda line: None)
    assert not (tmp_path / "out" / "fig06_embedding_norms.png").exists()
    assert [read_meta(run)["status_name"] for run in cache.iterdir()] == ["interrupted"]
    build_figures(tmp_path / "out", cache, only=["fig06_embedding_norms"], tiny=True, report=lambda line: None)
    assert (tmp_path / "out" / "fig06_embedding_norms.png").stat().st_size > 10_000
    assert [read_meta(run)["status_name"] for run in cache.iterdir()] == ["finished"]


def test_the_list_names_every_figure_with_its_last_build_time(built, tmp_path):
    """`flowsim figures --list`: a line per figure, its name first (what --only takes), the seconds of its last build
    from the manifest, or that it was not built there."""
    from typer.testing import CliRunner

    from flowsim.cli import app

    root, _ = built
    manifest = json.loads((root / "out" / "manifest.json").read_text())["figures"]
    result = CliRunner().invoke(app, ["figures", "--list", "--out", str(root / "out")])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == figure_names()
    for line in lines:
        name = line.split(":")[0]
        expected = f"({manifest[name]['seconds']:.1f} s on its last build in" if name in manifest else "(not built in"
        assert expected in line, line
        module = importlib.import_module(f"figures.{name}")
        assert f". Computes {module.COST} (" in line and not line.split(". Computes")[0].endswith(","), line  # whole sentence
    empty = CliRunner().invoke(app, ["figures", "--list", "--out", str(tmp_path / "none")])
    assert all("not built in" in line for line in empty.output.strip().splitlines()) and not (tmp_path / "none").exists()
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "manifest.json").write_text("{not json")
    refused = CliRunner().invoke(app, ["figures", "--list", "--out", str(damaged)])
    assert refused.exit_code == 2 and "manifest.json is damaged (not valid JSON" in refused.output, refused.output


def test_a_finished_run_beside_the_cache_is_read_instead_of_computed(built, tmp_path, monkeypatch):
    """`flowsim run` writes runs/NAME-TIMESTAMP beside the figures' cache runs/figures: a run of exactly the
    configuration a figure needs is read from there; one of another configuration is not."""
    import figures.runs as runs

    root, _ = built
    cached = default_run(root / "cache", tiny=True)
    mine = tmp_path / "runs" / "default-20261204-120000"
    shutil.copytree(cached, mine)
    other = tmp_path / "runs" / "another"
    shutil.copytree(cached, other)
    (other / "config.toml").write_text((other / "config.toml").read_text().replace("t_end = 150.0", "t_end = 140.0"))

    def no_computing(*args, **kwargs):
        raise AssertionError("the run was computed again")

    monkeypatch.setattr(runs, "execute_run", no_computing)
    assert default_run(tmp_path / "runs" / "figures", tiny=True) == mine
    shutil.rmtree(mine)
    with pytest.raises(AssertionError, match="computed again"):  # the other configuration is no match
        default_run(tmp_path / "runs" / "figures", tiny=True)


def test_a_figure_that_builds_for_long_says_it_is_at_work(tmp_path, monkeypatch):
    """Guards issue 84, item 3: fig07 was silent for 89 s while its runs ran; a figure being built now says its seconds
    every HEARTBEAT_SECONDS (10 s; here shortened)."""
    import threading
    from types import SimpleNamespace

    import figures
    from figures import fig07_transition_matrices

    said, two_beats = [], threading.Event()

    def slow_build(cache, out, tiny=False):
        two_beats.wait(5.0)
        return SimpleNamespace(caption="a caption", data={})

    def report(line):
        said.append(line)
        if sum("so far" in line for line in said) >= 2:
            two_beats.set()

    monkeypatch.setattr(figures, "HEARTBEAT_SECONDS", 0.05)
    monkeypatch.setattr(fig07_transition_matrices, "build", slow_build)
    build_figures(tmp_path / "out", tmp_path / "cache", only=["fig07_transition_matrices"], report=report)
    assert said[0].endswith("figure 1 of 1") and said[1] == "fig07_transition_matrices: building, 0 s so far", said
    assert said[-1].startswith("fig07_transition_matrices: ") and said[-1].endswith("a caption"), said


@pytest.mark.slow
def test_a_build_says_which_figure_it_is_building_and_every_band_and_line_is_named(built, tmp_path):
    """`flowsim figures` names each figure (and what it computes) before building it; fig02 names every panel's lines,
    fig04 the entropy line and each shaded stage in one figure legend."""
    import matplotlib.pyplot as plt

    from figures import fig02_singular_values, fig04_attention_entropy

    root, _ = built
    said = []
    build_figures(tmp_path / "out", root / "cache", only=["fig06_embedding_norms"], tiny=True, report=said.append)
    assert said[0] == (f"fig06_embedding_norms: building ({importlib.import_module('figures.fig06_embedding_norms').COST}); "
                       "figure 1 of 1")
    shown = []
    real_save = fig02_singular_values.save_figure

    def keep(figure, *arguments):
        shown.append(figure)
        return real_save(figure, *arguments)

    for module in (fig02_singular_values, fig04_attention_entropy):
        module.save_figure = keep
        try:
            module.build(root / "cache", tmp_path / "again", tiny=True)
        finally:
            module.save_figure = real_save
    singular, entropy = shown
    for axis in singular.axes:
        labels = [text.get_text() for text in axis.get_legend().get_texts()]
        assert labels[:1] == ["condensation (detected)"] and "σ0" in labels and "σ1" in labels, (axis.get_title(), labels)
    labels = [text.get_text() for text in entropy.legends[0].get_texts()]
    assert "attention entropy of the query (nats)" in labels and "focus (detected)" in labels, labels
    for figure in shown:
        plt.close(figure)


def test_a_text_figures_title_line_is_read_from_the_runs_config_and_a_foreign_config_is_named(tmp_path):
    from figures.bridge_runs import training_summary

    (tmp_path / "config.toml").write_text("[data]\nvocab_size = 255\nbatch_size = 256\ns = 64\n"
                                          "[optim]\nlr = 0.125\nsteps = 3200\n")
    assert training_summary(tmp_path) == "d = 256, SGD lr 0.125, 3200 steps, batch 256 × 64 tokens"
    (tmp_path / "config.toml").write_text("[data]\nvocab_size = 'many'\n")
    with pytest.raises(FigureInputError, match=r"config.toml: not a bridge run's config .*expected its \[data\]"):
        training_summary(tmp_path)
