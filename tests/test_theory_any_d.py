"""The theory at any vocabulary size: closed forms against sympy and autodiff, and predictions that do not
move with the horizon."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy as sp
from conftest import random_chain

import flowsim
from flowsim.config import load_config
from flowsim.model.losses import expected_cross_entropy, mean_field_attention
from flowsim.observe.families import compute_observables
from flowsim.observe.observables import stage_observables
from flowsim.solve.trajectory import Trajectory
from theory.focus import condensed_point_expressions
from theory.cycles import dilution_rates, focused_token
from theory.manifold import FlowTurnedStiff, ReducedFlow, ReducedState, compiled_reduced_flow
from theory.mean_field import MeanFieldChain, condensed_point, origin_rate
from theory.origin import mu1_expression
from theory.predict import AFTER_HORIZON, NOT_PREDICTED, compared_rows, predict_run
from theory.restart import FIRST_SPAN, STIFF_START, RuleName, follow_reduced_flow
from theory.transverse import TransverseCoupling, transverse_coupling, transverse_hessian, transverse_velocity


def random_state(d, k, rank, seed, scale=0.5):
    rng = np.random.default_rng(seed)
    return ReducedState(*(scale * rng.standard_normal(shape) for shape in ((d, rank), (d, rank), (k, rank), (k, rank))))


@pytest.mark.parametrize("d", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_closed_forms_are_the_sympy_solutions(d):
    pi = np.sort(np.random.default_rng(d).dirichlet(np.ones(d)))[::-1]
    symbols, _, gamma, beta = condensed_point_expressions(d)
    values = dict(zip(symbols, pi))
    got_gamma, got_beta = condensed_point(pi)
    np.testing.assert_allclose(got_gamma, [float(x.subs(values)) for x in gamma], rtol=1e-12)
    np.testing.assert_allclose(got_beta, [float(x.subs(values)) for x in beta], rtol=1e-12, atol=1e-14)
    free = sp.Matrix(list(mu1_expression(d).free_symbols)).T
    at = {s: pi[int(str(s)[2:])] for s in free}
    assert origin_rate(pi) == pytest.approx(float(mu1_expression(d).subs(at)), rel=1e-12)


@pytest.mark.parametrize("compiled", [False, True])
def test_mean_field_closed_forms_equal_autodiff_at_d_12(compiled, monkeypatch):
    monkeypatch.setattr(MeanFieldChain, "COMPILED_FROM", 0 if compiled else 10**6)  # the factored maps both ways
    d = 12
    chain = random_chain(d, seed=5)
    closed = MeanFieldChain(chain.pi, chain.P)
    rng = np.random.default_rng(0)
    Phi, M = rng.standard_normal((d, d)), rng.standard_normal((d, d))

    def loss(Phi, M):
        return expected_cross_entropy(mean_field_attention(Phi, jnp.asarray(chain.pi)) @ M, jnp.asarray(chain.P),
                                      jnp.asarray(chain.pi))

    assert closed.loss_of_maps(Phi, M) == pytest.approx(float(loss(Phi, M)), abs=1e-13)
    for got, want in zip(closed.gradient_of_maps(Phi, M), jax.grad(loss, argnums=(0, 1))(Phi, M)):
        np.testing.assert_allclose(got, want, atol=1e-13)
    # factored maps give the same, and the products with G_M equal the formed G_M
    state = random_state(d, 3, 2, seed=1)
    factored = closed.factored(state.Gamma, state.Q.T @ state.R, state.B)
    G_Phi, G_M = closed.gradient_of_maps(state.Gamma @ state.Q.T @ state.R @ state.Gamma.T, state.Gamma @ state.B.T)
    np.testing.assert_allclose(factored.G_Phi, G_Phi, atol=1e-13)
    X = rng.standard_normal((d, 4))
    np.testing.assert_allclose(factored.G_M_times(X), G_M @ X, atol=1e-13)
    np.testing.assert_allclose(factored.G_M_transpose_times(X), G_M.T @ X, atol=1e-13)
    # the transverse equation's field (one compiled function, or numpy) is -H_T Z, C formed from the dense gradients
    Z = rng.standard_normal((2 * d + 2 * 3, 2))
    H_T = transverse_hessian(transverse_coupling(G_Phi, G_M, state))
    np.testing.assert_allclose(transverse_velocity(closed, state, Z), -H_T @ Z, atol=1e-12)
    # the Bayes loss is the infimum: reached where attention is the identity and M = log P
    assert closed.loss_of_maps(60.0 * np.eye(d), np.log(chain.P)) == pytest.approx(closed.bayes_loss(), abs=1e-10)
    assert closed.loss_of_maps(Phi, M) > closed.bayes_loss()


def test_sigma_max_by_lanczos_from_any_start_is_the_dense_svds(monkeypatch):
    """σ_max(C) by Lanczos (as beyond DENSE_UP_TO) from the top's own left vector, from the second one (orthogonal to
    the top: a mode the top has overtaken since the last sample) and from no start: each time the dense SVD's."""
    monkeypatch.setattr(TransverseCoupling, "DENSE_UP_TO", 0)
    chain = random_chain(30, seed=11)
    coupling = TransverseCoupling(MeanFieldChain(chain.pi, chain.P), random_state(30, 4, 2, seed=3))
    left, values, _ = np.linalg.svd(coupling.dense())
    assert values[1] < 0.9 * values[0]
    for start in (left[:, 0], left[:, 1], None):
        rate, u, v = coupling.top(start=start)
        assert rate == pytest.approx(values[0], rel=1e-10)
        np.testing.assert_allclose(abs(u @ left[:, 0]), 1.0, atol=1e-8)


