"""Figure 14: SGD on sampled Markov sequences against the ODE of the same start (t = lr × steps)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from figures.bridge_runs import bridge_run, ode_run
from figures.runs import read_observables
from figures.style import T_LABEL, FigureResult, figure_style, save_figure

NAME = "fig14_sgd_against_the_flow"
COST = "1 SGD run on the default Markov chain (torch) and its ODE: about a minute"  # on a 2-core CPU; cached after the first build
TINY = ("optim.steps=120", "data.batch_size=256", "data.s=16", "log.n_checkpoints=20", "log.probe_per_type=16")


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    run_dir = bridge_run(cache, "markov-default", TINY if tiny else ())
    name = run_dir.name
    runs = {"SGD (torch)": (name, read_observables(run_dir)), "gradient flow (ODE)": (f"{name}/ode", ode_run(run_dir))}
    data = {}
    with figure_style():
        figure, (left, right) = plt.subplots(1, 2, figsize=(9.0, 3.4))
        for style, (label, (key, observables)) in zip(("-", "--"), runs.items()):
            keep = observables.t > 0
            t = observables.t[keep]
            sigma, entropy = observables["sv_W0"][keep], observables["attention_entropy"][keep]
            for r in range(3):
                left.plot(t, sigma[:, r], ls=style, color=f"C{r}", label=f"{label}: σ{r}(W0)")
            for q in range(2):
                right.plot(t, entropy[:, q], ls=style, color=f"C{q}", label=f"{label}: query {q}")
            data.update({f"{key}:t": t, f"{key}:sv_W0": sigma, f"{key}:attention_entropy": entropy})
        left.set(xscale="log", yscale="log", xlabel=T_LABEL, ylabel="singular values of W0")
        right.set(xscale="log", xlabel=T_LABEL, ylabel="attention entropy (nats)")
        left.legend(fontsize=6)
        right.legend(fontsize=6)
    caption = ("SGD on sampled sequences of the default chain (s = 64, solid) against the exact finite-s gradient "
               "flow from the same parameters (dashed), on the flow's clock t = lr × steps: the curves overlap "
               "through condensation, focus and the opening of the next directions.")
    return save_figure(figure, out, NAME, caption, data)
