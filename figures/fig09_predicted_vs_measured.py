"""Figure 9: both tiers of the theory against measured stage times across ε (from ``flowsim compare``)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from figures.runs import onset_run
from figures.style import FigureResult, figure_style, save_figure
from flowsim.runs.predictions import COMPARE_JSON, compare_run

NAME = "fig09_predicted_vs_measured"
COST = "5 flowsim runs at d = 6 (one per ε) and the theory's prediction of each: under a minute each"  # on a 2-core CPU; cached after the first build
EPSILONS = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6)
EPSILONS_TINY = (1e-3,)
LAMBDA = 0.5  # the default chain
ROWS = (("condensation", None), ("focus", 0))


def compare_rows(run_dir: Path) -> list[dict]:
    """The run's compare.json rows, computing them (``flowsim compare``) when missing or written before the formula tier."""
    path = run_dir / COMPARE_JSON
    if not path.is_file() or any("formula" not in row for row in json.loads(path.read_text())["rows"]):
        compare_run(run_dir)
    return json.loads(path.read_text())["rows"]


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    epsilons = EPSILONS_TINY if tiny else EPSILONS
    data = {}
    with figure_style():
        figure, (axis, error_axis) = plt.subplots(1, 2, figsize=(10.0, 3.6), constrained_layout=True)
        series = {row: ([], [], []) for row in ROWS}
        number = lambda value: np.nan if value is None else value  # noqa: E731
        for eps in epsilons:
            run_dir = onset_run(cache, eps, LAMBDA, tiny)
            name = run_dir.name
            rows = compare_rows(run_dir)
            for stage, query in ROWS:
                row = next(r for r in rows if r["stage"] == stage and r["query"] == query)
                for values, key in zip(series[(stage, query)], ("formula", "predicted", "measured")):
                    values.append(number(row[key]))
                data[f"{name}:compare.{stage}"] = np.array([number(row["formula"]), number(row["predicted"]),
                                                            number(row["measured"])])
        worst = {"formula": 0.0, "reduced": 0.0}
        for (stage, query), (formula, predicted, measured) in series.items():
            label = "condensation's end" if stage == "condensation" else f"first focus of q{query}"
            line, = axis.plot(epsilons, predicted, ls="-", marker="", label=f"{label}: reduced flows")
            colour = line.get_color()
            axis.plot(epsilons, formula, ls="--", marker="", color=colour, label=f"{label}: formula")
            axis.plot(epsilons, measured, ls="none", marker="o", color=colour, label=f"{label}: measured")
            for tier, times, style in (("reduced", predicted, "-"), ("formula", formula, "--")):
                error = np.abs(np.asarray(times, dtype=float) - np.asarray(measured)) / np.asarray(measured)
                worst[tier] = max(worst[tier], float(np.nanmax(error)))
                error_axis.plot(epsilons, np.maximum(error, 1e-6), ls=style, marker="o" if tier == "reduced" else "s",
                                color=colour, label=f"{label}: {tier}")
        axis.set(xscale="log", xlabel="initial scale ε", ylabel="stage time t (gradient-flow time)")
        error_axis.set(xscale="log", yscale="log", xlabel="initial scale ε",
                       ylabel="|predicted − measured| / measured\n(floored at 1e-6)")
        for panel in (axis, error_axis):
            panel.invert_xaxis()
            panel.legend(fontsize=7)
    caption = ("Predicted against measured (dots: the detectors on the exact flow) times of condensation's end and of the "
               "frequent query's first focus across ε (left; solid: the theory's reduced flows, dashed: its formula tier, "
               "closed forms with no flow integrated), and each tier's relative error (right: the reduced flows at most "
               f"{100 * worst['reduced']:.2g}%, as they follow the exact flow almost by construction; the formulas at most "
               f"{100 * worst['formula']:.2g}%, falling as ε shrinks, since their leading terms log(1/ε)/μ1 and "
               "(1/μ1 + 1/μ2) log(1/ε) are exact and their O(1) parts approximate).")
    return save_figure(figure, out, NAME, caption, data)
