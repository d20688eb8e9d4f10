"""The run summary figure (loss, singular values of W0, attention entropy per query, with the
detected stages shaded), runs overlaid (``plot_overlay``: a run beside the ODE, or runs side by side), and
the sweep's phase diagram."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: runs happen on machines without a screen
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
import numpy as np  # noqa: E402

from flowsim.observe.families import FAMILIES, family_of_observables  # noqa: E402
from flowsim.common.io import write_atomic_bytes  # noqa: E402
from flowsim.observe.observables import Observables  # noqa: E402
from flowsim.observe.stages import STAGE, StageReport  # noqa: E402
from flowsim.solve.status import Status  # noqa: E402



MAX_DRAWN_QUERIES = 10  # a large vocabulary's entropies: the most frequent queries only (the detectors read all)
MAX_DRAWN_SINGULAR_VALUES = 4  # σ0-σ3: past ten, matplotlib's colours repeat and σ0 and σ10 look alike
STRIP_HEIGHT = 0.04  # a query's strip for its focus and dilution bars below 0, as a fraction of ln d


def _shade(axis, start: float, end: float | None, t_last: float, **style) -> None:
    axis.axvspan(start, t_last if end is None else end, lw=0, **style)


def drawn_queries(pi: np.ndarray, limit: int = MAX_DRAWN_QUERIES) -> np.ndarray:
    """The queries whose attention entropy a figure draws: all of them up to ``limit``, else the ``limit`` most
    frequent (largest π first)."""
    pi = np.asarray(pi)
    return np.arange(len(pi)) if len(pi) <= limit else np.argsort(-pi, kind="stable")[:limit]


def plot_run_summary(observables: Observables, path: Path, title: str = "", stages: StageReport | None = None,
                     loss_label: str = "population loss", time_label: str = "t", bayes_loss: float | None = None) -> Path:
    """``summary_figure`` written to ``path`` (atomically)."""
    return _save(summary_figure(observables, title, stages, loss_label, time_label, bayes_loss), path)


def _save(figure, path: Path) -> Path:
    """The figure as a PNG, written atomically (``io.write_atomic_bytes``: no partial file, no temporary left)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    write_atomic_bytes(Path(path), buffer.getvalue())
    return Path(path)


