"""Runs side by side. One-layer runs: each run's final loss, time to a loss target and stage onsets in one
table, and their loss, σ_r(W0) and attention entropies overlaid in one figure. Two-layer runs: the
premature-specialisation probes and the pathwise growth factors.

The onsets are the detectors' (``flowsim stages``, the same labels a run's own stages.json holds): the
end of condensation, then the first focus, dilution and restart of any query or direction. An event a
finished run did not reach by its horizon reads "not reached"; in a partial run it reads "-" (the run
may yet reach it). Cost: one stage labelling per run (its observables are read, or computed once).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flowsim.config import ConfigError, load_config
from flowsim.runs.labelling import label_run, observables_of_run
from flowsim.observe.observables import Observables
from flowsim.runs.plots import RUN_STYLES, STYLE_NAMES, plot_overlay
from flowsim.runs.predictions import pathwise_of_run
from flowsim.runs.rundir import CONFIG_FILE, read_meta, status_of
from flowsim.observe.specialisation import first_time_below, summarise
from flowsim.observe.stages import CYCLE
from flowsim.solve.status import Status
from theory.pathwise import pathwise_applies


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


def compare_two_layer_runs(run_dirs: list[Path], loss_target: float | None = None) -> str:
    """Two-layer runs side by side: the premature-specialisation probes table and the pathwise growth factors
    table (cached in each run's pathwise.npz). A run that cannot be read raises a ValueError naming it."""
    def show(value) -> str:
        return "-" if value is None else f"{value:.4g}"

    probes = (f"{'run':16} {'ffn':4} {'qk_rho':>6} {'smooth':>6} {'t_end':>6} {'loss':>9} {'t(target)':>9} "
              f"{'t_mature':>8} {'H2 fall':>8} {'index':>6} {'t_m(end)':>8} {'idx(end)':>8}")
    factors = (f"{'run':16} {'step(0)':>8} {'energy(0)':>9} {'ffn(0)':>9} {'peak bound':>10} "
               f"{'peak direct':>11} {'direct share':>12} {'exceeded':>8} {'loose':>7} {'tight':>7}")
    probe_lines, factor_lines = [probes], [factors]
    for run_dir in run_dirs:
        try:
            config = load_config(run_dir / CONFIG_FILE)
            summary = summarise(observables_of_run(run_dir), loss_target)
            pathwise = pathwise_of_run(run_dir).summary() if pathwise_applies(config) else None
        except (FileNotFoundError, ConfigError, ValueError) as error:
            raise ValueError(f"{run_dir}: {error}") from None
        name = run_dir.name[:16]
        probe_lines.append(f"{name:16} {config.model.ffn:4} {config.flow.qk_rho:6.3g} {config.flow.smoothing_a:6.3g} "
                           f"{summary.t_end:6.4g} {summary.final_loss:9.7f} {show(summary.t_loss_target):>9} "
                           f"{show(summary.t_basis_mature):>8} {show(summary.upper_entropy_fall_at_maturity):>8} "
                           f"{show(summary.premature_index):>6} {show(summary.t_basis_final):>8} "
                           f"{show(summary.premature_index_final):>8}")
        if pathwise is None:
            factor_lines.append(f"{name:16} (none: loss.kind = {config.loss.kind!r}; the factors need the exact loss)")
            continue
        factor_lines.append(f"{name:16} {pathwise['step_0']:8.4g} {pathwise['residual_energy_0']:9.4g} "
                            f"{pathwise['ffn_write_0']:9.4g} {pathwise['peak_bound']:10.4g} "
                            f"{pathwise['peak_direct']:11.4g} {pathwise['direct_share']:12.4g} "
                            f"{pathwise['exceeded_share']:8.3g} {pathwise['looseness']:7.3g} {pathwise['tight_looseness']:7.3g}")
    return "\n".join(probe_lines + [""] + factor_lines)
