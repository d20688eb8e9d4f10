import jax.numpy as jnp
import numpy as np
import pytest

import flowsim
from flowsim import MarkovChain, OneLayerTransformer
from flowsim.flow import GradientFlow, RateSchedule, SlowWindow
from flowsim import flow as flow_module
from flowsim.solvers import solve_flow
from flowsim.status import Status

from conftest import PAPER_PI


@pytest.fixture(scope="module")
def default_run(default_flow):
    """LSODA on the default flow up to t = 6000 (the run of `flowsim run`)."""
    flow, params0 = default_flow
    return solve_flow(flow, params0, np.linspace(0.0, 6000.0, 601), method="LSODA", rtol=1e-8, atol=1e-12)


def test_default_run_finishes_and_loss_never_increases(default_run):
    assert default_run.success, default_run.message
    loss = default_run.trajectory.loss
    assert loss[0] == pytest.approx(np.log(4), abs=1e-5)  # near θ = 0 the prediction is uniform
    assert np.all(np.diff(loss) <= 1e-12)
    assert loss[-1] < 0.6


def test_qk_gram_difference_is_conserved(default_run):
    """Q and K enter only through W_Q W_K^T, so W_Q^T W_Q - W_K^T W_K is a constant of motion."""
    params = default_run.trajectory.params
    gram = np.einsum("tmk,tml->tkl", params["W_Q"], params["W_Q"]) - np.einsum("tmk,tml->tkl", params["W_K"], params["W_K"])
    scale = np.max(np.abs(params["W_Q"])) ** 2
    assert scale > 0.1  # attention did grow, so the check is not trivial
    assert np.max(np.abs(gram - gram[0])) < 1e-6 * scale


def test_rates_scale_each_group_and_slow_window_ramps(default_flow, paper_chain, paper_model):
    flow, params0 = default_flow
    theta = flow.flatten({name: 3e2 * value for name, value in params0.items()})  # off the origin
    window = SlowWindow(rho=0.25, t0=10.0, tr=4.0)
    slowed = GradientFlow(flow.loss, params0, RateSchedule(constant={"W1": 2.0}, window=window))
    base = flow.unravel(flow.vector_field(0.0, theta))
    for t, qk_factor in [(5.0, 0.25), (12.0, 0.25 + 0.75 * 0.5), (20.0, 1.0)]:
        field = slowed.unravel(slowed.vector_field(t, theta))
        np.testing.assert_allclose(field["W_Q"], qk_factor * base["W_Q"], rtol=1e-12, atol=1e-300)
        np.testing.assert_allclose(field["W_K"], qk_factor * base["W_K"], rtol=1e-12, atol=1e-300)
        np.testing.assert_allclose(field["W1"], 2.0 * base["W1"], rtol=1e-12, atol=1e-300)
        np.testing.assert_allclose(field["W0"], base["W0"], rtol=1e-12, atol=1e-300)
    with pytest.raises(ValueError, match="unknown parameter groups"):
        GradientFlow(flow.loss, params0, RateSchedule(constant={"W_V": 2.0}))


def test_jacobian_is_the_derivative_of_the_vector_field(default_flow):
    flow, params0 = default_flow
    rng = np.random.default_rng(0)
    theta = 0.3 * rng.standard_normal(flow.size)
    direction = rng.standard_normal(flow.size)
    h = 1e-6
    finite_difference = (flow.vector_field(1.0, theta + h * direction) - flow.vector_field(1.0, theta - h * direction)) / (2 * h)
    np.testing.assert_allclose(flow.jacobian(1.0, theta) @ direction, finite_difference, atol=1e-7)


