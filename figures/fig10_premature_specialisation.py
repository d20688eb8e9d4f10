"""Figure 10: upper-layer attention entropy against the maturity of the lower residual basis."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from figures.runs import read_observables
from figures.style import T_LABEL, FigureResult, figure_style, save_figure
from figures.two_layer import two_layer_run

NAME = "fig10_premature_specialisation"
COST = "4 two-layer flows (the variants): about a minute each, shared by figures 10-12"  # on a 2-core CPU; cached after the first build
RUNS = ("baseline", "slowed", "glu", "glu_slowed")
RUNS_TINY = ("baseline", "glu_slowed")  # both FFNs, both Q/K rates


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    data = {}
    with figure_style():
        figure, (left, right) = plt.subplots(1, 2, figsize=(8.5, 3.4))
        for name in RUNS_TINY if tiny else RUNS:
            run_dir = two_layer_run(cache, name, tiny)
            observables = read_observables(run_dir)
            t, pi = observables.t, observables.constants["pi"]
            entropy = observables["attention_entropy_2"]
            upper = entropy @ (pi / pi.sum())
            angle = observables["basis_angle"]
            left.plot(angle, upper, label=name)
            right.plot(t[t > 0], upper[t > 0], label=name)
            data.update({f"{run_dir.name}:t": t, f"{run_dir.name}:attention_entropy_2": entropy,
                         f"{run_dir.name}:basis_angle": angle})
        left.invert_xaxis()
        left.set(xlabel="largest principal angle of span h2(t) to its final span (rad; maturity →)",
                 ylabel="upper-layer attention entropy (π-weighted, nats)")
        right.set(xscale="log", xlabel=T_LABEL, ylabel="upper-layer attention entropy")
        left.legend(fontsize=7)
    caption = ("Upper-layer attention entropy against the maturity of the residual basis it attends over: with the "
               "MLP it falls while the basis is still far from its final span (premature specialisation); with the "
               "gated FFN it does not, and slowing the upper Q/K delays the fall.")
    return save_figure(figure, out, NAME, caption, data)
