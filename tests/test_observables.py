import csv

import numpy as np
import pytest
from conftest import random_params

from flowsim import MarkovChain, OneLayerTransformer, make_loss_function
from flowsim.flow import GradientFlow
from flowsim.families import compute_observables
from flowsim.observables import (
    OBSERVABLES_CSV,
    Observables,
    principal_directions,
    stable_rank,
)
from flowsim.trajectory import Trajectory


def trajectory_of(models_params, loss=None):
    names = models_params[0].keys()
    params = {name: np.stack([np.asarray(p[name]) for p in models_params]) for name in names}
    n = len(models_params)
    return Trajectory(t=np.arange(n, dtype=float), loss=np.zeros(n) if loss is None else loss, params=params)


@pytest.fixture(scope="module")
def small_case():
    chain = MarkovChain(P=[[0.2, 0.5, 0.3], [0.6, 0.1, 0.3], [0.3, 0.3, 0.4]])
    model = OneLayerTransformer(d=3, m=4, k=2)
    trajectory = trajectory_of([random_params(model, 0.8, seed) for seed in range(5)])
    flow = GradientFlow(make_loss_function(model, chain), trajectory.at(0))
    return chain, model, trajectory, compute_observables(trajectory, model, chain.pi, flow)


def test_singular_values_and_attention_match_direct_numpy(small_case):
    chain, model, trajectory, observables = small_case
    for index in range(len(trajectory)):
        W0, WQ, WK, W1 = (trajectory.params[name][index] for name in ("W0", "W_Q", "W_K", "W1"))
        assert observables["sv_W0"][index, 0] == pytest.approx(np.linalg.norm(W0, 2), rel=1e-12)
        assert observables["sv_M"][index, 0] == pytest.approx(np.linalg.norm(W0 @ W1, 2), rel=1e-12)
        phi = W0 @ WQ @ WK.T @ W0.T
        assert observables["stable_rank_Phi"][index] == pytest.approx(
            np.linalg.norm(phi, "fro") ** 2 / np.linalg.norm(phi, 2) ** 2, rel=1e-10
        )
        scores = phi + np.log(chain.pi)
        attention = np.exp(scores - scores.max(axis=1, keepdims=True))
        attention /= attention.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(observables["attention"][index], attention, atol=1e-14)
        np.testing.assert_allclose(
            observables["attention_entropy"][index], [-(row * np.log(row)).sum() for row in attention], atol=1e-13
        )
        top = int(np.argmax(chain.pi))
        np.testing.assert_allclose(observables["attention_mass_top"][index], attention[:, top], atol=1e-14)
        np.testing.assert_allclose(observables["embedding_norm"][index], np.sqrt((W0**2).sum(axis=1)), atol=1e-14)


def test_gradient_norms_match_central_differences(small_case):
    chain, model, trajectory, observables = small_case
    loss = make_loss_function(model, chain)
    params = {name: np.asarray(value) for name, value in trajectory.at(2).items()}
    h = 1e-6
    for group in ("W0", "W_Q", "W1"):
        gradient = np.zeros_like(params[group])
        for index in np.ndindex(params[group].shape):
            shifted = [dict(params), dict(params)]
            for sign, copy in zip((1, -1), shifted):
                copy[group] = params[group].copy()
                copy[group][index] += sign * h
            gradient[index] = (float(loss(shifted[0])) - float(loss(shifted[1]))) / (2 * h)
        assert observables[f"grad_norm_{group}"][2] == pytest.approx(np.linalg.norm(gradient), rel=1e-6)


def test_gradient_norm_of_W1_at_the_origin_of_M_is_mu1():
    """With W0 = I and W1 = 0, ∂L/∂W1 = π (u - π)^T, whose norm is μ1 = ‖π‖ ‖π - u‖."""
    chain = MarkovChain(pi=[0.75, 0.19, 0.05, 0.01], lam=0.5)
    model = OneLayerTransformer(d=4, m=4, k=4)
    params = {"W0": np.eye(4), "W_Q": np.eye(4), "W_K": np.zeros((4, 4)), "W1": np.zeros((4, 4))}
    flow = GradientFlow(make_loss_function(model, chain), params)
    observables = compute_observables(trajectory_of([params]), model, chain.pi, flow)
    mu1 = np.linalg.norm(chain.pi) * np.linalg.norm(chain.pi - 0.25)
    assert observables["grad_norm_W1"][0] == pytest.approx(mu1, rel=1e-12)
    assert observables["grad_norm_W_K"][0] == 0.0  # attention frozen: ∂L/∂Φ = 0
    assert np.isnan(observables["stable_rank_M"][0])  # M = 0 has no stable rank


def test_stable_rank_closed_forms():
    assert stable_rank(np.array([[3.0, 0.0, 0.0]]))[0] == 1.0
    assert stable_rank(np.array([[2.0, 2.0, 2.0]]))[0] == 3.0


def test_principal_directions_recover_a_planar_trajectory():
    rng = np.random.default_rng(0)
    basis, _ = np.linalg.qr(rng.standard_normal((12, 2)))
    t = np.linspace(0, 1, 50)
    coefficients = np.column_stack([5 * np.sin(3 * t), np.cos(7 * t)])
    embeddings = (coefficients @ basis.T).reshape(50, 3, 4)
    directions, explained, projections = principal_directions(embeddings, 3)
    assert explained[:2].sum() == pytest.approx(1.0, abs=1e-12)
    # the first two directions span the plane of the trajectory
    np.testing.assert_allclose(np.linalg.norm(directions[:2] @ basis, axis=1), 1.0, atol=1e-12)
    centred = embeddings.reshape(50, -1) - embeddings.reshape(50, -1).mean(axis=0)
    np.testing.assert_allclose(projections[:, :2] @ directions[:2], centred, atol=1e-12)


def test_save_load_and_csv(tmp_path, small_case):
    observables = small_case[3]
    observables.save(tmp_path)
    loaded = Observables.load(tmp_path)
    np.testing.assert_array_equal(loaded.t, observables.t)
    assert set(loaded.columns) == set(observables.columns)
    for name in observables.columns:
        np.testing.assert_array_equal(loaded[name], observables[name])
    np.testing.assert_array_equal(loaded.constants["pi"], observables.constants["pi"])
    lines = (tmp_path / OBSERVABLES_CSV).read_text().splitlines()
    assert len(lines) == 1 + len(observables.t)
    header = next(csv.reader([lines[0]]))
    assert "attention_entropy[2]" in header and "attention[1,2]" in header
    column = header.index("attention_entropy[2]")
    row = next(csv.reader([lines[3]]))
    assert float(row[column]) == observables["attention_entropy"][2, 2]  # %.17g round-trips exactly