@pytest.mark.slow
def test_solvers_agree_at_tight_tolerance(default_flow):
    flow, params0 = default_flow
    times = np.array([0.0, 50.0, 300.0])  # through condensation, the first focus and the next direction opening
    # diffrax's implicit Kvaerno5 shares its code path with Tsit5 here and costs a minute
    # (benchmarks/solvers.py runs it); JaxRadau is the compiled implicit method.
    results = {
        method: solve_flow(flow, params0, times, method=method, rtol=1e-9, atol=1e-13, max_steps=400_000)
        for method in ("LSODA", "BDF", "Radau", "JaxRadau", "Tsit5")
    }
    reference = results["LSODA"]
    for method, result in results.items():
        assert result.success, (method, result.message)
        np.testing.assert_array_equal(result.trajectory.t, times)
        for index in (1, 2):
            difference = np.abs(flow.flatten(result.trajectory.at(index)) - flow.flatten(reference.trajectory.at(index)))
            assert difference.max() < 1e-6, (method, times[index], difference.max())
    # the state moved by O(1): agreement is not agreement on a frozen state
    assert np.abs(flow.flatten(reference.trajectory.at(2))).max() > 0.5


def test_gradient_descent_approaches_the_flow_at_order_eta(default_flow):
    flow, params0 = default_flow
    times = np.array([0.0, 10.0, 20.0])  # through condensation: the state changes at O(1)
    flow_end = flow.flatten(solve_flow(flow, params0, times, rtol=1e-11, atol=1e-15).trajectory.at(-1))
    errors = []
    for lr in (0.1, 0.05, 0.025):
        descent = solve_flow(flow, params0, times, method="gradient_descent", lr=lr)
        assert descent.success
        np.testing.assert_allclose(descent.trajectory.t, times, atol=1e-12)
        errors.append(np.abs(flow.flatten(descent.trajectory.at(-1)) - flow_end).max())
    assert errors[0] > 1e-4
    for coarse, fine in zip(errors, errors[1:]):
        assert 1.8 < coarse / fine < 2.2


def test_early_growth_rate_of_M_is_twice_mu1():
    """Near the origin ‖M‖ grows like exp(2 μ1 t), μ1 = ‖π‖ ‖π - u‖, for any λ."""
    pi = np.array(PAPER_PI)
    mu1 = np.linalg.norm(pi) * np.linalg.norm(pi - 1 / len(pi))
    model = OneLayerTransformer(d=4)
    params0 = model.init(1e-4, 1)
    times = np.linspace(0.0, 14.0, 141)
    for lam in (0.2, 0.8):
        flow = GradientFlow(flowsim.make_loss_function(model, MarkovChain(pi=pi, lam=lam)), params0)
        params = solve_flow(flow, params0, times, rtol=1e-10, atol=1e-16).trajectory.params
        log_norm_M = np.log(np.linalg.norm(np.einsum("tdm,tme->tde", params["W0"], params["W1"]), axis=(1, 2)))
        window = times >= 8.0
        slope = np.polyfit(times[window], log_norm_M[window], 1)[0]
        assert abs(slope / (2 * mu1) - 1) < 0.02, (lam, slope, 2 * mu1)


@pytest.mark.parametrize("method", ["LSODA", "Tsit5", "JaxRadau", "gradient_descent"])
def test_step_limit_keeps_and_marks_what_was_computed(default_flow, method):
    flow, params0 = default_flow
    times = np.linspace(0.0, 100.0, 101)
    result = solve_flow(flow, params0, times, method=method, max_steps=60, lr=1.0)
    assert result.status == Status.STEP_LIMIT and not result.success
    assert "step limit" in result.message
    n = len(result.trajectory)
    assert 1 <= n < len(times)
    np.testing.assert_allclose(result.trajectory.t, times[:n])
    assert np.all(np.isfinite(result.trajectory.params["W0"]))
    # what was kept is right: it matches a full run at the same times
    full = solve_flow(flow, params0, times[:n], method=method, lr=1.0, rtol=1e-8, atol=1e-12) if n > 1 else None
    if full is not None:
        np.testing.assert_allclose(result.trajectory.params["W1"][-1], full.trajectory.params["W1"][-1], atol=1e-6)


