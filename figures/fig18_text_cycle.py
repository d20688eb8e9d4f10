"""Figure 18: the cycle on real text: tracked queries' attention entropies and W0's σ0-σ2, SGD beside the surrogate's flow.

Each corpus's shipped one-layer example at d = 1001 (t = 3000), through `flowsim bridge validate` (cached in the figure cache):
SGD as markers, the exact flow of the bigram surrogate from the run's own start as lines (both read on the run's
probe set), SGD's detected stages shaded, the theory's onsets as ticks along the top.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from figures.bridge_runs import training_summary
from figures.runs import FigureInputError, observables_and_stages, read_observables
from figures.style import T_LABEL, FigureResult, figure_style, save_figure

NAME = "fig18_text_cycle"
COST = "`flowsim bridge validate` of both corpora at d = 1001 (torch, the corpora): SGD, the ODE and the theory: 7.6 minutes (TinyStories) and 14 (WikiText-2)"  # on a 2-core CPU; cached after the first build
CORPORA = ("tinystories", "wikitext2")
SIGMAS = 3  # W0's σ0, σ1, σ2: condensation and the first two restarts
# A tiny vocabulary and horizon (tests): condensation and the first foci only.
TINY = ("data.vocab_size=31", "data.s=16", "data.batch_size=64", "optim.lr=0.5", "optim.steps=300",
        "log.n_checkpoints=30", "log.probe_per_type=8", "log.val_batches=1", "log.track=[]", "log.fold_d=4",
        "model.m=8", "model.k=8")


def validated(cache: Path, corpus: str, tiny: bool) -> Path:
    """The folder of `flowsim bridge validate CORPUS` in the cache (computed when missing; every part is cached)."""
    try:
        from flowsim.bridge.validate import validate
    except ImportError as error:
        raise FigureInputError(f"this figure trains a torch model: install the bridge extra ({error})") from None
    from flowsim.config import ConfigError

    folder = Path(cache) / f"validate-{corpus}{'-tiny' if tiny else ''}"
    try:
        validate(corpus, folder, list(TINY if tiny else ()))
    except ConfigError as error:
        raise FigureInputError(f"{folder}: {error}") from None
    except FileNotFoundError as error:  # no corpora on this machine
        raise FigureInputError(str(error)) from None
    return folder


def tracked_queries(names: list[str], track: list[str]) -> list[int]:
    """The queries drawn: the run's tracked words (log.track), else its two most frequent types."""
    return [names.index(word) for word in track if word in names] or [0, 1]