def test_compiled_reduced_flow_and_its_jacobian_against_the_closed_form_and_finite_differences():
    d, k, rank = 10, 3, 2
    chain = random_chain(d, seed=3)
    closed = MeanFieldChain(chain.pi, chain.P)
    flow = ReducedFlow(closed, k, rank)
    y = random_state(d, k, rank, seed=2).pack()
    compiled = compiled_reduced_flow(d, k, rank)
    arrays = (jnp.asarray(closed.pi), jnp.asarray(closed.log_pi), jnp.asarray(closed.P))
    np.testing.assert_allclose(np.asarray(compiled.field(y, *arrays)), flow.vector_field(0.0, y), atol=1e-13)
    jacobian = np.asarray(compiled.jacobian(y, *arrays))
    step = 1e-6
    for j in range(0, len(y), 7):
        e = np.zeros_like(y)
        e[j] = step
        column = (flow.vector_field(0.0, y + e) - flow.vector_field(0.0, y - e)) / (2 * step)
        np.testing.assert_allclose(jacobian[:, j], column, atol=1e-7)
    np.testing.assert_allclose(jacobian, jacobian.T, atol=1e-12)  # minus a Hessian


def test_a_stiff_rank_flow_starts_with_rkc_and_a_soft_one_with_lsoda(monkeypatch):
    """The spectral radius is the dense Jacobian's (from below); a state whose ρ × FIRST_SPAN exceeds STIFF_START takes
    RKC from its first span, while one near the origin takes LSODA (the route beyond EXACT_JACOBIAN_UP_TO equations,
    lowered here to take this small flow, on the former route kept for comparison: LARGE_METHOD = "RKC")."""
    import theory.restart

    monkeypatch.setattr(theory.restart, "EXACT_JACOBIAN_UP_TO", 0)
    monkeypatch.setattr(theory.restart, "LARGE_METHOD", "RKC")
    d, k, rank = 10, 3, 2
    chain = random_chain(d, seed=3)
    flow = ReducedFlow(MeanFieldChain(chain.pi, chain.P), k, rank)
    arrays = (jnp.asarray(flow.chain.pi), jnp.asarray(flow.chain.log_pi), jnp.asarray(flow.chain.P))
    methods, solve = [], ReducedFlow.solve
    monkeypatch.setattr(ReducedFlow, "solve", lambda self, *a, **kw: methods.append(kw["method"]) or solve(self, *a, **kw))
    for scale, first_method in ((2.0, "RKC"), (1e-3, "LSODA")):
        state = random_state(d, k, rank, seed=3, scale=scale)
        exact = np.abs(np.linalg.eigvalsh(np.asarray(compiled_reduced_flow(d, k, rank).jacobian(state.pack(), *arrays)))).max()
        radius = flow.spectral_radius(state)
        assert 0.9 * exact <= radius <= exact * (1 + 1e-9), (radius, exact)
        assert (radius * FIRST_SPAN > STIFF_START) == (first_method == "RKC"), radius
        path = follow_reduced_flow(flow, state, 0.0, lambda y: 1.0, enough=lambda path: True)
        assert methods[-1] == first_method and path.segments[0].success, (scale, methods)


