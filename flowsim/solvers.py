"""One entry point, ``solve_flow``, for every way of integrating a gradient flow.

Methods (each a small object with ``start`` and ``advance``, as diffrax's solvers have ``init`` and ``step``):

* ``Scipy("LSODA" | "BDF" | "Radau")``: scipy's stiff integrators, driven step by step with
  the exact Jacobian -diag(r) Hessian(L) from JAX, dense output on the save times.
* ``Diffrax("Kvaerno5" | "Tsit5" | "Dopri8")``: diffrax (implicit, explicit, explicit), with a
  PID step controller that steps exactly onto the kinks of the rate schedule.
* ``JaxRadau()``: Radau IIA of order 5 compiled end to end in JAX (``flowsim.stiff``), with
  the Jacobian diagonalised so step-size changes cost nothing; it alone can integrate a batch
  of flows at once (``solve_flow_batch``). Its eigensystem rank, Newton control and fused
  products are fields.
* ``GradientDescent(lr)``: θ_{n+1} = θ_n - η r(nη) ∇L(θ_n), step n at time t = nη, saved at
  the steps nearest the save times.

``drive`` is the one loop around them: it shows progress (a "compiling" phase first), hands
partial results to a checkpoint callback, polls stop requests between chunks of work and
leaves the status to the method. Every method reports its compile time (JAX tracing and XLA
compilation, zero when the compiled code is reused) apart from its solve time after compilation.

Every method returns a ``FlowResult`` with a status: a run that hits its step limit,
meets a non-finite state, or fails inside the solver keeps every point computed
before that and says so; nothing is silently truncated.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import scipy.integrate
from tqdm.auto import tqdm

from flowsim import flow as flow_functions
from flowsim import bdf, stiff
from flowsim.config import SolverConfig, resolve_config
from flowsim.flow import GradientFlow
from flowsim.progress import ticking
from flowsim.interrupts import run_in_chunks
from flowsim import methods
from flowsim.methods import AUTO, DEFAULT_METHOD, METHOD, default_rtol, method_for
from flowsim.models import Params
from flowsim.status import Status, at_time
from flowsim.trajectory import Trajectory

SCIPY_METHODS = {"LSODA": scipy.integrate.LSODA, "BDF": scipy.integrate.BDF, "Radau": scipy.integrate.Radau}
DIFFRAX_METHODS = {"Kvaerno5": diffrax.Kvaerno5, "Tsit5": diffrax.Tsit5, "Dopri8": diffrax.Dopri8}

CHECKPOINT_EVERY_S = 20.0
# the defaults of the configuration's [solver] section, written once there
DEFAULT_ATOL = SolverConfig.model_fields["atol"].default
DEFAULT_MAX_STEPS = SolverConfig.model_fields["max_steps"].default


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
    radau_state: dict[str, np.ndarray] | None = None  # JaxRadau's loop state when interrupted (see ResumePoint)

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


@dataclass(frozen=True)
class ResumePoint:
    """Where a stopped solve continues: the points it saved (``t`` ascending from 0, ``theta``
    flat, one row per time) and, for JaxRadau, its whole loop state (``FlowResult.radau_state``).

    With the loop state JaxRadau takes exactly the steps of an uninterrupted solve, and
    gradient descent does too (it resumes at the step of its last saved point). The other
    methods start afresh from the last saved point, so their steps differ from an
    uninterrupted solve's."""

    t: np.ndarray
    theta: np.ndarray
    radau_state: dict[str, np.ndarray] | None = None

    def is_exact(self, method: str) -> bool:
        known = METHOD[method]
        return known.resumes_exactly and (not known.needs_saved_state or self.radau_state is not None)


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


def _check_options(method: str, rtol: float, atol: float, max_steps: int, lr: float | None) -> None:
    """The options, checked by the configuration's [solver] schema (a ConfigError, a ValueError, names the bad one)."""
    if method == "gradient_descent" and lr is None:
        raise ValueError("gradient_descent needs a positive learning rate solver.lr, got None")
    options = {"method": method, "rtol": rtol, "atol": atol,
               "max_steps": int(max_steps) if isinstance(max_steps, np.integer) else max_steps}
    resolve_config({"solver": options if lr is None else {**options, "lr": lr}})


def _initial_vector(flow: GradientFlow, params0: Params) -> np.ndarray:
    theta0 = flow.flatten(params0)
    if not np.all(np.isfinite(theta0)):
        raise ValueError("the initial parameters contain non-finite values")
    return theta0


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
    bar = _Progress(problem.progress and not method.shows_own_progress, times[0], times[-1], method.name)
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


def _stats(counts: dict, started: float) -> SolverStats:
    """Statistics from a method's counts (compile_seconds among them) and its start time."""
    wall = time.perf_counter() - started
    return SolverStats(**counts, wall_time_s=wall, solve_seconds=wall - counts["compile_seconds"])


def _result(flow, method, status, message, t_reached, saved_t, saved_theta, stats) -> FlowResult:
    thetas = np.asarray(saved_theta).reshape(-1, flow.size)
    trajectory = Trajectory(
        t=np.asarray(saved_t, dtype=float), loss=flow.loss_along(thetas), params=flow.unflatten_batch(thetas)
    )
    return FlowResult(status, message, method, float(t_reached), stats, trajectory)


