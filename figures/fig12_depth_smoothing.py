"""Figure 12: depth smoothing a = 0, 0.1, 0.2 on the two-layer model: loss and probes."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from figures.runs import read_observables
from figures.style import T_LABEL, FigureResult, figure_style, save_figure
from figures.two_layer import two_layer_run
from flowsim.model.chains import MarkovChain
from flowsim.config import load_config
from flowsim.runs.rundir import CONFIG_FILE

NAME = "fig12_depth_smoothing"
COST = "3 two-layer flows (a = 0, 0.1, 0.2): about a minute each"  # on a 2-core CPU; cached after the first build
RUNS = (("baseline", 0.0), ("smoothing_0.1", 0.1), ("smoothing_0.2", 0.2))
RUNS_TINY = (RUNS[0], RUNS[2])


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    data = {}
    with figure_style():
        figure, axes = plt.subplots(1, 3, figsize=(10.0, 3.2))
        for name, a in RUNS_TINY if tiny else RUNS:
            run_dir = two_layer_run(cache, name, tiny)
            observables = read_observables(run_dir)
            t, pi = observables.t, observables.constants["pi"]
            keep = t > 0
            loss, entropy, angle = observables["loss"], observables["attention_entropy_2"], observables["basis_angle"]
            chain = MarkovChain.from_config(load_config(run_dir / CONFIG_FILE).chain)
            bayes = -np.sum(chain.pi[:, None] * chain.P * np.log(chain.P))  # H(x_next | x_last): the best loss
            axes[0].plot(t[keep], loss[keep] - bayes, label=f"a = {a}")
            axes[1].plot(t[keep], (entropy @ (pi / pi.sum()))[keep], label=f"a = {a}")
            axes[2].plot(t[keep], angle[keep], label=f"a = {a}")
            data.update({f"{run_dir.name}:t": t, f"{run_dir.name}:loss": loss,
                         f"{run_dir.name}:attention_entropy_2": entropy, f"{run_dir.name}:basis_angle": angle})
        axes[0].set(yscale="log", ylabel="loss − Bayes loss H(P | π)")
        axes[1].set(ylabel="upper-layer attention entropy")
        axes[2].set(ylabel="basis angle to the final span (rad)")
        for axis in axes:
            axis.set(xscale="log", xlabel=T_LABEL)
        axes[0].legend(fontsize=7)
    caption = ("Depth smoothing across the two attention blocks (a = 0, 0.1, 0.2): the flow still descends, the upper "
               "entropy and the basis maturity barely move, and the loss at t = 200 is slightly higher with smoothing.")
    return save_figure(figure, out, NAME, caption, data)
