"""The names of the integration methods and their default tolerances (no solver imported).

Configuration validates against these; ``flowsim.solvers`` implements them.
"""

from __future__ import annotations

SCIPY_METHOD_NAMES = ("LSODA", "BDF", "Radau")
DIFFRAX_METHOD_NAMES = ("Kvaerno5", "Tsit5", "Dopri8")
METHODS: tuple[str, ...] = (*SCIPY_METHOD_NAMES, *DIFFRAX_METHOD_NAMES, "JaxRadau", "gradient_descent")
DEFAULT_METHOD = "JaxRadau"
# Each method's default relative tolerance: the loosest that keeps the relative loss error
# below 1e-6 over the default runs of both models (benchmarks/RESULTS.md); JaxRadau's
# order-5 error estimate is conservative here, LSODA's and the others' are not.
DEFAULT_RTOL = {"JaxRadau": 3e-6}
FALLBACK_RTOL = 1e-8


def default_rtol(method: str) -> float:
    """The relative tolerance ``method`` runs at when none is given."""
    return DEFAULT_RTOL.get(method, FALLBACK_RTOL)
