"""flowsim.methods: the registry the configuration validates against names exactly the
methods flowsim.solve.solvers implements, and each runs at its default tolerance."""

import jax.numpy as jnp
import numpy as np
import pytest

from flowsim.model.flow import GradientFlow
from flowsim.methods import METHODS, default_rtol
from flowsim.solve.solvers import DIFFRAX_METHODS, SCIPY_METHODS, solve_flow
from flowsim.solve.status import Status


@pytest.mark.slow
def test_every_registered_method_is_implemented():
    """flowsim.methods (what configs accept) and flowsim.solve.solvers (what runs) name the same methods."""
    assert set(METHODS) == set(SCIPY_METHODS) | set(DIFFRAX_METHODS) | {"JaxRadau", "JaxBDF", "gradient_descent"}
    params0 = {"theta": np.array([1.0, -2.0])}
    flow = GradientFlow(lambda params: 0.5 * jnp.sum(params["theta"] ** 2), params0)  # θ(t) = θ0 e^-t
    for method in METHODS:
        result = solve_flow(flow, params0, [0.0, 0.5, 1.0], method=method, lr=1e-3)
        assert result.success and result.method == method, (method, result.message)
        tolerance = 2e-3 if method == "gradient_descent" else 1e3 * default_rtol(method)
        np.testing.assert_allclose(result.trajectory.params["theta"][-1], params0["theta"] * np.exp(-1.0), rtol=tolerance)
        assert result.summary()["status_name"] == "finished" and result.summary()["status"] == Status.FINISHED


def test_the_run_layer_reads_a_methods_properties_from_its_table():
    """What a method can do is stated once (flowsim.methods.METHOD): the resume's exactness, the memory budget's
    dense Jacobian and the sweep's batching follow the table, and every family is built by flowsim.solve.solvers."""
    import pytest

    from flowsim.common.budget import BudgetError
    from flowsim.config import load_config
    from flowsim.assemble import prepare
    from flowsim.methods import METHOD
    from flowsim.solve.solvers import ResumePoint, method_named

    point = ResumePoint(np.array([0.0]), np.zeros((1, 2)))
    for name, method in METHOD.items():
        assert method_named(name, lr=1e-3).name == name
        assert point.is_exact(name) == (method.resumes_exactly and not method.needs_saved_state)
        with_state = ResumePoint(point.t, point.theta, {"t": np.zeros(1)})
        assert with_state.is_exact(name) == method.resumes_exactly
    # d = 1000 at m = 64: a dense Jacobian is about 2 TB, the methods that keep none need no more than the chain's maps
    wide = ["chain.pi=[" + ", ".join(["0.001"] * 1000) + "]", "model.m=64", "model.k=1", "time.n_linear=2", "time.n_log=0"]
    for name, method in METHOD.items():
        if method.needs_dense_jacobian:
            with pytest.raises(BudgetError, match="dense n x n Jacobian"):
                prepare(load_config(None, [*wide, f"solver.method='{name}'"]))
    assert [name for name, method in METHOD.items() if method.batches] == ["JaxRadau"]


@pytest.mark.slow
def test_the_default_method_is_jaxbdf_at_every_size():
    """solver.method = 'auto' (the default) is JaxBDF in solve_flow, at the paper's size
    and at a large vocabulary."""
    from flowsim.assemble import prepare
    from flowsim.config import load_config
    from flowsim.methods import AUTO, method_for

    assert load_config(None, []).solver.method == AUTO and load_config(None, []).solver.rtol is None
    assert method_for(AUTO) == "JaxBDF" and method_for("LSODA") == "LSODA"
    for pi in ([0.75, 0.19, 0.05, 0.01], [1 / 16] * 16):
        config = load_config(None, [f"chain.pi={pi}", "model.m=16", "model.k=16", "time.t_end=2.0", "time.n_linear=3",
                                    "time.n_log=0"])
        prepared = prepare(config)
        result = solve_flow(prepared.flow, prepared.params0, prepared.times, method=config.solver.method)
        assert result.success and result.method == "JaxBDF"


@pytest.mark.slow
def test_the_default_method_follows_a_general_chains_saturated_flow_in_fewer_steps_than_lsoda():
    """A general chain at d = 6 from ε = 1e-2 to t = 1e5: after a long plateau the attention saturates and a few
    dozen directions turn stiff, more than JaxRadau keeps (it took 15 495 steps here, against LSODA's 4645). The
    default takes fewer steps than LSODA and agrees with it (rtol 1e-9) to 1e-6 over the whole trajectory."""
    from flowsim.assemble import prepare
    from flowsim.config import load_config, transition_override
    from theory_accuracy import random_transition_matrix  # benchmarks/ is on the path (conftest)

    config = load_config(None, [transition_override(random_transition_matrix(6, 600)), "init.eps=0.01",
                                "time.t_end=100000", "time.n_linear=2", "time.n_log=60", "solver.atol=1e-12"])
    prepared = prepare(config)
    default = solve_flow(prepared.flow, prepared.params0, prepared.times, atol=1e-12)
    lsoda = solve_flow(prepared.flow, prepared.params0, prepared.times, method="LSODA", rtol=1e-9, atol=1e-12)
    assert default.success and lsoda.success
    assert default.stats.n_steps < lsoda.stats.n_steps, (default.stats, lsoda.stats)
    np.testing.assert_allclose(default.trajectory.loss, lsoda.trajectory.loss, rtol=1e-6)
    assert default.trajectory.loss[-1] < default.trajectory.loss[len(prepared.times) // 2] - 0.1  # it left the plateau