class _Progress:
    """A tqdm bar over model time on a log scale, log(1 + t) / log(1 + t_end): a gradient
    flow's steps grow with t, so its cost goes with log t rather than t, and so does the
    estimate of the time left."""

    def __init__(self, enabled: bool, t_start: float, t_end: float, method: str):
        self.method, self.t_end = method, float(t_end)
        self.bar = tqdm(total=float(np.log1p(t_end)), initial=float(np.log1p(t_start)), disable=not enabled, smoothing=0.0,
                        desc=self._label(t_start), bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]")

    def _label(self, t: float) -> str:
        return f"flow ({self.method}) t={t:.4g}/{self.t_end:.4g}"

    def compiling(self, seconds: float) -> None:
        """Say so while JAX compiles (tens of seconds the first time a model shape is met), with the seconds so far,
        not a silent 0%."""
        self.bar.set_description_str(f"flow ({self.method}) compiling (once per model shape) {seconds:.0f} s", refresh=True)

    def update(self, t: float) -> None:
        self.bar.set_description_str(self._label(t), refresh=False)
        self.bar.update(max(0.0, float(np.log1p(t)) - self.bar.n))

    def close(self) -> None:
        self.bar.close()


# ---------------------------------------------------------------------------------------------
# The entry points


# How each family builds its method object from (name, lr); ``register_method`` adds families.
FAMILIES: dict[str, Callable[[str, float | None], "Method"]] = {
    "scipy": lambda name, lr: Scipy(name), "diffrax": lambda name, lr: Diffrax(name), "radau": lambda name, lr: JaxRadau(),
    "bdf": lambda name, lr: JaxBDF(), "descent": lambda name, lr: GradientDescent(lr),
}


def register_method(method: methods.Method, build: Callable[[str, float | None], Method]) -> None:
    """Add an integration method: its properties (``flowsim.methods.Method``: name, family, default rtol, what it
    can do) and ``build(name, lr)``, which returns its ``Method`` object. Configurations, ``solve_flow`` and the
    run layer then accept its name like a shipped method's (docs/extending.md)."""
    if method.family in FAMILIES:
        raise ValueError(f"method family {method.family!r} is taken; give the new method a family of its own")
    methods.register(method)
    FAMILIES[method.family] = build


def method_named(name: str, lr: float | None = None) -> Method:
    """The method object for a configured name (``flowsim.methods.METHOD``), built by its family."""
    if name not in METHOD:
        raise ValueError(f"unknown method {name!r}; expected one of {sorted(METHOD)}")
    family = METHOD[name].family
    return FAMILIES[family](name, lr)


def solve_flow(
    flow: GradientFlow,
    params0: Params,
    t_eval,
    *,
    method: str | Method = DEFAULT_METHOD,
    rtol: float | None = None,
    atol: float = DEFAULT_ATOL,
    max_steps: int = DEFAULT_MAX_STEPS,
    lr: float | None = None,
    progress: bool = False,
    on_checkpoint: Callable[[FlowResult], None] | None = None,
    checkpoint_every_s: float = CHECKPOINT_EVERY_S,
    should_stop: Callable[[], bool] | None = None,
    resume: ResumePoint | None = None,
) -> FlowResult:
    """Integrate ``flow`` from ``params0`` and save at ``t_eval`` (ascending, t_eval[0] = 0).

    ``method`` is a name (``flowsim.methods.METHOD``; "auto", the default, picks JaxRadau or JaxBDF by the flow's
    size: ``flowsim.methods.method_for``) or a method object (``JaxRadau(rank=16)``).
    ``rtol``/``atol`` are the error tolerances of the adaptive methods (``rtol`` defaults
    to the method's own, ``default_rtol(method)``; with a small
    initialisation of scale ε, atol must sit well below ε²); ``lr`` is the step η of
    ``gradient_descent``. ``max_steps`` bounds the steps taken. ``on_checkpoint``, if
    given, receives the partial result every ``checkpoint_every_s`` seconds, so a long
    run can be saved as it goes. ``should_stop`` is polled between chunks of work (each
    under a second or so): once it returns True the solve returns what it has, with
    status ``interrupted``. ``resume`` continues a stopped solve (``ResumePoint``); the
    result then holds every point, the earlier ones included.
    """
    if method == AUTO:
        method = method_for(AUTO, flow.size)
    name = method if isinstance(method, str) else method.name
    rtol = default_rtol(name) if rtol is None else rtol
    _check_options(name, rtol, atol, max_steps, lr if isinstance(method, str) else getattr(method, "lr", None))
    solver = method_named(method, lr) if isinstance(method, str) else method
    times = check_save_times(t_eval)
    theta0 = _initial_vector(flow, params0)
    # JaxRadau continues its saved loop state exactly; every other resume starts afresh at the last saved point
    state = resume.radau_state if resume is not None and METHOD[name].needs_saved_state else None
    prefix_t, prefix_theta = np.zeros(0), np.zeros((0, flow.size))
    if resume is not None and state is None:
        if not resume.t[-1] < times[-1]:
            raise ValueError(f"nothing to resume: the saved points reach t = {resume.t[-1]:g}, the last save time")
        prefix_t, prefix_theta = np.asarray(resume.t[:-1]), np.asarray(resume.theta[:-1])
        times = np.concatenate([[resume.t[-1]], times[times > resume.t[-1]]])
        theta0 = np.asarray(resume.theta[-1])
    problem = Problem([flow], theta0[None], times, rtol, atol, int(max_steps), progress,
                      listening=progress or on_checkpoint is not None or should_stop is not None, should_stop=should_stop)
    saved = None if state is None else solver.check_saved_state(state, problem)  # checked before anything is compiled
    checkpoint = None if on_checkpoint is None else lambda results: on_checkpoint(_prepend(flow, prefix_t, prefix_theta, results[0]))
    result = drive(solver, problem, checkpoint, checkpoint_every_s, saved=saved)[0]
    return _prepend(flow, prefix_t, prefix_theta, result)


