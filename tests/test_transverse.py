"""The transverse block, μ_δ(δ) and the restart predictions against autodiff, sympy and measured flows."""

import numpy as np
import pytest
import sympy as sp
from conftest import random_chain

import flowsim
from flowsim.config import load_config
from flowsim.assemble import prepare
from flowsim.model.flow import GradientFlow
from flowsim.observe.families import compute_observables
from flowsim.solve.solvers import solve_flow
from flowsim.observe.stages import detect_stages
from prediction_accuracy import cycle_accuracy, random_family, restart_accuracy
from theory.cycles import dilution_rates, focused_token
from theory.manifold import ReducedFlow, ReducedState, embed, project, reduced_gradient_formulas
from theory.origin import unstable_projection
from theory.predict import NOT_MEASURED, NOT_PREDICTED, compared_rows, predict_run
from theory.restart import REDUCED_RTOL, complement
from theory.mean_field import MeanFieldChain
from theory.symbolic import MeanFieldTwin
from theory.transverse import (
    ChainFamily,
    leading_coefficient,
    transverse_block_expression,
    transverse_coupling,
    transverse_hessian,
    transverse_rate_curve,
)


def random_state(d, k, rank, seed, scale=0.7):
    rng = np.random.default_rng(seed)
    return ReducedState(*(scale * rng.standard_normal(shape) for shape in ((d, rank), (d, rank), (k, rank), (k, rank))))


def maps(state):
    return state.Gamma @ state.Q.T @ state.R @ state.Gamma.T, state.Gamma @ state.B.T


@pytest.mark.parametrize("d, m, k, rank", [(3, 4, 2, 1), (4, 5, 3, 2)])
@pytest.mark.slow
def test_transverse_block_is_the_autodiff_hessian_off_the_manifold_and_the_sympy_derivation(d, m, k, rank):
    """At a random (not critical) rank-r point, the autodiff Hessian maps every transverse direction a ⊥ span(A)
    into itself by H_T = [[0, C], [C^T, 0]]: no coupling to the manifold or to the other directions."""
    chain = random_chain(d, seed=d)
    model = flowsim.OneLayerTransformer(d=d, m=m, k=k)
    state = random_state(d, k, rank, seed=rank)
    A = np.linalg.qr(np.random.default_rng(7).standard_normal((m, rank)))[0]
    params = embed(state, A)
    flow = GradientFlow(flowsim.make_loss_function(model, chain), params)
    hessian = -np.asarray(flow.jacobian(0.0, flow.flatten(params)))
    G_Phi, G_M = MeanFieldChain(chain.pi, chain.P).gradient_of_maps(*maps(state))
    H_T = transverse_hessian(transverse_coupling(G_Phi, G_M, state))
    assert np.abs(H_T).max() > 1e-2  # a point where the block is not trivially zero
    for a in complement(A).T:
        basis = []
        for z in np.eye(2 * d + 2 * k):
            u, w, x, y = np.split(z, np.cumsum([d, d, k]))
            basis.append(flow.flatten({"W0": np.outer(u, a), "W1": np.outer(a, w), "W_Q": np.outer(a, x), "W_K": np.outer(a, y)}))
        V = np.column_stack(basis)
        np.testing.assert_allclose(hessian @ V, V @ H_T, atol=1e-10)
    symbols, z, expression, flat = transverse_block_expression(d, k, rank)
    assert flat  # Φ and M do not move at first order off the manifold: no Gauss-Newton term
    rng = np.random.default_rng(3)
    G_Phi, G_M = rng.standard_normal((d, d)), rng.standard_normal((d, d))
    values = [*state.Gamma.ravel(), *state.B.ravel(), *state.Q.ravel(), *state.R.ravel(), *G_Phi.ravel(), *G_M.ravel()]
    derived = np.asarray(sp.lambdify(symbols, expression, "numpy")(*values), dtype=float)
    np.testing.assert_allclose(derived, transverse_hessian(transverse_coupling(G_Phi, G_M, state)), atol=1e-12)


@pytest.mark.parametrize("d, rank", [(3, 1), (4, 2)])
@pytest.mark.slow
def test_closed_form_gradients_equal_the_sympy_derivations(d, rank):
    chain = random_chain(d, seed=10 + d)
    twin, closed_form = MeanFieldTwin(chain.pi, chain.P), MeanFieldChain(chain.pi, chain.P)
    k = 2
    state = random_state(d, k, rank, seed=d)
    for got, want in zip(closed_form.gradient_of_maps(*maps(state)), twin.gradient_of_maps(*maps(state))):
        np.testing.assert_allclose(got, want, atol=1e-13)
    assert closed_form.loss_of_maps(*maps(state)) == pytest.approx(twin.loss_of_maps(*maps(state)), abs=1e-13)
    factored = closed_form.factored(state.Gamma, state.Q.T @ state.R, state.B)
    np.testing.assert_allclose(factored.G_Phi, twin.gradient_of_maps(*maps(state))[0], atol=1e-13)
    np.testing.assert_allclose(factored.G_M(), twin.gradient_of_maps(*maps(state))[1], atol=1e-13)
    assert factored.loss == pytest.approx(twin.loss_of_maps(*maps(state)), abs=1e-13)
    symbols, gradients = reduced_gradient_formulas(d, k, rank)
    G_Phi, G_M = twin.gradient_of_maps(*maps(state))
    values = {s: v for X, value in zip(symbols, (state.Gamma, state.B, state.Q, state.R, G_Phi, G_M))
              for s, v in zip(X, value.ravel())}
    closed = ReducedFlow(closed_form, k, rank).gradient(state)
    for name, got in zip(("Gamma", "B", "Q", "R"), (closed.Gamma, closed.B, closed.Q, closed.R)):
        np.testing.assert_allclose(got, np.asarray(gradients[name].subs(values), dtype=float), atol=1e-12)


