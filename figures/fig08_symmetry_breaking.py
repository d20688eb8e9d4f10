"""Figure 8: symmetric low-frequency tokens stagnate; an asymmetry δ escapes, later for smaller δ."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from figures.runs import flowsim_run, observables_and_stages
from figures.style import T_LABEL, FigureResult, figure_style, save_figure

NAME = "fig08_symmetry_breaking"
COST = "4 flowsim runs at d = 4 to t = 3000 (one per δ): seconds each"  # on a 2-core CPU; cached after the first build
DELTAS = (0.0, 0.05, 0.1, 0.2)
DELTAS_TINY = (0.0, 0.2)


def chain_pi(delta: float) -> list[float]:
    return [0.7, 0.1 + delta / 2, 0.1, 0.1 - delta / 2]


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    t_end, n_saved = (150.0, 20) if tiny else (3000.0, 150)
    data = {}
    with figure_style():
        figure, axis = plt.subplots(figsize=(6.5, 3.4))
        for delta in DELTAS_TINY if tiny else DELTAS:
            overrides = [f"chain.pi={chain_pi(delta)}", f"time.t_end={t_end}", f"time.n_linear={n_saved}", f"time.n_log={n_saved}"]
            run_dir = flowsim_run(cache, overrides)
            name = run_dir.name
            observables, report = observables_and_stages(run_dir)
            keep = observables.t > 0
            t, sigma = observables.t[keep], observables["sv_W0"][keep]
            opened = [i.t_start for i in report.of("restart") if i.direction == 1]
            label = f"δ = {delta}" + ("  (symmetric)" if delta == 0 else "") + (f", σ1 opens at t = {opened[0]:.0f}" if opened else ", no new direction")
            axis.plot(t, sigma[:, 1], label=label)
            data.update({f"{name}:t": t, f"{name}:sv_W0": sigma})
        axis.set(xscale="log", yscale="log", xlabel=T_LABEL, ylabel="σ1(W0), the second direction")
        axis.legend(fontsize=7)
    caption = ("π = (0.7, 0.1 + δ/2, 0.1, 0.1 - δ/2): with δ = 0 the flow stalls after condensation (σ1 stays at its "
               "floor); any asymmetry opens a second direction, later for smaller δ.")
    return save_figure(figure, out, NAME, caption, data)