def build(cache: Path, out: Path, tiny: bool = False) -> FigureResult:
    data = {}
    # every run first: validate draws its own overlay, and matplotlib's state after it is not the figure style's
    folders = {corpus: validated(cache, corpus, tiny) for corpus in CORPORA}
    from flowsim.bridge.config import load_bridge_config  # the bridge extra (torch): validated() checked it is there

    with figure_style():
        figure, axes = plt.subplots(2, len(CORPORA), figsize=(5.2 * len(CORPORA), 6.4), sharex="col", squeeze=False)
        for column, corpus in enumerate(CORPORA):
            folder = folders[corpus]
            sgd_dir, key = folder / "sgd", f"{folder.name}/sgd"
            sgd, report = observables_and_stages(sgd_dir)
            ode = read_observables(sgd_dir / "ode")
            payload = json.loads((folder / "validate.json").read_text())
            names = [str(name) for name in sgd.constants["type_names"]]
            queries = tracked_queries(names, load_bridge_config(sgd_dir / "config.toml").log.track)
            keep, ode_keep = sgd.t > 0, ode.t > 0
            t, ode_t = sgd.t[keep], ode.t[ode_keep]
            entropy_axis, sigma_axis = axes[0, column], axes[1, column]
            colour = {query: f"C{n}" for n, query in enumerate(queries)}
            for axis in (entropy_axis, sigma_axis):
                for interval in report.of("condensation"):
                    axis.axvspan(interval.t_start, interval.t_end, color="0.85", lw=0, zorder=0)
            for interval in report.intervals:
                end = t[-1] if interval.t_end is None else interval.t_end
                if interval.stage == "dilution" and interval.query in colour:
                    entropy_axis.axvspan(interval.t_start, end, facecolor="none", edgecolor=colour[interval.query],
                                         hatch="//", lw=0, alpha=0.5, zorder=0)
                elif interval.stage == "restart" and interval.direction < SIGMAS:
                    sigma_axis.axvspan(interval.t_start, end, facecolor="none", edgecolor=f"C{interval.direction}",
                                       hatch="\\\\", lw=0, alpha=0.5, zorder=0)
            for query in queries:
                entropy_axis.plot(t, sgd["attention_entropy"][keep, query], ls="none", marker="o", ms=2.2,
                                  color=colour[query])
                entropy_axis.plot(ode_t, ode["attention_entropy"][ode_keep, query], ls="-", lw=1.0, color=colour[query])
            for r in range(min(SIGMAS, sgd["sv_W0"].shape[1])):
                sigma_axis.plot(t, sgd["sv_W0"][keep, r], ls="none", marker="o", ms=2.2, color=f"C{r}")
                sigma_axis.plot(ode_t, ode["sv_W0"][ode_keep, r], ls="-", lw=1.0, color=f"C{r}")
            ticks = [row for row in payload["rows"] if row["theory"] is not None  # only for what is drawn
                     and (row["query"] in colour or row["stage"] == "condensation"
                          or (row["stage"] == "restart" and row["direction"] < SIGMAS))]
            for row in ticks:
                axis = entropy_axis if row["query"] is not None else sigma_axis
                tick_colour = colour.get(row["query"], f"C{row['direction']}" if row["direction"] is not None else "black")
                axis.plot([row["theory"]], [1.0], marker="v", ms=6, color=tick_colour, transform=axis.get_xaxis_transform(),
                          clip_on=False)
            entropy_legend = [Line2D([], [], color=colour[q], lw=1.0, marker="o", ms=2.2, label=f"'{names[q]}'")
                              for q in queries]
            sigma_legend = [Line2D([], [], color=f"C{r}", lw=1.0, marker="o", ms=2.2, label=f"σ{r}(W0)")
                            for r in range(SIGMAS)]
            common = [Line2D([], [], color="0.3", ls="none", marker="o", ms=2.2, label="SGD (markers)"),
                      Line2D([], [], color="0.3", lw=1.0, label="surrogate's flow (lines)"),
                      Line2D([], [], color="0.3", ls="none", marker="v", ms=6, label="theory's onset (tick)"),
                      Patch(color="0.85", label="condensation (SGD)")]
            entropy_axis.legend(handles=entropy_legend + common + [
                Patch(facecolor="none", edgecolor="0.3", hatch="//", label="dilution (SGD, query's colour)")],
                fontsize=6, loc="lower left", ncol=2)
            sigma_axis.legend(handles=sigma_legend + common + [
                Patch(facecolor="none", edgecolor="0.3", hatch="\\\\", label="restart (SGD, σr's colour)")],
                fontsize=6, loc="upper left", ncol=2)
            entropy_axis.set(xscale="log", ylabel="attention entropy (nats), probe set",
                             title=f"{corpus} to t = {payload['t_end']:g}\n{training_summary(sgd_dir)}")
            sigma_axis.set(xscale="log", yscale="log", xlabel=T_LABEL, ylabel="singular values of W0")
            data.update({f"{key}:t": t, f"{key}:attention_entropy": sgd["attention_entropy"][keep],
                         f"{key}:sv_W0": sgd["sv_W0"][keep], f"{key}/ode:t": ode_t,
                         f"{key}/ode:attention_entropy": ode["attention_entropy"][ode_keep],
                         f"{key}/ode:sv_W0": ode["sv_W0"][ode_keep]})
        # inside the style: a line's "C1" is resolved when it is drawn, a hatch's when it is made
        return save_figure(figure, out, NAME, CAPTION, data)


CAPTION = ("The cycle on real text (one-layer model at the real vocabulary, SGD at its shipped learning rate, "
           "t = lr × steps): tracked words' attention entropies (top) focus, then dilute (hatched), and W0's "
           "second and third singular directions open (restarts, bottom). Markers: SGD; lines: the exact "
           "mean-field flow of the corpus's bigram surrogate from the run's own initial parameters, read on the "
           "run's probe set; ticks: the theory's onsets. TinyStories (t = 3000) goes through a whole cycle on both sides. "
           "On WikiText-2 (t = 3000) SGD opens σ1 and σ2 (its frequent words, not drawn, focus as σ1 opens) and the "
           "tracked words' attention spreads, while the surrogate's flow only condenses (its σ1 stalls): no whole "
           "cycle there.")
