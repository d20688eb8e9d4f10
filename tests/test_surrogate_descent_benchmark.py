"""benchmarks/surrogate_descent.py: its per-example loss is the mean-field loss split over (query, target) pairs,
and its descent takes plain steps of that loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import surrogate_descent  # benchmarks/ is on the path (conftest)
from flowsim.model.chains import MarkovChain
from flowsim.model.losses import population_loss_mean_field
from flowsim.model.models import OneLayerTransformer


def seeded_chain(d: int, seed: int) -> MarkovChain:
    rng = np.random.default_rng(seed)
    P = rng.dirichlet(np.full(d, 0.5), size=d)
    return MarkovChain(P=P)


@pytest.mark.parametrize("options", [{}, {"residual": True}, {"value_matrix": True}, {"logit_scale": "inv_sqrt_k"}])
@pytest.mark.slow
def test_the_pairs_losses_weighted_by_their_law_are_the_mean_field_loss(options):
    chain = seeded_chain(6, seed=3)
    model = OneLayerTransformer(d=6, m=3, k=2, **options)
    params = model.init(0.7, seed=1)
    query, target = (jnp.asarray(a.ravel()) for a in np.meshgrid(np.arange(6), np.arange(6), indexing="ij"))
    weights = jnp.asarray((chain.pi[:, None] * chain.P).ravel())
    log_pi = jnp.log(jnp.asarray(chain.pi))
    by_pairs = lambda p: jnp.sum(weights * surrogate_descent.example_losses(model, p, log_pi, query, target))  # noqa: E731
    exact = lambda p: population_loss_mean_field(p, chain, model)  # noqa: E731
    np.testing.assert_allclose(by_pairs(params), exact(params), rtol=1e-13)
    exact_gradient = jax.grad(exact)(params)
    for name, gradient in jax.grad(by_pairs)(params).items():  # so SGD's mean step is the exact one
        np.testing.assert_allclose(gradient, exact_gradient[name], rtol=1e-11, atol=1e-14)


def test_gradient_descent_takes_plain_steps_of_the_exact_loss():
    chain = seeded_chain(5, seed=4)
    model = OneLayerTransformer(d=5, m=3, k=3)
    params = model.init(0.5, seed=2)
    lr = surrogate_descent.READ_EVERY / 4  # four steps a reading
    times, sigmas = surrogate_descent.descend(model, chain, params, lr, batch=0, t_end=2 * surrogate_descent.READ_EVERY, seed=0)
    gradient = jax.jit(jax.grad(lambda p: population_loss_mean_field(p, chain, model)))
    for _ in range(8):
        step = gradient(params)
        params = {name: value - lr * step[name] for name, value in params.items()}
    np.testing.assert_allclose(times, [0.0, 5.0, 10.0])
    np.testing.assert_allclose(sigmas[-1], np.linalg.svd(np.asarray(params["W0"]), compute_uv=False), rtol=1e-12)


def test_sgd_steps_average_to_the_exact_step():
    chain = seeded_chain(4, seed=5)
    model = OneLayerTransformer(d=4, m=2, k=2)
    params = model.init(0.8, seed=0)
    lr = surrogate_descent.READ_EVERY  # one step a reading
    exact = surrogate_descent.descend(model, chain, params, lr, batch=0, t_end=lr, seed=0)[1][-1]
    noisy = np.mean([surrogate_descent.descend(model, chain, params, lr, batch=4096, t_end=lr, seed=s)[1][-1]
                     for s in range(4)], axis=0)
    np.testing.assert_allclose(noisy, exact, rtol=2e-2)  # a mean of 16 384 pairs


def test_departures_read_the_first_crossing_of_each_multiple():
    times = np.arange(6.0)
    sigma1 = np.array([1.0, 1.5, 2.5, 2.0, 3.5, 4.0])
    assert surrogate_descent.first_crossings(times, sigma1) == {2.0: 2.0, 3.0: 4.0}  # 5 × never


def test_pairs_are_drawn_from_their_law():
    chain = seeded_chain(5, seed=6)
    n = 400_000
    query, target = surrogate_descent.pair_sampler(chain)(jax.random.PRNGKey(0), n)
    counts = np.bincount(np.asarray(query) * 5 + np.asarray(target), minlength=25)
    expected = n * (chain.pi[:, None] * chain.P).ravel()
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected) + 1)  # five binomial standard deviations
