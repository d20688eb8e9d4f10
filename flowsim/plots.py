"""The run summary figure (loss, singular values of W0, attention entropy per query, with the
detected stages shaded), a run beside the ODE (``plot_overlay``), and the sweep's phase diagram."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: runs happen on machines without a screen
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from flowsim.observables import Observables  # noqa: E402
from flowsim.stages import StageReport  # noqa: E402

STAGE_COLOURS = {"condensation": "tab:grey", "plateau": "tab:olive"}


def _shade(axis, start: float, end: float | None, t_last: float, **style) -> None:
    axis.axvspan(start, t_last if end is None else end, lw=0, **style)


def plot_run_summary(observables: Observables, path: Path, title: str = "", stages: StageReport | None = None,
                     loss_label: str = "population loss", time_label: str = "t") -> Path:
    """``summary_figure`` written to ``path`` (atomically)."""
    return _save(summary_figure(observables, title, stages, loss_label, time_label), path)


def _save(figure, path: Path) -> Path:
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(temporary, dpi=110)
    plt.close(figure)
    temporary.replace(path)
    return path


def summary_figure(observables: Observables, title: str = "", stages: StageReport | None = None,
                   loss_label: str = "population loss", time_label: str = "t"):
    """Three panels against t (log axis, t > 0): loss; σ_r(W0); entropy of each query's attention.
    ``loss_label`` and ``time_label`` say what they are (a torch run: validation loss, t = lr × steps).

    With ``stages``: condensation and plateaus shaded on the loss, each restart on the
    singular values in its direction's colour, each focus (filled) and dilution (hatched)
    on the entropies in its query's colour.
    """
    keep = observables.t > 0
    t = observables.t[keep]
    two_layer = "sv_W_E" in observables.columns  # the hierarchical model: W_E, and the upper layer's entropy
    embedding = "W_E" if two_layer else "W0"
    sigma = observables[f"sv_{embedding}"][keep]
    entropy = observables["attention_entropy_2" if two_layer else "attention_entropy"][keep]
    pi = observables.constants["pi"]

    figure, axes = plt.subplots(3, 1, figsize=(7.5, 8.5), sharex=True, constrained_layout=True)
    axes[0].plot(t, observables["loss"][keep], color="black")
    axes[0].set_ylabel(loss_label)
    for i in range(sigma.shape[1]):
        axes[1].plot(t, sigma[:, i], label=f"σ{i}", color=f"C{i}")
    axes[1].set_yscale("log")
    axes[1].set_ylabel(f"singular values of {embedding}")
    axes[1].legend(fontsize="small", ncol=min(4, sigma.shape[1]))
    for query in range(entropy.shape[1]):
        axes[2].plot(t, entropy[:, query], label=f"query {query} (π={pi[query]:.3g})", color=f"C{query}")
    for interval in [] if stages is None else stages.intervals:
        span = (interval.t_start, interval.t_end, t[-1])
        if interval.stage in STAGE_COLOURS:
            _shade(axes[0], *span, color=STAGE_COLOURS[interval.stage], alpha=0.2)
            axes[0].text(interval.t_start, 1.0, interval.stage, transform=axes[0].get_xaxis_transform(),
                         fontsize="x-small", va="top", color=STAGE_COLOURS[interval.stage])
        elif interval.stage == "restart":
            _shade(axes[1], *span, color=f"C{interval.direction}", alpha=0.12)
        elif interval.stage == "focus":
            _shade(axes[2], *span, color=f"C{interval.query}", alpha=0.15)
        elif interval.stage == "dilution":
            _shade(axes[2], *span, facecolor="none", edgecolor=f"C{interval.query}", hatch="//", alpha=0.4)
    axes[2].axhline(np.log(len(pi)), color="grey", lw=0.5, ls=":")
    if two_layer:
        lower = observables["attention_entropy_1"][keep]
        for query in range(lower.shape[1]):
            axes[2].plot(t, lower[:, query], color=f"C{query}", ls="--", lw=0.8)
    axes[2].set_ylabel("attention entropy (nats)" + ("\nupper —, lower --" if two_layer else ""))
    axes[2].set_xlabel(time_label)
    axes[2].set_xscale("log")
    axes[2].legend(fontsize="small")
    if stages is not None:
        title = f"{title}\n{stages.cycles} cycle(s): shaded condensation/plateau (loss), restarts (σ), focus/dilution (entropy)"
    if title:
        axes[0].set_title(title, fontsize="small")
    return figure


def _grid_values(rows: list[dict], key: str) -> list:
    """The distinct values of a grid key: numbers in numeric order, anything else (model.ffn = 'glu') as text."""
    values = {row[key] for row in rows}
    numeric = all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values)
    return sorted(values) if numeric else sorted(values, key=str)


def _grid_label(value) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def plot_sweep_phase_diagram(rows: list[dict], grid_keys: list[str], path: Path,
                             columns: tuple[str, ...] = ("onset_condensation", "onset_focus", "onset_dilution",
                                                         "onset_restart")) -> Path:
    """One panel per time column of the rows (e.g. a stage's onset): its mean over seeds,
    on a log colour scale, over the first two grid keys (a single row for a one-key grid);
    cells where no seed reached it are grey."""
    x_key = grid_keys[0]
    y_key = grid_keys[1] if len(grid_keys) > 1 else None
    xs = _grid_values(rows, x_key)
    ys = _grid_values(rows, y_key) if y_key else [None]
    figure, axes = plt.subplots(1, len(columns), figsize=(3.2 * len(columns), 2.8), constrained_layout=True, squeeze=False)
    for axis, column in zip(axes[0], columns):
        grid = np.full((len(ys), len(xs)), np.nan)
        for j, y in enumerate(ys):
            for i, x in enumerate(xs):
                onsets = [row[column] for row in rows
                          if row[x_key] == x and (y_key is None or row[y_key] == y)]
                finite = [value for value in onsets if value is not None and np.isfinite(value)]
                grid[j, i] = np.log10(np.mean(finite)) if finite else np.nan
        image = axis.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
        axis.imshow(np.where(np.isnan(grid), 1.0, np.nan), origin="lower", aspect="auto", cmap="Greys", vmin=0, vmax=4)
        axis.set_xticks(range(len(xs)), [_grid_label(x) for x in xs], rotation=45)
        axis.set_yticks(range(len(ys)), [_grid_label(y) for y in ys] if y_key else [""])
        axis.set_xlabel(x_key)
        if y_key:
            axis.set_ylabel(y_key)
        axis.set_title(column.replace("_", " "))
        colorbar = figure.colorbar(image, ax=axis, label="log10 t")
        colorbar.ax.ticklabel_format(useOffset=False)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return Path(path)


def plot_overlay(run: Observables, ode: Observables, path: Path, title: str = "", names: list[str] | None = None,
                 run_label: str = "SGD run", ode_label: str = "ODE") -> Path:
    """``overlay_figure`` written to ``path`` (atomically)."""
    return _save(overlay_figure(run, ode, title, names, run_label, ode_label), path)


def overlay_figure(run: Observables, ode: Observables, title: str = "", names: list[str] | None = None,
                   run_label: str = "SGD run", ode_label: str = "ODE"):
    """A run beside the gradient flow on the same t axis (log, t > 0): the run solid, the ODE dashed, in one
    colour per series. Panels: loss (the run's validation loss, the ODE's population loss); σ_r(W0);
    attention entropy of each query (``names`` label the queries)."""
    figure, axes = plt.subplots(3, 1, figsize=(7.5, 8.5), sharex=True, constrained_layout=True)
    for observables, style, label in ((run, "-", run_label), (ode, "--", ode_label)):
        keep = observables.t > 0
        t = observables.t[keep]
        axes[0].plot(t, observables["loss"][keep], color="black", ls=style, label=label)
        sigma = observables["sv_W0"][keep]
        for i in range(sigma.shape[1]):
            axes[1].plot(t, sigma[:, i], color=f"C{i}", ls=style, lw=1.0)
        entropy = observables["attention_entropy"][keep]
        colours = [f"C{q}" for q in range(10)] if entropy.shape[1] <= 10 else list(plt.cm.tab20.colors)
        for query in range(entropy.shape[1]):
            name = f"query {query}" if names is None else names[query]
            axes[2].plot(t, entropy[:, query], color=colours[query % len(colours)], ls=style, lw=1.0,
                         label=name if style == "-" else None)
    axes[0].set_ylabel(f"loss\n({run_label}: validation, {ode_label}: population)")
    axes[0].legend(fontsize="small")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("singular values of W0")
    axes[2].set_ylabel(f"attention entropy (nats)\n{run_label} —, {ode_label} --")
    axes[2].set_xlabel("t (learning rate × steps for the run)")
    axes[2].set_xscale("log")
    axes[2].legend(fontsize="x-small", ncol=2)
    if title:
        axes[0].set_title(title, fontsize="small")
    return figure