def solve_flow_batch(
    flows: list[GradientFlow],
    params0: list[Params],
    t_eval,
    *,
    method: JaxRadau | None = None,
    rtol: float | None = None,
    atol: float = DEFAULT_ATOL,
    max_steps: int = DEFAULT_MAX_STEPS,
    progress: bool = False,
    on_checkpoint: Callable[[list[FlowResult]], None] | None = None,
    checkpoint_every_s: float = CHECKPOINT_EVERY_S,
    should_stop: Callable[[], bool] | None = None,
) -> list[FlowResult]:
    """Integrate several flows of one structure together with ``JaxRadau`` (one compiled
    loop over the batch), each from its own start, all saved at ``t_eval``.

    The flows must share ``GradientFlow.structure_key`` (same model, rates and loss
    kind; the chains may differ). Each member takes the steps it takes alone, so the
    results equal those of ``solve_flow(..., method="JaxRadau")`` run one by one.
    ``should_stop`` as in ``solve_flow`` (which also resumes an interrupted member exactly).
    """
    solver = JaxRadau() if method is None else method
    rtol = default_rtol(solver.name) if rtol is None else rtol
    _check_options(solver.name, rtol, atol, max_steps, None)
    if not flows or len(flows) != len(params0):
        raise ValueError(f"need one start per flow, got {len(flows)} flows and {len(params0)} starts")
    keys = {flow.structure_key for flow in flows}
    if len(keys) > 1:
        raise ValueError("flows batched together must share one structure (model, rates, loss kind); "
                         f"got {len(keys)} different structures")
    times = check_save_times(t_eval)
    thetas0 = np.stack([_initial_vector(flow, params) for flow, params in zip(flows, params0)])
    problem = Problem(list(flows), thetas0, times, rtol, atol, int(max_steps), progress,
                      listening=progress or on_checkpoint is not None or should_stop is not None, should_stop=should_stop)
    return drive(solver, problem, on_checkpoint, checkpoint_every_s)


def _prepend(flow: GradientFlow, prefix_t: np.ndarray, prefix_theta: np.ndarray, result: FlowResult) -> FlowResult:
    """``result`` with the earlier points of a resumed solve in front of its own."""
    if len(prefix_t) == 0:
        return result
    trajectory = result.trajectory
    thetas = np.concatenate([prefix_theta, flow.flatten_batch(trajectory.params)])
    joined = Trajectory(t=np.concatenate([prefix_t, trajectory.t]), loss=np.concatenate([flow.loss_along(prefix_theta), trajectory.loss]),
                        params=flow.unflatten_batch(thetas))
    return dataclasses.replace(result, trajectory=joined)


# ---------------------------------------------------------------------------------------------
# JaxRadau: the compiled Radau IIA loop, over a batch of flows


# Compiled JaxRadau integrators, shared by flows of one structure, batch size, save grid and method fields.
_RADAU_COMPILED: dict[tuple, stiff.RadauFunctions] = {}
RADAU_FIRST_CHUNK = 8  # step attempts in the first call of the compiled loop, when chunked
RADAU_CHUNK_SECONDS = 0.5  # later chunks are sized to about this wall-clock time
SAVE_BUFFER_BYTES = 16 * 2**20  # a save buffer this small costs nothing to carry (MEASUREMENTS.md)
SEQUENTIAL_STAGES_FROM_SIZE = 16_384  # larger flows evaluate the three Radau stages one by one (MEASUREMENTS.md)
# Eigenpairs of the Jacobian JaxRadau keeps (its stiff directions), by flow size: 8 at the
# paper's sizes, 32 from n = 1024, where 8 leaves stiff directions outside the subspace and
# the Newton iteration fails (benchmarks/MEASUREMENTS.md).
STIFF_RANKS = ((0, 8), (1024, 32))
# From this size the flow has more stiff directions than the eigensystem keeps: Newton control
# for slow solves (stiff.LARGE_FLOW_CONTROL) and lagged subspace refreshes (MEASUREMENTS.md).
LARGE_FLOW_FROM_SIZE = 1024


def stiff_rank(size: int) -> int:
    """The number of eigenpairs JaxRadau keeps for a flow of ``size`` parameters (STIFF_RANKS)."""
    return max(rank for threshold, rank in STIFF_RANKS if size >= threshold)


