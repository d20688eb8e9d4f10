"""What every integration method shares: the result and its statistics, the problem a method integrates, a
run's state between chunks of work, the ``Method`` interface, and ``drive``, the one loop around every method.

``drive`` shows progress (a "compiling" phase first), hands partial results to a checkpoint callback, polls
stop requests between chunks of work and leaves the status to the method. Every method reports its compile
time (JAX tracing and XLA compilation, zero when the compiled code is reused) apart from its solve time.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from flowsim.model.flow import GradientFlow
from flowsim.common.interrupts import run_in_chunks
from flowsim.methods import METHOD
from flowsim.common.progress import progress_bar, stderr_is_terminal, ticking
from flowsim.solve.status import Status, at_time
from flowsim.solve.trajectory import Trajectory

CHECKPOINT_EVERY_S = 20.0


@dataclass(frozen=True)
class SolverStats:
    """Work done: steps taken (accepted; rejected where the method reports them),
    vector-field and Jacobian evaluations (J·v products for JaxBDF; None where the library does not count
    them), LU decompositions (eigendecompositions for JaxRadau), wall time in all, and
    of it the compile time and the solve time after compilation."""

    n_steps: int
    n_rejected: int | None
    nfev: int | None
    njev: int | None
    nlu: int | None
    wall_time_s: float
    compile_seconds: float = 0.0
    solve_seconds: float = 0.0


@dataclass(frozen=True)
class FlowResult:
    """What ``solve_flow`` returns: status, message, statistics and the trajectory.

    ``status`` is a ``Status``: finished (every save time reached), step limit, non-finite
    state, solver failed, or running (a checkpoint of a run in progress). On a failure
    ``trajectory`` holds the save times reached before it, and ``t_reached`` is the last
    time the integrator reached.
    """

    status: Status
    message: str
    method: str
    t_reached: float
    stats: SolverStats
    trajectory: Trajectory
    solver_state: dict[str, np.ndarray] | None = None  # JaxRadau's or JaxBDF's loop state when interrupted (ResumePoint)

    @property
    def success(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def status_name(self) -> str:
        return self.status.label

    def summary(self) -> dict:
        return {
            "status": int(self.status),
            "status_name": self.status_name,
            "message": self.message,
            "method": self.method,
            "t_reached": self.t_reached,
            **asdict(self.stats),
        }


class SavedStateError(ValueError):
    """A saved loop state (``ResumePoint.solver_state``) that does not belong to the problem being resumed."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a stopped solve continues: the points it saved (``t`` ascending from 0, ``theta``
    flat, one row per time) and, for JaxRadau and JaxBDF, the whole loop state (``FlowResult.solver_state``).

    With the loop state JaxRadau and JaxBDF take exactly the steps of an uninterrupted solve,
    and gradient descent does too (it resumes at the step of its last saved point). The other
    methods, and these two without their state, start afresh from the last saved point, so their
    steps differ from an uninterrupted solve's."""

    t: np.ndarray
    theta: np.ndarray
    solver_state: dict[str, np.ndarray] | None = None
    state_method: str | None = None  # the method whose loop state ``solver_state`` is (None: the resuming one's)

    def state_for(self, method: str) -> dict[str, np.ndarray] | None:
        """The loop state, if ``method`` can continue it: a run begun by another method (one that "auto" stood for
        in an earlier version) restarts from its last saved point instead."""
        if not METHOD[method].needs_saved_state or self.state_method not in (None, method):
            return None
        return self.solver_state

    def is_exact(self, method: str) -> bool:
        known = METHOD[method]
        return known.resumes_exactly and (not known.needs_saved_state or self.state_for(method) is not None)


def check_save_times(t_eval) -> np.ndarray:
    """Save times must be finite, strictly ascending, and start at 0 (the initial point)."""
    times = np.asarray(t_eval, dtype=float)
    if times.ndim != 1 or len(times) < 2:
        raise ValueError(f"save times must be a 1-d array with at least 2 entries, got shape {times.shape}")
    if not np.all(np.isfinite(times)):
        raise ValueError("save times must be finite")
    if times[0] != 0:
        raise ValueError(f"save times must start at t = 0 (the initial point), got t[0] = {times[0]}")
    if np.any(np.diff(times) <= 0):
        raise ValueError("save times must be strictly ascending")
    return times


# ---------------------------------------------------------------------------------------------
# The problem, a run's state, and the one loop around every method


@dataclass(frozen=True)
class Problem:
    """What every method integrates: flows of one structure (one flow but for JaxRadau's batches), their
    starts (one flat row each), the save times and the tolerances."""

    flows: list[GradientFlow]
    thetas0: np.ndarray
    times: np.ndarray
    rtol: float
    atol: float
    max_steps: int
    progress: bool = False
    listening: bool = False  # someone checkpoints or may ask to stop: the method returns in short chunks
    should_stop: Callable[[], bool] | None = None
    started: float = field(default_factory=time.perf_counter)

    @property
    def flow(self) -> GradientFlow:
        return self.flows[0]


