import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_params

import flowsim
from flowsim import MarkovChain, OneLayerTransformer
from flowsim.model.losses import (
    context_count_law,
    loss_monte_carlo,
    population_loss_enumerated,
    population_loss_finite,
)
from flowsim.model.models import TwoLayerTransformer

NON_PAPER_P = [[0.2, 0.5, 0.3], [0.6, 0.1, 0.3], [0.3, 0.3, 0.4]]


def test_mean_field_gradient_matches_central_differences(paper_chain):
    model = OneLayerTransformer(d=4, m=3, k=2)
    params = random_params(model, 0.7, seed=1)
    loss = jax.jit(flowsim.make_loss_function(model, paper_chain))
    gradient = jax.jit(jax.grad(loss))(params)
    rng = np.random.default_rng(0)
    for _ in range(5):
        direction = {name: rng.standard_normal(np.shape(value)) for name, value in params.items()}
        h = 1e-5
        plus = loss({n: params[n] + h * direction[n] for n in params})
        minus = loss({n: params[n] - h * direction[n] for n in params})
        finite_difference = (plus - minus) / (2 * h)
        analytic = sum(np.sum(gradient[n] * direction[n]) for n in params)
        assert abs(finite_difference - analytic) < 1e-8 * max(1.0, abs(analytic))


@pytest.mark.parametrize("options", [
    {},
    {"value_matrix": True},
    {"residual": True, "logit_scale": "inv_sqrt_k"},
    {"value_matrix": True, "residual": True, "logit_scale": "inv_sqrt_k", "fused_products": True},
], ids=["paper", "value", "residual-scaled", "all-fused"])
@pytest.mark.slow
def test_the_written_out_mean_field_gradient_is_autodiffs(options):
    """The one-layer mean-field loss differentiates by its written-out gradient; autodiff of the loss's value
    is the independent route: the gradient, the Hessian (forward mode over the gradient) and the derivatives
    in π and P (a token of frequency 0 included) all agree."""
    from flowsim.model.losses import _mean_field_core, _mean_field_value, one_layer_mean_field_gradient

    rng = np.random.default_rng(7)
    d = 6
    P = jnp.asarray(rng.dirichlet(np.ones(d), size=d))
    pi = jnp.asarray(np.r_[rng.dirichlet(np.ones(d - 1)), 0.0])
    model = OneLayerTransformer(d=d, m=4, k=3, **options)
    params = random_params(model, 0.8, seed=2)
    def derivatives(core):  # gradient, Hessian, and the derivatives in π and P, compiled
        return jax.jit(lambda params, pi, P: (jax.grad(core, argnums=1)(model, params, pi, P),
                                              jax.hessian(core, argnums=1)(model, params, pi, P),
                                              jax.grad(core, argnums=(2, 3))(model, params, pi, P)))(params, pi, P)

    expected, got = derivatives(_mean_field_value), derivatives(_mean_field_core)
    written_out = jax.jit(lambda params: one_layer_mean_field_gradient(model, params, pi, P))(params)
    for name in expected[0]:
        np.testing.assert_allclose(written_out[name], expected[0][name], rtol=1e-12, atol=1e-15)
    for got_leaf, expected_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got_leaf, expected_leaf, rtol=1e-11, atol=1e-14)


def test_gradient_at_origin_is_rank_one_on_M_and_zero_on_Phi(paper_chain):
    """docs/model.md: at θ = 0, ∂L/∂M = π (u - π)^T and ∂L/∂Φ = 0.

    With m = k = d, W0 = I gives M = W1 and Φ = W_Q W_K^T, so ∂L/∂W1 = ∂L/∂M, and with
    W_Q = I, ∂L/∂W_K = (∂L/∂Φ)^T; the other factors are zero (θ at the origin of M, Φ).
    """
    d = paper_chain.d
    model = OneLayerTransformer(d=d, m=d, k=d)
    params = {"W0": np.eye(d), "W_Q": np.eye(d), "W_K": np.zeros((d, d)), "W1": np.zeros((d, d))}
    gradient = jax.grad(flowsim.make_loss_function(model, paper_chain))(params)
    pi = paper_chain.pi
    np.testing.assert_allclose(gradient["W1"], np.outer(pi, np.full(d, 1 / d) - pi), atol=1e-15)
    np.testing.assert_allclose(gradient["W_K"], 0.0, atol=1e-15)
    # And at θ = 0 itself every parameter gradient vanishes (products of zeros).
    zero = {name: np.zeros(shape) for name, shape in OneLayerTransformer(d=d).shapes.items()}
    gradient_zero = jax.grad(flowsim.make_loss_function(OneLayerTransformer(d=d), paper_chain))(zero)
    assert max(np.abs(g).max() for g in gradient_zero.values()) == 0.0