def _save_slots(n_times: int, size: int) -> int:
    """Save buffers come in powers of two, at least 64 and, while the buffer of a flow of ``size`` parameters
    stays within SAVE_BUFFER_BYTES, at least 512: every save grid of up to 512 times shares one compilation."""
    floor = 512 if 512 * size * 8 <= SAVE_BUFFER_BYTES else 64
    return max(floor, 1 << (n_times - 1).bit_length())


@dataclass
class RadauIntegration(Integration):
    functions: Any = None
    loss: Any = None  # the batch's losses, stacked
    state: Any = None  # stiff.RadauState
    times_device: Any = None
    slots: int = 0
    chunk: int = RADAU_FIRST_CHUNK
    solve_started: float = 0.0


@dataclass(frozen=True)
class JaxRadau(Method):
    """Radau IIA (order 5) compiled end to end in JAX (``flowsim.stiff``) over a batch of flows.

    ``rank``: eigenpairs of the Jacobian kept (None: ``stiff_rank(n)``, the full eigensystem when n is
    smaller); ``large_flow``: the Newton control and lagged subspace refreshes of flows with more stiff
    directions than the eigensystem keeps (None: from n = LARGE_FLOW_FROM_SIZE); ``fused_products``:
    the model's small products fused inside the loop (``GradientFlow.loop_loss``)."""

    rank: int | None = None
    large_flow: bool | None = None
    fused_products: bool = True
    name = "JaxRadau"

    def rank_for(self, size: int) -> int:
        return stiff_rank(size) if self.rank is None else self.rank

    def is_large(self, size: int) -> bool:
        return size >= LARGE_FLOW_FROM_SIZE if self.large_flow is None else self.large_flow

    def compiled(self, flow: GradientFlow, batch: int, n_save: int, loss_batch) -> tuple[stiff.RadauFunctions, float]:
        """The compiled integrator for this structure (built on first use) and the seconds spent compiling now."""
        rank, large = self.rank_for(flow.size), self.is_large(flow.size)
        key = (flow.structure_key, batch, n_save, rank, large, self.fused_products)
        if key in _RADAU_COMPILED:
            return _RADAU_COMPILED[key], 0.0
        # Pure functions of one member with the (static) structure bound: no flow object is captured.
        structure = flow.structure
        bind = lambda function: functools.partial(function, structure)  # noqa: E731
        if not flow.eigensystem_is_real:
            eigensystem = stiff.general_eigensystem(bind(flow_functions.jacobian))
        elif flow.size <= rank:
            eigensystem = stiff.symmetric_eigensystem(bind(flow_functions.rate_vector), bind(flow_functions.loss_hessian))
        else:
            eigensystem = stiff.low_rank_eigensystem(bind(flow_functions.rate_vector), bind(flow_functions.loss_gradient),
                                                     flow.size, rank, lagged=large)
        newton = stiff.LARGE_FLOW_CONTROL if large else stiff.NewtonControl()
        problem = stiff.RadauProblem(bind(flow_functions.vector_field), eigensystem, flow.rates.kinks,
                                     sequential_stages=flow.size >= SEQUENTIAL_STAGES_FROM_SIZE, newton=newton)
        functions = stiff.build_radau(problem, batch, n_save, flow.size, loss_batch)
        _RADAU_COMPILED[key] = functions
        return functions, functions.compile_seconds

    def check_saved_state(self, arrays: dict[str, np.ndarray], problem: Problem) -> stiff.RadauState:
        """A saved loop state (``FlowResult.radau_state``) for this problem, or a ValueError naming what is wrong."""
        batch, size = problem.thetas0.shape
        state = _radau_state_from_arrays(arrays, batch, size, _save_slots(len(problem.times), size), self.is_large(size))
        t, start, end = np.asarray(state.t), float(problem.times[0]), float(problem.times[-1])
        if not np.all(np.isfinite(t)) or np.any(t < start) or np.any(t > end):
            raise ValueError(f"the saved JaxRadau state is at t = {t.tolist()}, outside the run's save times [{start:g}, "
                             f"{end:g}]: the file was altered")
        if not (np.all(np.isfinite(np.asarray(state.y))) and np.all(np.asarray(state.h) > 0)):
            raise ValueError("the saved JaxRadau state holds a non-finite point or a step size that is not positive: "
                             "the file was altered")
        return state

    def start(self, problem: Problem, state: stiff.RadauState | None = None) -> RadauIntegration:
        """Compile (once per structure) and start, or continue the loop ``state``."""
        flows, times = problem.flows, problem.times
        losses = [flow.loop_loss if self.fused_products else flow.loss for flow in flows]
        loss = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *losses)
        slots = _save_slots(len(times), problem.flow.size)
        functions, compile_seconds = self.compiled(problem.flow, len(flows), slots, loss)
        times_device = padded_save_times(times, slots)
        solve_started = time.perf_counter()
        if state is None:
            state = functions.init(jnp.asarray(problem.thetas0), loss, times_device, times[-1], problem.rtol, problem.atol)
        run = RadauIntegration(problem, float(times[0]), compile_seconds=compile_seconds, functions=functions, loss=loss,
                               state=state, times_device=times_device, slots=slots, chunk=first_chunk(problem),
                               solve_started=solve_started)
        run.t = float(np.min(np.asarray(state.t)))
        return run

    def advance(self, run: RadauIntegration) -> None:
        problem, t_end = run.problem, run.problem.times[-1]
        max_attempts = attempt_limit(problem)
        chunk_started = time.perf_counter()
        run.state = run.functions.advance(run.state, run.loss, run.times_device, t_end, t_end, problem.rtol, problem.atol,
                                          max_attempts, np.int32(run.chunk))
        active = np.asarray(run.state.status) == Status.RUNNING
        run.chunk = next_chunk(run.chunk, time.perf_counter() - chunk_started)
        run.t = float(np.min(np.where(active, run.state.t, t_end)))
        if not active.any():
            run.status = Status.FINISHED  # each member's own status is in its result

    def interrupt(self, run: RadauIntegration) -> None:
        run.status = Status.INTERRUPTED

    def results(self, run: RadauIntegration) -> list[FlowResult]:
        problem, state = run.problem, jax.device_get(run.state)
        wall, solve_seconds = time.perf_counter() - problem.started, time.perf_counter() - run.solve_started
        arrays = _radau_state_to_arrays(run.state) if run.status == Status.INTERRUPTED else None
        results = []
        for i, flow in enumerate(problem.flows):
            status = Status(int(state.status[i]))
            message = status.message(at_time(float(state.t[i])), max_steps=problem.max_steps, method=self.name,
                                     reason="the step size fell below its floor")
            n_saved = int(state.n_saved[i])
            stats = SolverStats(
                n_steps=int(state.n_steps[i]), n_rejected=int(state.n_rejected[i]), nfev=int(state.nfev[i]),
                njev=int(state.njev[i]), nlu=int(state.njev[i]), wall_time_s=wall, compile_seconds=run.compile_seconds,
                solve_seconds=solve_seconds,
            )
            result = _result(flow, self.name, status, message, state.t[i], problem.times[:n_saved], state.saved[i, :n_saved], stats)
            if arrays is not None and status == Status.RUNNING:
                result = dataclasses.replace(result, status=Status.INTERRUPTED, radau_state=arrays,
                                             message=Status.INTERRUPTED.message(at_time(result.t_reached)))
            results.append(result)
        return results


