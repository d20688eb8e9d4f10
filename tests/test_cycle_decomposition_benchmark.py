"""benchmarks/cycle_decomposition.py: SGD on the s → ∞ loss draws its pairs from the chain, and the N → ∞ reading."""

import jax
import numpy as np
import pytest

import cycle_decomposition  # benchmarks/ is on the path (conftest)
from conftest import random_chain
from flowsim.model.losses import make_loss_function
from flowsim.model.models import OneLayerTransformer


def test_one_sgd_step_on_the_limit_loss_is_the_mean_field_gradient_on_average():
    """One step at a large batch: (θ0 - θ1) / lr is the batch-mean gradient of the mean-field per-query loss, whose
    expectation over (q ~ π, y ~ P[q]) is the mean-field loss's gradient: within a few standard errors of it, and
    not the gradient under another chain."""
    chain = random_chain(5, 3)
    model = OneLayerTransformer(d=5, m=4, k=3)
    params0 = {name: np.asarray(value) for name, value in model.init(0.5, 1).items()}
    lr, batch = 1e-3, 200_000
    trajectory = cycle_decomposition.sgd_on_limit_loss(model, chain, params0, lr, batch, np.array([0, 1]), seed=7,
                                                       progress=lambda message: None)
    assert trajectory.t.tolist() == [0.0, lr] and trajectory.loss[0] == pytest.approx(
        float(make_loss_function(model, chain)(params0)), rel=1e-12)
    exact = jax.grad(make_loss_function(model, chain))(params0)
    stepped = {name: (params0[name] - trajectory.params[name][1]) / lr for name in params0}
    scale = max(float(np.abs(np.asarray(value)).max()) for value in exact.values())
    errors = [float(np.abs(stepped[name] - np.asarray(exact[name])).max()) for name in params0]
    assert max(errors) < 0.1 * scale, (errors, scale)  # Monte Carlo: about 2-4% at this B over seeds
    wrong = jax.grad(make_loss_function(model, random_chain(5, 4)))(params0)  # pairs from another chain
    assert max(float(np.abs(stepped[name] - np.asarray(wrong[name])).max()) for name in params0) > 0.5 * scale


def test_events_extrapolate_to_infinite_samples_under_a_one_over_n_bias():
    assert cycle_decomposition.extrapolated(110.0, 102.5, 4.0) == pytest.approx(100.0)  # t(N) = 100 + 10 240 / N at 1024, 4096
    assert cycle_decomposition.extrapolated(None, 102.5, 4.0) is None
    assert cycle_decomposition.share(120.0, 100.0, 200.0) == "+10%" and cycle_decomposition.share(None, 1.0, 2.0) == "–"
