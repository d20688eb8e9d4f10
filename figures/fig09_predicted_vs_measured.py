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
COST = "5 flowsim runs at d = 4 (one per ε) and the theory's prediction of each: under a minute each"  # on a 2-core CPU; cached after the first build
EPSILONS = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6)
EPSILONS_TINY = (1e-3,)
LAMBDA = 0.5  # the default chain
ROWS = (("condensation", None, None), ("focus", 0, None), ("restart", None, 1))  # (stage, query, direction)


def compare_rows(run_dir: Path) -> list[dict]:
    """The run's compare.json rows, computing them (``flowsim compare``) when missing or written before the formula tier
    had σ1's restart (the default chain has a formula for it)."""
    path = run_dir / COMPARE_JSON
    stale = lambda rows: any("formula" not in row or (row["stage"], row["direction"]) == ("restart", 1)  # noqa: E731
                             and row["formula"] is None for row in rows)
    if not path.is_file() or stale(json.loads(path.read_text())["rows"]):
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
            for stage, query, direction in ROWS:
                row = next(r for r in rows if (r["stage"], r["query"], r["direction"]) == (stage, query, direction))
                for values, key in zip(series[(stage, query, direction)], ("formula", "predicted", "measured")):
                    values.append(number(row[key]))
                data[f"{name}:compare.{stage}{'' if direction is None else direction}"] = np.array(
                    [number(row["formula"]), number(row["predicted"]), number(row["measured"])])
        worst = {"formula": 0.0, "reduced": 0.0}
        labels = {"condensation": "condensation's end", "focus": "first focus of q0", "restart": "σ1's restart"}
        for (stage, query, direction), (formula, predicted, measured) in series.items():
            label = labels[stage]
            line, = axis.plot(epsilons, predicted, ls="-", marker="", label=f"{label}: reduced flows")
            colour = line.get_color()
            axis.plot(epsilons, formula, ls="--", marker="", color=colour, label=f"{label}: formula")
            axis.plot(epsilons, measured, ls="none", marker="o", color=colour, label=f"{label}: measured")
            for tier, times, style in (("reduced", predicted, "-"), ("formula", formula, "--")):
                error = np.abs(np.asarray(times, dtype=float) - np.asarray(measured)) / np.asarray(measured)
                if not np.all(np.isnan(error)):  # a short run (--tiny) can end before σ1's restart
                    worst[tier] = max(worst[tier], float(np.nanmax(error)))
                error_axis.plot(epsilons, np.maximum(error, 1e-6), ls=style, marker="o" if tier == "reduced" else "s",
                                color=colour, label=f"{label}: {tier}")
        top = np.nanmax(np.concatenate([np.asarray(values, dtype=float) for triple in series.values() for values in triple]))
        # headroom above the lines for the legend, which sits over the small-ε side where they are lowest
        axis.set(xscale="log", xlabel="initial scale ε", ylabel="stage time t (gradient-flow time)", ylim=(0, 1.8 * top))
        error_axis.set(xscale="log", yscale="log", xlabel="initial scale ε",
                       ylabel="|predicted − measured| / measured\n(floored at 1e-6)")
        for panel in (axis, error_axis):
            panel.invert_xaxis()
            panel.legend(fontsize=7)
    caption = ("Predicted against measured (dots: the detectors on the exact flow) times of condensation's end, of the "
               "frequent query's first focus and of σ1's restart across ε (left; solid: the theory's reduced flows, dashed: "
               "its formula tier, closed forms with no flow integrated), and each tier's relative error (right: the reduced "
               f"flows at most {100 * worst['reduced']:.2g}%, as they follow the exact flow almost by construction; the "
               f"formulas at most {100 * worst['formula']:.2g}%, falling as ε shrinks, since their leading terms "
               "log(1/ε)/μ1 and (1/μ1 + 1/μ2) log(1/ε) (the restart's too) are exact and their O(1) parts approximate).")
    return save_figure(figure, out, NAME, caption, data)
