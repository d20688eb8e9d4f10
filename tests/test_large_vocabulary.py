"""A run at d = 256 end to end: its observables are folded and bounded, and every command downstream reads them
(`stages`, `compare-runs`, the summary figure; slow: `compare` and a sweep)."""

import csv
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from flowsim.cli import app
from flowsim.observe.observables import FOLDED_ATTENTION_TYPES, Observables

D = 256
ZIPF = [1.0 / (i + 1) for i in range(D)]
SETTINGS = [f"chain.pi={[p / sum(ZIPF) for p in ZIPF]}", "chain.lam=0.5", "init.eps=0.01", "model.m=8", "model.k=8",
            "time.t_end=600.0", "time.n_linear=60", "time.n_log=60"]


def invoke(*arguments):
    return CliRunner().invoke(app, list(arguments))


def sets(settings):
    return [item for setting in settings for item in ("--set", setting)]


@pytest.fixture(scope="module")
def large_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("d256") / "run"
    result = invoke("run", *sets(SETTINGS), "--out", str(run_dir), "--quiet")
    assert result.exit_code == 0, result.output
    return run_dir


def test_a_large_run_keeps_folded_attention_every_query_and_the_phases_it_took(large_run):
    observables = Observables.load(large_run)
    kept = FOLDED_ATTENTION_TYPES + 1
    assert observables["attention"].shape == (len(observables.t), kept, kept)
    assert observables["attention_entropy"].shape == (len(observables.t), D)  # what the detectors read: every query
    assert observables["sv_M"].shape[1] == 8 and len(observables.constants["attention_fold"]) == D
    np.testing.assert_allclose(observables["attention"].sum(axis=2), 1.0, atol=1e-12)  # folded rows stay laws
    with open(large_run / "observables.csv") as file:
        header = next(csv.reader(file))
    assert len(header) < 4 * D + kept**2 + 100  # no d x d column
    meta = json.loads((large_run / "meta.json").read_text())
    assert meta["status_name"] == "finished"
    assert {"observables_seconds", "stage_labels_seconds", "summary_figure_seconds", "peak_memory_mb"} <= set(meta["outputs"])
    stages = (large_run / "stages.txt").read_text()
    assert "condensation" in stages and "focus         q0" in stages


def test_stages_and_compare_runs_read_the_large_run(large_run, tmp_path):
    written = (large_run / "stages.txt").read_text().strip()
    labelled = invoke("stages", str(large_run))
    assert labelled.exit_code == 0 and written in labelled.output, labelled.output
    figure = tmp_path / "overlay.png"
    compared = invoke("compare-runs", str(large_run), "--figure", str(figure))
    assert compared.exit_code == 0 and figure.stat().st_size > 0, compared.output
    assert "finished" in compared.output


def test_the_summary_draws_the_most_frequent_queries_and_names_them(large_run):
    from flowsim.runs.plots import MAX_DRAWN_QUERIES, summary_figure
    from flowsim.observe.stages import detect_stages

    observables = Observables.load(large_run)
    figure = summary_figure(observables, stages=detect_stages(observables))
    entropy_axis = figure.axes[2]
    labels = [line.get_label() for line in entropy_axis.get_lines()]
    queries = [label for label in labels if label.startswith("query ")]
    assert len(queries) == MAX_DRAWN_QUERIES and queries[0] == "query 0 (π = 0.163)"
    assert f"the {MAX_DRAWN_QUERIES} most frequent of {D} queries" in entropy_axis.get_ylabel()
    legend = [text.get_text() for text in entropy_axis.get_legend().get_texts()]
    assert "focus (bar below 0, query's colour)" in legend and f"ln {D}: uniform over the types" in legend


def test_attention_kept_whole_at_a_large_d_is_refused_before_the_solve(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWSIM_MEMORY_BUDGET_GB", "0.1")
    result = invoke("run", *sets([*SETTINGS, f"observables.fold_d={D - 1}"]), "--out", str(tmp_path / "run"))
    assert result.exit_code == 2 and not (tmp_path / "run").exists(), result.output
    assert "observables.fold_d = 16" in result.output and f"{D} x {D} per save" in result.output
    folded = invoke("run", *sets([*SETTINGS, "time.t_end=1.0"]), "--out", str(tmp_path / "folded"), "--quiet")
    assert folded.exit_code == 0, folded.output  # the default folds, within the same budget


@pytest.mark.slow  # the theory's prediction at d = 256 and two more solves
def test_compare_and_a_sweep_read_the_large_run(large_run, tmp_path):
    compared = invoke("compare", str(large_run))
    assert compared.exit_code == 0, compared.output
    rows = json.loads((large_run / "compare.json").read_text())
    assert rows
    others = [setting for setting in SETTINGS if not setting.startswith("chain.lam")]
    swept = invoke("sweep", "--grid", "chain.lam=[0.4, 0.5]", *sets(others), "--out", str(tmp_path / "sweep"))
    assert swept.exit_code == 0, swept.output
    with open(tmp_path / "sweep" / "sweep.csv") as file:
        table = list(csv.DictReader(file))
    assert len(table) == 2 and all(float(row["end_condensation"]) > 0 for row in table)
    same = next(row for row in table if row["chain.lam"] == "0.5")  # the large run's own settings
    assert float(same["end_condensation"]) == pytest.approx(json.loads((large_run / "stages.json").read_text())
                                                            ["intervals"][0]["t_end"], rel=1e-9)


def test_the_fold_keys_help_states_the_defaults_the_code_uses():
    from flowsim.config import ObservablesConfig
    from flowsim.observe.observables import FULL_ATTENTION_MAX_D

    meaning = ObservablesConfig.model_fields["fold_d"].description
    assert f"whole up to d = {FULL_ATTENTION_MAX_D}, else {FOLDED_ATTENTION_TYPES}" in meaning
