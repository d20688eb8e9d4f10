"""The finite-context loss at any d: the window composition's exact moments and the loss to second order in them,
each against an independent route (the count programme's exact law, autodiff's Hessian, the exact finite-s loss,
Monte Carlo)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_chain, random_params

import flowsim
from flowsim import MarkovChain, OneLayerTransformer
from flowsim.model.losses import (
    _second_order_core,
    context_count_law,
    loss_monte_carlo,
    population_loss_finite_second_order,
)
from flowsim.model.windows import window_composition


@pytest.mark.parametrize("start", ["stationary", "uniform"])
def test_window_moments_are_the_count_laws(start):
    """μ_q and C_q equal the mean and covariance of c / s given x_s = q under the count programme's exact law."""
    chain = MarkovChain(P=random_chain(4, seed=7).P, start=start)
    s = 7
    law, composition = context_count_law(chain, s), window_composition(chain, s)
    for q in range(chain.d):
        rows = law.query == q
        probability = law.probability[rows]
        frequencies = law.counts[rows] / s
        mean = probability @ frequencies / probability.sum()
        centred = frequencies - mean
        covariance = centred.T @ (centred * probability[:, None]) / probability.sum()
        assert composition.query_probability[q] == pytest.approx(probability.sum(), abs=1e-14)
        np.testing.assert_allclose(composition.mean[q], mean, atol=1e-14)
        np.testing.assert_allclose(composition.covariance[q], covariance, atol=1e-14)


def test_an_unreachable_query_reads_a_window_of_itself():
    """A query no window ends on (a transient token, probability 0 from the stationary start) gets μ_q = e_q and
    C_q = 0, so the loss has no NaN and gives it no weight."""
    chain = MarkovChain(P=[[0.0, 0.5, 0.5], [0.0, 0.3, 0.7], [0.0, 0.6, 0.4]])
    composition = window_composition(chain, 5)
    assert composition.query_probability[0] == 0
    np.testing.assert_array_equal(composition.mean[0], [1.0, 0.0, 0.0])
    assert np.all(composition.covariance[0] == 0)
    model = OneLayerTransformer(d=3, m=2, k=2)
    assert np.isfinite(float(population_loss_finite_second_order(random_params(model, 0.5, seed=0), chain, 5, model)))


@pytest.mark.parametrize("options", [{}, {"value_matrix": True, "residual": True, "logit_scale": "inv_sqrt_k"}])
def test_the_written_curvature_is_autodiffs_hessian(options):
    """½ tr(C_q ∇²ℓ_q) as written (U, N, ω) equals the same trace with ∇²ℓ_q from jax.hessian of ℓ_q(x) itself."""
    chain = random_chain(5, seed=3)
    model = OneLayerTransformer(d=5, m=3, k=2, **options)
    params = random_params(model, 0.8, seed=4)
    composition = window_composition(chain, 6)
    P = jnp.asarray(chain.P)
    phi = model.attention_logits(params)

    def query_loss(x, q):
        attention = x * jnp.exp(phi[q]) / jnp.sum(x * jnp.exp(phi[q]))
        logits = model.logits_from_attention(params, attention[None], jnp.array([q]))[0]
        return jax.nn.logsumexp(logits) - P[q] @ logits

    queries, means = jnp.arange(chain.d), jnp.asarray(composition.mean)
    values, hessians = jax.jit(jax.vmap(query_loss))(means, queries), jax.jit(jax.vmap(jax.hessian(query_loss)))(means, queries)
    by_hessian = jnp.sum(composition.query_probability * (
        values + 0.5 * jnp.sum(hessians * composition.covariance, axis=(1, 2))))
    written = _second_order_core(model, params, P, *(jnp.asarray(a) for a in (
        composition.query_probability, composition.mean, composition.covariance)))
    assert float(written) == pytest.approx(float(by_hessian), abs=1e-13)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_second_order_loss_converges_to_the_exact_finite_loss_at_rate_one_over_s_squared(seed):
    """On a seeded family of chains, against the count programme: |L₂ - L_s| falls by about 4 per doubling of s
    (s = 32 → 64), faster than the mean-field loss's |L_∞ - L_s|, and the gradient's error falls too."""
    chain = random_chain(3, seed=10 + seed)
    model = OneLayerTransformer(d=3, m=3, k=3)
    params = random_params(model, 0.8, seed=seed)
    errors, gradient_errors = {}, {}
    for s in (32, 64):
        exact = flowsim.population_loss(params, chain, s, model=model)
        second = population_loss_finite_second_order(params, chain, s, model)
        errors[s] = abs(float(second - exact))
        exact_gradient = jax.grad(lambda p: flowsim.population_loss(p, chain, s, model=model))(params)
        second_gradient = jax.grad(lambda p: population_loss_finite_second_order(p, chain, s, model))(params)
        gradient_errors[s] = max(float(jnp.max(jnp.abs(exact_gradient[n] - second_gradient[n]))) for n in params)
        if s == 64:
            mean_field_error = abs(float(flowsim.population_loss(params, chain, model=model) - exact))
    assert 2.8 < errors[32] / errors[64] < 5.5
    assert errors[64] < 0.5 * mean_field_error
    assert gradient_errors[64] < 0.5 * gradient_errors[32]


