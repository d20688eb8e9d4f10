"""One matplotlib style for every figure (readable in greyscale: colour and line style
change together), and how a figure is saved (PNG, PDF and a caption line)."""

from __future__ import annotations

import io
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from cycler import cycler  # noqa: E402

from flowsim.common.io import write_atomic_bytes  # noqa: E402
from flowsim.observe.stages import STAGE  # noqa: E402

# Okabe-Ito colours, each with its own dash pattern so lines stay distinct in greyscale
COLOURS = ("#000000", "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#999999")
DASHES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)), (0, (3, 1)), (0, (1, 1)), (0, (6, 2, 1, 2)))
T_LABEL = "gradient-flow time t (learning rate × steps)"

STYLE = {
    "axes.prop_cycle": cycler(color=COLOURS) + cycler(linestyle=DASHES),
    "lines.markersize": 3,
    "lines.linewidth": 1.4,
    "font.size": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "figure.dpi": 150,
    "savefig.bbox": "tight",
    "figure.constrained_layout.use": True,
}


@contextmanager
def figure_style():
    with plt.rc_context(STYLE):
        yield


@dataclass
class FigureResult:
    """A written figure: its files, its caption and the arrays it plots, keyed "RUN:COLUMN"
    (RUN a run directory in the cache, COLUMN one of its observables; "RUN:t" the times used)."""

    name: str
    png: Path
    pdf: Path
    caption: str
    data: dict[str, np.ndarray] = field(default_factory=dict)


def save_figure(figure, out: Path, name: str, caption: str, data: dict[str, np.ndarray]) -> FigureResult:
    """Write NAME.png, NAME.pdf and NAME.txt (the caption) into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for suffix in ("png", "pdf"):
        buffer = io.BytesIO()
        figure.savefig(buffer, format=suffix)
        write_atomic_bytes(out / f"{name}.{suffix}", buffer.getvalue())
    plt.close(figure)
    write_atomic_bytes(out / f"{name}.txt", (caption + "\n").encode())
    return FigureResult(name, out / f"{name}.png", out / f"{name}.pdf", caption, data)


def shade_stages(axis, report, t_last: float, stages: tuple[str, ...], query: int | None = None) -> None:
    """Shade the detected intervals of ``stages`` (hatched for dilution), each stage named once in the axis's legend."""
    named = set()
    for interval in report.intervals:
        if interval.stage not in stages or (query is not None and interval.query not in (None, query)):
            continue
        end = t_last if interval.t_end is None else interval.t_end
        label = "_nolegend_" if interval.stage in named else f"{interval.stage} (detected)"
        named.add(interval.stage)
        axis.axvspan(interval.t_start, end, facecolor="0.85" if interval.stage != "dilution" else "none",
                     edgecolor="0.4", hatch=STAGE[interval.stage].hatch, lw=0, alpha=0.6, zorder=0, label=label)


def plot_specialisation(axes, observables, name: str, key: str, entropy_column: str, angle_column: str,
                        loss_offset: float = 0.0) -> dict[str, np.ndarray]:
    """One run on three axes against t (t > 0): the π-weighted upper-layer entropy, an angle of the
    residual basis (``angle_column``), the loss minus ``loss_offset``. Returns the plotted columns
    as figure data under ``key`` (the run's folder name)."""
    keep = observables.t > 0
    t, pi = observables.t[keep], observables.constants["pi"]
    entropy, angle, loss = (observables[column][keep] for column in (entropy_column, angle_column, "loss"))
    for axis, values in zip(axes, (entropy @ (pi / pi.sum()), angle, loss - loss_offset)):
        axis.plot(t, values, label=name)
    return {f"{key}:t": t, f"{key}:{entropy_column}": entropy, f"{key}:{angle_column}": angle, f"{key}:loss": loss}

