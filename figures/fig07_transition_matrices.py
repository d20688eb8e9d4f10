"""Figure 7: the same π with different transition matrices (λ family) goes through the same stages."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from figures.runs import default_run, observables_and_stages
from figures.style import T_LABEL, FigureResult, figure_style, save_figure

NAME = "fig07_transition_matrices"
COST = "3 flowsim runs at d = 4 (one per λ): seconds each"  # on a 2-core CPU; cached after the first build
LAMBDAS = (0.2, 0.5, 0.8)
LAMBDAS_TINY = (0.5, 0.8)


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    data = {}
    with figure_style():
        figure, (top, bottom) = plt.subplots(2, 1, figsize=(6.5, 5.0), sharex=True)
        for lam in LAMBDAS_TINY if tiny else LAMBDAS:
            run_dir = default_run(cache, tiny, [f"chain.lam={lam}"])
            name = run_dir.name
            observables, _ = observables_and_stages(run_dir)
            keep = observables.t > 0
            t = observables.t[keep]
            sigma, entropy = observables["sv_W0"][keep], observables["attention_entropy"][keep]
            line, = top.plot(t, sigma[:, 0], label=f"λ = {lam}: σ0(W0)")
            top.plot(t, sigma[:, 1], color=line.get_color(), ls=":", label=f"λ = {lam}: σ1(W0)")
            bottom.plot(t, entropy[:, 0], color=line.get_color(), ls=line.get_linestyle(), label=f"λ = {lam}")
            data.update({f"{name}:t": t, f"{name}:sv_W0": sigma, f"{name}:attention_entropy": entropy})
        top.set(xscale="log", yscale="log", ylabel="singular values of W0")
        top.legend(fontsize=6, ncol=3)
        bottom.set(xscale="log", xlabel=T_LABEL, ylabel="attention entropy of q0 (nats)")
        bottom.legend(fontsize=7)
    caption = ("The same π = (0.75, 0.19, 0.05, 0.01) with transition matrices P = λI + (1-λ)1π^T for three λ: "
               "condensation, the frequent query's focus and the opening of σ1 come in the same order.")
    return save_figure(figure, out, NAME, caption, data)
