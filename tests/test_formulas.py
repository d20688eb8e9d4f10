"""theory.formulas: the closed forms against sympy's derivation, the numeric coupling, Stage I's orbit as ε -> 0 and
the exact flow on seeded chains drawn here."""

from __future__ import annotations

import numpy as np
import pytest

from flowsim import MarkovChain
from flowsim.config import transition_override
from prediction_accuracy import flow_config, measured_stages  # benchmarks/ is on the path (conftest)
from theory.focus import attention_coupling
from theory.formulas import (chain_constants, condensation_end, first_focus, half_focus_logit, logistic_square_integral,
                             predict_formulas)
from theory.mean_field import MeanFieldChain, condensed_point
from theory.origin import predict_condensation
from theory.symbolic import MeanFieldTwin


RESTART_BOUND = 0.30  # σ1's restart: this test's tolerance, above the validation families' worst (27.9%; the
# development family's is 49%: docs/theory.md, RESULTS.md "The formula tier's σ1 restart")


def general_chain(d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(π, P): Dirichlet rows floored at 0.1/d, π stationary (``MarkovChain``)."""
    rows = np.maximum(np.random.default_rng(seed).dirichlet(np.ones(d), size=d), 0.1 / d)
    chain = MarkovChain(P=rows / rows.sum(axis=1, keepdims=True))
    return chain.pi, chain.P


def paper_chain(d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(π, P) of the paper family: π ~ Dirichlet(1) floored at 0.02, λ ~ U[0.2, 0.8]."""
    rng = np.random.default_rng(seed)
    pi = np.maximum(np.sort(rng.dirichlet(np.ones(d)))[::-1], 0.02)
    chain = MarkovChain(pi=pi / pi.sum(), lam=rng.uniform(0.2, 0.8))
    return chain.pi, chain.P


@pytest.mark.parametrize("d", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_mu2_formula_is_the_sympy_coupling_at_the_condensed_point(d):
    """μ2 = ‖ℓ‖ |Σ π_i² (π·ℓ - (Pℓ)_i)| (Σπ³ - ‖π‖⁴)/‖π‖⁵ against h* = γ*^T G_Φ γ* with G_Φ from sympy's row loss."""
    pi, P = general_chain(d, seed=10 + d)
    gamma, beta = condensed_point(pi)
    G_Phi, _ = MeanFieldTwin(pi, P).gradient_of_maps(np.zeros((d, d)), np.outer(gamma, beta))
    h = float(gamma @ G_Phi @ gamma)
    constants = chain_constants(pi, P)
    assert constants.mu2 == pytest.approx(abs(h), rel=1e-10)
    assert constants.h_sign == np.sign(h)


def test_mu2_formula_is_the_numeric_coupling_on_a_seeded_family():
    for seed, d in enumerate([5, 9, 17, 40]):
        for pi, P in (general_chain(d, seed), paper_chain(d, seed)):
            gamma, beta = condensed_point(pi)
            h = attention_coupling(MeanFieldChain(pi, P), gamma, beta)
            assert chain_constants(pi, P).mu2 == pytest.approx(abs(h), rel=1e-9), (d, seed)


def test_logistic_square_integral_against_quadrature():
    from scipy.integrate import quad

    for u in (-8.0, -1.0, 0.0, 0.7, 5.0):
        want, _ = quad(lambda v: 1.0 / (1.0 + np.exp(-v)) ** 2, -60.0, u)
        assert logistic_square_integral(u) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert logistic_square_integral(40.0) == pytest.approx(39.0, abs=1e-12)  # I(u) = u - 1 past the transition


def test_condensation_formula_approaches_stage_one_orbit_as_eps_shrinks():
    """Both are log(1/ε)/μ1 + O(1); their O(1) parts differ (the logistic against the orbit), so their relative gap
    falls like 1/log(1/ε)."""
    pi, P = paper_chain(6, seed=3)
    constants = chain_constants(pi, P)
    gaps = []
    for eps in (1e-2, 1e-6, 1e-12):
        params0 = {"W0": np.outer(pi, [eps, 0]), "W1": np.outer([eps, 0], pi - 1 / 6),
                   "W_Q": np.zeros((2, 2)), "W_K": np.zeros((2, 2))}
        orbit = predict_condensation(pi, P, params0, eps)
        formula = condensation_end(constants, pi, orbit.a0, 1 / 3)
        gaps.append((abs(formula - orbit.t_end), abs(formula - orbit.t_end) / orbit.t_end))
    assert all(gap < 0.5 / constants.mu1 for gap, _ in gaps)  # an O(1) offset on the clock 1/μ1, whatever ε
    relative = [share for _, share in gaps]
    assert relative[0] > relative[1] > relative[2] and relative[2] < 0.005


@pytest.mark.slow
def test_formulas_against_the_exact_flow_on_a_seeded_family():
    """Condensation within 6% and the first focus within 12% at ε = 1e-2, the bounds the formula tier states
    (docs/theory.md; measured on families of d = 4 to 64, RESULTS.md "The formula tier"), and σ1's restart within
    RESTART_BOUND, on chains drawn here."""
    from flowsim.assemble import prepare
    from flowsim.config import load_config

    eps = 1e-2
    chains = [paper_chain(5, seed) for seed in (201, 202)] + [general_chain(5, 203)]
    for pi, P in chains:
        overrides = [transition_override(P), f"init.eps={eps}", "init.seed=0"]
        prepared = prepare(load_config(None, overrides))
        formulas = predict_formulas(prepared.chain.pi, prepared.chain.P, prepared.params0, eps)
        assert formulas.focus is not None
        assert formulas.restart is not None and formulas.restart.time is not None
        # to 2 × the predicted restart: the detectors date an event once they have read 10^0.15 past it (docs/stages.md),
        # and general chain 203's first focus comes just after its restart
        report = measured_stages(flow_config(overrides, eps, 2.0 * formulas.restart.time, 500))
        condensed = [i.t_end for i in report.intervals if i.stage == "condensation"]
        focused = [i.t_start for i in report.intervals if i.stage == "focus" and i.query == formulas.constants.query]
        restarted = [i.t_start for i in report.intervals if i.stage == "restart" and i.direction == 1]
        assert condensed and focused and restarted
        assert formulas.condensation == pytest.approx(condensed[0], rel=0.06), (pi, condensed[0])
        assert formulas.focus == pytest.approx(focused[0], rel=0.12), (pi, focused[0])
        assert formulas.restart.time == pytest.approx(restarted[0], rel=RESTART_BOUND), (pi, restarted[0])


def autodiff_curvature(pi: np.ndarray, P: np.ndarray, mu2: float) -> float:
    """κ = L_φφ - b^T (H + 2 μ2 I)^{-1} b with H, b and L_φφ by jax's autodiff of the rank-one loss (no closed-form
    gradient, no differences)."""
    import jax
    import jax.numpy as jnp

    from theory.formulas import _rank_one_loss

    d = len(pi)
    gamma, beta = condensed_point(pi)
    args = (jnp.asarray(pi), jnp.log(jnp.asarray(pi)), jnp.asarray(P))

    def loss(x, phi):
        return _rank_one_loss(d, x, phi, *args)

    x = jnp.concatenate([jnp.asarray(gamma), jnp.asarray(beta)])
    H = np.asarray(jax.hessian(loss, 0)(x, 0.0))
    b = np.asarray(jax.jacfwd(jax.grad(loss, 1), 0)(x, 0.0))
    second = float(jax.grad(jax.grad(loss, 1), 1)(x, 0.0))
    return second - b @ np.linalg.solve(H + 2 * mu2 * np.eye(2 * d), b)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.slow
def test_attention_curvature_against_autodiff(seed):
    """The dense route (central differences of the closed-form gradient) against jax's Hessian of the loss."""
    pi, P = general_chain(4, seed=30 + seed) if seed else paper_chain(4, seed=30)
    constants = chain_constants(pi, P)
    assert constants.kappa == pytest.approx(autodiff_curvature(pi, P, constants.mu2), rel=1e-7, abs=1e-10)


def test_attention_curvature_by_conjugate_gradients_is_the_dense_solve(monkeypatch):
    """Beyond DENSE_UP_TO: conjugate gradients on autodiff's Hessian-vector products, against the dense route."""
    import theory.formulas as formulas

    pi, P = general_chain(12, seed=4)
    mu2 = chain_constants(pi, P).mu2
    dense = formulas.attention_curvature(pi, P, mu2)
    monkeypatch.setattr(formulas, "DENSE_UP_TO", 0)
    assert formulas.attention_curvature(pi, P, mu2) == pytest.approx(dense, rel=1e-7)


@pytest.mark.parametrize("phi0", [1e-9, 1e-2])
def test_linear_equivalent_logit_is_the_time_of_the_quadratic_growth(phi0):
    """dφ/dG = 2φ(1 - κφ/μ2) from φ0 reaches φ_½ at G = ½ log(φ_lin/φ0) (integrated by quad) for κ < 0, also where
    φ0 is past μ2/|κ| and the growth is a blow-up from the start."""
    from scipy.integrate import quad

    from theory.formulas import linear_equivalent_logit

    mu2, kappa, phi_half = 1e-3, -0.03, 2.0
    growth, _ = quad(lambda phi: 1.0 / (2 * phi * (1 - kappa * phi / mu2)), phi0, phi_half, limit=200, epsrel=1e-12)
    assert growth == pytest.approx(0.5 * np.log(linear_equivalent_logit(mu2, kappa, phi_half, phi0) / phi0), rel=1e-6)
    assert linear_equivalent_logit(mu2, 0.02, phi_half, phi0) == phi_half  # κ > 0: the linear growth is kept


@pytest.mark.parametrize("a_attention", [2e-2, 1e-30])  # a focus during condensation, and long after it
def test_first_focus_is_where_the_attentions_growth_reaches_the_half_focus_logit(a_attention):
    """t_f against a quadrature of the growth it solves, G(t) = μ2 ∫ σ(2μ1(s - t_½))² ds = log((2 φ_lin)^½ / a_A), and
    φ_½ against the entropy written out with scipy (H(softmax(φ_½ c + log π)) = H(π)/2)."""
    from scipy.integrate import quad
    from scipy.special import expit, softmax
    from scipy.stats import entropy

    from theory.formulas import half_focus_logit, linear_equivalent_logit

    pi, P = paper_chain(4, seed=7)
    constants = chain_constants(pi, P)
    phi_half = half_focus_logit(constants, pi)
    c = constants.g_star**2 * pi[constants.query] * pi / (pi @ pi)
    assert entropy(softmax(phi_half * c + np.log(pi))) == pytest.approx(entropy(pi) / 2, rel=1e-9)
    a0 = 1e-3
    t_half = np.log(constants.ell_norm / (np.linalg.norm(pi) * a0**2 / 2) - 1) / (2 * constants.mu1)
    t_focus = first_focus(constants, pi, a0, a_attention, phi_half)
    y_squared = lambda s: expit(2 * constants.mu1 * (s - t_half)) ** 2  # noqa: E731
    settled = min(t_focus, t_half + 40 / constants.mu1)  # past it y² = 1 to 1e-30
    growth = constants.mu2 * (sum(quad(y_squared, lower, upper, epsabs=0, epsrel=1e-12, limit=200)[0]
                                  for lower, upper in ((-np.inf, t_half), (t_half, settled))) + t_focus - settled)
    phi_lin = linear_equivalent_logit(constants.mu2, constants.kappa, phi_half, a_attention**2 / 2)
    assert growth == pytest.approx(np.log(np.sqrt(2 * phi_lin) / a_attention), rel=1e-8)


def test_predict_tier_formula_prints_the_closed_forms_alone():
    from typer.testing import CliRunner

    from flowsim.cli import app

    result = CliRunner().invoke(app, ["predict", "--tier", "formula"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["stage", "q/dir", "formula", "reduced"]
    condensation = next(line for line in lines if line.startswith("condensation")).split()
    focus = next(line for line in lines if line.startswith("focus")).split()
    restart = next(line for line in lines if line.startswith("restart")).split()
    assert condensation[-1] == "-" and focus[:2] == ["focus", "q0"]  # no reduced flow was run
    assert restart[:2] == ["restart", "σ1"] and restart[-1] == "-" and float(restart[2]) > float(focus[2])
    assert "μ2 = |h*| = 0.0797847" in result.output  # the default chain's coupling, as the reduced tier's μ2
    bad = CliRunner().invoke(app, ["predict", "--tier", "fast"])
    assert bad.exit_code == 2 and "--tier must be 'both' or 'formula', got 'fast'" in bad.output


def test_logistic_square_integral_keeps_its_digits_far_left():
    from scipy.integrate import quad

    for u in (-40.0, -10.0, -7.5):
        want, _ = quad(lambda v: np.exp(2 * v) / (1.0 + np.exp(v)) ** 2, -np.inf, u, epsabs=0, epsrel=1e-13)
        assert logistic_square_integral(u) == pytest.approx(want, rel=1e-12)


def test_no_focus_where_the_attention_turns_away_from_the_frequent_token_or_has_no_coupling():
    """h* > 0: the unstable attention (φ < 0) moves the frequent query's mass off the frequent token, which is not
    Stage II's focus (the reduced tier finds the entropy falling 0.01 nats on this chain, the exact flow no focus by
    t = 4000); i.i.d. tokens (P = 1 π^T): h* = 0 up to rounding, whatever its sign."""
    pi, P = general_chain(4, seed=162)
    constants = chain_constants(pi, P)
    assert constants.h_sign > 0 and constants.mu2 > 0
    assert first_focus(constants, pi, 1e-2, 1e-2, half_focus_logit(constants, pi)) is None
    iid = np.outer(np.ones(4), pi)
    flat = chain_constants(pi, iid)
    assert flat.mu2 == 0 and flat.kappa == 0 and first_focus(flat, pi, 1e-2, 1e-2, half_focus_logit(flat, pi)) is None


def test_a_start_past_condensations_level_has_no_condensation_time():
    pi, P = paper_chain(5, seed=3)
    constants = chain_constants(pi, P)
    level = 1 / 3
    a0_at_level = np.sqrt(2 * level**2 * constants.ell_norm / np.linalg.norm(pi))
    assert condensation_end(constants, pi, 0.99 * a0_at_level, level) is not None
    assert condensation_end(constants, pi, 1.01 * a0_at_level, level) is None


@pytest.mark.parametrize("setting, message", [
    ("chain.pi=[0.25, 0.25, 0.25, 0.25]", "no condensation to time: π is uniform"),
    ("chain.pi=[1.0, 0.0, 0.0]", "π"),
])
def test_predict_tier_formula_refuses_a_chain_outside_the_formulas_in_one_line(setting, message):
    from typer.testing import CliRunner

    from flowsim.cli import app

    result = CliRunner().invoke(app, ["predict", "--tier", "formula", "--set", setting])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_carried_transverse_part_is_what_condensation_leaves_off_its_direction():
    """σ_max(U), U = (I - π̂π̂^T) W0(0) E, against σ1(W0) of the exact flow once condensed and before the focus: the
    rows of W0 off π̂ and its columns off α stand still while it condenses."""
    from flowsim.assemble import prepare
    from flowsim.config import load_config
    from flowsim.solve.solvers import solve_flow
    from theory.formulas import carried_transverse_part
    from theory.origin import unstable_projection

    pi, P = paper_chain(5, seed=211)
    overrides = [transition_override(P), "init.eps=1e-3", "init.seed=3"]
    prepared = prepare(load_config(None, overrides))
    formulas = predict_formulas(prepared.chain.pi, prepared.chain.P, prepared.params0, 1e-3)
    assert 3 * formulas.condensation < 0.5 * formulas.focus  # the plateau between them is where U is read
    config = flow_config(overrides, 1e-3, 3 * formulas.condensation, 50)
    result = solve_flow(prepared.flow, prepared.params0, np.array([0.0, 3 * formulas.condensation]), rtol=1e-9,
                        atol=config.solver.atol)
    sigma = np.linalg.svd(result.trajectory.params["W0"][-1], compute_uv=False)
    U, _ = carried_transverse_part(prepared.params0, prepared.chain.pi, unstable_projection(prepared.params0, pi)[1])
    assert sigma[0] > 100 * sigma[1]  # condensed
    assert np.linalg.svd(U, compute_uv=False)[0] == pytest.approx(sigma[1], rel=0.03)


def test_focused_critical_point_is_critical_by_autodiff():
    """The L-BFGS point's gradient by jax's autodiff of the rank-one loss (not the closed form it was found with)."""
    import jax
    import jax.numpy as jnp

    from theory.formulas import _rank_one_loss, focused_critical_point, half_focus_logit

    pi, P = general_chain(6, seed=212)
    constants = chain_constants(pi, P)
    assert constants.h_sign < 0
    gamma, beta, phi = focused_critical_point(pi, P, half_focus_logit(constants, pi))
    args = (jnp.asarray(pi), jnp.log(jnp.asarray(pi)), jnp.asarray(P))
    x = jnp.concatenate([jnp.asarray(gamma), jnp.asarray(beta)])
    d_x, d_phi = jax.grad(_rank_one_loss, argnums=(1, 2))(6, x, phi, *args)
    assert np.max(np.abs(np.asarray(d_x))) < 1e-8 and abs(float(d_phi)) < 1e-8
    assert phi > 0  # the attention of h* < 0, towards the frequent token


def test_focused_points_flat_directions_are_two_symmetries_that_keep_mu_and_others_that_move_it():
    """At the focused critical point the rank-one Hessian over (γ, β, φ) is flat along β → β + c1 and the rescaling
    (γ, β, φ) → (cγ, β/c, φ/c²), which leave σ_max(C) as it is, and along others that are no symmetry, some of
    which move it: why no conservation law fixes the flow's point, nor μ_R (docs/theory.md, "Why σ1's restart misses")."""
    from theory.formulas import (focused_critical_point, focused_state, half_focus_logit, rank_one_hessian,
                                 symmetry_directions)
    from theory.transverse import TransverseCoupling

    pi, P = general_chain(5, seed=214)
    d, chain, constants = 5, MeanFieldChain(pi, P), chain_constants(pi, P)
    gamma, beta, phi = focused_critical_point(pi, P, half_focus_logit(constants, pi))
    z = np.concatenate([gamma, beta, [phi]])
    values, vectors = np.linalg.eigh(rank_one_hessian(chain, gamma, beta, phi))
    flat = np.abs(values) < 1e-6 * np.abs(values).max()
    assert flat.sum() >= 3  # 4 on this chain; 3 on the paper family (benchmarks/restart_formula_diagnosis.py)
    symmetries = symmetry_directions(gamma, beta, phi)
    null = vectors[:, flat]
    assert np.linalg.norm(symmetries - null @ (null.T @ symmetries)) < 1e-6  # both lie in the flat space
    others = np.linalg.svd(null - symmetries @ (symmetries.T @ null))[0][:, :null.shape[1] - 2]

    xi = np.random.default_rng(0).standard_normal(4)  # any direction in k = 4: C's spectrum does not depend on it

    def slope(v, h=1e-3):
        rate = lambda point: TransverseCoupling(chain, focused_state(point[:d], point[d:2 * d], point[2 * d], xi)).top()[0]  # noqa: E731
        return (rate(z + h * v) - rate(z - h * v)) / (2 * h) / rate(z)

    assert abs(slope(symmetries[:, 0])) < 1e-8 and abs(slope(symmetries[:, 1])) < 1e-8
    assert max(abs(slope(v)) for v in others.T) > 1e-3


def test_restart_formula_adds_an_order_one_time_to_the_first_focus():
    """ℓ_1 and a_s both scale with the start, so t_R - t_½ does not move when θ(0) is scaled, while the focus does (its
    log(1/ε) terms)."""
    from flowsim.assemble import prepare
    from flowsim.config import load_config

    pi, P = paper_chain(5, seed=213)
    prepared = prepare(load_config(None, [transition_override(P), "init.eps=1e-2", "init.seed=1"]))
    gaps, foci = [], []
    for scale in (1.0, 1e-3):
        params0 = {name: scale * np.asarray(value) for name, value in prepared.params0.items()}
        formulas = predict_formulas(prepared.chain.pi, prepared.chain.P, params0, 1e-2 * scale)
        gaps.append(formulas.restart.time - formulas.focus_half)
        foci.append(formulas.focus)
    assert gaps[0] > 0 and gaps[1] == pytest.approx(gaps[0], rel=1e-6)
    assert foci[1] > foci[0] + 1.0


def test_no_restart_formula_beyond_its_size_says_so(monkeypatch):
    import theory.formulas as formulas_module
    from flowsim.assemble import prepare
    from flowsim.config import load_config

    monkeypatch.setattr(formulas_module, "FOCUSED_UP_TO", 3)
    prepared = prepare(load_config(None, []))
    formulas = predict_formulas(prepared.chain.pi, prepared.chain.P, prepared.params0, 1e-3)
    assert formulas.focus is not None and formulas.restart.time is None
    assert "no formula beyond d = 3" in formulas.restart.note


def test_what_condensation_leaves_is_the_kernel_of_sympys_origin_block():
    """carried_transverse_part keeps W0's rows off π̂ and W1's columns off ŵ = (π - u)^: by sympy's G_0 (d = 3) these
    are the kernel of the per-column block [[0, G_0], [G_0^T, 0]], and what they drop is spanned by its ±μ1
    eigenvectors (π̂, ±ŵ)/√2."""
    import sympy as sp

    from theory.origin import mu1_expression, origin_gradient, unstable_directions

    d = 3
    G = origin_gradient(d)
    pi_values = np.array([0.6, 0.3, 0.1])
    at = dict(zip(sp.symbols(f"pi0:{d - 1}", positive=True), pi_values[:-1]))
    G_numeric = np.array(G.subs(at).evalf(), dtype=float)
    block = np.block([[np.zeros((d, d)), G_numeric], [G_numeric.T, np.zeros((d, d))]])
    pi_hat, w_hat = unstable_directions(pi_values)
    keep_u, keep_w = np.eye(d) - np.outer(pi_hat, pi_hat), np.eye(d) - np.outer(w_hat, w_hat)
    kept = np.block([[keep_u, np.zeros((d, d))], [np.zeros((d, d)), keep_w]])
    np.testing.assert_allclose(block @ kept, 0, atol=1e-14)  # the kept parts stand still at the origin
    mu1 = float(mu1_expression(d).subs(at))
    for sign in (1, -1):  # Hessian eigenvalues -μ1 (π̂, ŵ)/√2: the flow grows it; +μ1 (π̂, -ŵ)/√2: it decays
        vector = np.concatenate([pi_hat, sign * w_hat]) / np.sqrt(2)
        np.testing.assert_allclose(block @ vector, -sign * mu1 * vector, atol=1e-12)
    dropped = np.eye(2 * d) - kept
    assert np.linalg.matrix_rank(dropped, tol=1e-12) == 2  # exactly the span of those two eigenvectors


@pytest.mark.parametrize("goal", [None, 1e-6])
def test_no_restart_formula_where_symmetric_rare_tokens_leave_no_transverse_coupling(monkeypatch, goal):
    """π = (0.7, 0.1, 0.1, 0.1): C = 0 at the focused point (``theory.transverse``, the degenerate point), so the formula
    gives no σ1 restart and says why, and the exact flow shows none by four times the first focus. What the
    critical-point solve leaves of C is its own gradient residual, however far it got: with L-BFGS stopped at a 1e-6
    goal (as it may stop early on another CPU) μ_R is 1.1e-7, which a fixed 1e-6 μ2 = 8e-8 called a restart at t = 1e8."""
    import theory.formulas as formulas_module
    from flowsim.assemble import prepare
    from flowsim.config import load_config

    if goal is not None:
        monkeypatch.setattr(formulas_module, "FOCUSED_GRADIENT", goal)
    overrides = ["chain.pi=[0.7, 0.1, 0.1, 0.1]", "init.eps=1e-3"]
    prepared = prepare(load_config(None, overrides))
    formulas = predict_formulas(prepared.chain.pi, prepared.chain.P, prepared.params0, 1e-3)
    assert formulas.focus is not None and formulas.restart.time is None
    assert "no restart: C = 0 at the focused point" in formulas.restart.note
    if goal is None:  # the flow itself, once
        report = measured_stages(flow_config(overrides, 1e-3, 4 * formulas.focus, 300))
        assert [i for i in report.intervals if i.stage == "focus" and i.query == 0]
        assert not [i for i in report.intervals if i.stage == "restart" and i.direction == 1]


def test_a_chain_near_the_degenerate_point_keeps_its_restart():
    """π = (0.7, 0.1, 0.1001, 0.0999): C is small (μ_R ≈ 6e-6), not the solve's residual, so the restart is predicted."""
    from flowsim.assemble import prepare
    from flowsim.config import load_config

    prepared = prepare(load_config(None, ["chain.pi=[0.7, 0.1, 0.1001, 0.0999]", "init.eps=1e-3"]))
    formulas = predict_formulas(prepared.chain.pi, prepared.chain.P, prepared.params0, 1e-3)
    assert formulas.restart.time is not None and formulas.restart.time > formulas.focus, formulas.restart.note


def test_the_restarts_amplitude_is_how_the_transverse_equation_grows_sigma1_at_the_focused_point():
    """At the focused point held still, Z(t) = exp(-t H_T) Z0 from what condensation leaves (``theory.transverse``'s
    H_T, its matrix exponential): σ1 of W0 = γ α^T + U(t) E^T approaches a_s e^{μ_R t}, which checks the growing mode's
    sign, its √2s and the projection off γ in a_s."""
    from scipy.linalg import expm, null_space

    from flowsim.assemble import prepare
    from flowsim.config import load_config
    from theory.formulas import (attention_part, carried_transverse_part, focused_critical_point, focused_state,
                                 half_focus_logit)
    from theory.origin import unstable_projection
    from theory.transverse import TransverseCoupling, transverse_hessian

    pi, P = paper_chain(5, seed=214)
    prepared = prepare(load_config(None, [transition_override(P), "init.eps=1e-3", "init.seed=2"]))
    pi, P = prepared.chain.pi, prepared.chain.P
    # a start at 1e-8 keeps U(t) a perturbation of γ α^T (‖γ‖ ≈ 3) while its fastest mode grows e^16-fold
    params0 = {name: 1e-5 * np.asarray(value) for name, value in prepared.params0.items()}
    formulas = predict_formulas(pi, P, params0, 1e-8)
    restart = formulas.restart
    _, alpha = unstable_projection(params0, pi)
    gamma, beta, phi = focused_critical_point(pi, P, half_focus_logit(formulas.constants, pi))
    state = focused_state(gamma, beta, phi, attention_part(params0, alpha, formulas.constants.h_sign))
    H = transverse_hessian(TransverseCoupling(MeanFieldChain(pi, P), state).dense())
    U, Y = carried_transverse_part(params0, pi, alpha)
    E, d = null_space(alpha[None, :]), len(pi)
    ratios = []
    for growth in (8.0, 12.0, 16.0):  # μ_R t
        Z = expm(-(growth / restart.rate) * H) @ np.vstack([U, Y])
        W0 = np.outer(gamma, alpha) + Z[:d] @ E.T
        ratios.append(np.linalg.svd(W0, compute_uv=False)[1] / (restart.amplitude * np.exp(growth)))
    assert abs(ratios[-1] - 1) < 1e-6, ratios  # the opposite sign in c gives 0.98 here


def test_a_start_past_the_restart_threshold_along_the_mode_restarts_with_the_focus_and_says_so():
    from flowsim.assemble import prepare
    from flowsim.config import load_config
    from theory.predict import formula_line

    prepared = prepare(load_config(None, []))
    params0 = {name: np.asarray(value) * (1.0 if name == "W0" else 300.0) for name, value in prepared.params0.items()}
    formulas = predict_formulas(prepared.chain.pi, prepared.chain.P, params0, 1e-3)
    assert formulas.restart.amplitude >= formulas.restart.threshold
    assert formulas.restart.time == formulas.focus_half and "past ℓ_1" in formulas.restart.note
    assert f"σ1 restart: {formulas.restart.note}" in formula_line(formulas)