def test_the_second_order_correction_is_the_sampled_one_at_d_16():
    """Where the count programme cannot reach (d = 16, s = 64): the finite-s loss minus the mean-field loss, from the
    moments, against the same difference from 60 000 sampled windows (one sample, the per-window difference taken,
    so its standard error is the correction's own)."""
    chain = random_chain(16, seed=5)
    model = OneLayerTransformer(d=16, m=4, k=4)
    params = random_params(model, 1.0, seed=6)
    s, n = 64, 60_000
    correction = float(population_loss_finite_second_order(params, chain, s, model)
                       - flowsim.population_loss(params, chain, model=model))
    sequences = chain.sample(n, s + 1, seed=8)
    logits = model.forward(params, jnp.asarray(sequences[:, :-1]))
    targets = sequences[:, -1]
    windowed = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    mean_field = model.mean_field_logits(params, jnp.asarray(chain.pi))[sequences[:, -2]]
    limit = jax.nn.logsumexp(mean_field, axis=-1) - jnp.take_along_axis(mean_field, targets[:, None], axis=-1)[:, 0]
    difference = np.asarray(windowed - limit)
    sampled, stderr = difference.mean(), difference.std(ddof=1) / np.sqrt(n)
    assert abs(sampled) > 5 * stderr  # the correction is measured, not zero
    assert abs(correction - sampled) < 3 * stderr
    assert loss_monte_carlo(params, chain, s, 2000, seed=1, model=model).n == 2000


def test_the_second_order_kind_is_a_loss_kind_with_a_size_check(paper_chain, paper_model, monkeypatch):
    loss = flowsim.make_loss_function(paper_model, paper_chain, "finite_second_order", s=16)
    params = random_params(paper_model, 0.5, seed=2)
    assert float(loss(params)) == pytest.approx(
        float(population_loss_finite_second_order(params, paper_chain, 16, paper_model)), rel=1e-14)
    monkeypatch.setenv("FLOWSIM_MEMORY_BUDGET_GB", "1e-9")
    with pytest.raises(flowsim.common.budget.BudgetError, match="finite_second_order"):
        flowsim.make_loss_function(paper_model, paper_chain, "finite_second_order", s=16)


def test_the_benchmarks_independent_token_ablation_is_the_covariance_of_independent_draws():
    """benchmarks/finite_context_flow.py's ablation against the count programme's exact moments for a chain whose tokens
    are independent (every row of P is π): there the Markov covariance and the ablation's are the same, and on a
    Markov chain they differ while the means agree."""
    import finite_context_flow  # benchmarks/ is on the path (conftest)

    pi = np.array([0.5, 0.3, 0.2])
    independent = window_composition(MarkovChain(P=np.tile(pi, (3, 1))), 7)
    np.testing.assert_allclose(finite_context_flow.independent_tokens(independent).covariance, independent.covariance,
                               atol=1e-15)
    markov = window_composition(random_chain(3, seed=2), 7)
    ablated = finite_context_flow.independent_tokens(markov)
    np.testing.assert_array_equal(ablated.mean, markov.mean)
    assert np.abs(ablated.covariance - markov.covariance).max() > 1e-4