@pytest.mark.slow
def test_transverse_rate_over_delta_against_the_full_hessian_and_its_derived_leading_coefficient():
    """μ(δ) at the end of each chain's focus orbit; at δ = 0 the point is degenerate (the whole transverse
    space in the Hessian's kernel); c1 = σ_max(dC/dδ) is the slope at 0 and the curve bends away from it;
    each μ equals minus the smallest autodiff Hessian eigenvalue where the rank-one flow from θ(0) settles."""
    family = ChainFamily.rare_asymmetry((0.7, 0.1, 0.1, 0.1), 0.5, 1, 3)
    deltas = [0.0, 1e-3, 2e-3, 0.05, 0.1, 0.15]
    curve = transverse_rate_curve(family, deltas)
    assert curve.rate[0] < 1e-12
    c1 = leading_coefficient(curve)
    assert curve.rate[1] / 1e-3 == pytest.approx(c1, rel=1e-3)
    # μ(-δ) = μ(δ) (tokens 1 and 3 swapped), so μ/δ = c1 + O(δ²): Richardson removes the δ² term
    assert (4 * curve.rate[1] / 1e-3 - curve.rate[2] / 2e-3) / 3 == pytest.approx(c1, rel=2e-5)
    assert curve.rate[-1] / 0.15 > 2 * c1  # far from linear over the range
    model = flowsim.OneLayerTransformer(d=4, m=3, k=2)
    for delta, rate in zip(curve.delta[[0, 3, 4, 5]], curve.rate[[0, 3, 4, 5]]):
        pi, P = (np.asarray(x) for x in family(float(delta)))
        chain = flowsim.MarkovChain(P=P)
        params0 = model.init(1e-3, 0)
        alpha = unstable_projection(params0, chain.pi)[1]
        settled = ReducedFlow(MeanFieldChain(chain.pi, chain.P), model.k).solve(project(params0, alpha), np.array([3000.0]))
        point = embed(ReducedState.unpack(settled.y[:, -1], 4, model.k), alpha)
        flow = GradientFlow(flowsim.make_loss_function(model, chain), point)
        eigenvalues = np.linalg.eigvalsh(-np.asarray(flow.jacobian(0.0, flow.flatten(point))))
        if delta == 0.0:
            assert eigenvalues[0] > -1e-10
            assert np.sum(np.abs(eigenvalues) < 1e-9) >= (model.m - 1) * (2 * 4 + 2 * model.k)
        else:
            assert -eigenvalues[0] == pytest.approx(rate, rel=1e-4)


@pytest.mark.slow
def test_restart_predictions_on_a_seeded_random_family_and_the_symmetric_chain():
    """σ1's restart within 3% of the measured flow on random chains (d = 3, 4, 5) the theory was not built on,
    and on an asymmetric-rare-token chain where the flow settles first; where the settled-point formula
    applies it agrees with the integrated transverse equation; symmetric rare tokens are degenerate."""
    rules = set()
    for pi, lam in random_family(5, seed=3) + [([0.7, 0.15, 0.1, 0.05], 0.5)]:
        row = restart_accuracy(pi, lam, 1e-3, t_cap=6000.0, n_save=300)
        if row.t_end is None:
            continue
        rules.add(row.prediction.rule)
        assert row.measured is not None and row.error < 0.03, row
        if row.prediction.rule == "formula":
            assert row.prediction.t_onset == pytest.approx(row.prediction.t_integrated, rel=0.02)
            assert row.prediction.t_settle < row.prediction.t_integrated
    assert rules == {"formula", "before settling"}, rules
    symmetric = restart_accuracy([0.7, 0.1, 0.1, 0.1], 0.5, 1e-3, t_cap=2000.0)
    assert symmetric.prediction.rule == "degenerate" and symmetric.prediction.t_onset is None