def padded_save_times(times: np.ndarray, slots: int) -> jax.Array:
    """The save times padded with +inf to the save buffer's ``slots`` (never reached)."""
    return jnp.asarray(np.concatenate([times, np.full(slots - len(times), np.inf)]))


def first_chunk(problem: Problem) -> int:
    """Step attempts in a compiled loop's first call: each call returns to the host to report, checkpoint or stop,
    so only when someone is listening does the loop run in chunks (later ones sized by ``next_chunk``)."""
    return RADAU_FIRST_CHUNK if problem.listening else 2**31 - 1


def attempt_limit(problem: Problem) -> np.int32:
    """``max_steps`` as the compiled loops take it."""
    return np.int32(min(problem.max_steps, 2**31 - 1))


def next_chunk(chunk: int, elapsed: float) -> int:
    """Step attempts for a compiled loop's next call: sized to about RADAU_CHUNK_SECONDS, at most doubled."""
    return int(np.clip(chunk * RADAU_CHUNK_SECONDS / max(elapsed, 1e-3), 1, 2 * chunk + 1))


def _radau_state_to_arrays(state: stiff.RadauState) -> dict[str, np.ndarray]:
    """The loop state as named numpy arrays (``jacobian.V`` for the nested eigensystem)."""
    state = jax.device_get(state)
    arrays = {name: np.asarray(value) for name, value in state._asdict().items() if name != "jacobian"}
    arrays.update({f"jacobian.{name}": np.asarray(value) for name, value in state.jacobian._asdict().items()})
    return arrays


def _radau_state_from_arrays(arrays: dict[str, np.ndarray], batch: int, size: int, slots: int, large: bool) -> stiff.RadauState:
    """The loop state back from ``_radau_state_to_arrays`` (its interrupted members are still running in it)."""
    if "jacobian.ahead" not in arrays and "jacobian.V_inv" in arrays:  # saved before eigensystems carried it
        basis = np.swapaxes(arrays["jacobian.V_inv"], 1, 2)  # its own subspace stands in for the next one
        lagged = large and basis.shape[2] < size
        arrays = {**arrays, "jacobian.ahead": basis if lagged else basis[:, :, :0]}
    try:
        jacobian = stiff.Eigensystem(*(jnp.asarray(arrays[f"jacobian.{name}"]) for name in stiff.Eigensystem._fields))
        fields = {name: jnp.asarray(arrays[name]) for name in stiff.RadauState._fields if name != "jacobian"}
    except KeyError as error:
        raise ValueError(f"the saved JaxRadau state lacks the array {error.args[0]!r}") from None
    saved = fields["saved"]
    if saved.ndim == 3 and saved.shape[1] < slots:
        # saved with a smaller buffer (an earlier version's): the written rows are kept, the rest are padding
        fields["saved"] = jnp.concatenate([saved, jnp.zeros((saved.shape[0], slots - saved.shape[1], *saved.shape[2:]))], axis=1)
    if fields["y"].shape != (batch, size) or fields["saved"].shape != (batch, slots, size):
        raise ValueError(f"the saved JaxRadau state is for {fields['y'].shape} parameters and "
                         f"{fields['saved'].shape[1]} save slots, not ({batch}, {size}) and {slots}")
    return stiff.RadauState(jacobian=jacobian, **fields)


