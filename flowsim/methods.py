"""The integration methods as data: each one's name, default tolerance and what it can do (no solver imported).

Configuration validates against ``METHODS``; the memory budget, the sweep, the resume and ``flowsim.solve.solvers`` read
a method's properties here instead of testing its name. ``flowsim.solve.solvers`` implements each ``family``.
"""

from __future__ import annotations

from dataclasses import dataclass

FALLBACK_RTOL = 1e-8


@dataclass(frozen=True)
class Method:
    """An integration method as configuration and the run layer see it."""

    name: str
    family: str  # the implementation in ``flowsim.solve.solvers`` ("scipy", "diffrax", "radau", "bdf", "descent", or registered)
    # the loosest rtol that keeps the relative loss error below 1e-6 over the default runs of both models
    # (benchmarks/RESULTS.md); JaxRadau's order-5 error estimate is conservative here, the others' are not
    default_rtol: float = FALLBACK_RTOL
    resumes_exactly: bool = False  # a resumed run takes the steps of an uninterrupted one ...
    needs_saved_state: bool = False  # ... given the loop state it saved (solver_state.npz), not only its last point
    batches: bool = False  # flows of one structure are integrated together as one compiled batch
    needs_dense_jacobian: bool = False  # holds a dense n x n Jacobian and its factorisation (the memory budget counts it)


METHOD_TABLE = (
    *(Method(name, "scipy", needs_dense_jacobian=True) for name in ("LSODA", "BDF", "Radau")),
    *(Method(name, "diffrax") for name in ("Kvaerno5", "Tsit5", "Dopri8")),
    Method("JaxRadau", "radau", default_rtol=3e-6, resumes_exactly=True, needs_saved_state=True, batches=True),
    Method("JaxBDF", "bdf", default_rtol=1e-7, resumes_exactly=True, needs_saved_state=True),
    Method("gradient_descent", "descent", resumes_exactly=True),  # it resumes at the step of its last saved point
)
METHOD = {method.name: method for method in METHOD_TABLE}
METHODS: tuple[str, ...] = tuple(METHOD)  # the methods flowsim ships; ``METHOD`` also holds registered ones
AUTO = "auto"  # the default: JaxBDF (``method_for``)
DEFAULT_METHOD = AUTO


def method_for(name: str) -> str:
    """The method ``name`` stands for: itself, or for "auto" JaxBDF, at every size. JaxRadau keeps a few stiff
    directions (``stiff_rank``) and its steps collapse once a flow has more (a general chain's saturated attention,
    late in the flow, even at the paper's size); JaxBDF does not, and compiles in half the time
    (benchmarks/MEASUREMENTS.md, "The default method: JaxBDF at every size")."""
    return "JaxBDF" if name == AUTO else name


def register(method: Method) -> None:
    """Make ``method`` known to configurations and the run layer (``flowsim.solve.solvers.register_method`` also gives
    its implementation). A shipped method cannot be replaced."""
    if method.name in METHODS or method.name == AUTO:
        raise ValueError(f"method {method.name!r} is one of flowsim's own and cannot be registered again")
    METHOD[method.name] = method


def check_method(name: str, key: str = "solver.method") -> str:
    """``name`` if it is a known method, else a ValueError naming the configuration ``key`` and the known ones."""
    if name not in METHOD and name != AUTO:
        known = [repr(known_name) for known_name in (AUTO, *METHOD)]
        raise ValueError(f"{key} = {name!r} is invalid: input should be {', '.join(known[:-1])} or {known[-1]}")
    return name


def default_rtol(method: str) -> float | None:
    """The relative tolerance ``method`` runs at when none is given (None for "auto": its method's, once the size
    is known)."""
    if method == AUTO:
        return None
    return METHOD[method].default_rtol if method in METHOD else FALLBACK_RTOL
