"""One entry point, ``solve_flow``, for every way of integrating a gradient flow.

Methods:

* ``LSODA``, ``BDF``, ``Radau``: scipy's stiff integrators, driven step by step with the
  exact Jacobian -diag(r) Hessian(L) from JAX, dense output on the save times.
* ``Kvaerno5`` (implicit), ``Tsit5``, ``Dopri8`` (explicit): diffrax, with a PID step
  controller that steps exactly onto the kinks of the rate schedule.
* ``JaxRadau``: Radau IIA of order 5 compiled end to end in JAX (``flowsim.stiff``),
  with the Jacobian diagonalised so step-size changes cost nothing; it alone can
  integrate a batch of flows at once (``solve_flow_batch``).
* ``gradient_descent``: θ_{n+1} = θ_n - η r(nη) ∇L(θ_n), step n at time t = nη, saved at
  the steps nearest the save times.

Every method reports its compile time (JAX tracing and XLA compilation, zero when the
compiled code is reused) apart from its solve time after compilation.

Every method returns a ``FlowResult`` with a status: a run that hits its step limit,
meets a non-finite state, or fails inside the solver keeps every point computed
before that and says so; nothing is silently truncated.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import scipy.integrate
from tqdm.auto import tqdm

from flowsim import flow as flow_functions
from flowsim import stiff
from flowsim.config import resolve_config
from flowsim.flow import GradientFlow
from flowsim.losses import with_fused_products
from flowsim.methods import DEFAULT_METHOD, default_rtol
from flowsim.models import Params
from flowsim.status import Status, at
from flowsim.trajectory import Trajectory

SCIPY_METHODS = {"LSODA": scipy.integrate.LSODA, "BDF": scipy.integrate.BDF, "Radau": scipy.integrate.Radau}
DIFFRAX_METHODS = {"Kvaerno5": diffrax.Kvaerno5, "Tsit5": diffrax.Tsit5, "Dopri8": diffrax.Dopri8}

CHECKPOINT_EVERY_S = 20.0


@dataclass(frozen=True)
class SolverStats:
    """Work done: steps taken (accepted; rejected where the method reports them),
    vector-field and Jacobian evaluations (None where the library does not count
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
        return method == "gradient_descent" or (method == "JaxRadau" and self.radau_state is not None)


def check_save_times(t_eval, start: float = 0.0) -> np.ndarray:
    """Save times must be finite, strictly ascending, and start at ``start`` (the initial point, 0)."""
    times = np.asarray(t_eval, dtype=float)
    if times.ndim != 1 or len(times) < 2:
        raise ValueError(f"save times must be a 1-d array with at least 2 entries, got shape {times.shape}")
    if not np.all(np.isfinite(times)):
        raise ValueError("save times must be finite")
    if times[0] != start:
        raise ValueError(f"save times must start at t = {start:g} (the initial point), got t[0] = {times[0]}")
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


def solve_flow(
    flow: GradientFlow,
    params0: Params,
    t_eval,
    *,
    method: str = DEFAULT_METHOD,
    rtol: float | None = None,
    atol: float = 1e-12,
    max_steps: int = 200_000,
    lr: float | None = None,
    progress: bool = False,
    on_checkpoint: Callable[[FlowResult], None] | None = None,
    checkpoint_every_s: float = CHECKPOINT_EVERY_S,
    should_stop: Callable[[], bool] | None = None,
    resume: ResumePoint | None = None,
) -> FlowResult:
    """Integrate ``flow`` from ``params0`` and save at ``t_eval`` (ascending, t_eval[0] = 0).

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
    rtol = default_rtol(method) if rtol is None else rtol
    _check_options(method, rtol, atol, max_steps, lr)
    times = check_save_times(t_eval)
    theta0 = _initial_vector(flow, params0)
    prefix_t, prefix_theta = np.zeros(0), np.zeros((0, flow.size))
    if resume is not None and not (method == "JaxRadau" and resume.radau_state is not None):
        # Start afresh at the last saved point; the points before it are kept as they are.
        if not resume.t[-1] < times[-1]:
            raise ValueError(f"nothing to resume: the saved points reach t = {resume.t[-1]:g}, the last save time")
        prefix_t, prefix_theta = np.asarray(resume.t[:-1]), np.asarray(resume.theta[:-1])
        times = np.concatenate([[resume.t[-1]], times[times > resume.t[-1]]])
        theta0 = np.asarray(resume.theta[-1])
    if method == "JaxRadau":
        state = None if resume is None else resume.radau_state
        result = solve_flow_batch(
            [flow], [flow.unravel(theta0)], times, rtol=rtol, atol=atol, max_steps=max_steps, progress=progress,
            on_checkpoint=None if on_checkpoint is None else lambda results: on_checkpoint(_prepend(flow, prefix_t, prefix_theta, results[0])),
            checkpoint_every_s=checkpoint_every_s, should_stop=should_stop, radau_state=state, start=times[0])[0]
        return _prepend(flow, prefix_t, prefix_theta, result)
    integrate = {**dict.fromkeys(SCIPY_METHODS, _solve_scipy), **dict.fromkeys(DIFFRAX_METHODS, _solve_diffrax),
                 "gradient_descent": _solve_gradient_descent}[method]
    started = time.perf_counter()
    checkpoint = None if on_checkpoint is None else lambda partial: on_checkpoint(_prepend(flow, prefix_t, prefix_theta, partial))
    status, message, t_reached, saved_t, saved_theta, counts = integrate(
        flow, theta0, times, method=method, rtol=rtol, atol=atol, max_steps=int(max_steps), lr=lr,
        progress=progress, on_checkpoint=checkpoint, checkpoint_every_s=checkpoint_every_s, started=started,
        should_stop=should_stop,
    )
    result = _result(flow, method, status, message, t_reached, saved_t, saved_theta, _stats(counts, started))
    return _prepend(flow, prefix_t, prefix_theta, result)


def _prepend(flow: GradientFlow, prefix_t: np.ndarray, prefix_theta: np.ndarray, result: FlowResult) -> FlowResult:
    """``result`` with the earlier points of a resumed solve in front of its own."""
    if len(prefix_t) == 0:
        return result
    trajectory = result.trajectory
    thetas = np.concatenate([prefix_theta, flow.flatten_batch(trajectory.params)])
    joined = Trajectory(t=np.concatenate([prefix_t, trajectory.t]), loss=np.concatenate([flow.loss_along(prefix_theta), trajectory.loss]),
                        params=flow.unflatten_batch(thetas))
    return dataclasses.replace(result, trajectory=joined)


def _stats(counts: dict, started: float) -> SolverStats:
    """Statistics from a method's counts (compile_seconds among them) and its start time."""
    wall = time.perf_counter() - started
    return SolverStats(**counts, wall_time_s=wall, solve_seconds=wall - counts["compile_seconds"])


# Compiled JaxRadau integrators, shared by flows of one structure, batch size and save grid.
_RADAU_COMPILED: dict[tuple, stiff.RadauFunctions] = {}
RADAU_FIRST_CHUNK = 8  # step attempts in the first call of the compiled loop, when chunked
RADAU_CHUNK_SECONDS = 0.5  # later chunks are sized to about this wall-clock time
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


def _save_slots(n_times: int) -> int:
    """Save buffers come in powers of two (at least 64), so save grids of similar length share one compilation."""
    return max(64, 1 << (n_times - 1).bit_length())


def _radau_functions(flow: GradientFlow, batch: int, n_save: int, loss_batch) -> tuple[stiff.RadauFunctions, float]:
    """The compiled integrator for this structure (built on first use) and the seconds spent compiling now."""
    rank, large = stiff_rank(flow.size), flow.size >= LARGE_FLOW_FROM_SIZE
    key = (flow.structure_key, batch, n_save, rank, large)
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


def solve_flow_batch(
    flows: list[GradientFlow],
    params0: list[Params],
    t_eval,
    *,
    rtol: float | None = None,
    atol: float = 1e-12,
    max_steps: int = 200_000,
    progress: bool = False,
    on_checkpoint: Callable[[list[FlowResult]], None] | None = None,
    checkpoint_every_s: float = CHECKPOINT_EVERY_S,
    should_stop: Callable[[], bool] | None = None,
    radau_state: dict[str, np.ndarray] | None = None,
    start: float = 0.0,
) -> list[FlowResult]:
    """Integrate several flows of one structure together with ``JaxRadau`` (one compiled
    loop over the batch), each from its own start, all saved at ``t_eval``.

    The flows must share ``GradientFlow.structure_key`` (same model, rates and loss
    kind; the chains may differ). Each member takes the steps it takes alone, so the
    results equal those of ``solve_flow(..., method="JaxRadau")`` run one by one.
    ``should_stop`` as in ``solve_flow``; ``radau_state`` continues an interrupted solve
    exactly (``FlowResult.radau_state``); ``start`` is the first save time (the start).
    """
    rtol = default_rtol("JaxRadau") if rtol is None else rtol
    _check_options("JaxRadau", rtol, atol, max_steps, None)
    if not flows or len(flows) != len(params0):
        raise ValueError(f"need one start per flow, got {len(flows)} flows and {len(params0)} starts")
    keys = {flow.structure_key for flow in flows}
    if len(keys) > 1:
        raise ValueError("flows batched together must share one structure (model, rates, loss kind); "
                         f"got {len(keys)} different structures")
    times = check_save_times(t_eval, start)
    thetas0 = np.stack([_initial_vector(flow, params) for flow, params in zip(flows, params0)])
    # Inside the compiled loop the model's small products fuse (losses.with_fused_products).
    loss = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *[with_fused_products(flow.loss) for flow in flows])
    started = time.perf_counter()
    slots = _save_slots(len(times))
    # a saved state is checked before anything is shown or compiled
    resumed = None if radau_state is None else _radau_state_from_arrays(radau_state, len(flows), thetas0.shape[1], slots)
    bar = _Progress(progress, times[0], times[-1], "JaxRadau")
    bar.compiling()
    functions, compile_seconds = _radau_functions(flows[0], len(flows), slots, loss)
    solve_started = time.perf_counter()
    times_device = jnp.asarray(np.concatenate([times, np.full(slots - len(times), np.inf)]))
    t_end = times[-1]
    state = functions.init(jnp.asarray(thetas0), loss, times_device, t_end, rtol, atol) if resumed is None else resumed
    bar.update(times[0])
    last_checkpoint = time.perf_counter()
    max_attempts = np.int32(min(max_steps, 2**31 - 1))
    # Each call of the compiled loop returns to the host to report, checkpoint or stop: only
    # when someone is listening, in chunks of attempts sized to about RADAU_CHUNK_SECONDS.
    listening = progress or on_checkpoint is not None or should_stop is not None
    chunk = RADAU_FIRST_CHUNK if listening else 2**31 - 1
    interrupted = False
    try:
        while True:
            chunk_started = time.perf_counter()
            state = functions.advance(state, loss, times_device, t_end, t_end, rtol, atol, max_attempts, np.int32(chunk))
            active = np.asarray(state.status) == Status.RUNNING
            elapsed = time.perf_counter() - chunk_started
            chunk = int(np.clip(chunk * RADAU_CHUNK_SECONDS / max(elapsed, 1e-3), 1, 2 * chunk + 1))
            bar.update(float(np.min(np.where(active, state.t, times[-1]))))
            if not active.any():
                break
            if should_stop is not None and should_stop():
                interrupted = True
                break
            if on_checkpoint is not None and time.perf_counter() - last_checkpoint >= checkpoint_every_s:
                on_checkpoint(_radau_results(flows, state, times, max_steps, started, compile_seconds, solve_started))
                last_checkpoint = time.perf_counter()
    finally:
        bar.close()
    results = _radau_results(flows, state, times, max_steps, started, compile_seconds, solve_started)
    if interrupted:
        arrays = _radau_state_to_arrays(state)
        results = [dataclasses.replace(result, status=Status.INTERRUPTED, radau_state=arrays,
                                       message=Status.INTERRUPTED.message(at(result.t_reached)))
                   if result.status == Status.RUNNING else result for result in results]
    return results


