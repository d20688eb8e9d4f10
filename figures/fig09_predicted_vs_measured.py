"""Figure 9: predicted against measured stage onsets across ε (from ``flowsim compare``)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from figures.runs import onset_run
from figures.style import FigureResult, figure_style, save_figure
from flowsim.predictions import COMPARE_JSON, compare_run

NAME = "fig09_predicted_vs_measured"
COST = "5 flowsim runs at d = 6 (one per ε) and the theory's prediction of each: under a minute each"  # on a 2-core CPU; cached after the first build
EPSILONS = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6)
EPSILONS_TINY = (1e-3,)
LAMBDA = 0.5  # the default chain
ROWS = (("condensation", None), ("focus", 0))


def compare_rows(run_dir: Path) -> list[dict]:
    """The run's compare.json rows, computing them (``flowsim compare``) when missing."""
    if not (run_dir / COMPARE_JSON).is_file():
        compare_run(run_dir)
    return json.loads((run_dir / COMPARE_JSON).read_text())["rows"]


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    epsilons = EPSILONS_TINY if tiny else EPSILONS
    data = {}
    with figure_style():
        figure, axis = plt.subplots(figsize=(6.0, 3.6))
        series = {row: ([], []) for row in ROWS}
        for eps in epsilons:
            run_dir = onset_run(cache, eps, LAMBDA, tiny)
            name = run_dir.name
            rows = compare_rows(run_dir)
            for stage, query in ROWS:
                row = next(r for r in rows if r["stage"] == stage and r["query"] == query)
                series[(stage, query)][0].append(row["predicted"])
                series[(stage, query)][1].append(np.nan if row["measured"] is None else row["measured"])
                data[f"{name}:compare.{stage}"] = np.array([row["predicted"], np.nan if row["measured"] is None else row["measured"]])
        for (stage, query), (predicted, measured) in series.items():
            label = stage + (f" q{query}" if query is not None else "")
            line, = axis.plot(epsilons, predicted, marker="", label=f"{label}: predicted")
            axis.plot(epsilons, measured, ls="none", marker="o", color=line.get_color(), label=f"{label}: measured")
        axis.set(xscale="log", xlabel="initial scale ε", ylabel="onset time t (gradient-flow time)")
        axis.invert_xaxis()
        axis.legend(fontsize=7)
    caption = ("Predicted (lines, theory/) against measured (dots, detectors) onsets of condensation and of the "
               "frequent query's focus: both grow like log(1/ε), and their relative error shrinks as ε → 0.")
    return save_figure(figure, out, NAME, caption, data)