MODELS = [
    OneLayerTransformer(d=3, m=4, k=3),
    OneLayerTransformer(d=3, m=4, k=3, value_matrix=True, residual=True, logit_scale="inv_sqrt_k"),
]
CHAINS = [
    MarkovChain(pi=[0.6, 0.3, 0.1], lam=0.4),
    MarkovChain(P=NON_PAPER_P, start="uniform"),
    MarkovChain(pi=[0.7, 0.3, 0.0], lam=0.5, start="uniform"),  # token 2 transient
]


@pytest.mark.parametrize("model", MODELS, ids=["paper", "options"])
@pytest.mark.parametrize("chain", CHAINS, ids=["paper-chain", "general-P", "transient-token"])
def test_count_programme_equals_enumeration(model, chain):
    params = random_params(model, 1.0, seed=7)
    for s in range(1, 9):
        exact = float(population_loss_finite(params, chain, s, model))
        brute = float(population_loss_enumerated(params, chain, s, model))
        assert abs(exact - brute) < 1e-12, (s, exact, brute)


def test_count_law_is_a_distribution_with_the_right_marginals():
    chain = MarkovChain(P=NON_PAPER_P)
    s = 20
    law = context_count_law(chain, s)
    assert abs(law.probability.sum() - 1) < 1e-13
    assert np.all(law.counts.sum(axis=1) == s)
    assert np.all(law.counts[np.arange(len(law.query)), law.query] >= 1)
    # Stationary start: E[c_j] = s π_j and x_s ~ π.
    np.testing.assert_allclose(law.probability @ law.counts, s * chain.pi, atol=1e-11)
    np.testing.assert_allclose(np.bincount(law.query, weights=law.probability), chain.pi, atol=1e-13)
    # Support size: every composition c of s with c[query] >= 1, times the query.
    expected_support = sum(1 for c in itertools.product(range(s + 1), repeat=3) if sum(c) == s for q in range(3) if c[q])
    assert len(law.probability) == expected_support


def test_finite_loss_agrees_with_monte_carlo():
    model = OneLayerTransformer(d=3, m=4, k=4)
    chain = MarkovChain(P=NON_PAPER_P)
    params = random_params(model, 1.0, seed=3)
    s = 12
    exact = float(flowsim.population_loss(params, chain, s, model=model))
    estimate = loss_monte_carlo(params, chain, s, n_samples=40_000, seed=11, model=model)
    assert estimate.stderr > 0
    assert abs(estimate.mean - exact) < 4 * estimate.stderr


def test_finite_loss_converges_to_mean_field_at_rate_one_over_s():
    model = OneLayerTransformer(d=3, m=4, k=4)
    chain = MarkovChain(pi=[0.6, 0.3, 0.1], lam=0.5)
    params = random_params(model, 0.8, seed=5)
    mean_field = float(flowsim.population_loss(params, chain))
    sizes = [8, 16, 32, 64, 128, 256]
    scaled = [s * abs(float(flowsim.population_loss(params, chain, s)) - mean_field) for s in sizes]
    assert max(scaled) < 10.0
    assert scaled[-1] > 0
    assert 0.8 < scaled[-1] / scaled[-2] < 1.25  # s·|L_s - L_∞| has settled to a constant