def test_lsoda_hands_the_piece_where_the_flow_turns_stiff_to_rkc_without_forming_a_jacobian(monkeypatch):
    """A soft start takes LSODA until it asks for a Jacobian; that piece is solved again by RKC from its start, and
    the path agrees with LSODA run with the exact Jacobian throughout (the route beyond EXACT_JACOBIAN_UP_TO
    equations, lowered here to take this small flow, on the former route kept for comparison: LARGE_METHOD = "RKC")."""
    import theory.restart

    monkeypatch.setattr(theory.restart, "EXACT_JACOBIAN_UP_TO", 0)
    monkeypatch.setattr(theory.restart, "LARGE_METHOD", "RKC")
    d, k, rank = 10, 3, 2
    chain = random_chain(d, seed=3)
    flow = ReducedFlow(MeanFieldChain(chain.pi, chain.P), k, rank)
    state = random_state(d, k, rank, seed=3, scale=1e-3)
    calls, solve = [], ReducedFlow.solve
    monkeypatch.setattr(ReducedFlow, "solve", lambda self, *a, **kw: calls.append((kw["method"], kw["t_start"])) or solve(self, *a, **kw))
    path = follow_reduced_flow(flow, state, 0.0, lambda y: 1.0, until=2 * 1024.0)
    handed = [n for n in range(1, len(calls)) if calls[n] == ("RKC", calls[n - 1][1]) and calls[n - 1][0] == "LSODA"]
    assert len(handed) == 1 and {method for method, _ in calls[handed[0]:]} == {"RKC"}, calls
    with pytest.raises(FlowTurnedStiff):
        solve(flow, ReducedState.unpack(path.y(calls[handed[0]][1]), d, k), [2 * 1024.0], t_start=calls[handed[0]][1],
              rtol=1e-6, atol=1e-12, until_stiff=True)
    exact = solve(flow, state, [path.t_reach], rtol=1e-10, atol=1e-14).y[:, -1]
    np.testing.assert_allclose(path.y(path.t_reach), exact, rtol=0, atol=1e-4 * np.abs(exact).max())


def test_the_rank_r_flow_is_the_exact_flow_of_the_model_with_m_equal_to_r():
    """``ReducedFlow.exact_flow`` (flowsim's one-layer model with m = r, mean-field loss) has the reduced flow's field
    at any point, through ``to_model``, and ``from_model`` undoes ``to_model``."""
    d, k, rank = 9, 3, 2
    chain = random_chain(d, seed=5)
    flow = ReducedFlow(MeanFieldChain(chain.pi, chain.P), k, rank)
    y = random_state(d, k, rank, seed=5, scale=0.7).pack()
    params = flow.to_model(y)
    exact = flow.exact_flow
    field = np.asarray(exact.vector_field(0.0, exact.flatten(params)))
    velocity = flow.from_model(exact.unflatten_batch(field[None]))[0]
    np.testing.assert_allclose(velocity, flow.vector_field(0.0, y), rtol=1e-10, atol=1e-13)
    np.testing.assert_array_equal(flow.from_model({name: value[None] for name, value in params.items()})[0], y)


@pytest.mark.slow
def test_a_large_rank_flow_takes_the_exact_flows_solver_and_its_spline_follows_lsoda(monkeypatch):
    """Beyond EXACT_JACOBIAN_UP_TO equations (lowered here to take this small flow) every piece is "FLOW": the m = r
    model's exact flow by flowsim's stiff solver, no spectral radius; its saved points and its spline between them
    agree with LSODA's exact-Jacobian path at a tight tolerance, on a stiff start (ρ × FIRST_SPAN > STIFF_START)."""
    import theory.restart

    monkeypatch.setattr(theory.restart, "EXACT_JACOBIAN_UP_TO", 0)
    d, k, rank = 10, 3, 2
    chain = random_chain(d, seed=3)
    flow = ReducedFlow(MeanFieldChain(chain.pi, chain.P), k, rank)
    state = random_state(d, k, rank, seed=3, scale=2.0)
    calls, solve = [], ReducedFlow.solve
    monkeypatch.setattr(ReducedFlow, "solve", lambda self, *a, **kw: calls.append(kw["method"]) or solve(self, *a, **kw))
    monkeypatch.setattr(ReducedFlow, "spectral_radius", lambda self, state: pytest.fail("no spectral radius is needed"))
    path = follow_reduced_flow(flow, state, 0.0, lambda y: 1.0, until=256.0)
    assert calls and set(calls) == {"FLOW"}, calls
    between = (path.t[1:] + path.t[:-1]) / 2
    exact = solve(flow, state, between, rtol=1e-11, atol=1e-14, method="LSODA")
    scale = np.abs(exact.y).max()
    np.testing.assert_allclose(np.stack([path.y(t) for t in between], axis=1), exact.y, rtol=0, atol=1e-4 * scale)


