"""The reference methods: scipy's stiff integrators (one step per chunk, the exact Jacobian from JAX), diffrax's
(one compiled call), and gradient descent (compiled chunks of steps), for comparison with the compiled ones."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import scipy.integrate

from flowsim.solve.integration import FlowResult, Integration, Method, Problem, flow_result, solver_stats
from flowsim.common.progress import stderr_is_terminal
from flowsim.solve.status import Status, at_time

SCIPY_METHODS = {"LSODA": scipy.integrate.LSODA, "BDF": scipy.integrate.BDF, "Radau": scipy.integrate.Radau}
DIFFRAX_METHODS = {"Kvaerno5": diffrax.Kvaerno5, "Tsit5": diffrax.Tsit5, "Dopri8": diffrax.Dopri8}


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
        return [flow_result(run.problem.flow, self.name, run.status, run.message, solver.t, run.saved_t, run.saved_theta,
                        solver_stats(counts, run.problem.started))]


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
        labelled = problem.progress and stderr_is_terminal()  # in a log file the run's own lines say how far it is
        if labelled:
            print(f"flow ({self.name}) to t = {times[-1]:.4g}: diffrax's bar, in model time", file=sys.stderr, flush=True)
        meter = diffrax.TqdmProgressMeter() if labelled else diffrax.NoProgressMeter()
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
        stats = solver_stats({**run.counts, "compile_seconds": run.compile_seconds}, run.problem.started)
        return [flow_result(run.problem.flow, self.name, run.status, run.message, run.t_reached, run.saved_t, run.saved_theta, stats)]


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
        return [flow_result(run.problem.flow, self.name, run.status, run.message, n * self.lr,
                        np.array(run.saved_steps) * self.lr, run.saved_theta, solver_stats(counts, run.problem.started))]