# ---------------------------------------------------------------------------------------------
# JaxBDF: the compiled matrix-free BDF loop, one flow


_BDF_COMPILED: dict[tuple, bdf.BdfFunctions] = {}  # by flow structure and save slots


@dataclass
class BdfIntegration(Integration):
    functions: Any = None
    loss: Any = None
    state: Any = None  # bdf.BdfState
    times_device: Any = None
    chunk: int = RADAU_FIRST_CHUNK
    solve_started: float = 0.0


@dataclass(frozen=True)
class JaxBDF(Method):
    """Variable-order BDF compiled end to end in JAX, its Newton systems solved by GMRES on J·v products
    (``flowsim.bdf``): nothing of size n² is held, so it suits the largest flows."""

    name = "JaxBDF"

    def start(self, problem: Problem) -> BdfIntegration:
        flow, times = problem.flow, problem.times
        loss = flow.loop_loss
        slots = _save_slots(len(times), flow.size)
        key, compile_seconds = (flow.structure_key, slots), 0.0
        if key not in _BDF_COMPILED:
            field_of_member = functools.partial(flow_functions.vector_field, flow.structure)
            _BDF_COMPILED[key] = bdf.build_bdf(bdf.BdfProblem(field_of_member, flow.rates.kinks), slots, flow.size, loss)
            compile_seconds = _BDF_COMPILED[key].compile_seconds
        functions = _BDF_COMPILED[key]
        times_device = padded_save_times(times, slots)
        solve_started = time.perf_counter()
        state = functions.init(jnp.asarray(problem.thetas0[0]), loss, times_device, times[-1], problem.rtol, problem.atol)
        return BdfIntegration(problem, float(times[0]), compile_seconds=compile_seconds, functions=functions, loss=loss,
                              state=state, times_device=times_device, chunk=first_chunk(problem), solve_started=solve_started)

    def advance(self, run: BdfIntegration) -> None:
        problem, t_end = run.problem, run.problem.times[-1]
        chunk_started = time.perf_counter()
        run.state = run.functions.advance(run.state, run.loss, run.times_device, t_end, t_end, problem.rtol, problem.atol,
                                          attempt_limit(problem), np.int32(run.chunk))
        run.chunk = next_chunk(run.chunk, time.perf_counter() - chunk_started)
        run.t = float(run.state.t)
        if int(run.state.status) != Status.RUNNING:
            run.status = Status.FINISHED  # the flow's own status is in its result

    def interrupt(self, run: BdfIntegration) -> None:
        run.status = Status.INTERRUPTED

    def results(self, run: BdfIntegration) -> list[FlowResult]:
        problem, state = run.problem, jax.device_get(run.state)
        status = Status(int(state.status))
        if run.status == Status.INTERRUPTED and status == Status.RUNNING:
            status = Status.INTERRUPTED
        message = status.message(at_time(float(state.t)), max_steps=problem.max_steps, method=self.name,
                                 reason="the step size fell below its floor")
        n_saved = int(state.n_saved)
        stats = SolverStats(n_steps=int(state.n_steps), n_rejected=int(state.n_rejected), nfev=int(state.nfev),
                            njev=int(state.n_products), nlu=0, wall_time_s=time.perf_counter() - problem.started,
                            compile_seconds=run.compile_seconds, solve_seconds=time.perf_counter() - run.solve_started)
        return [_result(problem.flow, self.name, status, message, state.t, problem.times[:n_saved], state.saved[:n_saved], stats)]


# ---------------------------------------------------------------------------------------------
# scipy's stiff integrators, one step per chunk


@dataclass
class ScipyIntegration(Integration):
    solver: Any = None
    steps: int = 0
    saved_t: list = field(default_factory=list)
    saved_theta: list = field(default_factory=list)


@dataclass(frozen=True)
class Scipy(Method):
    """scipy's LSODA, BDF or Radau with the exact Jacobian from JAX, one step per chunk."""

    name: str = "LSODA"

    def start(self, problem: Problem) -> ScipyIntegration:
        flow, times = problem.flow, problem.times
        theta0 = problem.thetas0[0]
        field_ = lambda t, theta: np.asarray(flow.vector_field(t, theta))  # noqa: E731
        jacobian = lambda t, theta: np.asarray(flow.jacobian(t, theta))  # noqa: E731
        field_(times[0], theta0), jacobian(times[0], theta0)  # compiles both on first use
        compile_seconds = time.perf_counter() - problem.started
        solver = SCIPY_METHODS[self.name](field_, times[0], theta0, times[-1], rtol=problem.rtol, atol=problem.atol, jac=jacobian)
        return ScipyIntegration(problem, float(times[0]), compile_seconds=compile_seconds, solver=solver,
                        saved_t=[times[0]], saved_theta=[theta0])

    def advance(self, run: ScipyIntegration) -> None:
        problem, solver, times = run.problem, run.solver, run.problem.times
        if run.steps >= problem.max_steps:
            run.status = Status.STEP_LIMIT
            run.message = run.status.message(at_time(solver.t), max_steps=problem.max_steps)
            return
        error = solver.step()
        run.steps += 1
        run.t = float(solver.t)
        if solver.status == "failed":
            run.status = Status.SOLVER_FAILED
            run.message = run.status.message(at_time(solver.t), method=self.name, reason=str(error))
            return
        if not np.all(np.isfinite(solver.y)):
            run.status = Status.NON_FINITE
            run.message = run.status.message(at_time(solver.t))
            return
        interpolant = solver.dense_output()
        while len(run.saved_t) < len(times) and times[len(run.saved_t)] <= solver.t:
            run.saved_t.append(times[len(run.saved_t)])
            run.saved_theta.append(interpolant(run.saved_t[-1]))
        if len(run.saved_t) == len(times):
            run.status, run.message = Status.FINISHED, Status.FINISHED.message()

    def results(self, run: ScipyIntegration) -> list[FlowResult]:
        solver = run.solver
        counts = {"n_steps": run.steps, "n_rejected": None, "nfev": int(solver.nfev), "njev": int(solver.njev),
                  "nlu": int(getattr(solver, "nlu", 0)), "compile_seconds": run.compile_seconds}
        return [_result(run.problem.flow, self.name, run.status, run.message, solver.t, run.saved_t, run.saved_theta,
                        _stats(counts, run.problem.started))]