def test_a_small_rank_flow_takes_lsoda_with_its_exact_jacobian_throughout(monkeypatch):
    """Up to EXACT_JACOBIAN_UP_TO equations: LSODA forms the Jacobian where it asks for one (no hand-over to RKC, no
    spectral radius), on the stiff start that takes RKC beyond it, and the path is LSODA's at a tight tolerance."""
    from theory.restart import EXACT_JACOBIAN_UP_TO

    d, k, rank = 10, 3, 2
    assert (2 * d + 2 * k) * rank <= EXACT_JACOBIAN_UP_TO
    chain = random_chain(d, seed=3)
    flow = ReducedFlow(MeanFieldChain(chain.pi, chain.P), k, rank)
    state = random_state(d, k, rank, seed=3, scale=2.0)  # ρ × FIRST_SPAN > STIFF_START (the test above)
    calls, solve = [], ReducedFlow.solve
    monkeypatch.setattr(ReducedFlow, "solve", lambda self, *a, **kw: calls.append((kw["method"], kw["until_stiff"]))
                        or solve(self, *a, **kw))
    monkeypatch.setattr(ReducedFlow, "spectral_radius", lambda self, state: pytest.fail("no spectral radius is needed"))
    path = follow_reduced_flow(flow, state, 0.0, lambda y: 1.0, until=256.0)
    assert calls and set(calls) == {("LSODA", False)}, calls
    exact = solve(flow, state, [path.t_reach], rtol=1e-10, atol=1e-14).y[:, -1]
    np.testing.assert_allclose(path.y(path.t_reach), exact, rtol=0, atol=1e-4 * np.abs(exact).max())


def test_the_condensation_orbit_in_d_plus_one_coordinates_is_the_rank_one_flow():
    """The orbit of ``CondensationFlow`` (g, β) equals the rank-one flow in (γ, β, q, r) from the same start, and
    its Jacobian is the finite-difference one of its field, which is minus the gradient of its loss."""
    from theory.origin import CondensationFlow, condensation_orbit, unstable_directions

    chain = random_chain(7, seed=11)
    orbit = condensation_orbit(tuple(chain.pi), tuple(map(tuple, chain.P)), t_max_over_mu=30.0)
    w0, w1 = unstable_directions(chain.pi)
    delta, k = orbit.delta, 2
    start = ReducedState(delta * w0[:, None] / np.sqrt(2), delta * w1[:, None] / np.sqrt(2), np.zeros((k, 1)), np.zeros((k, 1)))
    times = orbit.t[::400]
    rank_one = ReducedFlow(MeanFieldChain(chain.pi, chain.P), k).solve(start, times, rtol=1e-11, atol=1e-9 * delta)
    states = [ReducedState.unpack(y, 7, k) for y in rank_one.y.T]
    scale = np.abs(orbit.beta).max()
    np.testing.assert_allclose(orbit.gamma[::400], [s.Gamma[:, 0] for s in states], atol=1e-7 * scale)
    np.testing.assert_allclose(orbit.beta[::400], [s.B[:, 0] for s in states], atol=1e-7 * scale)
    assert orbit.sigma0[-1] > 100 * orbit.sigma0[0]  # it did condense
    # the attention coupling h along it, in closed form and from the formed d x d attention
    from theory.focus import attention_coupling, condensation_coupling

    twin = MeanFieldChain(chain.pi, chain.P)
    closed = condensation_coupling(twin, orbit.gamma[::400] @ chain.pi / np.linalg.norm(chain.pi), orbit.beta[::400])
    formed = [attention_coupling(twin, gamma, beta) for gamma, beta in zip(orbit.gamma[::400], orbit.beta[::400])]
    np.testing.assert_allclose(closed, formed, rtol=1e-10, atol=1e-14)
    assert abs(formed[-1]) > 1e-6  # away from zero, where the tolerance means something
    flow, y = CondensationFlow(chain.pi, chain.P), np.concatenate([[0.8], np.random.default_rng(1).standard_normal(7)])
    step = 1e-6
    columns = [(flow.field(0.0, y + step * e) - flow.field(0.0, y - step * e)) / (2 * step) for e in np.eye(8)]
    np.testing.assert_allclose(flow.jacobian(0.0, y), np.array(columns).T, atol=1e-8)
    gradient = [(flow.loss(y + step * e) - flow.loss(y - step * e)) / (2 * step) for e in np.eye(8)]
    np.testing.assert_allclose(flow.field(0.0, y), -np.array(gradient), atol=1e-8)


