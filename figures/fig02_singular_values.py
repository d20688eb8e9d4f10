"""Figure 2: singular values of W0, W1, W_Q, W_K against t (log time)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from figures.runs import default_run, observables_and_stages
from figures.style import T_LABEL, FigureResult, figure_style, save_figure, shade_stages

NAME = "fig02_singular_values"
COST = "the default flowsim run (d = 4): seconds, shared by figures 1-6"  # on a 2-core CPU; cached after the first build
MATRICES = ("W0", "W1", "W_Q", "W_K")


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    run_dir = default_run(cache, tiny)
    observables, report = observables_and_stages(run_dir)
    keep = observables.t > 0
    t = observables.t[keep]
    data = {f"{run_dir.name}:t": t}
    with figure_style():
        figure, axes = plt.subplots(2, 2, figsize=(7.5, 5.2), sharex=True, constrained_layout=True)
        for axis, name in zip(axes.flat, MATRICES):
            sigma = observables[f"sv_{name}"][keep]
            data[f"{run_dir.name}:sv_{name}"] = sigma
            shade_stages(axis, report, t[-1], ("condensation",))
            for r in range(sigma.shape[1]):
                axis.plot(t, sigma[:, r], label=f"σ{r}")
            axis.set(xscale="log", yscale="log", title=name, ylabel="singular value")
        for axis in axes[1]:
            axis.set_xlabel(T_LABEL)
        for axis in axes.flat:  # every panel names its own lines and the shaded condensation
            axis.legend(fontsize=6, ncol=2)
    caption = ("Singular values against t: W0 and W1 condense to rank one (σ0 grows, shaded) while W_Q, W_K stay "
               "at their initial scale; later σ1, σ2 of W0 leave the floor one after another (restarts).")
    return save_figure(figure, out, NAME, caption, data)
