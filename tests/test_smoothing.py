"""Depth smoothing (Window Smoothing) as a preconditioner of the two-layer flow."""

import jax
import numpy as np
import pytest
from conftest import random_params

import flowsim
from flowsim.model.flow import DepthSmoothing, GradientFlow, path_smoothing_operator
from flowsim.model.models import TwoLayerTransformer
from flowsim.solve.solvers import solve_flow


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_operator_is_symmetric_doubly_stochastic_and_psd_up_to_one_half(n):
    for a in np.linspace(0.0, 0.5, 11):
        S = path_smoothing_operator(n, a)
        np.testing.assert_array_equal(S, S.T)
        np.testing.assert_allclose(S.sum(axis=0), 1.0, atol=1e-15)
        np.testing.assert_allclose(S.sum(axis=1), 1.0, atol=1e-15)
        assert np.linalg.eigvalsh(S).min() >= -1e-12
    # the interior and end rules of Window Smoothing
    S = path_smoothing_operator(n, 0.2)
    assert S[0, 0] == pytest.approx(0.9) and S[0, 1] == pytest.approx(0.1)
    if n > 2:
        assert S[1, 1] == pytest.approx(0.8) and S[1, 0] == S[1, 2] == pytest.approx(0.1)
    # beyond 1/2 a long path loses positive semi-definiteness
    assert np.linalg.eigvalsh(path_smoothing_operator(7, 0.7)).min() < 0


def test_bad_smoothing_is_refused():
    with pytest.raises(ValueError, match=r"\[0, 1/2\]"):
        DepthSmoothing(0.6, (("W_Q1", "W_Q2"),))
    with pytest.raises(ValueError, match="smoothing_variant"):
        DepthSmoothing(0.1, (("W_Q1", "W_Q2"),), variant="fancy")
    with pytest.raises(ValueError, match="repeated blocks"):
        DepthSmoothing(0.1, ())


@pytest.fixture(scope="module")
def two_layer_setup():
    chain = flowsim.MarkovChain(pi=[0.75, 0.19, 0.05, 0.01], lam=0.5)
    model = TwoLayerTransformer(d=4, m=4, k=3, ffn="mlp", ffn_width=5)
    return chain, model, flowsim.make_loss_function(model, chain)


def test_zero_smoothing_is_the_plain_flow_exactly(two_layer_setup):
    chain, model, loss = two_layer_setup
    params = random_params(model, 0.4, seed=1)
    plain = GradientFlow(loss, params)
    zero = GradientFlow(loss, params, smoothing=DepthSmoothing(0.0, model.repeated_blocks))
    theta = plain.flatten(params)
    np.testing.assert_array_equal(zero.vector_field(0.0, theta), plain.vector_field(0.0, theta))


@pytest.mark.parametrize("variant", ["standard", "norm_preserving"])
@pytest.mark.slow
def test_smoothed_field_mixes_same_role_gradients_and_descends(two_layer_setup, variant):
    chain, model, loss = two_layer_setup
    params = random_params(model, 0.4, seed=2)
    a = 0.2
    flow = GradientFlow(loss, params, smoothing=DepthSmoothing(a, model.repeated_blocks, variant))
    theta = flow.flatten(params)
    gradient = jax.jit(jax.grad(loss))(params)
    field = flow.unflatten_batch(flow.vector_field(0.0, theta)[None])
    for lower, upper in model.repeated_blocks:
        g1, g2 = np.asarray(gradient[lower]), np.asarray(gradient[upper])
        u1, u2 = (1 - a / 2) * g1 + a / 2 * g2, a / 2 * g1 + (1 - a / 2) * g2
        if variant == "norm_preserving":
            u1, u2 = u1 * np.linalg.norm(g1) / np.linalg.norm(u1), u2 * np.linalg.norm(g2) / np.linalg.norm(u2)
        np.testing.assert_allclose(-field[lower][0], u1, atol=1e-13)
        np.testing.assert_allclose(-field[upper][0], u2, atol=1e-13)
    np.testing.assert_allclose(-field["W_E"][0], gradient["W_E"], atol=1e-13)  # embeddings are not smoothed
    # the Jacobian is the derivative of the smoothed field (central differences)
    direction = np.random.default_rng(3).standard_normal(flow.size)
    h = 1e-6
    difference = (flow.vector_field(0.0, theta + h * direction) - flow.vector_field(0.0, theta - h * direction)) / (2 * h)
    np.testing.assert_allclose(flow.jacobian(0.0, theta) @ direction, difference, atol=1e-7)
    # descent along a solved trajectory from a small initialisation: LSODA calls the field and the Jacobian
    # compiled above (JaxRadau's complex route on a smoothed flow is checked in test_stiff)
    start = random_params(model, 1e-2, seed=4)
    result = solve_flow(flow, start, np.linspace(0.0, 300.0, 61), method="LSODA", rtol=1e-9, atol=1e-12)
    assert result.success and np.all(np.diff(result.trajectory.loss) <= 1e-12)
    assert result.trajectory.loss[-1] < result.trajectory.loss[0] - 0.1
