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

import functools
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


def check_save_times(t_eval) -> np.ndarray:
    """Save times must be finite, strictly ascending, and start at 0 (the initial point)."""
    times = np.asarray(t_eval, dtype=float)
    if times.ndim != 1 or len(times) < 2:
        raise ValueError(f"save times must be a 1-d array with at least 2 entries, got shape {times.shape}")
    if not np.all(np.isfinite(times)):
        raise ValueError("save times must be finite")
    if times[0] != 0.0:
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
) -> FlowResult:
    """Integrate ``flow`` from ``params0`` and save at ``t_eval`` (ascending, t_eval[0] = 0).

    ``rtol``/``atol`` are the error tolerances of the adaptive methods (``rtol`` defaults
    to the method's own, ``default_rtol(method)``; with a small
    initialisation of scale ε, atol must sit well below ε²); ``lr`` is the step η of
    ``gradient_descent``. ``max_steps`` bounds the steps taken. ``on_checkpoint``, if
    given, receives the partial result every ``checkpoint_every_s`` seconds, so a long
    run can be saved as it goes.
    """
    rtol = default_rtol(method) if rtol is None else rtol
    _check_options(method, rtol, atol, max_steps, lr)
    times = check_save_times(t_eval)
    theta0 = _initial_vector(flow, params0)
    if method == "JaxRadau":
        return solve_flow_batch([flow], [params0], times, rtol=rtol, atol=atol, max_steps=max_steps, progress=progress,
                                on_checkpoint=None if on_checkpoint is None else lambda results: on_checkpoint(results[0]),
                                checkpoint_every_s=checkpoint_every_s)[0]
    integrate = {**dict.fromkeys(SCIPY_METHODS, _solve_scipy), **dict.fromkeys(DIFFRAX_METHODS, _solve_diffrax),
                 "gradient_descent": _solve_gradient_descent}[method]
    started = time.perf_counter()
    status, message, t_reached, saved_t, saved_theta, counts = integrate(
        flow, theta0, times, method=method, rtol=rtol, atol=atol, max_steps=int(max_steps), lr=lr,
        progress=progress, on_checkpoint=on_checkpoint, checkpoint_every_s=checkpoint_every_s, started=started,
    )
    return _result(flow, method, status, message, t_reached, saved_t, saved_theta, _stats(counts, started))


def _stats(counts: dict, started: float) -> SolverStats:
    """Statistics from a method's counts (compile_seconds among them) and its start time."""
    wall = time.perf_counter() - started
    return SolverStats(**counts, wall_time_s=wall, solve_seconds=wall - counts["compile_seconds"])


# Compiled JaxRadau integrators, shared by flows of one structure, batch size and save grid.
_RADAU_COMPILED: dict[tuple, stiff.RadauFunctions] = {}
RADAU_PROGRESS_CHUNKS = 20
SEQUENTIAL_STAGES_FROM_SIZE = 16_384  # larger flows evaluate the three Radau stages one by one (MEASUREMENTS.md)
STIFF_RANK = 8  # eigenpairs of the Jacobian JaxRadau keeps: the stiff directions (benchmarks/MEASUREMENTS.md)


def _save_slots(n_times: int) -> int:
    """Save buffers come in powers of two (at least 64), so save grids of similar length share one compilation."""
    return max(64, 1 << (n_times - 1).bit_length())