@pytest.mark.slow
def test_the_focus_orbit_by_rkc_is_lsodas(monkeypatch):
    """Large chains integrate the focus orbit by RKC at RKC_RTOL: at d = 6 both methods give the same entropy, and
    the same halfway fall to well within the rows' 4 digits."""
    import theory.focus as focus

    chain = flowsim.MarkovChain(pi=[0.4, 0.25, 0.15, 0.1, 0.06, 0.04], lam=0.3)
    key = (tuple(chain.pi), tuple(map(tuple, chain.P)))
    by_lsoda = focus.focus_orbit.__wrapped__(*key)
    monkeypatch.setattr(focus, "RKC_FROM_EQUATIONS", 0)
    by_rkc = focus.focus_orbit.__wrapped__(*key)
    assert by_rkc.query == by_lsoda.query == int(np.argmax(chain.pi))
    assert by_lsoda.entropy[0] - by_lsoda.entropy.min() > 0.1  # it focuses
    np.testing.assert_allclose(by_rkc.entropy, by_lsoda.entropy, atol=1e-3)

    def halfway(orbit) -> float:  # where the entropy falls halfway to its minimum
        bottom = int(np.argmin(orbit.entropy))
        level = (orbit.entropy[0] + orbit.entropy[bottom]) / 2
        return float(np.interp(-level, -orbit.entropy[: bottom + 1], orbit.tau[: bottom + 1]))

    assert halfway(by_rkc) == pytest.approx(halfway(by_lsoda), rel=2e-5)


def test_transverse_coupling_products_and_its_iterative_top_singular_value(monkeypatch):
    d, k = 30, 4
    chain = random_chain(d, seed=8)
    coupling = TransverseCoupling(MeanFieldChain(chain.pi, chain.P), random_state(d, k, 1, seed=4))
    C = coupling.dense()
    rng = np.random.default_rng(1)
    Y, U = rng.standard_normal((d + 2 * k, 3)), rng.standard_normal((d, 3))
    np.testing.assert_allclose(coupling.times(Y), C @ Y, atol=1e-13)
    np.testing.assert_allclose(coupling.transpose_times(U), C.T @ U, atol=1e-13)
    dense_rate, left, right = coupling.top()
    monkeypatch.setattr(TransverseCoupling, "DENSE_UP_TO", 5)  # the Lanczos route of large vocabularies
    rate, left_iterative, right_iterative = coupling.top()
    assert rate == pytest.approx(np.linalg.svd(C, compute_uv=False)[0], rel=1e-10) and rate == pytest.approx(dense_rate)
    assert abs(left @ left_iterative) == pytest.approx(1.0, abs=1e-8)
    np.testing.assert_allclose(C @ right_iterative, rate * left_iterative, atol=1e-9)


def test_stage_observables_equal_the_full_observables():
    d = 6
    chain = random_chain(d, seed=2)
    model = flowsim.OneLayerTransformer(d=d, m=5, k=3)
    rng = np.random.default_rng(3)
    params = {name: 0.8 * rng.standard_normal((4, *shape)) for name, shape in model.shapes.items()}
    trajectory = Trajectory(t=np.array([0.0, 1.0, 2.0, 3.0]), loss=rng.standard_normal(4), params=params)
    light, full = stage_observables(trajectory, chain.pi), compute_observables(trajectory, model, chain.pi)
    for name, column in light.columns.items():
        np.testing.assert_allclose(column, full[name], rtol=1e-10, atol=1e-12, err_msg=name)
    # each column is a function of its own time: the cut trajectory's are the whole's first rows (the confirmation's cut)
    keep = trajectory.t <= 2.0
    cut = Trajectory(t=trajectory.t[keep], loss=trajectory.loss[keep], params={n: p[keep] for n, p in params.items()})
    sliced, direct = light.until(2.0), stage_observables(cut, chain.pi)
    np.testing.assert_array_equal(sliced.t, direct.t)
    assert sliced.columns.keys() == direct.columns.keys()
    for name, column in direct.columns.items():
        np.testing.assert_allclose(sliced[name], column, rtol=1e-12, atol=1e-14, err_msg=name)


@pytest.fixture(scope="module")
def default_prediction_to_500():
    """The default chain's prediction at t_end = 500 (shared: each takes seconds)."""
    return predict_run(load_config(None, ["time.t_end=500"]))


