"""flowsim.methods: the registry the configuration validates against names exactly the
methods flowsim.solvers implements, and each runs at its default tolerance."""

import jax.numpy as jnp
import numpy as np

from flowsim.flow import GradientFlow
from flowsim.methods import METHODS, default_rtol
from flowsim.solvers import DIFFRAX_METHODS, SCIPY_METHODS, solve_flow
from flowsim.status import Status


def test_every_registered_method_is_implemented():
    """flowsim.methods (what configs accept) and flowsim.solvers (what runs) name the same methods."""
    assert set(METHODS) == set(SCIPY_METHODS) | set(DIFFRAX_METHODS) | {"JaxRadau", "gradient_descent"}
    params0 = {"theta": np.array([1.0, -2.0])}
    flow = GradientFlow(lambda params: 0.5 * jnp.sum(params["theta"] ** 2), params0)  # θ(t) = θ0 e^-t
    for method in METHODS:
        result = solve_flow(flow, params0, [0.0, 0.5, 1.0], method=method, lr=1e-3)
        assert result.success and result.method == method, (method, result.message)
        tolerance = 2e-3 if method == "gradient_descent" else 1e3 * default_rtol(method)
        np.testing.assert_allclose(result.trajectory.params["theta"][-1], params0["theta"] * np.exp(-1.0), rtol=tolerance)
        assert result.summary()["status_name"] == "finished" and result.summary()["status"] == Status.FINISHED