@dataclass
class Integration:
    """A method's state between chunks of work; each method keeps its own fields beside these."""

    problem: Problem
    t: float  # the earliest time a member has reached
    status: Status = Status.RUNNING
    message: str = Status.RUNNING.message()
    compile_seconds: float = 0.0


class Method:
    """An integration method: ``start`` compiles what it needs and makes its ``Integration``, ``advance`` does one
    chunk of work (a step, or about half a second of compiled steps), ``results`` reads the run, whatever
    its status. ``drive`` owns the loop."""

    name: str = ""
    shows_own_progress = False  # the method draws its own progress bar while it advances

    def start(self, problem: Problem) -> Integration:
        raise NotImplementedError

    def advance(self, run: Integration) -> None:
        raise NotImplementedError

    def results(self, run: Integration) -> list[FlowResult]:
        raise NotImplementedError

    def interrupt(self, run: Integration) -> None:
        """A stop request between chunks: keep what was saved."""
        run.status, run.message = Status.INTERRUPTED, Status.INTERRUPTED.message(at_time(run.t))


def drive(method: Method, problem: Problem, on_checkpoint: Callable[[list[FlowResult]], None] | None = None,
          checkpoint_every_s: float = CHECKPOINT_EVERY_S, saved: Any = None) -> list[FlowResult]:
    """The loop every method runs in: progress (a "compiling" phase, then model time), a stop request
    polled after each chunk, ``on_checkpoint`` with the partial results every ``checkpoint_every_s``
    seconds, and the results with the method's status. ``saved``: a method's saved state to continue."""
    times = problem.times
    own_bar = method.shows_own_progress and stderr_is_terminal()
    bar = _Progress(problem.progress and not own_bar, times[0], times[-1], method.name)
    try:
        bar.compiling(0.0)
        with ticking(bar.compiling):
            run = method.start(problem) if saved is None else method.start(problem, saved)
        bar.update(run.t)

        def advance() -> bool:
            method.advance(run)
            bar.update(run.t)
            return run.status == Status.RUNNING

        checkpoint = None if on_checkpoint is None else lambda: on_checkpoint(method.results(run))
        if run.status == Status.RUNNING and run_in_chunks(advance, problem.should_stop, checkpoint, checkpoint_every_s):
            method.interrupt(run)
    finally:
        bar.close()
    return method.results(run)


def solver_stats(counts: dict, started: float) -> SolverStats:
    """Statistics from a method's counts (compile_seconds among them) and its start time."""
    wall = time.perf_counter() - started
    return SolverStats(**counts, wall_time_s=wall, solve_seconds=wall - counts["compile_seconds"])


def flow_result(flow: GradientFlow, method: str, status: Status, message: str, t_reached, saved_t, saved_theta,
                stats: SolverStats) -> FlowResult:
    """A method's result: its saved points (flat rows) as a trajectory with their losses."""
    thetas = np.asarray(saved_theta).reshape(-1, flow.size)
    trajectory = Trajectory(
        t=np.asarray(saved_t, dtype=float), loss=flow.loss_along(thetas), params=flow.unflatten_batch(thetas)
    )
    return FlowResult(status, message, method, float(t_reached), stats, trajectory)


class _Progress:
    """A bar (plain lines in a log file) over model time on a log scale, log(1 + t) / log(1 + t_end): a gradient
    flow's steps grow with t, so its cost goes with log t rather than t, and so does the
    estimate of the time left."""

    def __init__(self, enabled: bool, t_start: float, t_end: float, method: str):
        self.method, self.t_end = method, float(t_end)
        # No bar at all when none is shown: even a disabled tqdm makes tqdm's multiprocessing lock, a named semaphore
        # that a sweep's worker, stopped by SIGTERM, leaves for Python's resource tracker to warn of.
        self.bar = None if not enabled else progress_bar(
            total=float(np.log1p(t_end)), initial=float(np.log1p(t_start)), smoothing=0.0, desc=self._label(t_start),
            bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]",
            count=lambda n: "of log(1 + t)")

    def _label(self, t: float) -> str:
        return f"flow ({self.method}) t={t:.4g}/{self.t_end:.4g}"

    def compiling(self, seconds: float) -> None:
        """Say so while JAX compiles (tens of seconds the first time a model shape is met), with the seconds so far,
        not a silent 0%."""
        if self.bar is not None:
            self.bar.set_description_str(f"flow ({self.method}) compiling (once per model shape) {seconds:.0f} s", refresh=True)

    def update(self, t: float) -> None:
        if self.bar is not None:
            self.bar.set_description_str(self._label(t), refresh=False)
            self.bar.update(max(0.0, float(np.log1p(t)) - self.bar.n))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
