import csv

import numpy as np
import pytest
from conftest import random_params

from flowsim import MarkovChain, OneLayerTransformer, make_loss_function
from flowsim.model.flow import GradientFlow
from flowsim.observe.families import compute_observables
from flowsim.observe.observables import (
    FOLDED_ATTENTION_TYPES,
    FULL_ATTENTION_MAX_D,
    OBSERVABLES_CSV,
    Observables,
    kept_attention_types,
    observables_memory_bytes,
    principal_directions,
    stable_rank,
)
from flowsim.solve.trajectory import Trajectory


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


@pytest.fixture(scope="module")
def folded_case():
    """d = 40 (above FULL_ATTENTION_MAX_D): random weights large enough that attention is far from uniform."""
    d = 40
    rng = np.random.default_rng(7)
    pi = rng.dirichlet(np.full(d, 0.5))
    chain = MarkovChain(pi=pi, lam=0.3)
    model = OneLayerTransformer(d=d, m=6, k=3)
    trajectory = trajectory_of([random_params(model, 1.3, seed) for seed in range(4)])
    flow = GradientFlow(make_loss_function(model, chain), trajectory.at(0))
    return chain, model, trajectory, flow


def test_save_by_save_observables_equal_the_whole_arrays_and_full_svds(folded_case):
    """Every column of the save-by-save observables against Φ, M and A formed whole in numpy: per-query entropy and
    mass (all d queries), the attention folded by hand (top types kept, the rest summed as keys and π-averaged as
    queries), and the factored singular values of M and Φ against full d x d SVDs (the rest of whose values are 0)."""
    chain, model, trajectory, flow = folded_case
    observables = compute_observables(trajectory, model, chain.pi, flow)
    fold = observables.constants["attention_fold"]
    assert observables["attention"].shape == (len(trajectory), FOLDED_ATTENTION_TYPES + 1, FOLDED_ATTENTION_TYPES + 1)
    kept = np.argsort(-chain.pi, kind="stable")[:FOLDED_ATTENTION_TYPES]
    np.testing.assert_array_equal(fold[kept], np.arange(FOLDED_ATTENTION_TYPES))
    other = np.setdiff1d(np.arange(chain.d), kept)
    assert np.all(fold[other] == FOLDED_ATTENTION_TYPES)
    for index in range(len(trajectory)):
        W0, WQ, WK, W1 = (trajectory.params[name][index] for name in ("W0", "W_Q", "W_K", "W1"))
        phi, M = W0 @ WQ @ WK.T @ W0.T, W0 @ W1
        scores = phi + np.log(chain.pi)
        A = np.exp(scores - scores.max(axis=1, keepdims=True))
        A /= A.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(observables["attention_entropy"][index], -(A * np.log(A)).sum(axis=1), atol=1e-12)
        np.testing.assert_allclose(observables["attention_mass_top"][index], A[:, np.argmax(chain.pi)], atol=1e-14)
        keys = np.column_stack([A[:, kept], A[:, other].sum(axis=1)])  # (d, f + 1)
        weights = chain.pi[other] / chain.pi[other].sum()
        folded = np.vstack([keys[kept], weights @ keys[other]])
        np.testing.assert_allclose(observables["attention"][index], folded, atol=1e-14)
        for name, matrix in (("M", M), ("Phi", phi)):
            full = np.linalg.svd(matrix, compute_uv=False)
            sigma = observables[f"sv_{name}"][index]
            assert len(sigma) == model.m
            np.testing.assert_allclose(sigma, full[:model.m], rtol=1e-10, atol=1e-12 * full[0])
            assert full[model.m:].max() < 1e-12 * full[0]  # rank <= m: nothing is lost
            assert observables[f"stable_rank_{name}"][index] == pytest.approx((full**2).sum() / full[0] ** 2, rel=1e-10)
        np.testing.assert_allclose(observables["embedding_norm"][index], np.linalg.norm(W0, axis=1), atol=1e-14)


