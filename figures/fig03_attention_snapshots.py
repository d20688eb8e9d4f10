"""Figure 3: the attention matrix A (query × key token) at one snapshot per stage."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from figures.runs import default_run, observables_and_stages
from figures.style import FigureResult, figure_style, save_figure
from flowsim.observe.stages import EVENT_STAGES, STAGE

NAME = "fig03_attention_snapshots"
COST = "the default flowsim run (d = 4): seconds, shared by figures 1-6"  # on a 2-core CPU; cached after the first build


def snapshot_times(report, t: np.ndarray) -> list[tuple[str, int]]:
    """(label, saved index) at the end of condensation and in the middle (log time) of the first
    interval of each other stage, after the initial point."""
    chosen = [("start", 0)]
    for stage in (stage.name for stage in EVENT_STAGES):
        found = report.of(stage)
        if not found:
            continue
        interval = found[0]
        end = t[-1] if interval.t_end is None else interval.t_end
        # a stage dated by its end is shown there; one dated by its onset in its middle
        moment = end if STAGE[stage].dated_by == "end" else float(np.sqrt(max(interval.t_start, t[1]) * end))
        label = stage + (f" q{interval.query}" if interval.query is not None else "")
        chosen.append((label, int(np.argmin(np.abs(t - moment)))))
    return sorted(chosen, key=lambda item: item[1])


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    run_dir = default_run(cache, tiny)
    observables, report = observables_and_stages(run_dir)
    t, attention = observables.t, observables["attention"]
    chosen = snapshot_times(report, t)
    with figure_style():
        figure, axes = plt.subplots(1, len(chosen), figsize=(2.0 * len(chosen), 2.4), constrained_layout=True)
        for axis, (label, index) in zip(np.atleast_1d(axes), chosen):
            image = axis.imshow(attention[index], cmap="Greys", vmin=0, vmax=1)
            axis.set_title(f"{label}\nt = {t[index]:.3g}", fontsize=7)
            axis.set_xlabel("key token")
            axis.set_ylabel("query token")
            axis.grid(False)
        figure.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    caption = ("Attention A (rows: query token, columns: key token) at one time per stage: uniform-by-π at the "
               "start and through condensation, concentrated on the frequent token in focus, spread again in dilution.")
    return save_figure(figure, out, NAME, caption,
                       {f"{run_dir.name}:t": t[[i for _, i in chosen]], f"{run_dir.name}:attention": attention[[i for _, i in chosen]]})