@pytest.mark.slow
def test_the_chained_prediction_stops_once_its_events_are_confirmed(monkeypatch, default_prediction_to_500):
    """At t_end = 500 the default chain's prediction stops at the σ2 crossing (t = 980 >= 10^0.25 × 500), where
    the detectors place every event up to 980 / 10^0.25 the same on the trajectory and on its cut 0.1 decade
    earlier; followed on through rank 3 to MAX_REACH × t_end, it gives the same rows. Beside the chain, the
    rank-two flow from θ(0) that the first rows are read on."""
    import theory.cycles as cycles

    stopped = default_prediction_to_500
    assert stopped.cycles.opened is not None and stopped.cycles.opened.t[0] == 0.0 and stopped.cycles.opened.rank == 2
    assert len(stopped.cycles.stages) == 2 and stopped.cycles.trajectory.t[-1] < cycles.MAX_REACH * 500
    assert stopped.cycles.confirmation.confirmed and stopped.cycles.confirmed_through > 500
    # a lookahead that makes the first check come at MAX_REACH × t_end
    monkeypatch.setattr(cycles, "lookahead_decades", lambda th: np.log10(cycles.MAX_REACH) - cycles.CONFIRM_DECADES)
    followed = predict_run(load_config(None, ["time.t_end=500"]))
    assert len(followed.cycles.stages) == 3 and followed.cycles.trajectory.t[-1] >= cycles.MAX_REACH * 500 * 0.99

    def rows(prediction) -> list[tuple]:
        return [(row.stage, row.query, row.direction, row.predicted, row.note) for row in prediction.rows
                if row.predicted is not None or (row.stage == "restart" and row.direction <= 2)]

    assert len([row for row in rows(stopped) if row[3] is not None]) >= 3 and rows(followed) == rows(stopped)


def test_a_first_focus_that_only_the_chained_flow_shows_has_one_row(monkeypatch):
    """Where the focus orbit does not focus the first query (its entropy falls short of the detector's drop) but
    the chained prediction's detectors do, its row is the chained onset, with no 'no focus' verdict beside it."""
    import dataclasses

    import theory.predict as predict

    matched = predict.predict_focus
    monkeypatch.setattr(predict, "predict_focus", lambda *args: dataclasses.replace(matched(*args), t_onset={}))
    rows = [row for row in predict_run(load_config(None, ["time.t_end=500"])).rows if row.stage == "focus" and row.query == 0]
    assert len(rows) == 1 and rows[0].predicted == pytest.approx(96.16, rel=0.05) and not rows[0].note, rows


def test_a_crossing_rank_in_pieces_stops_sooner_with_the_same_restarts(monkeypatch, default_prediction_to_500):
    """Solving each doubling in pieces stops the default chain's rank-two flow, continued from the σ1 crossing
    (t = 199.5), short of the doubling's end once its rule is known, with the same rule and crossing (to the flows'
    tolerance) as whole doublings."""
    import theory.cycles as cycles
    import theory.restart as restart
    from flowsim.assemble import prepare

    prepared = prepare(load_config(None, ["time.t_end=500"]))
    first = default_prediction_to_500.cycles.stages[0]
    at_crossing = {name: value[-1] for name, value in first.params.items()}
    A = np.column_stack([first.A, cycles.next_direction(at_crossing, first.A)])
    floor = np.linalg.svd(np.asarray(prepared.params0["W0"]), compute_uv=False)[2]
    chain = MeanFieldChain(prepared.chain.pi, prepared.chain.P)

    def continued() -> restart.RestartPrediction:
        return restart.propagate_rank(chain, at_crossing, A, first.restart.t_integrated, 2000.0, 10 * floor,
                                      cycles.prediction_grid(2000.0)).restart

    pieced = continued()
    monkeypatch.setattr(restart, "PIECES_PER_SPAN", 1)
    whole = continued()
    assert whole.rule == pieced.rule and pieced.t_integrated == pytest.approx(whole.t_integrated, rel=1e-4)
    assert pieced.t_reach < whole.t_reach - 100, (pieced.t_reach, whole.t_reach)


