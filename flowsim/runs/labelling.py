"""The labelling of a run directory: its observables (computed once from trajectory.npz and cached beside it, or
measured by the bridge), its stage labels (stages.json, stages.txt), and what a partial run's table covers.
Every command that reads a run (``stages``, ``compare``, ``compare-runs``, the bridge, the figures) goes through
here."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flowsim.assemble import prepare, sequence_law
from flowsim.config import ConfigError, load_config
from flowsim.observe.families import compute_observables, family_of, family_of_observables
from flowsim.solve.integration import FlowResult
from flowsim.common.io import DamagedFileError, file_digest, read_npz
from flowsim.model.models import Model
from flowsim.observe.observables import MEASURED_BY, OBSERVABLES_NPZ, TRAJECTORY_DIGEST, Observables
from flowsim.runs.rundir import CONFIG_FILE, TRAJECTORY_FILE, load_run, read_meta, status_of
from flowsim.observe.stages import StageReport, detect_stages
from flowsim.solve.status import Status
from flowsim.solve.trajectory import Trajectory

RESUMABLE = (Status.INTERRUPTED.label, Status.STEP_LIMIT.label)  # the statuses `flowsim run --resume` continues
MIN_SAMPLES_FOR_STAGES = 3
ONE_LAYER_COLUMNS = {"sv_W0", "attention_entropy", "loss"}


def observables_of_run(run_dir: Path) -> Observables:
    """The run's observables: read observables.npz when it holds measurements or was
    computed from the run's present trajectory.npz, else compute them again and save them."""
    run_dir = Path(run_dir)
    if (run_dir / OBSERVABLES_NPZ).is_file():
        try:
            observables = Observables.load(run_dir)
        except DamagedFileError:
            observables = None  # a cache: recomputed below
        if observables is not None and MEASURED_BY in observables.constants:
            return observables
        digest = file_digest(run_dir / TRAJECTORY_FILE) if (run_dir / TRAJECTORY_FILE).is_file() else None
        current = observables is not None and ("basis_angle" not in observables.columns
                                               or "basis_doubling_angle" in observables.columns)  # else an older layout
        if current and digest is not None and str(observables.constants.get(TRAJECTORY_DIGEST)) == digest:
            Trajectory.load(run_dir / TRAJECTORY_FILE)  # checked (finite, consistent): a cache of a damaged file is no cure
            return observables
    run = load_run(run_dir)
    config = load_config(run_dir / CONFIG_FILE)
    prepared = prepare(config)
    observables = compute_observables(run.trajectory, prepared.model, prepared.chain.pi, prepared.flow,
                                      sequence_law(prepared.chain), config.observables.fold_d)
    save_observables(observables, run_dir)
    return observables


def save_observables(observables: Observables, run_dir: Path) -> None:
    """Save observables computed from the run's trajectory.npz, with its digest (they are recomputed when it changes)."""
    digest = np.asarray(file_digest(Path(run_dir) / TRAJECTORY_FILE))
    Observables(observables.t, observables.columns, {**observables.constants, TRAJECTORY_DIGEST: digest}).save(run_dir)


def stage_detectors_apply(model: Model) -> bool:
    """Whether the stage detectors read this model's observables (its family's row says)."""
    return family_of(model).stage_detectors_apply


def stages_of(result: FlowResult, model: Model, observables: Observables) -> StageReport | None:
    """The stage labels of a solved run (``flowsim run`` and every sweep row), or None where they do not
    apply: a model the detectors do not read, a run whose state left the flow, or fewer than
    MIN_SAMPLES_FOR_STAGES saved times after t = 0."""
    if not stage_detectors_apply(model) or result.status.broken or np.count_nonzero(observables.t > 0) < MIN_SAMPLES_FOR_STAGES:
        return None
    return detect_stages(observables)


def check_labelable(run_dir: Path) -> str:
    """The run's status name; a run whose state left the flow (diverged, non-finite) is refused."""
    meta = read_meta(run_dir)
    status = status_of(meta)
    if status in (Status.NON_FINITE.label, Status.DIVERGED.label):
        raise ConfigError(f"{run_dir}: the run stopped with status {status!r} ({meta.get('message', '')}); "
                          "its points are not a gradient flow, so its stages are not labelled")
    return status


def label_run(run_dir: Path) -> StageReport:
    """Detect the stages of a run directory and write stages.json and stages.txt."""
    check_labelable(run_dir)
    observables = observables_of_run(run_dir)
    family = family_of_observables(observables.constants, observables.columns)
    if family is None or not family.stage_detectors_apply or not ONE_LAYER_COLUMNS <= set(observables.columns):
        kind = "unknown" if family is None else family.kind
        raise ConfigError(f"stage detection is defined for the one-layer model; this run has model.kind = {kind!r}")
    report = detect_stages(observables)
    report.save(run_dir)
    return report


def partial_note(run_dir: Path) -> str | None:
    """One line saying that a run stopped before its last save time, or None for a finished run."""
    run_dir = Path(run_dir)
    meta = read_meta(run_dir)
    status = status_of(meta)
    if status == Status.FINISHED.label:
        return None
    reached, t_end = meta.get("t_reached"), meta.get("t_end")
    if (run_dir / TRAJECTORY_FILE).is_file():  # the saved points, which the table covers (a running solver is ahead)
        try:
            reached = float(read_npz(run_dir / TRAJECTORY_FILE, ("t",))["t"][-1])
        except (DamagedFileError, IndexError):
            pass
    where = f", saved up to t = {reached:g}" if isinstance(reached, (int, float)) else ""
    where += f" of t_end = {t_end:g}" if where and isinstance(t_end, (int, float)) else ""
    hint = f"; continue it with `flowsim run --resume {run_dir}`" if status in RESUMABLE and "t_end" in meta else ""
    return f"partial run: status {status}{where}{hint}"
