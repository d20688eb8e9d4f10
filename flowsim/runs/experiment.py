"""One run end to end: config -> chain, model, loss, flow -> solver -> run directory, then its observables, stage
labels (``flowsim.runs.labelling``) and summary figure; and the resume of a stopped run."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import hashlib
import resource
import sys
import time
from pathlib import Path

from flowsim.assemble import PreparedRun, bayes_loss, sequence_law, model_description, prepare
from flowsim.config import ConfigError, RunConfig, changed_keys, load_config
from flowsim.common.interrupts import signals_interrupt, stop_requests
from flowsim.common.io import DamagedFileError, read_npz, write_atomic_bytes, write_atomic_npz
from flowsim.methods import METHOD, default_rtol, method_for
from flowsim.observe.families import compute_observables
from flowsim.observe.observables import OBSERVABLES_NPZ
from flowsim.runs.plots import plot_run_summary
from flowsim.runs.rundir import (
    CONFIG_FILE,
    META_FILE,
    SOLVER_STATE_FILE,
    SUMMARY_FIGURE,
    TRAJECTORY_FILE,
    check_not_in_use,
    folder_lock,
    library_versions,
    load_run,
    read_meta,
    this_process,
    write_config,
    write_meta,
)
from flowsim.solve.solvers import FlowResult, ResumePoint, SavedStateError, SolverStats, solve_flow
from flowsim.solve.status import Status
from flowsim.runs.labelling import RESUMABLE, save_observables, stages_of

def execute_run(
    config: RunConfig, run_dir: Path, *, progress: bool = True, prepared: PreparedRun | None = None,
    resume: ResumePoint | None = None, history: list | None = None,
) -> FlowResult:
    """Integrate the configured flow and write the run directory (config, trajectory, meta, figure).

    ``prepared`` is ``prepare(config)`` when the caller has already built it. SIGINT or
    SIGTERM stops the solver within about a second: the points so far are written with
    status ``interrupted`` (and JaxRadau's loop state, for ``resume_run``). ``resume`` and
    ``history`` (earlier sessions of the run) are ``resume_run``'s.

    The folder is locked while the run writes it (``folder_lock``: a second writer gets
    ``FolderInUseError``). meta.json says "finished" only once every output is written. A failure
    before the first checkpoint leaves a resumed folder as it was; a failure to write (a full
    disk) keeps what was written, and meta.json says "failed" and what was lost
    (``OutputWriteError``). config.toml and meta.json hold the configuration pinned (``pinned_config``): the
    method "auto" stood for and the tolerance it ran at.
    """
    prepared = prepare(config) if prepared is None else prepared
    config = pinned_config(config)
    run_dir = Path(run_dir)
    with folder_lock(run_dir):
        before = {name: (run_dir / name).read_bytes() for name in (CONFIG_FILE, META_FILE) if (run_dir / name).is_file()}
        checkpoints = []
        try:
            return _write_run(config, run_dir, progress, prepared, resume, history, checkpoints)
        except OSError as error:
            raise _record_lost_outputs(run_dir, error) from error
        except BaseException:
            if resume is not None and not checkpoints:  # nothing new written: the folder as it was
                for name, data in before.items():
                    write_atomic_bytes(run_dir / name, data)
            raise


def pinned_config(config: RunConfig) -> RunConfig:
    """The configuration with what its defaults resolved to written out: the method "auto" stands for today and its
    rtol, so a run reloaded from its config.toml integrates the same way when a default changes. (A run saved with
    "auto" keeps it: its config digest, which a resume checks, is of the configuration as saved.)"""
    method = method_for(config.solver.method)
    rtol = config.solver.rtol if config.solver.rtol is not None else default_rtol(method)
    return config.model_copy(update={"solver": config.solver.model_copy(update={"method": method, "rtol": rtol})})


class OutputWriteError(RuntimeError):
    """Writing a run's outputs failed (a full disk, a read-only folder): the message says what was kept."""


def _record_lost_outputs(run_dir: Path, error: OSError) -> OutputWriteError:
    """Mark the run "failed" in meta.json with what was written and what was lost (if meta.json can be written)."""
    reason = "disk full" if error.errno == errno.ENOSPC else (error.strerror or type(error).__name__).lower()
    outputs = (TRAJECTORY_FILE, OBSERVABLES_NPZ, "stages.json", SUMMARY_FIGURE)
    present = [name for name in outputs if (run_dir / name).is_file()]
    lost = [name for name in outputs if name not in present]
    kept = ", ".join(name + (" (as of its last checkpoint)" if name == TRAJECTORY_FILE else "") for name in present)
    message = (f"failed: {reason} while writing {error.filename or 'an output'}; kept: {kept or 'nothing'}; "
               f"not written: {', '.join(lost) or 'nothing'}")
    try:
        write_meta(run_dir, {**read_meta(run_dir), "status_name": f"failed: {reason}", "message": message})
    except (OSError, DamagedFileError):
        message += "; meta.json could not be updated either"
    return OutputWriteError(f"{run_dir}: {message}")


def config_digest(config: RunConfig) -> str:
    """SHA-256 of the resolved configuration: a resume checks that config.toml still describes the run."""
    return hashlib.sha256(config.to_toml().encode()).hexdigest()


def check_unedited(run_dir: Path, config: RunConfig, meta: dict, command: str, consequence: str) -> None:
    """ConfigError, naming the changed keys, where ``config`` (read from the run's config.toml) is not the
    configuration the run started with (meta.json's digest of it; a run that recorded none is taken as it is)."""
    recorded = meta.get("config_digest")
    if recorded is not None and recorded != config_digest(config):
        changed = changed_keys(meta.get("config", {}), config.to_dict())
        raise ConfigError(f"{command}: config.toml was edited after the run started ({changed}); {consequence}")


def _write_run(config: RunConfig, run_dir: Path, progress: bool, prepared: PreparedRun, resume: ResumePoint | None,
               history: list | None, checkpoints: list) -> FlowResult:
    chain = prepared.chain
    write_config(run_dir, config.to_toml())
    meta = {
        "status_name": Status.RUNNING.label,
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "seed": config.init.seed,
        "t_end": config.time.t_end,
        "chain": chain.describe(),
        "config_digest": config_digest(config),
        "config": config.to_dict(),
        "tolerances": {"rtol": config.solver.rtol, "atol": config.solver.atol},
        "versions": library_versions(),
        **this_process(),
        **({"sessions": history} if history else {}),
    }
    write_meta(run_dir, meta)

    def save(result: FlowResult, final: bool = False) -> None:
        result.trajectory.save(run_dir / TRAJECTORY_FILE)
        summary = result.summary()
        if not final or result.status == Status.INTERRUPTED:
            write_meta(run_dir, {**meta, **summary, "n_saved": len(result.trajectory),
                                 **({} if result.status == Status.INTERRUPTED else {"status_name": Status.RUNNING.label})})
        checkpoints.append(result.t_reached)

    started = time.perf_counter()
    with stop_requests() as stop:
        result = solve_flow(
            prepared.flow, prepared.params0, prepared.times, method=config.solver.method, rtol=config.solver.rtol,
            atol=config.solver.atol, max_steps=config.solver.max_steps, lr=config.solver.lr, progress=progress,
            on_checkpoint=save, should_stop=stop, resume=resume,
        )
    if stop() and result.status == Status.FINISHED:  # the request came during the last chunk: it still stops here
        result = dataclasses.replace(result, status=Status.INTERRUPTED,
                                     message=f"stopped by {stop.signal_name} after the last save time")
    meta["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    meta["total_wall_time_s"] = time.perf_counter() - started
    if result.solver_state is not None:
        write_atomic_npz(run_dir / SOLVER_STATE_FILE, result.solver_state)
    else:
        (run_dir / SOLVER_STATE_FILE).unlink(missing_ok=True)
    save(result, final=True)
    if result.status == Status.INTERRUPTED:
        return result  # observables, stages and figure come when the run is resumed, or on request
    _write_outputs(config, run_dir, prepared, result, meta)
    return result


class OutputsInterrupted(Exception):
    """SIGINT or SIGTERM came while a solved run's outputs were computed: meta.json says which phase was cut and
    that the trajectory is whole; the message says how to finish (``flowsim stages`` or ``flowsim run --resume``)."""


OUTPUT_PHASES = ("observables", "stage labels", "summary figure")  # after the solve, in this order


def peak_memory_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def _write_outputs(config: RunConfig, run_dir: Path, prepared: PreparedRun, result: FlowResult, meta: dict) -> None:
    """Observables, stages and the summary figure of a run that ended, then meta.json, last: every output is there.
    meta.json records each phase's seconds and the process's peak memory at its end (``outputs``). A signal in any
    phase stops it within a save's work: meta.json then says "interrupted" with the phase and the solve's
    statistics, and ``OutputsInterrupted`` says what was kept."""
    chain, model = prepared.chain, prepared.model
    record = {"peak_memory_mb_after_solve": peak_memory_mb()}
    phase, started = OUTPUT_PHASES[0], time.perf_counter()

    def next_phase(name: str | None) -> None:
        nonlocal phase, started
        record[f"{phase.replace(' ', '_')}_seconds"] = time.perf_counter() - started
        phase, started = name, time.perf_counter()

    try:
        with signals_interrupt():
            observables = compute_observables(result.trajectory, model, chain.pi, prepared.flow, sequence_law(chain),
                                              config.observables.fold_d)
            save_observables(observables, run_dir)
            next_phase(OUTPUT_PHASES[1])
            stages = stages_of(result, model, observables)
            if stages is not None:
                stages.save(run_dir)
            next_phase(OUTPUT_PHASES[2])
            if len(result.trajectory) > 1:
                title = f"{model_description(config)}\n{chain.describe()}, {result.method}, {result.status_name}"
                plot_run_summary(observables, run_dir / SUMMARY_FIGURE, title=title, stages=stages,
                                 bayes_loss=bayes_loss(config, chain))
            next_phase(None)
    except KeyboardInterrupt:
        kept = f"the trajectory to t = {result.t_reached:g} is whole ({len(result.trajectory)} points)"
        message = (f"interrupted while computing the {phase} after the solve; {kept}; `flowsim run --resume {run_dir}` "
                   f"writes the outputs without solving again (`flowsim stages {run_dir}` labels it)")
        write_meta(run_dir, {**meta, **result.summary(), "n_saved": len(result.trajectory),
                             "status": int(Status.INTERRUPTED), "status_name": Status.INTERRUPTED.label, "message": message,
                             "interrupted_phase": phase})
        raise OutputsInterrupted(f"{run_dir}: {message}") from None
    record["peak_memory_mb"] = peak_memory_mb()
    write_meta(run_dir, {**meta, **result.summary(), "n_saved": len(result.trajectory), "outputs": record})


def _complete_outputs(config: RunConfig, run_dir: Path, prepared: PreparedRun, run) -> FlowResult:
    """A run whose trajectory reached its last save time but whose outputs were not all written (the disk filled,
    or a signal came, after the last checkpoint): its observables, stages, figure and meta.json, from the
    trajectory as saved, with the solver statistics meta.json recorded at that checkpoint."""
    recorded = run.meta
    stats = SolverStats(n_steps=recorded.get("n_steps", 0), wall_time_s=recorded.get("wall_time_s", 0.0),
                        compile_seconds=recorded.get("compile_seconds", 0.0), solve_seconds=recorded.get("solve_seconds", 0.0),
                        **{name: recorded.get(name) for name in ("n_rejected", "nfev", "njev", "nlu")})  # None: not counted
    result = FlowResult(Status.FINISHED, "reached the last save time (its outputs written by a resume)",
                        recorded.get("method", config.solver.method), float(run.trajectory.t[-1]), stats, run.trajectory)
    with folder_lock(run_dir):
        try:
            recorded = {name: value for name, value in recorded.items() if name != "interrupted_phase"}
            _write_outputs(config, run_dir, prepared, result,
                           {**recorded, "finished": _dt.datetime.now().isoformat(timespec="seconds")})
        except OSError as error:
            raise _record_lost_outputs(run_dir, error) from error
    return result




def resume_run(run_dir: Path, *, progress: bool = True) -> tuple[FlowResult, bool]:
    """Continue an interrupted run (or one stopped by its step limit) in its own folder.

    Returns the result and whether the continuation is exact (the steps of an uninterrupted
    run: JaxRadau from its saved loop state, gradient descent from its last saved step).
    Raises ConfigError when there is nothing to resume."""
    run_dir = Path(run_dir)
    check_not_in_use(run_dir)  # a run still being written names its writer, whatever it has written so far
    run = load_run(run_dir)
    status = run.status_name
    if status not in RESUMABLE:
        live = " (its process is still running)" if status == Status.RUNNING.label else ""
        raise ConfigError(f"--resume {str(run_dir)!r}: the run has status {status!r}{live}; "
                          f"only runs with status {' or '.join(RESUMABLE)} can be resumed")
    config = load_config(run_dir / CONFIG_FILE)
    check_unedited(run_dir, config, run.meta, f"--resume {str(run_dir)!r}",
                   "the rest of the trajectory would belong to another flow. Restore it, or start a new run")
    prepared = prepare(config)
    if run.trajectory.t[-1] >= prepared.times[-1]:  # solved to the end: only outputs written after it are missing
        return _complete_outputs(config, run_dir, prepared, run), True
    method = method_for(config.solver.method)
    solver_state = None
    if METHOD[method].needs_saved_state and (run_dir / SOLVER_STATE_FILE).is_file():
        solver_state = read_npz(run_dir / SOLVER_STATE_FILE)
    thetas = prepared.flow.flatten_batch(run.trajectory.params)
    resume = ResumePoint(run.trajectory.t, thetas, solver_state, state_method=run.meta.get("method"))
    history = [*run.meta.get("sessions", []), {key: run.meta.get(key) for key in
                                                 ("started", "status_name", "t_reached", "n_steps", "solve_seconds")}]
    try:
        result = execute_run(config, run_dir, progress=progress, prepared=prepared, resume=resume, history=history)
    except SavedStateError as error:
        raise DamagedFileError(run_dir / SOLVER_STATE_FILE, f"not this run's {method} loop state: {error}",
                               "delete it to resume afresh from the last saved point") from None
    return result, resume.is_exact(method)
