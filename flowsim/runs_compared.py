"""One-layer runs side by side: each run's final loss, time to a loss target and stage onsets in one
table, and their loss, σ_r(W0) and attention entropies overlaid in one figure.

The onsets are the detectors' (``flowsim stages``, the same labels a run's own stages.json holds): the
end of condensation, then the first focus, dilution and restart of any query or direction. An event a
finished run did not reach by its horizon reads "not reached"; in a partial run it reads "-" (the run
may yet reach it). Cost: one stage labelling per run (its observables are read, or computed once).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flowsim.experiment import label_run, observables_of_run
from flowsim.observables import Observables
from flowsim.plots import RUN_STYLES, STYLE_NAMES, plot_overlay
from flowsim.rundir import read_meta, status_of
from flowsim.specialisation import first_time_below
from flowsim.stages import CYCLE
from flowsim.status import Status



@dataclass(frozen=True)
class RunRow:
    """One run's line of the table."""

    name: str
    status: str
    t_end: float
    final_loss: float
    t_loss_target: float | None  # None: not reached (or no target given)
    end_condensation: float | None
    onsets: dict[str, float | None]  # CYCLE's stages -> first onset
    cycles: int


def run_row(run_dir: Path, observables: Observables, loss_target: float | None = None) -> RunRow:
    """The table line of a one-layer run (labels its stages, writing stages.json as ``flowsim stages`` does)."""
    report = label_run(run_dir)
    loss = observables["loss"]
    target = None if loss_target is None else first_time_below(observables.t, loss, loss_target)
    return RunRow(Path(run_dir).name, status_of(read_meta(run_dir)), float(observables.t[-1]), float(loss[-1]), target,
                  report.end_of_condensation(), {stage: report.onset(stage) for stage in CYCLE}, report.cycles)


def runs_table(rows: list[RunRow], loss_target: float | None = None) -> str:
    """Aligned columns, one line per run."""
    header = ["run", "status", "t_end", "final loss", *([f"t(loss<={loss_target:g})"] if loss_target is not None else []),
              "condensed", *CYCLE, "cycles"]

    def time(value: float | None, row: RunRow) -> str:
        if value is not None:
            return f"{value:.5g}"
        return "not reached" if row.status == Status.FINISHED.label else "-"

    lines = [header]
    for row in rows:
        target = [time(row.t_loss_target, row)] if loss_target is not None else []
        lines.append([row.name, row.status, f"{row.t_end:g}", f"{row.final_loss:.7f}", *target,
                      time(row.end_condensation, row), *(time(row.onsets[stage], row) for stage in CYCLE), str(row.cycles)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def compare_one_layer_runs(run_dirs: list[Path], figure: Path, loss_target: float | None = None) -> tuple[str, Path]:
    """The table of ``run_dirs`` and their overlay figure written to ``figure`` (at most len(RUN_STYLES) runs)."""
    if not 1 <= len(run_dirs) <= len(RUN_STYLES):
        raise ValueError(f"compare-runs overlays 1 to {len(RUN_STYLES)} one-layer runs, got {len(run_dirs)}")
    observables = [observables_of_run(run_dir) for run_dir in run_dirs]
    rows = [run_row(run_dir, seen, loss_target) for run_dir, seen in zip(run_dirs, observables)]
    labelled = [(row.name, seen) for row, seen in zip(rows, observables)]
    title = ", ".join(f"{row.name} ({STYLE_NAMES[style]})" for row, style in zip(rows, RUN_STYLES))
    plot_overlay(labelled, figure, title=title, loss_label="population loss")
    return runs_table(rows, loss_target), Path(figure)