# ---------------------------------------------------------------------------------------------
# diffrax: one compiled call


def _call_while_listening(function: Callable, *arguments):
    """``function(*arguments)`` in a worker thread while the main thread waits in short joins.
    Python runs signal handlers only in the main thread, between bytecodes: blocked in one long
    compiled call it would not run them until the call returned, and a stop request made by
    SIGINT / SIGTERM would never reach the solver's polled event."""
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = function(*arguments)
        except BaseException as error:  # handed to the caller below
            outcome["error"] = error

    worker = threading.Thread(target=target, name="flowsim-solve", daemon=True)  # daemon: a second signal can exit
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@dataclass
class DiffraxIntegration(Integration):
    compiled: Any = None
    arguments: tuple = ()
    t_reached: float = 0.0
    saved_t: np.ndarray | None = None
    saved_theta: np.ndarray | None = None
    counts: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Diffrax(Method):
    """diffrax's Kvaerno5, Tsit5 or Dopri8, the whole solve one compiled call (its own progress meter; a
    stop request reaches it through an event polled after every step)."""

    name: str = "Kvaerno5"
    shows_own_progress = True

    def start(self, problem: Problem) -> DiffraxIntegration:
        flow, times = problem.flow, problem.times
        term = diffrax.ODETerm(lambda t, y, args: flow.vector_field(t, y))
        # PI coefficients of diffrax's advice for stiff problems: far fewer rejected implicit steps.
        gains = {"pcoeff": 0.3, "icoeff": 0.4} if self.name == "Kvaerno5" else {}
        controller = diffrax.PIDController(rtol=problem.rtol, atol=problem.atol, **gains)
        kinks = [t for t in flow.rates.kinks if times[0] < t < times[-1]]
        if kinks:
            controller = diffrax.ClipStepSizeController(controller, step_ts=jnp.asarray(kinks, dtype=float))
        meter = diffrax.TqdmProgressMeter() if problem.progress else diffrax.NoProgressMeter()
        should_stop = problem.should_stop
        stop = None if should_stop is None else diffrax.Event(lambda t, y, args, **kwargs: jax.pure_callback(
            lambda t: np.bool_(should_stop()), jax.ShapeDtypeStruct((), jnp.bool_), t))

        def integrate(y0, save_times):
            return diffrax.diffeqsolve(
                term, DIFFRAX_METHODS[self.name](), t0=save_times[0], t1=save_times[-1], dt0=None, y0=y0,
                saveat=diffrax.SaveAt(ts=save_times), stepsize_controller=controller, max_steps=problem.max_steps,
                throw=False, progress_meter=meter, event=stop,
            )

        arguments = (jnp.asarray(problem.thetas0[0]), jnp.asarray(times))
        compiled = jax.jit(integrate).lower(*arguments).compile()
        return DiffraxIntegration(problem, float(times[0]), compile_seconds=time.perf_counter() - problem.started,
                          compiled=compiled, arguments=arguments, t_reached=float(times[0]),
                          saved_t=times[:1], saved_theta=problem.thetas0[:1],
                          counts={"n_steps": 0, "n_rejected": None, "nfev": None, "njev": None, "nlu": None})

    def advance(self, run: DiffraxIntegration) -> None:
        problem, times = run.problem, run.problem.times
        solution = (run.compiled(*run.arguments) if problem.should_stop is None
                    else _call_while_listening(run.compiled, *run.arguments))
        ys = np.asarray(solution.ys)
        reached = np.all(np.isfinite(ys), axis=1)
        n_saved = len(times) if reached.all() else int(np.argmin(reached))
        run.counts = {"n_steps": int(solution.stats["num_accepted_steps"]), "n_rejected": int(solution.stats["num_rejected_steps"]),
                      "nfev": None, "njev": None, "nlu": None}
        result = solution.result
        if result == diffrax.RESULTS.successful:
            status, message = Status.FINISHED, Status.FINISHED.message()
        elif result == diffrax.RESULTS.max_steps_reached:
            status, message = Status.STEP_LIMIT, Status.STEP_LIMIT.message(max_steps=problem.max_steps)
        elif result == diffrax.RESULTS.event_occurred:
            where = f"after t = {times[n_saved - 1]:.6g}" if n_saved else "before the first save time"
            status, message = Status.INTERRUPTED, Status.INTERRUPTED.message(where)
        else:
            status = Status.SOLVER_FAILED
            message = status.message(method=self.name, reason=str(diffrax.RESULTS[result]))
        if status == Status.FINISHED and n_saved < len(times):
            status = Status.NON_FINITE
            message = status.message(f"after t = {times[n_saved - 1]:.6g}")
        run.status, run.message = status, message
        run.t_reached = float(times[max(n_saved - 1, 0)]) if status != Status.FINISHED else float(times[-1])
        run.t = run.t_reached
        run.saved_t, run.saved_theta = times[:n_saved], ys[:n_saved]

    def results(self, run: DiffraxIntegration) -> list[FlowResult]:
        stats = _stats({**run.counts, "compile_seconds": run.compile_seconds}, run.problem.started)
        return [_result(run.problem.flow, self.name, run.status, run.message, run.t_reached, run.saved_t, run.saved_theta, stats)]