def summary_figure(observables: Observables, title: str = "", stages: StageReport | None = None,
                   loss_label: str = "population loss", time_label: str = "t", bayes_loss: float | None = None):
    """Three panels against t (log axis, t > 0): loss; σ_r(W0); entropy of each query's attention (the
    ``MAX_DRAWN_QUERIES`` most frequent queries when there are more). ``loss_label`` and ``time_label`` say what they are (a torch run: validation loss, t = lr × steps);
    ``bayes_loss``, where the data law gives one, is drawn on the loss as the line it cannot go below.

    With ``stages``: condensation and plateaus shaded on the loss, each restart on the
    singular values in its direction's colour, each focus (filled) and dilution (hatched)
    on the entropies in its query's colour.
    """
    keep = observables.t > 0
    t = observables.t[keep]
    family = family_of_observables(observables.constants, observables.columns) or FAMILIES["one_layer"]
    embedding = family.embedding
    sigma = observables[f"sv_{embedding}"][keep]
    entropy = observables[family.entropy][keep]
    pi = observables.constants["pi"]

    figure, axes = plt.subplots(3, 1, figsize=(7.5, 8.5), sharex=True, constrained_layout=True)
    axes[0].plot(t, observables["loss"][keep], color="black", label=loss_label)
    axes[0].set_ylabel(loss_label)
    if bayes_loss is not None:
        axes[0].axhline(bayes_loss, color="tab:red", ls=":", lw=1.0, label=f"Bayes loss {bayes_loss:.5g}")
    drawn_sigmas = min(sigma.shape[1], MAX_DRAWN_SINGULAR_VALUES)
    for i in range(drawn_sigmas):
        axes[1].plot(t, sigma[:, i], label=f"σ{i}", color=f"C{i}")
    axes[1].set_yscale("log")
    more = "" if drawn_sigmas == sigma.shape[1] else f"\n(σ0-σ{drawn_sigmas - 1} of {sigma.shape[1]})"
    axes[1].set_ylabel(f"singular values of {embedding}{more}")
    queries = drawn_queries(pi)
    colour = {int(query): f"C{n}" for n, query in enumerate(queries)}
    names = observables.constants.get("type_names")
    for query in queries:
        word = f"'{names[query]}' " if names is not None and query < len(names) else ""
        axes[2].plot(t, entropy[:, query], label=f"query {word}{query} (π = {pi[query]:.3g})", color=colour[int(query)])
    row_of = {int(query): n for n, query in enumerate(queries)}  # each query's own strip below 0, under the curves
    strip = STRIP_HEIGHT * np.log(len(pi))
    bands: dict[int, dict[str, object]] = {0: {}, 1: {}, 2: {}}  # per panel: legend entries of the shading drawn
    for interval in [] if stages is None else stages.intervals:
        span = (interval.t_start, interval.t_end, t[-1])
        stage_colour = STAGE[interval.stage].colour
        if stage_colour is not None:
            _shade(axes[0], *span, color=stage_colour, alpha=0.2)
            axes[0].text(interval.t_start, 1.0, interval.stage, transform=axes[0].get_xaxis_transform(),
                         fontsize="x-small", va="top", color=stage_colour)
            bands[0][interval.stage] = Patch(color=stage_colour, alpha=0.2, label=interval.stage)
        elif interval.stage == "restart" and interval.direction < drawn_sigmas:
            _shade(axes[1], *span, color=f"C{interval.direction}", alpha=0.12)
            bands[1]["restart"] = Patch(color="grey", alpha=0.2, label="restart (σr's colour)")
        elif interval.query in colour and interval.stage in ("focus", "dilution"):
            # a bar in the query's own strip along the bottom, not a band over the panel: ten queries' bands
            # stacked into one opaque block that hid the curves
            end = t[-1] if interval.t_end is None else interval.t_end
            height = -strip * (row_of[int(interval.query)] + 1)
            style = {"ls": "-"} if interval.stage == "focus" else {"ls": (0, (2, 1))}
            axes[2].plot([interval.t_start, end], [height, height], color=colour[interval.query], lw=2.5,
                         solid_capstyle="butt", **style)
            bands[2][interval.stage] = Line2D([], [], color="grey", lw=3, **style,
                                              label=f"{interval.stage} (bar below 0, query's colour)")
    axes[2].axhline(np.log(len(pi)), color="grey", lw=0.5, ls=":", label=f"ln {len(pi)}: uniform over the types")
    layered = family.lower_entropy is not None and family.lower_entropy in observables.columns
    if layered:
        lower = observables[family.lower_entropy][keep]
        for query in queries:
            axes[2].plot(t, lower[:, query], color=colour[int(query)], ls="--", lw=0.8)
    shown = "" if len(queries) == len(pi) else f"\n(the {len(queries)} most frequent of {len(pi)} queries)"
    if bands[2]:  # the bars' strips below 0, one per drawn query
        axes[2].set_ylim(bottom=-strip * (len(queries) + 1))
    axes[2].set_ylabel("attention entropy (nats)" + ("\nupper —, lower --" if layered else "") + shown)
    axes[2].set_xlabel(time_label)
    axes[2].set_xscale("log")
    for panel, axis in enumerate(axes):
        handles, _ = axis.get_legend_handles_labels()
        handles += list(bands[panel].values())
        if handles and (panel > 0 or len(handles) > 1):  # the loss alone needs no legend: its axis names it
            # the entropies' legend below the panel: inside it hid the curves and the bars
            below = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.18)} if panel == 2 else {}
            axis.legend(handles=handles, fontsize="x-small", ncol=min(4, max(1, len(handles) // 4)), **below)
    if stages is not None:
        title = f"{title}\n{stages.cycles} cycle(s): shaded condensation/plateau (loss), restarts (σ), focus/dilution (entropy)"
    if title:
        axes[0].set_title(title, fontsize="small")
    return figure


def _grid_values(rows: list[dict], key: str) -> list:
    """The distinct values of a grid key: numbers in numeric order, anything else (model.ffn = 'glu', chain.pi = [...])
    in the order of their text."""
    values = list({repr(row[key]): row[key] for row in rows}.values())  # lists are values too, and unhashable
    numeric = all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values)
    return sorted(values) if numeric else sorted(values, key=str)


def _grid_label(value) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


ONSET_COLUMNS = ("onset_condensation", "onset_focus", "onset_dilution", "onset_restart")
NOT_REACHED, NO_FINISHED_RUN = "not\nreached", "no finished\nrun"  # what a cell without a value says


def plot_sweep_phase_diagram(rows: list[dict], grid_keys: list[str], path: Path,
                             columns: tuple[str, ...] = ONSET_COLUMNS) -> Path:
    """``phase_diagram_figure`` written to ``path`` (atomically)."""
    return _save(phase_diagram_figure(rows, grid_keys, columns), path)


def sweep_scope(rows: list[dict], grid_keys: list[str]) -> str:
    """What a phase diagram's cells are: the seeds per cell and the horizon each run went to (read from the rows'
    resolved configurations; a range where they differ)."""
    horizons = sorted({row["config"]["time"]["t_end"] for row in rows if "time" in row.get("config", {})})
    cells = {tuple(repr(row.get(key)) for key in grid_keys[:2]) for row in rows}  # repr: a value may be a list
    per_cell = max(1, round(len(rows) / max(1, len(cells))))
    horizon = ("" if not horizons else f", each run to t = {horizons[0]:g}" if len(horizons) == 1
               else f", runs to t = {horizons[0]:g}-{horizons[-1]:g}")
    return f"{per_cell} seed(s) per cell (init.seed = 0..{per_cell - 1}){horizon}"


def phase_diagram_figure(rows: list[dict], grid_keys: list[str], columns: tuple[str, ...] = ONSET_COLUMNS):
    """One panel per time column of the rows (e.g. a stage's onset): its mean over the seeds that reached it, over
    the first two grid keys (a single row for a one-key grid), on one log colour scale shared by every panel, so
    that colours compare across stages. A cell where only k of its N seeds reached the time is hatched and says
    "k/N" (its colour is the mean of those k); a cell where none did is grey and says why: "not reached" (its runs
    finished without the event) or "no finished run" (rows without a status count as finished)."""
    x_key = grid_keys[0]
    y_key = grid_keys[1] if len(grid_keys) > 1 else None
    xs = _grid_values(rows, x_key)
    ys = _grid_values(rows, y_key) if y_key else [None]
    grids, counts, finished = {}, {}, np.zeros((len(ys), len(xs)), dtype=bool)
    for column in columns:
        grid, count = np.full((len(ys), len(xs)), np.nan), np.zeros((len(ys), len(xs), 2), dtype=int)
        for j, y in enumerate(ys):
            for i, x in enumerate(xs):
                cell = [row for row in rows if row[x_key] == x and (y_key is None or row[y_key] == y)]
                finished[j, i] = any(row.get("status", Status.FINISHED.label) == Status.FINISHED.label for row in cell)
                times = [row[column] for row in cell if row.get(column) is not None and np.isfinite(row[column])]
                grid[j, i] = np.log10(np.mean(times)) if times else np.nan
                count[j, i] = len(times), len(cell)
        grids[column], counts[column] = grid, count
    values = np.concatenate([grid[np.isfinite(grid)] for grid in grids.values()])
    low, high = (float(values.min()), float(values.max())) if len(values) else (0.0, 1.0)
    if high - low < 1e-9:
        low, high = low - 0.5, high + 0.5
    figure, axes = plt.subplots(1, len(columns), figsize=(3.2 * len(columns) + 1.0, 2.8), constrained_layout=True,
                                squeeze=False)
    partial_cells = False
    for axis, column in zip(axes[0], columns):
        grid, count = grids[column], counts[column]
        image = axis.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=low, vmax=high)
        axis.imshow(np.where(np.isnan(grid), 1.0, np.nan), origin="lower", aspect="auto", cmap="Greys", vmin=0, vmax=4)
        for j, i in zip(*np.nonzero(np.isnan(grid))):
            axis.text(i, j, NOT_REACHED if finished[j, i] else NO_FINISHED_RUN, ha="center", va="center", fontsize="x-small")
        for j, i in zip(*np.nonzero((count[:, :, 0] > 0) & (count[:, :, 0] < count[:, :, 1]))):
            axis.add_patch(Rectangle((i - 0.5, j - 0.5), 1, 1, facecolor="none", edgecolor="white", hatch="//", lw=0))
            axis.text(i, j, f"{count[j, i, 0]}/{count[j, i, 1]}", ha="center", va="center", fontsize="x-small",
                      color="black", backgroundcolor="white")
            partial_cells = True
        axis.set_xticks(range(len(xs)), [_grid_label(x) for x in xs], rotation=45)
        axis.set_yticks(range(len(ys)), [_grid_label(y) for y in ys] if y_key else [""])
        axis.set_xlabel(x_key)
        if y_key:
            axis.set_ylabel(y_key)
        axis.set_title(column.replace("_", " "))
    if partial_cells:
        figure.legend(handles=[Patch(facecolor="0.6", edgecolor="white", hatch="//",
                                     label="k/N: only k of the cell's N seeds reached it (the mean of those k)")],
                      loc="outside lower center", fontsize="x-small")
    colorbar = figure.colorbar(image, ax=axes[0].tolist(), label="log10 t (mean over\nthe seeds that reached it)")
    colorbar.ax.ticklabel_format(useOffset=False)
    figure.suptitle(sweep_scope(rows, grid_keys), fontsize="small")
    return figure


RUN_STYLES = ("-", "--", ":", "-.")  # one line style per overlaid run, in order
STYLE_NAMES = dict(zip(RUN_STYLES, ("solid", "dashed", "dotted", "dash-dotted")))


def plot_overlay(runs: list[tuple[str, Observables]], path: Path, title: str = "", names: list[str] | None = None,
                 loss_label: str = "loss", time_label: str = "t") -> Path:
    """``overlay_figure`` written to ``path`` (atomically)."""
    return _save(overlay_figure(runs, title, names, loss_label, time_label), path)


def overlay_figure(runs: list[tuple[str, Observables]], title: str = "", names: list[str] | None = None,
                   loss_label: str = "loss", time_label: str = "t"):
    """Labelled runs on one t axis (log, t > 0), one line style per run (``RUN_STYLES``: the first solid, the
    second dashed, ...) and one colour per series. Panels: loss; σ_r(W0); attention entropy of each query
    (``names`` label the queries). At most len(RUN_STYLES) runs."""
    if not 1 <= len(runs) <= len(RUN_STYLES):
        raise ValueError(f"an overlay draws 1 to {len(RUN_STYLES)} runs, got {len(runs)}")
    figure, axes = plt.subplots(3, 1, figsize=(7.5, 8.5), sharex=True, constrained_layout=True)
    for (label, observables), style in zip(runs, RUN_STYLES):
        keep = observables.t > 0
        t = observables.t[keep]
        axes[0].plot(t, observables["loss"][keep], color="black", ls=style, label=label)
        sigma = observables["sv_W0"][keep]
        for i in range(min(sigma.shape[1], MAX_DRAWN_SINGULAR_VALUES)):
            axes[1].plot(t, sigma[:, i], color=f"C{i}", ls=style, lw=1.0, label=f"σ{i}" if style == RUN_STYLES[0] else None)
        entropy = observables["attention_entropy"][keep]
        queries = drawn_queries(observables.constants["pi"]) if "pi" in observables.constants \
            else np.arange(min(entropy.shape[1], MAX_DRAWN_QUERIES))
        for n, query in enumerate(queries):
            name = f"query {query}" if names is None else f"query '{names[query]}'"
            axes[2].plot(t, entropy[:, query], color=f"C{n}", ls=style, lw=1.0,
                         label=name if style == RUN_STYLES[0] else None)
    axes[0].set_ylabel(loss_label)
    axes[0].legend(fontsize="small")
    axes[1].set_yscale("log")
    axes[1].set_ylabel(f"singular values of W0 (σ0-σ{MAX_DRAWN_SINGULAR_VALUES - 1} at most)\n" + ", ".join(f"{label} {STYLE_NAMES[style]}"
                                                           for (label, _), style in zip(runs, RUN_STYLES)))
    axes[1].legend(fontsize="x-small", ncol=4)
    axes[2].set_ylabel("attention entropy (nats)\n" + ", ".join(f"{label} {STYLE_NAMES[style]}"
                                                                 for (label, _), style in zip(runs, RUN_STYLES)))
    axes[2].set_xlabel(time_label)
    axes[2].set_xscale("log")
    axes[2].legend(fontsize="x-small", ncol=2)
    if title:
        axes[0].set_title(title, fontsize="small")
    return figure