def _radau_state_to_arrays(state: stiff.RadauState) -> dict[str, np.ndarray]:
    """The loop state as named numpy arrays (``jacobian.V`` for the nested eigensystem)."""
    state = jax.device_get(state)
    arrays = {name: np.asarray(value) for name, value in state._asdict().items() if name != "jacobian"}
    arrays.update({f"jacobian.{name}": np.asarray(value) for name, value in state.jacobian._asdict().items()})
    return arrays


def _radau_state_from_arrays(arrays: dict[str, np.ndarray], batch: int, size: int, slots: int) -> stiff.RadauState:
    """The loop state back from ``_radau_state_to_arrays`` (its interrupted members are still running in it)."""
    if "jacobian.ahead" not in arrays and "jacobian.V_inv" in arrays:  # saved before eigensystems carried it
        basis = np.swapaxes(arrays["jacobian.V_inv"], 1, 2)  # its own subspace stands in for the next one
        lagged = size >= LARGE_FLOW_FROM_SIZE and basis.shape[2] < size
        arrays = {**arrays, "jacobian.ahead": basis if lagged else basis[:, :, :0]}
    try:
        jacobian = stiff.Eigensystem(*(jnp.asarray(arrays[f"jacobian.{name}"]) for name in stiff.Eigensystem._fields))
        fields = {name: jnp.asarray(arrays[name]) for name in stiff.RadauState._fields if name != "jacobian"}
    except KeyError as error:
        raise ValueError(f"the saved JaxRadau state lacks the array {error.args[0]!r}") from None
    if fields["y"].shape != (batch, size) or fields["saved"].shape != (batch, slots, size):
        raise ValueError(f"the saved JaxRadau state is for {fields['y'].shape} parameters and "
                         f"{fields['saved'].shape[1]} save slots, not ({batch}, {size}) and {slots}")
    return stiff.RadauState(jacobian=jacobian, **fields)


