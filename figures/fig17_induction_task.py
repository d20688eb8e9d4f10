"""Figure 17: premature specialisation on the induction task, where the upper layer must read a
feature the lower layer writes (configs/induction)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from figures.runs import flowsim_run, read_observables
from figures.style import T_LABEL, FigureResult, figure_style, plot_specialisation, save_figure
from flowsim.config import load_config, shipped_config
from flowsim.observe.specialisation import MATURE_ANGLE
from flowsim.model.tasks import InductionTask

NAME = "fig17_induction_task"
COST = "5 induction flows (d = 3, s = 5, exact loss): about a minute each"  # on a 2-core CPU; cached after the first build
SHIPPED = shipped_config("induction")
RUNS = ("baseline", "slowed", "glu", "glu_slowed", "smoothing_0.1")
RUNS_TINY = ("baseline",)  # one induction run: each variant is a compilation of its own, the tiny set's costliest
TINY = ("time.t_end=20.0", "time.n_linear=21", "time.n_log=15")


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    data = {}
    task_config = load_config(SHIPPED / "baseline.toml").task
    bayes = InductionTask(task_config.d, task_config.s, task_config.noise).bayes_loss
    with figure_style():
        figure, (left, middle, right) = plt.subplots(1, 3, figsize=(11.0, 3.4))
        for name in RUNS_TINY if tiny else RUNS:
            run_dir = flowsim_run(cache, TINY if tiny else (), config_path=SHIPPED / f"{name}.toml")
            observables = read_observables(run_dir)
            data.update(plot_specialisation((left, middle, right), observables, name, run_dir.name,
                                            "attention_entropy_2", "basis_doubling_angle", loss_offset=bayes))
        left.set(xscale="log", xlabel=T_LABEL, ylabel="upper-layer attention entropy (nats)")
        middle.axhline(MATURE_ANGLE, color="0.5", linewidth=0.8, linestyle=":")
        middle.set(xscale="log", xlabel=T_LABEL, ylabel="turn of the residual basis over [t, 2t] (rad)")
        right.set(xscale="log", yscale="log", xlabel=T_LABEL, ylabel="loss - Bayes loss")
        left.legend(fontsize=7)
    caption = ("The induction task (d = 3, s = 5, exact loss): the upper layer's attention entropy falls while the "
               "residual basis it attends over still turns by far more than 0.1 rad (dotted) per doubling of time "
               "(premature specialisation); the variants' losses above the Bayes loss (seed 0; benchmarks/RESULTS.md "
               "has the seeded table).")
    return save_figure(figure, out, NAME, caption, data)
