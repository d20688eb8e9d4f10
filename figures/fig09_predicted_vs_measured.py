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
        figure, (axis, error_axis) = plt.subplots(1, 2, figsize=(10.0, 3.6), constrained_layout=True)
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
        worst = 0.0
        for (stage, query), (predicted, measured) in series.items():
            label = "condensation's end" if stage == "condensation" else f"{stage} onset of q{query}"
            line, = axis.plot(epsilons, predicted, marker="", label=f"{label}: predicted")
            axis.plot(epsilons, measured, ls="none", marker="o", color=line.get_color(), label=f"{label}: measured")
            error = np.abs(np.asarray(predicted, dtype=float) - np.asarray(measured)) / np.asarray(measured)
            worst = max(worst, float(np.nanmax(error)))
            error_axis.plot(epsilons, np.maximum(error, 1e-6), marker="o", color=line.get_color(),
                            label=f"{label}: |predicted − measured| / measured")
        axis.set(xscale="log", xlabel="initial scale ε", ylabel="stage time t (gradient-flow time)")
        error_axis.set(xscale="log", yscale="log", xlabel="initial scale ε",
                       ylabel="relative error of the prediction\n(floored at 1e-6)")
        for panel in (axis, error_axis):
            panel.invert_xaxis()
            panel.legend(fontsize=7)
    caption = ("Predicted (lines: the theory's reduced flows) against measured (dots: the detectors on the exact flow) "
               "times of condensation's end and of the frequent query's focus onset across ε (left), and their "
               f"relative error (right, at most {100 * worst:.2g}%: the reduced flows follow the exact flow almost by "
               "construction): both times grow like log(1/ε).")
    return save_figure(figure, out, NAME, caption, data)
