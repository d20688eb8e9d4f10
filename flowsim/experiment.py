"""One run end to end: config -> chain, model, loss, flow -> solver -> run directory,
then observables, stage labels and the summary figure."""

from __future__ import annotations

import datetime as _dt
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flowsim.chains import MarkovChain
from flowsim.config import ConfigError, RunConfig, load_config
from flowsim.flow import DepthSmoothing, GradientFlow, RateSchedule
from flowsim.losses import make_loss_function
from flowsim.models import Model, OneLayerTransformer, Params, model_from_config
from flowsim.observables import OBSERVABLES_NPZ, Observables, compute_observables
from flowsim.plots import plot_run_summary
from flowsim.rundir import (
    CONFIG_FILE,
    SUMMARY_FIGURE,
    TRAJECTORY_FILE,
    library_versions,
    load_run,
    write_config,
    write_meta,
)
from flowsim.solvers import FlowResult, solve_flow
from flowsim.stages import StageReport, detect_stages

MIN_SAMPLES_FOR_STAGES = 3
ONE_LAYER_COLUMNS = {"sv_W0", "attention_entropy", "loss"}


def observables_of_run(run_dir: Path) -> Observables:
    """The run's observables: read observables.npz, or compute and save them if missing."""
    run_dir = Path(run_dir)
    if (run_dir / OBSERVABLES_NPZ).is_file():
        return Observables.load(run_dir)
    run = load_run(run_dir)
    prepared = prepare(load_config(run_dir / CONFIG_FILE))
    observables = compute_observables(run.trajectory, prepared.model, prepared.chain.pi, prepared.flow)
    observables.save(run_dir)
    return observables


def stages_apply(model: Model) -> bool:
    """The stage detectors read the one-layer model's observables."""
    return isinstance(model, OneLayerTransformer)


def label_run(run_dir: Path) -> StageReport:
    """Detect the stages of a run directory and write stages.json and stages.txt."""
    observables = observables_of_run(run_dir)
    if not ONE_LAYER_COLUMNS <= set(observables.columns):  # the detectors read the one-layer observables
        kind = "two_layer" if "attention_entropy_2" in observables.columns else "unknown"
        raise ConfigError(f"stage detection is defined for the one-layer model; this run has model.kind = {kind!r}")
    report = detect_stages(observables)
    report.save(run_dir)
    return report


def initial_params(config: RunConfig, model: Model) -> Params:
    """Seeded N(0, ε²) entries, or the arrays of ``init.file``."""
    if config.init.file is None:
        return model.init(config.init.eps, config.init.seed)
    path = Path(config.init.file)
    if not path.is_file():
        raise ConfigError(f"init.file {str(path)!r} does not exist")
    with np.load(path) as data:
        params = {name: np.asarray(data[name], dtype=float) for name in data.files if name in model.shapes}
    try:
        model.check_params(params)
    except ValueError as error:
        raise ConfigError(f"init.file {str(path)!r}: {error}") from None
    return params


@dataclass(frozen=True)
class PreparedRun:
    """Everything a configured run needs, built and validated."""

    chain: MarkovChain
    model: Model
    flow: GradientFlow
    params0: Params
    times: np.ndarray


def prepare(config: RunConfig) -> PreparedRun:
    """Build the chain, model, flow, initial point and save times, or raise ConfigError."""
    chain = MarkovChain.from_config(config.chain)
    model = model_from_config(config.model, chain.d)
    params0 = initial_params(config, model)
    rates = RateSchedule.from_config(config.flow, model.slow_groups)
    smoothing = DepthSmoothing.from_config(config.flow, model.repeated_blocks, config.model.kind)
    try:
        loss = make_loss_function(model, chain, config.loss.kind, config.loss.s, config.loss.mc_samples, config.loss.mc_seed)
        flow = GradientFlow(loss, params0, rates, smoothing)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if config.init.file is None and config.solver.atol > 1e-2 * config.init.eps**2:
        warnings.warn(
            f"solver.atol = {config.solver.atol:g} is not well below init.eps^2 = {config.init.eps**2:g}: "
            "the early, small-scale dynamics will be resolved poorly",
            stacklevel=2,
        )
    return PreparedRun(chain, model, flow, params0, config.save_times())


def execute_run(
    config: RunConfig, run_dir: Path, *, progress: bool = True, prepared: PreparedRun | None = None
) -> FlowResult:
    """Integrate the configured flow and write the run directory (config, trajectory, meta, figure).

    ``prepared`` is ``prepare(config)`` when the caller has already built it.
    """
    prepared = prepare(config) if prepared is None else prepared
    chain, model = prepared.chain, prepared.model
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir, config.to_toml())
    meta = {
        "status_name": "running",
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "seed": config.init.seed,
        "chain": chain.describe(),
        "versions": library_versions(),
    }
    write_meta(run_dir, meta)

    def save(result: FlowResult) -> None:
        result.trajectory.save(run_dir / TRAJECTORY_FILE)
        write_meta(run_dir, {**meta, **result.summary(), "n_saved": len(result.trajectory)})

    started = time.perf_counter()
    result = solve_flow(
        prepared.flow, prepared.params0, prepared.times, method=config.solver.method, rtol=config.solver.rtol, atol=config.solver.atol,
        max_steps=config.solver.max_steps, lr=config.solver.lr, progress=progress, on_checkpoint=save,
    )
    meta["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    meta["total_wall_time_s"] = time.perf_counter() - started
    save(result)
    observables = compute_observables(result.trajectory, model, chain.pi, prepared.flow)
    observables.save(run_dir)
    stages = None
    if stages_apply(model) and np.count_nonzero(observables.t > 0) >= MIN_SAMPLES_FOR_STAGES:
        stages = detect_stages(observables)
        stages.save(run_dir)
    if len(result.trajectory) > 1:
        title = f"{chain.describe()}, {config.solver.method}, {result.status_name}"
        plot_run_summary(observables, run_dir / SUMMARY_FIGURE, title=title, stages=stages)
    return result
