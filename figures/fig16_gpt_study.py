"""Figure 16: the GPT family on WikiText-2: the top layer's attention entropy against the
maturity of the residual stream it reads, for the MLP and gated FFN with and without the
upper-Q/K schedule (seed 0; benchmarks/gpt_study.py has the seeded table)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from figures.bridge_runs import bridge_run
from figures.runs import read_observables
from figures.style import T_LABEL, FigureResult, figure_style, plot_specialisation, save_figure

NAME = "fig16_gpt_study"
COST = "4 GPT runs on WikiText-2 (torch, the corpora): minutes each"  # on a 2-core CPU; cached after the first build
RUNS = ("gpt-mlp", "gpt-mlp-qk", "gpt-glu", "gpt-glu-qk")
RUNS_TINY = ("gpt-mlp", "gpt-glu-qk")
TINY = ("data.vocab_size=100", "data.s=16", "data.batch_size=8", "model.n_layer=2", "model.d_model=16", "model.n_head=2",
        "optim.steps=20", "log.n_checkpoints=6", "log.probe_per_type=8", "log.val_batches=1")


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    data = {}
    with figure_style():
        figure, (left, middle, right) = plt.subplots(1, 3, figsize=(11.0, 3.4))
        for name in RUNS_TINY if tiny else RUNS:
            run_dir = bridge_run(cache, name, TINY if tiny else ())
            observables = read_observables(run_dir)
            top = max(int(c.rsplit("_", 1)[1]) for c in observables.columns if c.startswith("attention_entropy_"))
            data.update(plot_specialisation((left, middle, right), observables, name, run_dir.name,
                                            f"attention_entropy_{top}", f"basis_angle_{top - 1}"))
        left.set(xscale="log", xlabel=T_LABEL, ylabel="top-layer attention entropy (nats)")
        middle.set(xscale="log", xlabel=T_LABEL, ylabel="angle of the stream below it to its final span (rad)")
        right.set(xscale="log", xlabel=T_LABEL, ylabel="validation loss")
        left.legend(fontsize=7)
    caption = ("A small GPT on WikiText-2 (AdamW; t = lr × steps): the top layer's attention entropy, the angle of the "
               "residual stream it reads to its final span, and the validation loss, for the GELU MLP and the gated FFN, "
               "each with and without the slowed upper Q/K (seed 0; the seeded table is in benchmarks/RESULTS.md).")
    return save_figure(figure, out, NAME, caption, data)
