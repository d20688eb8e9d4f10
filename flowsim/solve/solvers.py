"""One entry point, ``solve_flow``, for every way of integrating a gradient flow, and the table of methods.

Methods (each a small object with ``start`` and ``advance``, as diffrax's solvers have ``init`` and ``step``):

* ``JaxRadau()`` (``flowsim.solve.compiled_methods``): Radau IIA of order 5 compiled end to end in JAX
  (``flowsim.solve.stiff``), with the Jacobian's stiff eigensystem kept so step-size changes cost nothing; it alone
  can integrate a batch of flows at once (``solve_flow_batch``).
* ``JaxBDF()`` (``flowsim.solve.compiled_methods``): variable-order BDF compiled end to end, its Newton systems
  solved by GMRES on J·v, forward differences of the field by default (``flowsim.solve.bdf``); nothing n × n is held.
* ``Scipy("LSODA" | "BDF" | "Radau")``, ``Diffrax("Kvaerno5" | "Tsit5" | "Dopri8")`` and
  ``GradientDescent(lr)`` (``flowsim.solve.reference_methods``): scipy's and diffrax's integrators, and
  θ_{n+1} = θ_n - η r(nη) ∇L(θ_n) at t = nη, for comparison.

``flowsim.solve.integration.drive`` is the one loop around them (progress, checkpoints, stop requests). Every
method returns a ``FlowResult`` with a status: a run that hits its step limit, meets a non-finite state, or
fails inside the solver keeps every point computed before that and says so; nothing is silently truncated.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from flowsim import methods
from flowsim.solve.compiled_methods import JaxBDF, JaxRadau, stiff_rank
from flowsim.config import SolverConfig, resolve_config
from flowsim.model.flow import GradientFlow
from flowsim.solve.integration import (CHECKPOINT_EVERY_S, FlowResult, Integration, Method, Problem, ResumePoint, SavedStateError,
                                 SolverStats, check_save_times, drive, flow_result, solver_stats)
from flowsim.methods import AUTO, DEFAULT_METHOD, METHOD, default_rtol, method_for
from flowsim.model.models import Params
from flowsim.solve.reference_methods import DIFFRAX_METHODS, SCIPY_METHODS, Diffrax, GradientDescent, Scipy
from flowsim.solve.trajectory import Trajectory

__all__ = ["CHECKPOINT_EVERY_S", "DIFFRAX_METHODS", "FAMILIES", "SCIPY_METHODS", "Diffrax", "FlowResult", "GradientDescent",
           "Integration", "JaxBDF", "JaxRadau", "Method", "Problem", "ResumePoint", "Scipy", "SolverStats", "check_save_times",
           "drive", "flow_result", "method_named", "register_method", "solve_flow", "solve_flow_batch", "solver_stats",
           "stiff_rank"]

# the defaults of the configuration's [solver] section, written once there
DEFAULT_ATOL = SolverConfig.model_fields["atol"].default
DEFAULT_MAX_STEPS = SolverConfig.model_fields["max_steps"].default


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

    ``method`` is a name (``flowsim.methods.METHOD``; "auto", the default, is JaxBDF: ``flowsim.methods.method_for``)
    or a method object (``JaxRadau(rank=16)``).
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
        method = method_for(AUTO)
    name = method if isinstance(method, str) else method.name
    rtol = default_rtol(name) if rtol is None else rtol
    _check_options(name, rtol, atol, max_steps, lr if isinstance(method, str) else getattr(method, "lr", None))
    solver = method_named(method, lr) if isinstance(method, str) else method
    times = check_save_times(t_eval)
    theta0 = _initial_vector(flow, params0)
    # JaxRadau and JaxBDF continue their own saved loop state exactly; any other resume starts afresh at the last saved point
    state = None if resume is None else resume.state_for(name)
    prefix_t, prefix_theta = np.zeros(0), np.zeros((0, flow.size))
    if resume is not None and state is None:
        if not resume.t[-1] < times[-1]:
            raise ValueError(f"nothing to resume: the saved points reach t = {resume.t[-1]:g}, the last save time")
        prefix_t, prefix_theta = np.asarray(resume.t[:-1]), np.asarray(resume.theta[:-1])
        times = np.concatenate([[resume.t[-1]], times[times > resume.t[-1]]])
        theta0 = np.asarray(resume.theta[-1])
    problem = Problem([flow], theta0[None], times, rtol, atol, int(max_steps), progress,
                      listening=progress or on_checkpoint is not None or should_stop is not None, should_stop=should_stop)
    try:
        saved = None if state is None else solver.check_saved_state(state, problem)  # checked before anything is compiled
    except ValueError as error:
        raise SavedStateError(str(error)) from None
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
