"""Figure 6: per-token embedding norms against t (mass redistribution)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from figures.runs import default_run, observables_and_stages
from figures.style import T_LABEL, FigureResult, figure_style, save_figure, shade_stages

NAME = "fig06_embedding_norms"
COST = "the default flowsim run (d = 4): seconds, shared by figures 1-6"  # on a 2-core CPU; cached after the first build


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    run_dir = default_run(cache, tiny)
    observables, report = observables_and_stages(run_dir)
    keep = observables.t > 0
    t, norms, pi = observables.t[keep], observables["embedding_norm"][keep], observables.constants["pi"]
    with figure_style():
        figure, axis = plt.subplots(figsize=(6.5, 3.2))
        shade_stages(axis, report, t[-1], ("dilution",))
        for token in range(norms.shape[1]):
            axis.plot(t, norms[:, token], label=f"token {token} (π = {pi[token]:.2g})")
        axis.set(xscale="log", yscale="log", xlabel=T_LABEL, ylabel="embedding norm ‖W0[i]‖")
        axis.legend(fontsize=7)
    caption = ("Embedding norm of each token: all grow in condensation; during dilution (hatched) frequent and "
               "rare tokens move apart (mass redistribution).")
    return save_figure(figure, out, NAME, caption, {f"{run_dir.name}:t": t, f"{run_dir.name}:embedding_norm": norms})
