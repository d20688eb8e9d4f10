"""Figure 1: the population loss of the default run against t, the detected stages shaded."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from figures.runs import default_run, observables_and_stages
from figures.style import T_LABEL, FigureResult, figure_style, save_figure, shade_stages

NAME = "fig01_loss_stages"
COST = "the default flowsim run (d = 4): seconds, shared by figures 1-6"  # on a 2-core CPU; cached after the first build


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    run_dir = default_run(cache, tiny)
    observables, report = observables_and_stages(run_dir)
    keep = observables.t > 0
    t, loss = observables.t[keep], observables["loss"][keep]
    with figure_style():
        figure, axis = plt.subplots(figsize=(6.5, 3.2))
        shade_stages(axis, report, t[-1], ("condensation", "plateau"))
        axis.plot(t, loss, marker="", label="population loss L(θ(t))")
        placed: list[float] = []
        for interval in report.intervals[:12]:  # the first onsets; later ones crowd the axis
            if interval.stage in ("focus", "dilution", "restart"):
                label = f"{interval.stage} " + (f"q{interval.query}" if interval.query is not None else f"σ{interval.direction}")
                axis.axvline(interval.t_start, color="0.3", lw=0.6, ls=":")
                # labels of onsets closer than 5% in log time go one row lower instead of on top of each other
                row = sum(abs(np.log(interval.t_start / other)) < 0.05 for other in placed)
                placed.append(interval.t_start)
                axis.text(interval.t_start, 0.98 - 0.3 * row, label, rotation=90, fontsize=6, va="top", ha="right",
                          transform=axis.get_xaxis_transform())
        axis.set_xscale("log")
        axis.set_xlabel(T_LABEL)
        axis.set_ylabel("population loss (nats)")
        axis.legend(loc="lower left")
    caption = ("Loss of the default run against t: condensation (shaded) drops it from log d, each later stage "
               "(dotted lines: focus, dilution, restart onsets) starts a new descent.")
    return save_figure(figure, out, NAME, caption, {f"{run_dir.name}:t": t, f"{run_dir.name}:loss": loss})