def _radau_results(flows, state, times, max_steps, started, compile_seconds, solve_started) -> list[FlowResult]:
    state = jax.device_get(state)
    wall, solve_seconds = time.perf_counter() - started, time.perf_counter() - solve_started
    results = []
    for i, flow in enumerate(flows):
        status = Status(int(state.status[i]))
        message = status.message(at(float(state.t[i])), max_steps=max_steps, method="JaxRadau",
                                 reason="the step size fell below its floor")
        n_saved = int(state.n_saved[i])
        stats = SolverStats(
            n_steps=int(state.n_steps[i]), n_rejected=int(state.n_rejected[i]), nfev=int(state.nfev[i]),
            njev=int(state.njev[i]), nlu=int(state.njev[i]), wall_time_s=wall, compile_seconds=compile_seconds,
            solve_seconds=solve_seconds,
        )
        results.append(_result(flow, "JaxRadau", status, message, state.t[i], times[:n_saved], state.saved[i, :n_saved], stats))
    return results


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

    def compiling(self) -> None:
        """Say so while JAX compiles (tens of seconds the first time a model shape is met), not a silent 0%."""
        self.bar.set_description_str(f"flow ({self.method}) compiling (once per model shape)", refresh=True)

    def update(self, t: float) -> None:
        self.bar.set_description_str(self._label(t), refresh=False)
        self.bar.update(max(0.0, float(np.log1p(t)) - self.bar.n))

    def close(self) -> None:
        self.bar.close()