def _radau_functions(flow: GradientFlow, batch: int, n_save: int, loss_batch) -> tuple[stiff.RadauFunctions, float]:
    """The compiled integrator for this structure (built on first use) and the seconds spent compiling now."""
    key = (flow.structure_key, batch, n_save, STIFF_RANK)
    if key in _RADAU_COMPILED:
        return _RADAU_COMPILED[key], 0.0
    # Pure functions of one member with the (static) structure bound: no flow object is captured.
    structure = flow.structure
    bind = lambda function: functools.partial(function, structure)  # noqa: E731
    if not flow.eigensystem_is_real:
        eigensystem, rank = stiff.general_eigensystem(bind(flow_functions.jacobian)), flow.size
    elif flow.size <= STIFF_RANK:
        eigensystem = stiff.symmetric_eigensystem(bind(flow_functions.rate_vector), bind(flow_functions.loss_hessian))
        rank = flow.size
    else:
        eigensystem = stiff.low_rank_eigensystem(bind(flow_functions.rate_vector), bind(flow_functions.loss_gradient),
                                                 flow.size, STIFF_RANK)
        rank = STIFF_RANK
    problem = stiff.RadauProblem(bind(flow_functions.vector_field), eigensystem, flow.rates.kinks,
                                 sequential_stages=flow.size >= SEQUENTIAL_STAGES_FROM_SIZE)
    functions = stiff.build_radau(problem, batch, n_save, flow.size, loss_batch, rank,
                                  complex_eigensystem=not flow.eigensystem_is_real)
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
) -> list[FlowResult]:
    """Integrate several flows of one structure together with ``JaxRadau`` (one compiled
    loop over the batch), each from its own start, all saved at ``t_eval``.

    The flows must share ``GradientFlow.structure_key`` (same model, rates and loss
    kind; the chains may differ). Each member takes the steps it takes alone, so the
    results equal those of ``solve_flow(..., method="JaxRadau")`` run one by one.
    """
    rtol = default_rtol("JaxRadau") if rtol is None else rtol
    _check_options("JaxRadau", rtol, atol, max_steps, None)
    if not flows or len(flows) != len(params0):
        raise ValueError(f"need one start per flow, got {len(flows)} flows and {len(params0)} starts")
    keys = {flow.structure_key for flow in flows}
    if len(keys) > 1:
        raise ValueError("flows batched together must share one structure (model, rates, loss kind); "
                         f"got {len(keys)} different structures")
    times = check_save_times(t_eval)
    thetas0 = np.stack([_initial_vector(flow, start) for flow, start in zip(flows, params0)])
    # Inside the compiled loop the model's small products fuse (losses.with_fused_products).
    loss = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *[with_fused_products(flow.loss) for flow in flows])
    started = time.perf_counter()
    slots = _save_slots(len(times))
    functions, compile_seconds = _radau_functions(flows[0], len(flows), slots, loss)
    solve_started = time.perf_counter()
    times_device = jnp.asarray(np.concatenate([times, np.full(slots - len(times), np.inf)]))
    t_end = times[-1]
    state = functions.init(jnp.asarray(thetas0), loss, times_device, t_end, rtol, atol)
    bar = _Progress(progress, times[-1], "JaxRadau")
    last_checkpoint = time.perf_counter()
    # Stopping to report costs a host round trip per chunk: chunks only when someone is listening.
    chunks = RADAU_PROGRESS_CHUNKS if progress or on_checkpoint is not None else 1
    stops = times[np.unique(np.linspace(0, len(times) - 1, chunks + 1).astype(int))[1:]]
    try:
        for t_stop in stops:
            state = functions.advance(state, loss, times_device, t_end, t_stop, rtol, atol, np.int32(min(max_steps, 2**31 - 1)))
            active = np.asarray(state.status) == Status.RUNNING
            bar.update(float(np.min(np.where(active, state.t, times[-1]))))
            if not active.any():
                break
            if on_checkpoint is not None and time.perf_counter() - last_checkpoint >= checkpoint_every_s:
                on_checkpoint(_radau_results(flows, state, times, max_steps, started, compile_seconds, solve_started))
                last_checkpoint = time.perf_counter()
    finally:
        bar.close()
    return _radau_results(flows, state, times, max_steps, started, compile_seconds, solve_started)


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
    """A tqdm bar over model time, refreshed as the integrator advances."""

    def __init__(self, enabled: bool, t_end: float, method: str):
        self.bar = tqdm(total=float(t_end), disable=not enabled, desc=f"flow ({method})", unit="t",
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| t={n:.4g}/{total:.4g} [{elapsed}<{remaining}]")

    def update(self, t: float) -> None:
        self.bar.update(max(0.0, t - self.bar.n))

    def close(self) -> None:
        self.bar.close()


def _solve_scipy(flow, theta0, times, *, method, rtol, atol, max_steps, progress, on_checkpoint, checkpoint_every_s, started, **_):
    field = lambda t, theta: np.asarray(flow.vector_field(t, theta))  # noqa: E731
    jacobian = lambda t, theta: np.asarray(flow.jacobian(t, theta))  # noqa: E731
    field(0.0, theta0), jacobian(0.0, theta0)  # compiles both on first use
    compile_seconds = time.perf_counter() - started
    solver = SCIPY_METHODS[method](field, 0.0, theta0, times[-1], rtol=rtol, atol=atol, jac=jacobian)
    saved_t, saved_theta = [0.0], [theta0]
    status, steps = Status.FINISHED, 0
    message = status.message()
    bar = _Progress(progress, times[-1], method)
    last_checkpoint = time.perf_counter()
    try:
        while len(saved_t) < len(times):
            if steps >= max_steps:
                status = Status.STEP_LIMIT
                message = status.message(at(solver.t), max_steps=max_steps)
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


def _solve_diffrax(flow, theta0, times, *, method, rtol, atol, max_steps, progress, started, **_):
    term = diffrax.ODETerm(lambda t, y, args: flow.vector_field(t, y))
    # PI coefficients of diffrax's advice for stiff problems: far fewer rejected implicit steps.
    gains = {"pcoeff": 0.3, "icoeff": 0.4} if method == "Kvaerno5" else {}
    controller = diffrax.PIDController(rtol=rtol, atol=atol, **gains)
    kinks = [t for t in flow.rates.kinks if 0 < t < times[-1]]
    if kinks:
        controller = diffrax.ClipStepSizeController(controller, step_ts=jnp.asarray(kinks, dtype=float))
    meter = diffrax.TqdmProgressMeter() if progress else diffrax.NoProgressMeter()

    def integrate(y0, save_times):
        return diffrax.diffeqsolve(
            term, DIFFRAX_METHODS[method](), t0=0.0, t1=save_times[-1], dt0=None, y0=y0,
            saveat=diffrax.SaveAt(ts=save_times), stepsize_controller=controller, max_steps=max_steps,
            throw=False, progress_meter=meter,
        )

    arguments = (jnp.asarray(theta0), jnp.asarray(times))
    compiled = jax.jit(integrate).lower(*arguments).compile()
    compile_seconds = time.perf_counter() - started
    solution = compiled(*arguments)
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
    else:
        status = Status.SOLVER_FAILED
        message = status.message(method=method, reason=str(diffrax.RESULTS[result]))
    if status == Status.FINISHED and n_saved < len(times):
        status = Status.NON_FINITE
        message = status.message(f"after t = {times[n_saved - 1]:.6g}")
    t_reached = float(times[n_saved - 1]) if status != Status.FINISHED else float(times[-1])
    return status, message, t_reached, times[:n_saved], ys[:n_saved], counts


def _solve_gradient_descent(
    flow, theta0, times, *, method, lr, max_steps, progress, on_checkpoint, checkpoint_every_s, started, **_
):
    # Save at the step nearest each save time; steps are distinct, so times stay ascending.
    save_steps = np.unique(np.rint(times / lr).astype(np.int64))
    theta = jnp.asarray(theta0)
    flow.gradient_descent(theta, 0, 0, lr).block_until_ready()  # compiles on first use
    compile_seconds = time.perf_counter() - started
    saved_steps, saved_theta = [0], [np.asarray(theta)]
    status = Status.FINISHED
    message = status.message()
    bar = _Progress(progress, save_steps[-1] * lr, method)
    last_checkpoint = time.perf_counter()
    try:
        for target in save_steps[1:]:
            if target > max_steps:
                status = Status.STEP_LIMIT
                message = status.message(at(saved_steps[-1] * lr), max_steps=max_steps)
                break
            theta = flow.gradient_descent(theta, saved_steps[-1], target, lr)
            if not bool(jnp.all(jnp.isfinite(theta))):
                status = Status.NON_FINITE
                message = status.message(f"between t = {saved_steps[-1] * lr:.6g} and t = {target * lr:.6g}")
                break
            saved_steps.append(int(target))
            saved_theta.append(np.asarray(theta))
            bar.update(target * lr)
            if on_checkpoint is not None and time.perf_counter() - last_checkpoint >= checkpoint_every_s:
                stats = _stats(_descent_counts(saved_steps[-1], compile_seconds), started)
                t_now = saved_steps[-1] * lr
                on_checkpoint(_result(flow, method, Status.RUNNING, Status.RUNNING.message(), t_now, np.array(saved_steps) * lr, saved_theta, stats))
                last_checkpoint = time.perf_counter()
    finally:
        bar.close()
    n = saved_steps[-1]
    return status, message, n * lr, np.array(saved_steps) * lr, saved_theta, _descent_counts(n, compile_seconds)


def _descent_counts(steps: int, compile_seconds: float) -> dict:
    return {"n_steps": steps, "n_rejected": None, "nfev": steps, "njev": 0, "nlu": 0, "compile_seconds": compile_seconds}