def test_the_control_variate_loss_is_unbiased_and_samples_only_the_remainder():
    """At s = 8, where the second-order loss is off by 1%, the control-variate loss averaged over 40 independent samples
    of 2000 windows is the exact finite-s loss (count programme) within 4 standard errors, and its spread over samples
    is under a third of the plain Monte Carlo loss's on the same number of windows."""
    chain = random_chain(3, seed=21)
    model = OneLayerTransformer(d=3, m=3, k=3)
    params = random_params(model, 1.5, seed=3)
    s = 8
    exact = float(flowsim.population_loss(params, chain, s, model=model))
    assert abs(float(population_loss_finite_second_order(params, chain, s, model)) - exact) > 2e-3
    estimate = jax.jit(lambda p, loss: loss(p))
    by_control_variate = [float(estimate(params, flowsim.make_loss_function(
        model, chain, "finite_control_variate", s, mc_samples=2000, mc_seed=seed))) for seed in range(40)]
    plain = [float(estimate(params, flowsim.make_loss_function(model, chain, "monte_carlo", s, mc_samples=2000,
                                                               mc_seed=seed))) for seed in range(40)]
    stderr = np.std(by_control_variate, ddof=1) / np.sqrt(40)
    assert abs(np.mean(by_control_variate) - exact) < 4 * stderr
    assert np.std(by_control_variate) < np.std(plain) / 3


@pytest.mark.slow
def test_the_control_variate_loss_has_its_exact_gradient_and_the_second_order_losss_hessian():
    """The sampled remainder enters the gradient exactly (central differences) and the Hessian not at all, so the
    implicit methods' Newton matrix costs what the second-order loss's does."""
    from jax.flatten_util import ravel_pytree

    chain = random_chain(4, seed=9)
    model = OneLayerTransformer(d=4, m=3, k=3)
    flat, unravel = ravel_pytree(random_params(model, 1.5, seed=3))
    control_variate_loss = flowsim.make_loss_function(model, chain, "finite_control_variate", 8, mc_samples=500)
    second_order_loss = flowsim.make_loss_function(model, chain, "finite_second_order", 8)
    control_variate = jax.jit(lambda theta: control_variate_loss(unravel(theta)))
    second_order = jax.jit(lambda theta: second_order_loss(unravel(theta)))
    direction = np.random.default_rng(0).standard_normal(flat.shape)
    h = 1e-6
    by_differences = (control_variate(flat + h * direction) - control_variate(flat - h * direction)) / (2 * h)
    assert float(jax.jit(jax.grad(control_variate))(flat) @ direction) == pytest.approx(float(by_differences), rel=1e-7)
    assert abs(float(control_variate(flat) - second_order(flat))) > 1e-4  # the remainder is there
    np.testing.assert_allclose(jax.jit(jax.hessian(control_variate))(flat), jax.jit(jax.hessian(second_order))(flat),
                               atol=1e-12)


@pytest.mark.parametrize("start", ["stationary", "uniform"])
def test_the_folded_covariance_is_exact_on_the_kept_types_and_independent_elsewhere(start):
    """folded_window_composition keeps C_q exactly between the K most frequent types and, outside that block, the
    covariance of independent tokens drawn from the window's mean composition; with K = d it is C_q."""
    from flowsim.model.windows import folded_window_composition, independent_covariance

    chain = MarkovChain(P=random_chain(6, seed=13).P, start=start)
    full = window_composition(chain, 9)
    np.testing.assert_allclose(folded_window_composition(chain, 9, 6).covariance(), full.covariance, atol=1e-15)
    folded = folded_window_composition(chain, 9, 2)
    assert list(folded.kept) == sorted(np.argsort(-chain.pi)[:2])
    np.testing.assert_array_equal(folded.mean, full.mean)
    covariance, block = folded.covariance(), np.ix_(np.arange(6), folded.kept, folded.kept)
    np.testing.assert_allclose(covariance[block], full.covariance[block], atol=1e-15)
    outside = independent_covariance(full.mean, 9)
    outside[block] = covariance[block]
    np.testing.assert_allclose(covariance, outside, atol=1e-15)
    assert np.abs(covariance - full.covariance).max() > 1e-4