# ---------------------------------------------------------------------------------------------
# Gradient descent: compiled chunks of steps


GD_CHUNK_STEPS = 1 << 14  # gradient-descent steps per compiled call: a stop request waits for at most this many
DIVERGENCE_FACTOR = 1e3  # gradient descent has diverged once its loss exceeds this multiple of max(|initial loss|, 1)


@dataclass
class DescentIntegration(Integration):
    theta: Any = None
    step: int = 0
    loss0: float = 0.0
    save_steps: np.ndarray | None = None
    saved_steps: list = field(default_factory=list)
    saved_theta: list = field(default_factory=list)


@dataclass(frozen=True)
class GradientDescent(Method):
    """θ_{n+1} = θ_n - η r(nη) ∇L(θ_n) at time t = nη, in compiled chunks of up to GD_CHUNK_STEPS steps;
    saved at the steps nearest the save times (they are distinct, so times stay ascending)."""

    lr: float | None = None
    name = "gradient_descent"

    def start(self, problem: Problem) -> DescentIntegration:
        flow, lr = problem.flow, self.lr
        save_steps = np.unique(np.rint(problem.times / lr).astype(np.int64))
        theta0 = problem.thetas0[0]
        theta = jnp.asarray(theta0)
        flow.gradient_descent(theta, 0, 0, lr).block_until_ready()  # compiles on first use
        loss0 = float(flow.loss_along(theta0[None])[0])
        first = int(save_steps[0])
        return DescentIntegration(problem, first * lr, compile_seconds=time.perf_counter() - problem.started, theta=theta,
                          step=first, loss0=loss0, save_steps=save_steps, saved_steps=[first], saved_theta=[np.asarray(theta)])

    def advance(self, run: DescentIntegration) -> None:
        problem, flow, lr = run.problem, run.problem.flow, self.lr
        target = int(run.save_steps[len(run.saved_steps)])
        if target > problem.max_steps:
            run.status = Status.STEP_LIMIT
            run.message = run.status.message(at_time(run.saved_steps[-1] * lr), max_steps=problem.max_steps)
            return
        end = min(target, run.step + GD_CHUNK_STEPS)
        run.theta, run.step = flow.gradient_descent(run.theta, run.step, end, lr), end
        if run.step < target:
            return
        between = f"between t = {run.saved_steps[-1] * lr:.6g} and t = {target * lr:.6g}"
        loss = float(flow.loss_along(np.asarray(run.theta)[None])[0])
        if not (np.isfinite(loss) and bool(jnp.all(jnp.isfinite(run.theta)))):
            run.status, run.message = Status.NON_FINITE, Status.NON_FINITE.message(between)
            return
        if loss > DIVERGENCE_FACTOR * max(abs(run.loss0), 1.0):
            run.status = Status.DIVERGED
            run.message = run.status.message(between, reason=f"the loss rose from {run.loss0:.6g} to {loss:.3g} "
                                             f"(beyond {DIVERGENCE_FACTOR:g} x max(|start|, 1)); lower solver.lr = {lr:g}")
            return
        run.saved_steps.append(target)
        run.saved_theta.append(np.asarray(run.theta))
        run.t = target * lr
        if len(run.saved_steps) == len(run.save_steps):
            run.status, run.message = Status.FINISHED, Status.FINISHED.message()

    def interrupt(self, run: DescentIntegration) -> None:
        run.status, run.message = Status.INTERRUPTED, Status.INTERRUPTED.message(at_time(run.saved_steps[-1] * self.lr))

    def results(self, run: DescentIntegration) -> list[FlowResult]:
        n, first = run.saved_steps[-1], run.saved_steps[0]
        counts = {"n_steps": n - first, "n_rejected": None, "nfev": n - first, "njev": 0, "nlu": 0,
                  "compile_seconds": run.compile_seconds}
        return [_result(run.problem.flow, self.name, run.status, run.message, n * self.lr,
                        np.array(run.saved_steps) * self.lr, run.saved_theta, _stats(counts, run.problem.started))]
