"""Figure 11: the pathwise growth factors of the upper-layer logits over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from figures.style import T_LABEL, FigureResult, figure_style, save_figure
from figures.two_layer import two_layer_run
from flowsim.runs.predictions import pathwise_of_run

NAME = "fig11_pathwise_factors"
COST = "the 4 two-layer flows of figure 10 and their pathwise factors: minutes"  # on a 2-core CPU; cached after the first build
RUNS = ("baseline", "slowed", "glu", "glu_slowed")
RUNS_TINY = ("baseline", "glu_slowed")  # both FFNs, both Q/K rates
PANELS = (("step", "step-size factor max(κ_Q, κ_K)"), ("residual_energy", "residual energy max‖h‖⁴"),
          ("coupling", "coupling ‖W_Q2‖² + ‖W_K2‖²"), ("mass", "attention-gradient mass Σ|G|"),
          ("bound", "bound (max over pairs)"), ("direct", "|direct-path ds/dt| (max over pairs)"))


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    data = {}
    with figure_style():
        figure, axes = plt.subplots(3, 2, figsize=(8.0, 7.0), sharex=True)
        for name in RUNS_TINY if tiny else RUNS:
            run_dir = two_layer_run(cache, name, tiny)
            factors = pathwise_of_run(run_dir)
            keep = factors.t > 0
            data[f"{run_dir.name}:t"] = factors.t[keep]
            for axis, (field, label) in zip(axes.flat, PANELS):
                values = getattr(factors, field)[keep]
                series = np.abs(values).max(axis=(1, 2)) if values.ndim == 3 else values
                axis.plot(factors.t[keep], series, label=name)
                axis.set(xscale="log", yscale="log", ylabel=label)
                data[f"{run_dir.name}:pathwise.{field}"] = values
        for axis in axes[-1]:
            axis.set_xlabel(T_LABEL)
        axes[0, 0].legend(fontsize=7)
    caption = ("The four factors bounding the direct Q/K path of the upper logits, the bound and the measured direct "
               "rate: slowing shrinks the step-size factor (by ρ = 0.25 until t = 8), the gated FFN the residual "
               "energy; the bound stays above the measured rate.")
    return save_figure(figure, out, NAME, caption, data)