def test_population_loss_dispatch_and_monte_carlo_kind(paper_chain, paper_model):
    params = random_params(paper_model, 0.5, seed=2)
    assert float(flowsim.population_loss(params, paper_chain)) == pytest.approx(
        float(flowsim.population_loss_mean_field(params, paper_chain, paper_model)), abs=1e-15
    )
    sampled = flowsim.make_loss_function(paper_model, paper_chain, "monte_carlo", s=16, mc_samples=20_000, mc_seed=4)
    exact = float(flowsim.population_loss(params, paper_chain, 16))
    assert abs(float(sampled(params)) - exact) < 0.03


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(kind="finite", s=0), "positive integer context length"), (dict(kind="exact"), "loss.kind must be one of")],
)
def test_bad_loss_arguments(paper_chain, paper_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        flowsim.make_loss_function(paper_model, paper_chain, **kwargs)


def test_model_chain_size_mismatch(paper_chain):
    with pytest.raises(ValueError, match="d = 3 tokens but the chain has d = 4"):
        flowsim.make_loss_function(OneLayerTransformer(d=3), paper_chain)


def test_forward_pass_matches_a_direct_per_sequence_computation():
    model = OneLayerTransformer(d=3, m=4, k=2)
    params = random_params(model, 1.0, seed=9)
    tokens = np.array([[0, 2, 1, 1], [2, 2, 0, 1]])
    W0, WQ, WK, W1 = (np.asarray(params[n]) for n in ("W0", "W_Q", "W_K", "W1"))
    logits = np.asarray(model.forward(params, tokens))
    for row, sequence in enumerate(tokens):
        embeddings = W0[sequence]
        scores = (embeddings[-1] @ WQ) @ (embeddings @ WK).T
        weights = np.exp(scores - scores.max())
        weights /= weights.sum()
        np.testing.assert_allclose(logits[row], weights @ embeddings @ W1, atol=1e-13)


@pytest.mark.slow
def test_mean_field_loss_with_a_zero_frequency_token():
    """π_3 = 0: the token gets no attention, and the loss stays finite and differentiable."""
    chain = MarkovChain(pi=[0.7, 0.2, 0.1, 0.0], lam=0.5)
    model = OneLayerTransformer(d=4, m=3, k=3)
    params = random_params(model, 0.7, seed=4)
    loss = jax.jit(flowsim.make_loss_function(model, chain))
    gradient = jax.grad(loss)(params)
    assert all(np.all(np.isfinite(g)) for g in gradient.values())
    direction = {name: np.ones(np.shape(value)) for name, value in params.items()}
    h = 1e-5
    plus = loss({n: params[n] + h * direction[n] for n in params})
    minus = loss({n: params[n] - h * direction[n] for n in params})
    analytic = sum(np.sum(gradient[n]) for n in params)
    assert abs((plus - minus) / (2 * h) - analytic) < 1e-8 * max(1.0, abs(analytic))
    # it is the s -> infinity limit of the exact finite-s loss
    assert abs(float(flowsim.population_loss(params, chain, 256)) - float(loss(params))) < 0.05


@pytest.mark.parametrize("model, kind", [
    (OneLayerTransformer(d=4, m=8, k=8), "mean_field"),
    (OneLayerTransformer(d=4, m=8, k=8, value_matrix=True, residual=True), "finite"),
    (TwoLayerTransformer(d=4, ffn="mlp"), "mean_field"),
    (TwoLayerTransformer(d=4, m=4, k=3, ffn="glu", ffn_width=5), "finite"),
], ids=["one_layer_mean_field", "one_layer_finite", "two_layer_mlp_mean_field", "two_layer_glu_finite"])
@pytest.mark.slow
def test_fused_products_give_the_same_loss_and_gradient(paper_chain, model, kind):
    """The fusible form of the small products (used inside JaxRadau) is the same function:
    loss and gradient equal the matrix-product form to rounding, and the form is really used."""
    from jax.flatten_util import ravel_pytree

    from flowsim.model.losses import make_loss_function, with_fused_products
    from flowsim.model.models import SMALL_MATMUL_TERMS, small_matmul

    params = random_params(model, scale=0.7, seed=3)
    loss = make_loss_function(model, paper_chain, kind=kind, s=6)
    fused = with_fused_products(loss)
    assert fused.func.model.fused_products and not loss.func.model.fused_products
    np.testing.assert_allclose(float(fused(params)), float(loss(params)), rtol=1e-13)
    gradient, fused_gradient = (ravel_pytree(jax.grad(f)(params))[0] for f in (loss, fused))
    np.testing.assert_allclose(fused_gradient, gradient, rtol=1e-10, atol=1e-11 * np.max(np.abs(gradient)))
    # the mean-field loss has no matrix product left at all
    products = str(jax.make_jaxpr(fused)(params)).count("dot_general")
    assert (products == 0) if kind == "mean_field" else (products < str(jax.make_jaxpr(loss)(params)).count("dot_general"))
    a, b = np.random.default_rng(0).standard_normal((2, 3, 5, 4)), np.random.default_rng(1).standard_normal((4, 6))
    assert "dot_general" not in str(jax.make_jaxpr(lambda x, y: small_matmul(x, y, fused=True))(a[0], b))
    np.testing.assert_allclose(small_matmul(a, b, fused=True), a @ b, rtol=1e-13)
    # products too large to gain stay matrix products
    big = np.ones((SMALL_MATMUL_TERMS // 16, 4, 4))
    assert "dot_general" in str(jax.make_jaxpr(lambda x, y: small_matmul(x, y, fused=True))(big, b))
    assert "dot_general" in str(jax.make_jaxpr(lambda x, y: small_matmul(x, y))(a[0], b))


@pytest.mark.parametrize("options", [{}, {"value_matrix": True, "residual": True, "logit_scale": "inv_sqrt_k"}],
                         ids=["paper", "value_residual_scaled"])
@pytest.mark.slow
def test_mean_field_loss_never_forms_M_and_equals_the_M_route(options):
    """The O(d² m) mean-field loss (attention W0, then W1) against Z = A M with M = W0 [W_V] W1 formed."""
    from jax.flatten_util import ravel_pytree

    from flowsim.model.losses import expected_cross_entropy, mean_field_attention

    d = 60
    rng = np.random.default_rng(11)
    chain = flowsim.MarkovChain.from_counts(rng.integers(0, 20, (d, d)), smoothing=0.5)
    model = flowsim.OneLayerTransformer(d=d, m=5, k=3, **options)
    params = random_params(model, scale=0.6, seed=5)
    pi, P = jnp.asarray(chain.pi), jnp.asarray(chain.P)

    def through_M(params):
        M = params["W0"] @ (params["W_V"] @ params["W1"] if model.value_matrix else params["W1"])
        Z = mean_field_attention(model.attention_logits(params), pi) @ M
        if model.residual:
            Z = Z + params["W0"] @ params["W1"]
        return expected_cross_entropy(Z, P, pi)

    loss = flowsim.make_loss_function(model, chain)
    np.testing.assert_allclose(float(loss(params)), float(through_M(params)), rtol=1e-12)
    gradient, reference = (ravel_pytree(jax.grad(f)(params))[0] for f in (loss, through_M))
    np.testing.assert_allclose(gradient, reference, rtol=1e-10, atol=1e-12 * np.abs(reference).max())
    # and no product costs d³: the largest matrix product of the loss and its gradient is O(d² m)
    assert _largest_product_flops(jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr) <= d * d * 5
    assert _largest_product_flops(jax.make_jaxpr(jax.value_and_grad(through_M))(params).jaxpr) >= d**3  # the check bites


def _largest_product_flops(jaxpr) -> int:
    """The most multiply-adds of any dot_general in a jaxpr (nested jaxprs included)."""
    largest = 0
    for equation in jaxpr.eqns:
        if equation.primitive.name == "dot_general":
            (contracting, _), _ = equation.params["dimension_numbers"]  # (lhs, rhs) contracting axes, batch axes
            inner = int(np.prod([equation.invars[0].aval.shape[axis] for axis in contracting]))
            largest = max(largest, int(np.prod(equation.outvars[0].aval.shape)) * inner)
        for value in equation.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner_jaxpr = getattr(sub, "jaxpr", None)
                if inner_jaxpr is not None:
                    largest = max(largest, _largest_product_flops(inner_jaxpr))
    return largest


def test_the_finite_loss_size_bounds_the_dynamic_programme_s_support(paper_chain):
    from math import comb

    from flowsim.model.losses import context_count_law, finite_loss_states

    for s in (1, 3, 6):
        law = context_count_law(paper_chain, s)  # dense chain: every state with c[x_s] >= 1 occurs
        assert len(law.probability) == 4 * comb(s + 2, 3) <= finite_loss_states(4, s)


def test_an_oversized_finite_loss_is_refused_before_any_allocation(paper_chain, paper_model, monkeypatch):
    import flowsim.model.losses as losses
    from flowsim.common.budget import BudgetError

    def never(*args, **kwargs):
        raise AssertionError("the count law was computed")

    monkeypatch.setattr(losses, "context_count_law", never)
    monkeypatch.setattr(losses.MarkovChain, "sample", never)
    with pytest.raises(BudgetError, match=r"loss.kind = 'finite' with s = 10000, d = 4 .* over the memory budget"):
        losses.make_loss_function(paper_model, paper_chain, "finite", 10_000)
    with pytest.raises(BudgetError, match=r"Monte Carlo loss on 1000000000 sequences .*: lower loss.mc_samples or loss.s$"):
        losses.make_loss_function(paper_model, paper_chain, "monte_carlo", 10_000, mc_samples=10**9)


def test_a_model_and_a_chain_of_different_d_are_one_clear_error():
    from flowsim.model.losses import population_loss
    from flowsim.model.models import OneLayerTransformer

    model = OneLayerTransformer(d=4, m=3, k=3)
    params = model.init(0.1, 0)
    chain = MarkovChain(pi=np.full(5, 0.2), lam=0.5)
    for s in (None, 3):
        with pytest.raises(ValueError, match="the model has d = 4 tokens and the chain d = 5"):
            population_loss(params, chain, s, model=model)