def test_gradient_norms_in_chunks_equal_one_batch(folded_case, monkeypatch):
    import flowsim.observe.observables as module

    chain, model, trajectory, flow = folded_case
    whole = module.gradient_norms(trajectory, flow)
    monkeypatch.setattr(module, "GRADIENT_NORM_ROWS", 3)  # 4 saves: two chunks
    chunked = module.gradient_norms(trajectory, flow)
    gradients = flow.unflatten_batch(flow.gradient_along(flow.flatten_batch(trajectory.params)))
    for name, value in gradients.items():
        direct = np.linalg.norm(value.reshape(len(trajectory), -1), axis=1)
        np.testing.assert_allclose(chunked[name], direct, rtol=1e-13)
        np.testing.assert_allclose(whole[name], direct, rtol=1e-13)


def test_the_principal_directions_match_an_svd_of_the_centred_trajectory():
    """The Gram route against numpy's SVD: the same explained fractions and, up to sign, the same directions."""
    embeddings = np.random.default_rng(3).standard_normal((30, 9, 4)) * np.linspace(3, 0.1, 36).reshape(9, 4)
    directions, explained, projections = principal_directions(embeddings, 3)
    centred = embeddings.reshape(30, -1) - embeddings.reshape(30, -1).mean(axis=0)
    _, sigma, rows = np.linalg.svd(centred, full_matrices=False)
    np.testing.assert_allclose(explained, sigma[:3] ** 2 / (sigma**2).sum(), rtol=1e-10)
    np.testing.assert_allclose(np.abs(np.sum(directions * rows[:3], axis=1)), 1.0, rtol=1e-10)
    np.testing.assert_allclose(projections, centred @ directions.T, atol=1e-12)


def test_kept_attention_types_and_the_memory_estimate():
    assert kept_attention_types(4) == 4 and kept_attention_types(FULL_ATTENTION_MAX_D) == FULL_ATTENTION_MAX_D
    assert kept_attention_types(1000) == FOLDED_ATTENTION_TYPES + 1
    assert kept_attention_types(1000, 999) == 1000 and kept_attention_types(1000, 998) == 999  # d - 1 kept apart: whole
    assert kept_attention_types(1000, 8) == 9
    whole, folded = observables_memory_bytes(1000, 16, 500, 999), observables_memory_bytes(1000, 16, 500)
    assert whole > 500 * 1000**2 * 8 and folded < 200e6
    # the working set does not grow with the number of saves: the estimate is affine in it, per-save cost O(d + f²)
    assert observables_memory_bytes(1000, 16, 1000) - folded == pytest.approx(folded - observables_memory_bytes(1000, 16, 0))


def test_an_interrupt_while_the_csv_is_formatted_reaches_the_caller(tmp_path):
    """Guards issue 83, item 4: observables.csv was formatted with np.char.mod, whose C loop drops a KeyboardInterrupt
    raised by the signal handler, so Ctrl-C during a large run's CSV step was lost and the run went on to `finished`.
    Now a SIGINT sent inside that step raises KeyboardInterrupt out of ``save`` (no CSV written), and the CSV holds
    the values as np.char.mod wrote them."""
    import os
    import signal

    from flowsim.common.interrupts import signals_interrupt

    small = Observables(np.array([0.0, 0.5]), {"a": np.array([1 / 3, np.nan]), "n": np.array([[1, 2], [3, 4]])})
    small.save(tmp_path)
    expected = [["t", "a", "n[0]", "n[1]"], ["0", "0.33333333333333331", "1", "2"], ["0.5", "nan", "3", "4"]]
    assert list(csv.reader((tmp_path / "observables.csv").open())) == expected
    large = Observables(np.linspace(0, 1, 100), {"attention": np.random.default_rng(0).random((100, 160, 160))})
    interrupted = tmp_path / "interrupted"
    previous = signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        with pytest.raises(KeyboardInterrupt), signals_interrupt():  # outside it, so it clears its record of the raise
            signal.setitimer(signal.ITIMER_REAL, 0.3)  # after observables.npz, inside the CSV's formatting (seconds)
            large.save(interrupted)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert (interrupted / "observables.npz").is_file() and not (interrupted / "observables.csv").exists()