def _solve_scipy(flow, theta0, times, *, method, rtol, atol, max_steps, progress, on_checkpoint, checkpoint_every_s, started,
                 should_stop, **_):
    field = lambda t, theta: np.asarray(flow.vector_field(t, theta))  # noqa: E731
    jacobian = lambda t, theta: np.asarray(flow.jacobian(t, theta))  # noqa: E731
    bar = _Progress(progress, times[0], times[-1], method)
    bar.compiling()
    field(times[0], theta0), jacobian(times[0], theta0)  # compiles both on first use
    compile_seconds = time.perf_counter() - started
    bar.update(times[0])
    solver = SCIPY_METHODS[method](field, times[0], theta0, times[-1], rtol=rtol, atol=atol, jac=jacobian)
    saved_t, saved_theta = [times[0]], [theta0]
    status, steps = Status.FINISHED, 0
    message = status.message()
    last_checkpoint = time.perf_counter()
    try:
        while len(saved_t) < len(times):
            if steps >= max_steps:
                status = Status.STEP_LIMIT
                message = status.message(at(solver.t), max_steps=max_steps)
                break
            if should_stop is not None and should_stop():
                status = Status.INTERRUPTED
                message = status.message(at(solver.t))
                break
            error = solver.step()
            steps += 1
            if solver.status == "failed":
                status = Status.SOLVER_FAILED
                message = status.message(at(solver.t), method=method, reason=str(error))
                break
            if not np.all(np.isfinite(solver.y)):
                status = Status.NON_FINITE
                message = status.message(at(solver.t))
                break
            interpolant = solver.dense_output()
            while len(saved_t) < len(times) and times[len(saved_t)] <= solver.t:
                saved_t.append(times[len(saved_t)])
                saved_theta.append(interpolant(saved_t[-1]))
            bar.update(solver.t)
            if on_checkpoint is not None and time.perf_counter() - last_checkpoint >= checkpoint_every_s:
                stats = _stats(_scipy_counts(solver, steps, compile_seconds), started)
                on_checkpoint(_result(flow, method, Status.RUNNING, Status.RUNNING.message(), solver.t, saved_t, saved_theta, stats))
                last_checkpoint = time.perf_counter()
    finally:
        bar.close()
    return status, message, solver.t, saved_t, saved_theta, _scipy_counts(solver, steps, compile_seconds)