def test_non_finite_state_and_solver_failure_are_reported():
    """L = -Σ θ^4 / 4 gives dθ/dt = θ^3, which blows up at t = 1/(2 θ0^2) = 0.5 for θ0 = 1."""
    params0 = {"theta": np.ones(3)}
    flow = GradientFlow(lambda params: -jnp.sum(params["theta"] ** 4) / 4, params0)
    times = np.linspace(0.0, 2.0, 21)
    descent = solve_flow(flow, params0, times, method="gradient_descent", lr=0.05)
    assert descent.status == Status.NON_FINITE and "non-finite" in descent.message
    assert 2 <= len(descent.trajectory) < len(times) and np.all(np.isfinite(descent.trajectory.params["theta"]))
    for method in ("LSODA", "JaxRadau"):
        stiff = solve_flow(flow, params0, times, method=method, max_steps=5000)
        assert stiff.status in (Status.NON_FINITE, Status.SOLVER_FAILED, Status.STEP_LIMIT) and not stiff.success, method
        assert stiff.t_reached == pytest.approx(0.5, abs=0.01), method
        # t = 0, 0.1, ..., 0.4: every save time before the blow-up. An implicit collocation step
        # can land on t = 0.5 itself with a large finite value; nothing after it is kept.
        kept = stiff.trajectory
        before = kept.t < 0.5
        assert np.count_nonzero(before) == 5 and len(kept) <= 6, method
        np.testing.assert_allclose(kept.params["theta"][before, 0], 1 / np.sqrt(1 - 2 * kept.t[before]), rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="Euler"), "unknown solver method 'Euler'"),
        (dict(method="gradient_descent"), "positive learning rate"),
        (dict(rtol=-1.0), "solver.rtol must be a positive number"),
        (dict(max_steps=0), "max_steps must be a positive integer"),
    ],
)
def test_bad_solver_arguments(default_flow, kwargs, message):
    flow, params0 = default_flow
    with pytest.raises(ValueError, match=message):
        solve_flow(flow, params0, [0.0, 1.0], **kwargs)


@pytest.mark.parametrize("times, message", [([1.0, 2.0], "start at t = 0"), ([0.0, 2.0, 1.0], "ascending")])
def test_bad_save_times(default_flow, times, message):
    flow, params0 = default_flow
    with pytest.raises(ValueError, match=message):
        solve_flow(flow, params0, times)


@pytest.mark.parametrize("method", ["LSODA", "gradient_descent"])
def test_checkpoints_are_prefixes_of_the_final_trajectory(default_flow, method):
    flow, params0 = default_flow
    times = np.linspace(0.0, 20.0, 11)  # few distinct prefix lengths: few recompiles of the loss
    partials = []
    result = solve_flow(flow, params0, times, method=method, lr=0.5, on_checkpoint=partials.append, checkpoint_every_s=0.0)
    assert result.success and len(partials) >= 3
    for partial in partials:
        n = len(partial.trajectory)
        np.testing.assert_array_equal(partial.trajectory.t, result.trajectory.t[:n])
        np.testing.assert_array_equal(partial.trajectory.params["W0"], result.trajectory.params["W0"][:n])


def test_flows_of_one_structure_share_compiled_functions_and_keep_their_own_data():
    model = OneLayerTransformer(d=4, m=3, k=2)
    params = model.init(0.3, 0)
    flows = [GradientFlow(flowsim.make_loss_function(model, MarkovChain(pi=PAPER_PI, lam=lam)), params) for lam in (0.2, 0.8)]
    other = GradientFlow(flowsim.make_loss_function(OneLayerTransformer(d=4, m=4, k=2), MarkovChain(pi=PAPER_PI, lam=0.2)),
                         OneLayerTransformer(d=4, m=4, k=2).init(0.3, 0))
    assert flows[0].structure_key == flows[1].structure_key != other.structure_key
    theta = flows[0].flatten(params)[None]
    compiled = flow_module._loss_batch_jit._cache_size
    before = compiled()
    for flow in flows:  # one compiled function, evaluating each flow's own chain
        assert flow.loss_along(theta)[0] == pytest.approx(float(flow.loss(params)), rel=1e-13)
    assert compiled() == before + 1
    other.loss_along(other.flatten(other.unravel(np.zeros(other.size)))[None])
    assert compiled() == before + 2
    assert flows[0].loss_along(theta)[0] != pytest.approx(flows[1].loss_along(theta)[0], rel=1e-6)
    split = flows[0].unflatten_batch(np.stack([theta[0], 2 * theta[0]]))
    for name in params:
        np.testing.assert_array_equal(split[name][1], 2 * np.asarray(params[name]))
