"""Figure 5: the embedding trajectory W0(t) projected on its principal directions."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from figures.runs import default_run, observables_and_stages
from figures.style import T_LABEL, FigureResult, figure_style, save_figure

NAME = "fig05_embedding_trajectory"
COST = "the default flowsim run (d = 4): seconds, shared by figures 1-6"  # on a 2-core CPU; cached after the first build


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    run_dir = default_run(cache, tiny)
    observables, report = observables_and_stages(run_dir)
    t, projections = observables.t, observables["embedding_pc"]
    explained = observables.constants["embedding_pc_explained"]
    with figure_style():
        figure, (left, right) = plt.subplots(1, 2, figsize=(8.0, 3.4), constrained_layout=True)
        left.plot(projections[:, 0], projections[:, 1], color="black", marker="", lw=1)
        for label, index in (("t = 0", 0), ("end", len(t) - 1)):
            left.annotate(label, (projections[index, 0], projections[index, 1]), fontsize=7)
        for stage in ("focus", "dilution", "restart"):  # where each kind of stage first starts
            found = report.of(stage)
            if found:
                index = int(np.argmin(np.abs(t - found[0].t_start)))
                left.plot(projections[index, 0], projections[index, 1], ls="none", marker="o", color="0.4")
                left.annotate(f"{stage} starts", (projections[index, 0], projections[index, 1]), fontsize=6,
                              xytext=(4, -8), textcoords="offset points")
        left.set(xlabel=f"PC1 ({100 * explained[0]:.0f}% of the variance)", ylabel=f"PC2 ({100 * explained[1]:.0f}%)")
        keep = t > 0
        for n in range(projections.shape[1]):
            right.plot(t[keep], projections[keep, n], label=f"PC{n + 1}")
        right.set(xscale="log", xlabel=T_LABEL, ylabel="projection of W0(t) − mean")
        right.legend(fontsize=7)
    caption = ("The embedding trajectory on its principal directions: growth along PC1 (condensation), a "
               "contraction, then a burst along an orthogonal direction when a new singular direction opens.")
    return save_figure(figure, out, NAME, caption, {f"{run_dir.name}:t": t, f"{run_dir.name}:embedding_pc": projections})