def _scipy_counts(solver, steps: int, compile_seconds: float) -> dict:
    return {"n_steps": steps, "n_rejected": None, "nfev": int(solver.nfev), "njev": int(solver.njev),
            "nlu": int(getattr(solver, "nlu", 0)), "compile_seconds": compile_seconds}


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


def _solve_diffrax(flow, theta0, times, *, method, rtol, atol, max_steps, progress, started, should_stop, **_):
    term = diffrax.ODETerm(lambda t, y, args: flow.vector_field(t, y))
    # PI coefficients of diffrax's advice for stiff problems: far fewer rejected implicit steps.
    gains = {"pcoeff": 0.3, "icoeff": 0.4} if method == "Kvaerno5" else {}
    controller = diffrax.PIDController(rtol=rtol, atol=atol, **gains)
    kinks = [t for t in flow.rates.kinks if times[0] < t < times[-1]]
    if kinks:
        controller = diffrax.ClipStepSizeController(controller, step_ts=jnp.asarray(kinks, dtype=float))
    meter = diffrax.TqdmProgressMeter() if progress else diffrax.NoProgressMeter()
    # The solve is one compiled call: a stop request reaches it through an event polled after every step.
    stop = None if should_stop is None else diffrax.Event(lambda t, y, args, **kwargs: jax.pure_callback(
        lambda t: np.bool_(should_stop()), jax.ShapeDtypeStruct((), jnp.bool_), t))

    def integrate(y0, save_times):
        return diffrax.diffeqsolve(
            term, DIFFRAX_METHODS[method](), t0=save_times[0], t1=save_times[-1], dt0=None, y0=y0,
            saveat=diffrax.SaveAt(ts=save_times), stepsize_controller=controller, max_steps=max_steps,
            throw=False, progress_meter=meter, event=stop,
        )

    arguments = (jnp.asarray(theta0), jnp.asarray(times))
    compiled = jax.jit(integrate).lower(*arguments).compile()
    compile_seconds = time.perf_counter() - started
    solution = compiled(*arguments) if should_stop is None else _call_while_listening(compiled, *arguments)
    ys = np.asarray(solution.ys)
    reached = np.all(np.isfinite(ys), axis=1)
    n_saved = len(times) if reached.all() else int(np.argmin(reached))
    counts = {"n_steps": int(solution.stats["num_accepted_steps"]), "n_rejected": int(solution.stats["num_rejected_steps"]),
              "nfev": None, "njev": None, "nlu": None, "compile_seconds": compile_seconds}
    result = solution.result
    if result == diffrax.RESULTS.successful:
        status, message = Status.FINISHED, Status.FINISHED.message()
    elif result == diffrax.RESULTS.max_steps_reached:
        status, message = Status.STEP_LIMIT, Status.STEP_LIMIT.message(max_steps=max_steps)
    elif result == diffrax.RESULTS.event_occurred:
        where = f"after t = {times[n_saved - 1]:.6g}" if n_saved else "before the first save time"
        status, message = Status.INTERRUPTED, Status.INTERRUPTED.message(where)
    else:
        status = Status.SOLVER_FAILED
        message = status.message(method=method, reason=str(diffrax.RESULTS[result]))
    if status == Status.FINISHED and n_saved < len(times):
        status = Status.NON_FINITE
        message = status.message(f"after t = {times[n_saved - 1]:.6g}")
    t_reached = float(times[max(n_saved - 1, 0)]) if status != Status.FINISHED else float(times[-1])
    return status, message, t_reached, times[:n_saved], ys[:n_saved], counts