@pytest.mark.slow
def test_chained_rank_flows_predict_later_restarts_focuses_and_dilutions_with_the_dilution_sign():
    """On π = (0.5, 0.3, 0.15, 0.05), λ = 0.6 (σ1 opens before the rank-one flow settles) the chained
    prediction gives σ1 and σ2, the focus of the other queries and the dilution within 3% of the flow; over
    every predicted dilution D = d log A_if/dt < 0, and during the focus before it D > 0."""
    config = load_config(None, ["chain.pi=[0.5, 0.3, 0.15, 0.05]", "chain.lam=0.6", "time.t_end=1500"])
    prediction = predict_run(config)
    prepared = prepare(config)
    result = solve_flow(prepared.flow, prepared.params0, prepared.times)
    report = detect_stages(compute_observables(result.trajectory, prepared.model, prepared.chain.pi))
    rows = {(row.stage, row.query, row.direction): row for row in compared_rows(prediction.rows, report)}
    for key in [("restart", None, 1), ("restart", None, 2), ("focus", 1, None), ("focus", 3, None), ("dilution", 3, None)]:
        assert rows[key].rel_error is not None and rows[key].rel_error < 0.03, rows[key]
    assert prediction.cycles.stages[0].restart.rule == "before settling"  # σ1, on the rank-one equation
    dilutions = prediction.cycles.dilutions()
    assert dilutions
    # every dilution's rates at once (the pairs share each saved time's products), each checked on its own
    pairs = [(dilution.query, focused_token(prediction.cycles, dilution)) for dilution in dilutions]
    for dilution, rates in zip(dilutions, dilution_rates(prediction.cycles, pairs)):
        inside = (rates.t >= dilution.t_start) & (rates.t <= (dilution.t_end or rates.t[-1]))
        # D < 0 down to the resolution of the rank-r flows' path (their relative tolerance REDUCED_RTOL)
        assert np.all(rates.total[inside] < REDUCED_RTOL * np.abs(rates.total).max())
        focus = prediction.cycles.report.of("focus", dilution.query)[0]
        assert rates.total[np.searchsorted(rates.t, focus.t_start)] > 0
        # D is d log A_if/dt: against autodiff's derivative of log A_if along the predicted velocity
        np.testing.assert_allclose(rates.total, autodiff_dilution_rate(prediction.cycles, dilution.query, rates.token),
                                   rtol=1e-9, atol=1e-12 * np.abs(rates.total).max())
    # several pairs at once (other queries and tokens too): each column is its own pair's rate
    query, token = pairs[0]
    other = (token + 1) % len(prediction.cycles.pi)
    for rates in dilution_rates(prediction.cycles, [(query, token), (query, other), (other, token), (other, other)]):
        np.testing.assert_allclose(rates.total, autodiff_dilution_rate(prediction.cycles, rates.query, rates.token),
                                   rtol=1e-9, atol=1e-12 * np.abs(rates.total).max())


def autodiff_dilution_rate(cycles, query: int, token: int) -> np.ndarray:
    """d log A_if/dt = the JVP of θ -> log softmax(W0[i] W_Q W_K^T W0^T + log π)_f along the predicted velocity."""
    import jax
    import jax.numpy as jnp

    def log_attention(W0, W_Q, W_K):
        logits = W0[query] @ W_Q @ W_K.T @ W0.T + jnp.log(cycles.pi)
        return jax.nn.log_softmax(logits)[token]

    names = ("W0", "W_Q", "W_K")
    along = jax.vmap(lambda theta, velocity: jax.jvp(log_attention, theta, velocity)[1])
    return np.asarray(along(tuple(cycles.trajectory.params[name] for name in names),
                            tuple(cycles.velocity[name] for name in names)))


@pytest.mark.slow
def test_later_events_of_the_chained_prediction_on_a_seeded_random_family():
    """Later restarts, the other queries' focus and the dilutions on random chains (d = 3, 4, 5): every event
    on both sides, each within 5%."""
    compared = 0
    for pi, lam in random_family(3, seed=4):
        result = cycle_accuracy(pi, lam, 1e-3, restarts=4.0, n_save=300)
        later = [row for row in result.rows if (row.stage == "restart" and row.direction >= 2)
                 or (row.stage == "focus" and row.query != 0) or row.stage == "dilution"]
        assert not [row for row in later if row.note in (NOT_MEASURED, NOT_PREDICTED)], result
        errors = [row.rel_error for row in later if row.rel_error is not None]
        assert all(error < 0.05 for error in errors), result
        compared += len(errors)
    assert compared >= 6


def test_a_chain_family_refuses_bad_input_by_name():
    with pytest.raises(ValueError, match="sum to 0"):
        ChainFamily((0.7, 0.1, 0.1, 0.1), (0.5, 0.0, 0.0, 0.0), 0.5)
    with pytest.raises(ValueError, match="one per token"):
        ChainFamily((0.7, 0.1, 0.1, 0.1), (0.5, -0.5), 0.5)
    with pytest.raises(ValueError, match="two different tokens"):
        ChainFamily.rare_asymmetry((0.7, 0.1, 0.1, 0.1), 0.5, 2, 2)
    with pytest.raises(ValueError, match="has a token with π <= 0"):
        transverse_rate_curve(ChainFamily.rare_asymmetry((0.7, 0.1, 0.1, 0.1), 0.5, 1, 3), [0.0, 0.3])