@pytest.mark.slow
def test_a_prediction_reads_each_horizon_as_the_exact_flow_does():
    """At horizons 900, 1500 and 4000 every row timed before the horizon is the exact flow's as the detectors read
    it there: condensation to 0.1%, the first focus, σ1 and every later focus and dilution to 0.5%, later restarts to
    1%, and the flow shows no focus or dilution the rows lack. Focus and dilution onsets are read on the run's save
    times; the detectors date an event once they have read 10^0.15 past it, so at 900 the flow has three events
    (q1's focus at 724 and q0's dilution at 693 are not dated yet) and the rows no more. A focus or dilution both
    horizons time is the same to 1% (read on the two horizons' save grids: q0's dilution 695.4 and 689.7, where the
    halfway rule moved q1's focus from 691 to 705 with the horizon). An event past the horizon is named with its
    time, not dropped, and the longer horizon times it. The restarts do not move
    with the horizon: at 900 the rank-3 flow starts past it (σ2 passes at t = 980) and is followed only until the
    detectors can confirm the events before 900, where at 4000 it is followed until it reaches the Bayes loss; and
    D = d log A_if/dt < 0 at every dilution onset the chain confirms."""
    import theory.cycles as cycles
    from prediction_accuracy import measured_stages

    configs = [load_config(None, [f"time.t_end={t_end}"]) for t_end in (900, 1500, 4000)]
    shortest, short, long = predictions = [predict_run(config) for config in configs]
    tolerance = {"condensation": 1e-3, "focus": 5e-3, "dilution": 5e-3, "restart": 1e-2}
    for prediction, config in zip(predictions, configs):
        rows = compared_rows(prediction.rows, measured_stages(config))
        timed = [row for row in rows if row.predicted is not None and row.measured is not None]
        assert len(timed) >= (3 if config.time.t_end == 900 else 5), (config.time.t_end, rows)
        for row in timed:
            bound = 5e-3 if (row.stage, row.direction) == ("restart", 1) else tolerance[row.stage]
            assert row.rel_error <= bound, (config.time.t_end, row)
        assert not [row for row in rows if row.note == NOT_PREDICTED and row.stage in ("focus", "dilution")], rows
    later = {(row.stage, row.query, row.direction): row for row in long.rows}
    for row in short.rows:
        if row.predicted is not None and row.stage in ("focus", "dilution"):
            assert later[row.stage, row.query, row.direction].predicted == pytest.approx(row.predicted, rel=1e-2), row
        if row.predicted is None and row.note.startswith(AFTER_HORIZON):
            time = float(row.note.rsplit("t = ", 1)[1])
            assert time > 1500 and later[row.stage, row.query, row.direction].predicted is not None, row
    for prediction in (short, long):  # mass leaves the focused token at every predicted dilution's onset
        dilutions = prediction.cycles.dilutions()
        pairs = [(dilution.query, focused_token(prediction.cycles, dilution)) for dilution in dilutions]
        for dilution, rates in zip(dilutions, dilution_rates(prediction.cycles, pairs)):
            assert np.interp(dilution.t_start, rates.t, rates.total) < 0, dilution
    for restart_short, restart_long in zip(short.cycles.restarts(), long.cycles.restarts()):
        assert (restart_short.rule, restart_short.t_settle, restart_short.t_integrated) == (
            restart_long.rule, restart_long.t_settle, restart_long.t_integrated)
    *within, past = shortest.cycles.restarts()
    assert [r.t_integrated for r in within] == [r.t_integrated for r in long.cycles.restarts()[:2]]
    assert shortest.cycles.stages[-1].t[0] > 900 and shortest.cycles.confirmed_through > 900
    assert past.rule == RuleName.NOT_SETTLED and past.t_reach < cycles.MAX_REACH * 900
    assert long.cycles.restarts()[2].rule == RuleName.OPTIMUM and long.cycles.restarts()[2].t_reach > 10_000
    assert next(row for row in shortest.rows if row.direction == 3).note.startswith("no restart by t = 900")


def test_an_onset_two_cuts_place_apart_is_unsettled():
    """Two placements agree within CONFIRM_RTOL; an onset moved further, or an event only one of them has, is
    named with how it moved."""
    from theory.cycles import CONFIRM_RTOL, differences

    cut = {("focus", 0): [100.0], ("dilution", 3): [1282.73], ("dilution", 1): [500.0]}
    longer = {("focus", 0): [100.0 * (1 + CONFIRM_RTOL / 2)], ("dilution", 3): [1315.06], ("dilution", 1): [500.0, 900.0]}
    moved = differences(longer, cut, 8743.0, 11007.0)
    assert set(moved) == {("dilution", 3), ("dilution", 1)}
    assert "1282.7" in moved[("dilution", 3)] and "1315.1" in moved[("dilution", 3)]
    assert moved[("dilution", 1)].startswith("1 onset(s) on the trajectory to t = 8743, 2 to t = 11007")
    assert differences(cut, cut, 1.0, 2.0) == {}