GD_CHUNK_STEPS = 1 << 14  # gradient-descent steps per compiled call: a stop request waits for at most this many
DIVERGENCE_FACTOR = 1e3  # gradient descent has diverged once its loss exceeds this multiple of max(|initial loss|, 1)


def _solve_gradient_descent(
    flow, theta0, times, *, method, lr, max_steps, progress, on_checkpoint, checkpoint_every_s, started, should_stop, **_
):
    # Save at the step nearest each save time; steps are distinct, so times stay ascending.
    save_steps = np.unique(np.rint(times / lr).astype(np.int64))
    theta = jnp.asarray(theta0)
    flow.gradient_descent(theta, 0, 0, lr).block_until_ready()  # compiles on first use
    loss0 = float(flow.loss_along(theta0[None])[0])
    compile_seconds = time.perf_counter() - started
    first = int(save_steps[0])
    saved_steps, saved_theta = [first], [np.asarray(theta)]
    status = Status.FINISHED
    message = status.message()
    bar = _Progress(progress, first * lr, save_steps[-1] * lr, method)
    last_checkpoint = time.perf_counter()
    step = first
    try:
        for target in save_steps[1:]:
            if target > max_steps:
                status = Status.STEP_LIMIT
                message = status.message(at(saved_steps[-1] * lr), max_steps=max_steps)
                break
            while step < target and not (should_stop is not None and should_stop()):
                end = min(int(target), step + GD_CHUNK_STEPS)
                theta, step = flow.gradient_descent(theta, step, end, lr), end
            if step < target:
                status = Status.INTERRUPTED
                message = status.message(at(saved_steps[-1] * lr))
                break
            between = f"between t = {saved_steps[-1] * lr:.6g} and t = {target * lr:.6g}"
            loss = float(flow.loss_along(np.asarray(theta)[None])[0])
            if not (np.isfinite(loss) and bool(jnp.all(jnp.isfinite(theta)))):
                status = Status.NON_FINITE
                message = status.message(between)
                break
            if loss > DIVERGENCE_FACTOR * max(abs(loss0), 1.0):
                status = Status.DIVERGED
                message = status.message(between, reason=f"the loss rose from {loss0:.6g} to {loss:.3g} "
                                         f"(beyond {DIVERGENCE_FACTOR:g} x max(|start|, 1)); lower solver.lr = {lr:g}")
                break
            saved_steps.append(int(target))
            saved_theta.append(np.asarray(theta))
            bar.update(target * lr)
            if on_checkpoint is not None and time.perf_counter() - last_checkpoint >= checkpoint_every_s:
                stats = _stats(_descent_counts(saved_steps[-1] - first, compile_seconds), started)
                t_now = saved_steps[-1] * lr
                on_checkpoint(_result(flow, method, Status.RUNNING, Status.RUNNING.message(), t_now, np.array(saved_steps) * lr, saved_theta, stats))
                last_checkpoint = time.perf_counter()
    finally:
        bar.close()
    n = saved_steps[-1]
    return status, message, n * lr, np.array(saved_steps) * lr, saved_theta, _descent_counts(n - first, compile_seconds)


def _descent_counts(steps: int, compile_seconds: float) -> dict:
    return {"n_steps": steps, "n_rejected": None, "nfev": steps, "njev": 0, "nlu": 0, "compile_seconds": compile_seconds}