@pytest.mark.slow
def test_the_folded_loss_is_the_second_order_loss_with_the_folded_covariance():
    """The folded route's products (diagonal plus rank one, and the kept block) give the loss and gradient of the
    full route fed the folded covariance as a d³ array; kept_types = d is the exact loss."""
    from flowsim.model.losses import folded_second_order_loss, second_order_loss
    from flowsim.model.windows import WindowComposition, folded_window_composition

    chain = random_chain(6, seed=14)
    model = OneLayerTransformer(d=6, m=3, k=2, value_matrix=True, residual=True)
    params = random_params(model, 1.2, seed=2)
    folded = folded_window_composition(chain, 9, 3)
    as_array = WindowComposition(9, folded.query_probability, folded.mean, folded.covariance())
    by_fold, by_array = folded_second_order_loss(model, chain, folded), second_order_loss(model, chain, as_array)
    assert float(by_fold(params)) == pytest.approx(float(by_array(params)), rel=1e-13)
    gradient = jax.jit(lambda p, loss: jax.grad(loss)(p))
    fold_gradient, array_gradient = gradient(params, by_fold), gradient(params, by_array)
    for name in params:
        np.testing.assert_allclose(fold_gradient[name], array_gradient[name], atol=1e-12)
    every_type = flowsim.make_loss_function(model, chain, "finite_second_order", s=9, kept_types=6)
    assert float(every_type(params)) == pytest.approx(float(population_loss_finite_second_order(params, chain, 9, model)),
                                                      rel=1e-14)
    fewer = flowsim.make_loss_function(model, chain, "finite_second_order", s=9, kept_types=3)
    assert float(fewer(params)) == pytest.approx(float(by_fold(params)), rel=1e-14)


@pytest.mark.parametrize("start", ["stationary", "uniform"])
@pytest.mark.slow
def test_the_covariance_in_blocks_of_queries_is_the_whole_one_and_so_is_its_loss(start):
    """window_covariance_blocks yields every query's C_q once, equal to window_composition's; the loss and gradient
    summed over blocks (the reference for the fold at d = 1001) are population_loss_finite_second_order's."""
    from flowsim.model.losses import second_order_losses_by_blocks
    from flowsim.model.windows import window_covariance_blocks, window_mean

    chain = MarkovChain(P=random_chain(7, seed=21).P, start=start)
    whole = window_composition(chain, 8)
    blocks = list(window_covariance_blocks(chain, 8, 3))
    assert [list(queries) for queries, _ in blocks] == [[0, 1, 2], [3, 4, 5], [6]]
    for queries, covariance in blocks:
        np.testing.assert_allclose(covariance, whole.covariance[queries], atol=1e-15)
    query_probability, mean = window_mean(chain, 8)
    np.testing.assert_allclose(query_probability, whole.query_probability, atol=1e-15)
    np.testing.assert_allclose(mean, whole.mean, atol=1e-15)
    model = OneLayerTransformer(d=7, m=3, k=2, value_matrix=True)
    points = [random_params(model, scale, seed=5) for scale in (0.4, 1.1)]
    for params, (value, gradient) in zip(points, second_order_losses_by_blocks(model, chain, 8, points, block=3)):
        exact_value, exact_gradient = jax.value_and_grad(population_loss_finite_second_order)(params, chain, 8, model)
        assert value == pytest.approx(float(exact_value), rel=1e-13)
        for name in params:
            np.testing.assert_allclose(gradient[name], exact_gradient[name], atol=1e-13)


@pytest.mark.slow
def test_the_folded_loss_leaves_its_traces_curvature_out_of_the_hessian():
    """The folded loss's Hessian-vector products are those of its mean-composition part Σ_q p_q ℓ_q(μ_q) alone (the
    JaxBDF Newton matrix, cheap at d = 1001), while its gradient is the whole loss's (checked above): the traces'
    gradient moves the flow, their curvature does not enter the products."""
    from flowsim.model.losses import _query_expansion
    from flowsim.model.windows import folded_window_composition

    chain = random_chain(6, seed=15)
    model = OneLayerTransformer(d=6, m=3, k=2)
    params = random_params(model, 1.3, seed=3)
    tangent = random_params(model, 1.0, seed=9)
    folded = folded_window_composition(chain, 9, 3)
    loss = flowsim.make_loss_function(model, chain, "finite_second_order", s=9, kept_types=3)
    P, p, mean = jnp.asarray(chain.P), jnp.asarray(folded.query_probability), jnp.asarray(folded.mean)
    mean_composition = lambda params: jnp.sum(p * _query_expansion(model, params, P, mean).loss)  # noqa: E731
    hvp = lambda f: jax.jvp(jax.grad(f), (params,), (tangent,))[1]  # noqa: E731
    folded_product, expected = hvp(loss), hvp(mean_composition)
    for name in params:
        np.testing.assert_allclose(folded_product[name], expected[name], atol=1e-12)
    with_traces = hvp(flowsim.make_loss_function(model, chain, "finite_second_order", s=9))
    assert max(float(jnp.abs(with_traces[name] - expected[name]).max()) for name in params) > 1e-4