def test_a_failed_later_rank_keeps_every_row_before_it(monkeypatch, default_prediction_to_500):
    """The rank-two flow fails (as a rank-7 transverse equation overflowed on a d = 16 chain): condensation, the
    first focus and σ1's restart are still predicted, equal to the whole prediction's, and σ2's row says where and
    why it is missing instead of the prediction raising."""
    import theory.cycles as cycles

    real = cycles.propagate_rank

    def failing_at_rank_two(chain, params, A, t_start, *arguments, **options):
        if A.shape[1] == 2 and t_start > 0:  # the chain's rank-two stage, not the rank-two flow from θ(0)
            raise RuntimeError("the transverse equation failed at t = 321 (|z| = inf)")
        return real(chain, params, A, t_start, *arguments, **options)

    monkeypatch.setattr(cycles, "propagate_rank", failing_at_rank_two)
    failed = predict_run(load_config(None, ["time.t_end=500"]))
    whole = {(row.stage, row.query, row.direction): row for row in default_prediction_to_500.rows}
    kept = {(row.stage, row.query, row.direction): row for row in failed.rows}
    for key in (("condensation", None, None), ("focus", 0, None), ("restart", None, 1)):
        assert kept[key].predicted is not None and kept[key].predicted == pytest.approx(whole[key].predicted, rel=1e-9), key
    sigma2 = kept[("restart", None, 2)]
    assert sigma2.predicted is None and sigma2.note.startswith("not predicted: the rank-2 flow from t = ")
    assert "(the transverse equation failed at t = 321 (|z| = inf)); the rows before it stand" in sigma2.note
    assert failed.cycles.failure[0] == 2
    # the chain ends at σ1's crossing, so its detectors place foci and dilutions short of the horizon: the row says so
    assert failed.cycles.confirmed_through < 500
    assert f"so its detectors place foci and dilutions only to t = {failed.cycles.confirmed_through:.4g}" in sigma2.note


def test_a_first_focus_beyond_the_flows_reach_is_not_predicted_and_not_ruled_out(default_prediction_to_500):
    """Where the flows the rows read end before the horizon (σ2 stopped the rows' flow, a later rank failed) and
    show no focus, the row says how far they reach instead of "no focus" (general P d = 16 #0 at ε = 1e-2: its rows'
    flow ends at 57 148, the chain confirms to 39 811, the exact flow focuses at 62 761)."""
    from dataclasses import replace

    from flowsim.observe.stages import StageThresholds
    from theory.cycles import Confirmation, confirmation_reach
    from theory.predict import first_focus_row

    prediction = default_prediction_to_500
    found = next(row for row in prediction.rows if row.stage == "focus" and row.query == 0)
    assert found.predicted is not None and 50.0 < found.predicted < 500
    read = prediction.cycles.observables.until(50.0)  # a rows' flow that ends before the focus
    cycles = replace(prediction.cycles, confirmation=Confirmation(20.0, {}), report=replace(prediction.cycles.report, intervals=[]))
    focus = replace(prediction.focus, t_onset={})
    times = np.geomspace(1.0, 500.0, 200)
    row = first_focus_row(focus, cycles, read, times, 500.0)
    assert row.predicted is None
    placed_to = read.t[-1] / confirmation_reach(StageThresholds())  # a lookahead short of the flow's end
    assert row.note.startswith("not predicted: no focus where the reduced flows let the detectors place one, up to "
                               f"t = {placed_to:.4g} of 500 ")
    assert "the chain's foci are placed to 20" in row.note and "on the focus orbit the entropy" in row.note
    # with flows that let the detectors place events up to the horizon, the same absence is the focus orbit's verdict
    placed = lambda through: first_focus_row(focus, replace(cycles, confirmation=Confirmation(through, {})), read,  # noqa: E731
                                             times, 500.0).note
    assert placed(500.0).startswith("no focus: on the focus orbit the entropy")
    assert placed(499.9).startswith("not predicted: ")


def test_the_exact_flows_route_refuses_save_times_that_end_before_it_starts():
    d, k = 6, 2
    chain = random_chain(d, seed=4)
    flow = ReducedFlow(MeanFieldChain(chain.pi, chain.P), k, 1)
    with pytest.raises(ValueError, match="must end after t_start = 5"):
        flow.solve(random_state(d, k, 1, seed=4, scale=0.1), np.array([5.0]), t_start=5.0, method="FLOW")
