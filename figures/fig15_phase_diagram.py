"""Figure 15: stage onset times over (ε, λ) from a sweep of flowsim runs."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from figures.runs import observables_and_stages, onset_run
from figures.style import FigureResult, figure_style, save_figure
from flowsim.observe.stages import StageThresholds

NAME = "fig15_phase_diagram"
COST = "20 flowsim runs at d = 4 (4 ε × 5 λ): seconds each, 4 of them shared with figure 9"  # on a 2-core CPU; cached after the first build
EPSILONS = (1e-2, 1e-3, 1e-4, 1e-5)
LAMBDAS = (0.1, 0.3, 0.5, 0.7, 0.9)
EPSILONS_TINY, LAMBDAS_TINY = (1e-3,), (0.5, 0.8)  # the runs of the tiny figures 7 and 9


def onsets(report) -> tuple[float, float]:
    """(end of condensation, onset of the first focus of query 0); NaN when not seen."""
    times = report.first_time("condensation"), report.first_time("focus", query=0)
    return tuple(np.nan if time is None else time for time in times)


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    epsilons, lambdas = (EPSILONS_TINY, LAMBDAS_TINY) if tiny else (EPSILONS, LAMBDAS)
    grid = np.full((2, len(epsilons), len(lambdas)), np.nan)
    horizon = 0.0
    data = {}
    for i, eps in enumerate(epsilons):
        for j, lam in enumerate(lambdas):
            run_dir = onset_run(cache, eps, lam, tiny)
            name = run_dir.name
            observables, report = observables_and_stages(run_dir)
            grid[:, i, j] = onsets(report)
            horizon = max(horizon, float(observables.t[-1]))
            data[f"{name}:onsets"] = grid[:, i, j].copy()
    dated_to = horizon / 10 ** StageThresholds().lookahead_decades  # the detectors date events up to here
    with figure_style():
        figure, axes = plt.subplots(1, 2, figsize=(8.5, 3.4))
        for axis, values, title in zip(axes, grid, ("condensation ends", "query 0 focuses")):
            image = axis.imshow(values, cmap="Greys", origin="lower", aspect="auto")
            axis.set(xticks=range(len(lambdas)), xticklabels=[f"{lam:g}" for lam in lambdas], xlabel="λ (P = λI + (1-λ)1π^T)",
                     yticks=range(len(epsilons)), yticklabels=[f"{eps:g}" for eps in epsilons], ylabel="initial scale ε",
                     title=f"t at which {title}")
            axis.grid(False)
            for (r, c), value in np.ndenumerate(values):
                if np.isnan(value):  # not dated within the horizon: hatched, not a shade of the scale
                    axis.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, facecolor="white", edgecolor="0.5", hatch="///", lw=0))
                axis.text(c, r, f"> {dated_to:.0f}" if np.isnan(value) else f"{value:.0f}", ha="center", va="center", fontsize=7,
                          color="white" if np.isfinite(value) and value > np.nanmean(values) else "black",
                          backgroundcolor="white" if np.isnan(value) else "none")
            figure.colorbar(image, ax=axis, label="gradient-flow time t")
        figure.suptitle(f"one run per cell (init.seed = 0), each to t = {horizon:.0f}: events dated up to t = {dated_to:.0f}",
                        fontsize="small")
    caption = ("Onset times over (ε, λ): condensation depends on ε only (log(1/ε)/μ1, μ1 independent of λ); "
               "the frequent query's focus comes later for smaller ε and for smaller λ (hatched: none dated by the "
               f"horizon t = {horizon:.0f}, where the detectors date events up to t = {dated_to:.0f}, 0.15 decade before it).")
    return save_figure(figure, out, NAME, caption, data)
