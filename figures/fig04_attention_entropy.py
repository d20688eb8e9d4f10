"""Figure 4: attention entropy of each query against t, its focus and dilution shaded."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from figures.runs import default_run, observables_and_stages
from figures.style import T_LABEL, FigureResult, figure_style, save_figure, shade_stages

NAME = "fig04_attention_entropy"
COST = "the default flowsim run (d = 4): seconds, shared by figures 1-6"  # on a 2-core CPU; cached after the first build


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    run_dir = default_run(cache, tiny)
    observables, report = observables_and_stages(run_dir)
    keep = observables.t > 0
    t, entropy, pi = observables.t[keep], observables["attention_entropy"][keep], observables.constants["pi"]
    with figure_style():
        figure, axes = plt.subplots(len(pi), 1, figsize=(6.5, 1.5 * len(pi)), sharex=True, constrained_layout=True)
        for query, axis in enumerate(np.atleast_1d(axes)):
            shade_stages(axis, report, t[-1], ("focus", "dilution"), query=query)
            axis.plot(t, entropy[:, query], color="black", marker="", label="attention entropy of the query (nats)")
            axis.set_ylabel(f"H(q{query})\nπ={pi[query]:.2g}")
            axis.set_xscale("log")
        np.atleast_1d(axes)[-1].set_xlabel(T_LABEL)
        legend = {}  # each line and band once, from whichever panel shows it
        for axis in np.atleast_1d(axes):
            legend.update({label: handle for handle, label in zip(*axis.get_legend_handles_labels())})
        figure.legend(legend.values(), legend.keys(), loc="outside upper center", ncol=3, fontsize=7)
    caption = ("Attention entropy (nats) of each query: focus (grey) is a fall towards 0, dilution (hatched) a rise "
               "back; the frequent query focuses first, and queries cycle through fall, rise and fall.")
    return save_figure(figure, out, NAME, caption, {f"{run_dir.name}:t": t, f"{run_dir.name}:attention_entropy": entropy})
