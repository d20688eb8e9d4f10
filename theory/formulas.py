"""The formula tier: stage times in closed form, from the chain's constants and the initial point's amplitudes.

Nothing here integrates a flow: each time is an explicit expression in π, P, ε (through the amplitudes a0 and
a_A of θ(0) along the origin's and the condensed point's unstable directions, a0 ≈ ε √m and a_A ≈ ε √k for a
Gaussian start), m and k, two one-dimensional root finds, one linear solve for the attention's curvature κ, and for
σ1's restart one critical point (L-BFGS, then Newton-CG) and its transverse spectrum. Cost O(d²) for μ1, μ2 and the
times; κ O(d³) up to d = 64, O(d²) per conjugate-gradient step beyond; the restart O(d²) per iteration (tens to a
thousand) and O(d³) for C's top triplet. Measured times: benchmarks/MEASUREMENTS.md.

**Condensation.** At θ = 0 the logits z = π^T M of every query grow along π - u at rate 2 μ1, μ1 = ‖π‖ ‖π - u‖, from
|z(0)| = x0 = ‖π‖ a0² / 2 (W0 = g π̂ α^T and W1 = α β^T with g = |β| = a0/√2), and settle at the condensed logits
ℓ = log π - mean(log π) (softmax(ℓ) = π). Interpolating the two ends by the logistic equation
d|z|/dt = 2 μ1 |z| (1 - |z|/‖ℓ‖), and σ0(W0) = g = (|z| / ‖π‖)^½, the detector's end of condensation (σ0 at the
fraction q of its condensed value g* = (‖ℓ‖/‖π‖)^½, so |z| = q² ‖ℓ‖) is

    t_c = [ log(‖ℓ‖/x0 - 1) + log(q² / (1 - q²)) ] / (2 μ1)
        = log(1/ε)/μ1  +  [ log(√2 g* / κ0) + ½ log(q²/(1 - q²)) ] / μ1  +  O(ε²),      a0 = κ0 ε.

**First focus.** The attention amplitude a_A grows as a_A' = |h(t)| a_A, h = γ^T (∂L/∂Φ) γ the attention coupling
(``theory.focus``), which rises from 0 to h* as the logits condense; h ∝ |z|² while z is small, so with
y = |z|/‖ℓ‖ on the logistic, |h| ≈ μ2 y², whose integral G is (μ2/(2 μ1)) I(U), U = 2 μ1 (t - t_½),
I(U) = log(1 + e^U) - σ(U) (t_½ = log(‖ℓ‖/x0 - 1)/(2 μ1), the logistic's midpoint; I(U) = U - 1 once condensed).
At the condensed point

    μ2 = |h*| = ‖ℓ‖ |Σ_i π_i² (π·ℓ - (P ℓ)_i)| (Σ_j π_j³ - ‖π‖⁴) / ‖π‖⁵

(paper family: π·ℓ - (P ℓ)_i = λ (π·ℓ - ℓ_i)). The attention logits of the most frequent query q are
Φ[q, j] = φ c_j, c_j = g*² π_q π_j / ‖π‖², with φ = -sign(h*) a_A² / 2. Their entropy H(φ) of
softmax(φ c + log π) falls from H(π) towards 0 as the query focuses on the most frequent token; the detector
dates the focus where it is 0.35 nats below its running maximum, H(φ_f) = H(π) - 0.35 (``onset_focus_logit``), and
σ1's restart below starts from half focus, H(φ_½) = H(π)/2, at t_h (t_f with φ_½ for φ_f). As φ grows the
rank-one map answers and the coupling moves, h = y² (-μ2 + κ φ) with κ = ∂²L/∂φ² - b^T (H + 2 μ2 I)^{-1} b
(``attention_curvature``), so dφ/dG = 2 φ (1 - κ φ/μ2): 1/φ obeys a linear equation, and φ reaches φ_f when the
linear growth φ0 e^{2G} reaches φ_lin = φ_f (μ2 - κ φ0)/(μ2 - κ φ_f) (κ < 0; φ_lin = φ_f for κ ≥ 0,
``linear_equivalent_logit``), φ0 = a_A²/2:

    t_f = t_½ + U/(2 μ1),   (μ2/(2 μ1)) I(U) = log((2 φ_lin)^½ / a_A)
        = t_½ + 1/(2 μ1) + log(2 φ_lin / a_A²) / (2 μ2)   once condensed
        = (1/μ1 + 1/μ2) log(1/ε)  +  O(1).

**σ1's restart.** θ(0)'s part transverse to α (one column per direction of α^⊥) barely moves while W0 condenses
(at the origin only W0's π̂ row and W1's (π - u)^ column move, and along α^⊥ their unstable combination is 0), so
condensation leaves U = (I - π̂π̂^T) W0(0) E, Y = ((I - ŵŵ^T) W1(0)^T E; W_Q(0)^T E; W_K(0)^T E)
(``carried_transverse_part``). Once the frequent query has focused, the rank-one point sits near a critical point
of the rank-one loss, where the transverse equation dZ/dt = -H_T Z (``theory.transverse``) grows its fastest mode
(ā, -b̄)/√2 at μ_R = σ_max(C). Found by L-BFGS (then Newton-CG where it stops short) from (γ*, β*, φ_½)
(``focused_critical_point``, d ≤ FOCUSED_UP_TO),
with c = (ā^T U - b̄^T Y)/√2 and a_s = ‖c‖ ‖(I - γ̂γ̂^T) ā‖/√2 the amplitude σ1(W0) sees,

    t_R = t_h + log(ℓ_1 / a_s) / μ_R,   ℓ_1 = 10 σ1(W0(0)) (the detector's threshold; t_h: t_f at φ_½)
        = (1/μ1 + 1/μ2) log(1/ε) + O(1)   (ℓ_1 and a_s are both O(ε)).

The logistic interpolates the orbit from 0 to ℓ (the logits also turn from π - u towards ℓ), and both times treat
the attention as growing on top of a condensing map whose own course it does not change, so they miss where the
attention grows during condensation (μ2 ≫ μ1) and moves σ0's condensed scale; the reduced-flow tier keeps that
interaction. Their accuracy against the exact flow is measured in RESULTS.md ("The formula tier").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from scipy.linalg import null_space
from scipy.optimize import brentq, minimize
from scipy.sparse.linalg import LinearOperator, cg
from scipy.special import softmax

from flowsim.observe.stages import StageThresholds
from theory.mean_field import MeanFieldChain, condensed_point, factored_maps
from theory.manifold import ReducedState
from theory.origin import unstable_directions, unstable_projection
from theory.transverse import TransverseCoupling


ROUNDING = 1e-12  # |h*| below this × ‖ℓ‖ is rounding: no attention coupling at the condensed point


@dataclass(frozen=True)
class ChainConstants:
    """The closed-form constants of a chain: the rates at the two critical points and the condensed scale."""

    mu1: float  # ‖π‖ ‖π - u‖: growth rate at the origin
    mu2: float  # |h*|: the attention's growth rate at the condensed point
    h_sign: float  # sign(h*): -1 (φ > 0) focuses the frequent query on the frequent token
    ell_norm: float  # ‖ℓ‖, ℓ = log π - mean(log π): the condensed logits' norm
    g_star: float  # (‖ℓ‖/‖π‖)^½: σ0(W0) at the condensed point
    query: int  # the most frequent token, whose query focuses first
    kappa: float  # dh/dφ along the attention's growth (``attention_curvature``): < 0 accelerates the focus


def chain_constants(pi: np.ndarray, P: np.ndarray) -> ChainConstants:
    """μ1, μ2, ‖ℓ‖, g* and κ by the formulas in the module docstring: O(d²) but for κ (``attention_curvature``)."""
    pi, P = np.asarray(pi, dtype=float), np.asarray(P, dtype=float)
    if np.any(pi <= 0):
        raise ValueError(f"the formulas need π > 0 everywhere, got min π = {pi.min():g} (token {int(np.argmin(pi))})")
    norm = float(np.linalg.norm(pi))
    mu1 = norm * float(np.linalg.norm(pi - 1.0 / len(pi)))
    if mu1 < 1e-12 * norm:
        raise ValueError(f"no condensation to time: π is uniform (d = {len(pi)}), so μ1 = ‖π‖ ‖π - u‖ = 0")
    ell = np.log(pi) - np.mean(np.log(pi))
    ell_norm = float(np.linalg.norm(ell))
    h = ell_norm * float(pi**2 @ (pi @ ell - P @ ell)) * (float(np.sum(pi**3)) - norm**4) / norm**5
    if abs(h) <= ROUNDING * ell_norm:  # P = 1 π^T (i.i.d. tokens) gives h* = 0 up to rounding, of either sign
        h = 0.0
    kappa = attention_curvature(pi, P, abs(h)) if h != 0 else 0.0
    return ChainConstants(mu1, abs(h), float(np.sign(h)), ell_norm, float(np.sqrt(ell_norm / norm)), int(np.argmax(pi)),
                          kappa)


def condensation_end(constants: ChainConstants, pi: np.ndarray, a0: float, level: float) -> float | None:
    """t_c = [log(‖ℓ‖/x0 - 1) + log(q²/(1 - q²))] / (2 μ1), x0 = ‖π‖ a0²/2, q = ``level``; None where the start is
    already past the level (x0 ≥ q² ‖ℓ‖: no condensation to time)."""
    x0 = float(np.linalg.norm(pi)) * a0**2 / 2
    if x0 >= level**2 * constants.ell_norm:
        return None
    return (np.log(constants.ell_norm / x0 - 1.0) + np.log(level**2 / (1.0 - level**2))) / (2 * constants.mu1)


def focus_entropy(constants: ChainConstants, pi: np.ndarray, phi: float) -> float:
    """H of the frequent query's attention softmax(φ c + log π), c_j = g*² π_q π_j / ‖π‖²: O(d)."""
    c = constants.g_star**2 * pi[constants.query] * pi / float(pi @ pi)
    weights = softmax(phi * c + np.log(pi))
    return float(-np.sum(weights * np.log(np.where(weights > 0, weights, 1.0))))


def half_focus_logit(constants: ChainConstants, pi: np.ndarray) -> float | None:
    """φ_½ > 0 where the frequent query's entropy is half H(π) (φ > 0: the attention of h* < 0, towards the frequent
    token); None where it never is (ties at the top of π)."""
    return focus_logit(constants, pi, focus_entropy(constants, pi, 0.0) / 2)


def onset_focus_logit(constants: ChainConstants, pi: np.ndarray, drop: float) -> float | None:
    """φ_f > 0 where the frequent query's entropy is ``drop`` nats below H(π), where the detectors date a focus onset
    (``StageThresholds.focus_drop``, below the running maximum, H(π) at the start); None where it never is."""
    return focus_logit(constants, pi, focus_entropy(constants, pi, 0.0) - drop)


def focus_logit(constants: ChainConstants, pi: np.ndarray, target: float) -> float | None:
    """φ > 0 where the frequent query's entropy falls to ``target``, by bracketing and Brent's method; None where it
    never does."""
    if target <= 0:
        return None
    far = 1.0
    while focus_entropy(constants, pi, far) > target:
        far *= 2
        if far > 1e12:
            return None
    return brentq(lambda phi: focus_entropy(constants, pi, phi) - target, 0.0, far, xtol=1e-12, rtol=1e-12)


def logistic_square_integral(u: float) -> float:
    """I(u) = ∫_{-∞}^u σ(v)² dv = log(1 + e^u) - σ(u) = -log(1 - s) - s, s = σ(u) (σ² = σ - σ'); I(u) = u - 1 + o(1).
    For s < 1e-3 the series s²/2 + s³/3 + s⁴/4 + s⁵/5 (to 1e-15 relative), where the difference would cancel."""
    if u < -7.0:  # s < 1e-3
        s = float(np.exp(u) / (1.0 + np.exp(u)))
        return s**2 / 2 + s**3 / 3 + s**4 / 4 + s**5 / 5
    return float(np.logaddexp(0.0, u) - 1.0 / (1.0 + np.exp(-u)))


def _rank_one_loss(d: int, x, phi, pi, log_pi, P):
    """L at Φ = φ γ γ^T, M = γ β^T, x = (γ, β): the mean-field loss on the rank-one manifold with one attention
    coordinate (``factored_maps`` with Γ = γ, K = [[φ]], B = β), O(d²)."""
    return factored_maps(x[:d, None], jnp.reshape(phi, (1, 1)), x[d:, None], pi, log_pi, P)[3]


@functools.partial(jax.jit, static_argnums=0)
def _curvature_parts(d: int, x, pi, log_pi, P):
    """(∂²L/∂φ², b = ∂(∂L/∂φ)/∂x) at φ = 0."""
    dphi = jax.grad(_rank_one_loss, argnums=2)
    return jax.grad(dphi, argnums=2)(d, x, 0.0, pi, log_pi, P), jax.grad(dphi, argnums=1)(d, x, 0.0, pi, log_pi, P)


@functools.partial(jax.jit, static_argnums=0)
def _hessian_product(d: int, x, v, pi, log_pi, P):
    """H v, H = ∂²L/∂x² at φ = 0: one forward-over-reverse pass, O(d²)."""
    gradient = lambda y: jax.grad(_rank_one_loss, argnums=1)(d, y, 0.0, pi, log_pi, P)  # noqa: E731
    return jax.jvp(gradient, (x,), (v,))[1]


DENSE_UP_TO = 64  # up to this d the (2d x 2d) Hessian is formed from the closed-form gradient; beyond, conjugate
# gradients on compiled Hessian-vector products (whose compilation costs more than the whole dense route at small d:
# benchmarks/MEASUREMENTS.md)
SHIFT_FLOOR = 1e-8  # the dense Hessian's rounding (about -2e-12 in its least eigenvalue) must not decide the solve
STEP = 1e-5  # central differences of the closed-form gradient: truncation O(STEP²) ≈ 1e-10, rounding ≈ 1e-11


def rank_one_gradient(chain: MeanFieldChain, x: np.ndarray, phi: float) -> tuple[np.ndarray, float]:
    """(∂L/∂x, ∂L/∂φ) at Φ = φ γ γ^T, M = γ β^T, x = (γ, β), in closed form (``MeanFieldChain.factored``):
    ∂L/∂γ = G_M β + φ (G_Φ + G_Φ^T) γ, ∂L/∂β = G_M^T γ, ∂L/∂φ = γ^T G_Φ γ. O(d²)."""
    d = chain.d
    gamma, beta = x[:d], x[d:]
    parts = chain.factored(gamma[:, None], np.array([[phi]]), beta[:, None])
    G_Phi_gamma = parts.G_Phi @ gamma
    d_gamma = parts.G_M_times(beta[:, None])[:, 0] + phi * (G_Phi_gamma + parts.G_Phi.T @ gamma)
    d_beta = parts.G_M_transpose_times(gamma[:, None])[:, 0]
    return np.concatenate([d_gamma, d_beta]), float(gamma @ G_Phi_gamma)


def rank_one_hessian(chain: MeanFieldChain, gamma: np.ndarray, beta: np.ndarray, phi: float) -> np.ndarray:
    """The rank-one loss's Hessian over z = (γ, β, φ), symmetrised, by central differences of ``rank_one_gradient``:
    4d + 2 gradients, O(d³)."""
    d = chain.d
    z = np.concatenate([gamma, beta, [phi]])

    def gradient(point: np.ndarray) -> np.ndarray:
        d_x, d_phi = rank_one_gradient(chain, point[:2 * d], point[2 * d])
        return np.append(d_x, d_phi)

    hessian = np.column_stack([(gradient(z + STEP * e) - gradient(z - STEP * e)) / (2 * STEP) for e in np.eye(len(z))])
    return 0.5 * (hessian + hessian.T)


def symmetry_directions(gamma: np.ndarray, beta: np.ndarray, phi: float) -> np.ndarray:
    """An orthonormal basis ((2d + 1) × 2) of the rank-one loss's two symmetries at (γ, β, φ): β → β + c1 (softmax
    ignores a shift of every logit) and (γ, β, φ) → (cγ, β/c, φ/c²), whose conservation law is the flow's GL(m)
    balance (docs/model.md). O(d)."""
    d = len(gamma)
    return np.linalg.qr(np.column_stack([np.concatenate([np.zeros(d), np.ones(d), [0.0]]),
                                         np.concatenate([gamma, -beta, [-2 * phi]])]))[0]


def dense_curvature_parts(pi: np.ndarray, P: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """(∂²L/∂φ², b, H) at the condensed point by central differences of ``rank_one_gradient``: 4d + 2 gradients,
    O(d³)."""
    chain = MeanFieldChain(pi, P)
    gamma, beta = condensed_point(pi)
    x = np.concatenate([gamma, beta])
    columns, coupling = [], []
    for e in np.eye(2 * len(pi)):
        (up, h_up), (down, h_down) = rank_one_gradient(chain, x + STEP * e, 0.0), rank_one_gradient(chain, x - STEP * e, 0.0)
        columns.append((up - down) / (2 * STEP))
        coupling.append((h_up - h_down) / (2 * STEP))
    second = (rank_one_gradient(chain, x, STEP)[1] - rank_one_gradient(chain, x, -STEP)[1]) / (2 * STEP)
    H = np.column_stack(columns)
    return second, np.array(coupling), 0.5 * (H + H.T)


def attention_curvature(pi: np.ndarray, P: np.ndarray, mu2: float) -> float:
    """κ = ∂²L/∂φ² - b^T (H + 2 μ2 I)^{-1} b at the condensed point: the slope of the attention coupling h(φ) once
    the rank-one map (γ, β) follows the growing attention. Each mode of H (eigenvalue λ) driven by b φ with φ ∝ e^{2 μ2 t}
    answers with -b φ / (λ + 2 μ2): the stiff modes adiabatically, the flat ones (λ = 0: γ ⊥ π does not move the
    condensed logits) at the growth rate itself, which is why κ < 0, an accelerating focus, is common where μ2 is
    small. The scaling mode (γ, -β) answers as the conservation law |γ|² - |β|² = q² + r² requires. O(d³) dense up to
    d = DENSE_UP_TO (``dense_curvature_parts``), else O(d²) per conjugate-gradient step on autodiff's products."""
    pi, P = np.asarray(pi, dtype=float), np.asarray(P, dtype=float)
    d = len(pi)
    shift = max(2 * mu2, SHIFT_FLOOR)
    if d <= DENSE_UP_TO:
        second, b, H = dense_curvature_parts(pi, P)
        return float(second - b @ np.linalg.solve(H + shift * np.eye(2 * d), b))
    gamma, beta = condensed_point(pi)
    args = (jnp.asarray(pi), jnp.log(jnp.asarray(pi)), jnp.asarray(P))
    x = jnp.concatenate([jnp.asarray(gamma), jnp.asarray(beta)])
    second, b = (np.asarray(part) for part in _curvature_parts(d, x, *args))
    operator = LinearOperator((2 * d, 2 * d), dtype=float,
                              matvec=lambda v: np.asarray(_hessian_product(d, x, jnp.asarray(v), *args)) + shift * v)
    response, info = cg(operator, b, rtol=1e-10, maxiter=20 * d)
    if info != 0:
        raise RuntimeError(f"the attention curvature's linear solve did not converge (conjugate gradients: {info})")
    return float(second - b @ response)


def linear_equivalent_logit(mu2: float, kappa: float, phi_half: float, phi0: float) -> float:
    """φ_lin = φ_½ (μ2 - κ φ0) / (μ2 - κ φ_½) for κ < 0, else φ_½: linear growth φ0 e^{2G} reaches φ_lin when the
    growth dφ/dG = 2 φ (1 - κ φ/μ2) reaches φ_½ (G = ∫|h| dt, the coupling h = y² (-μ2 + κ φ) scaled as a whole by the
    condensing map; 1/φ obeys a linear equation, so this is exact for that growth). With κ < 0 it runs away (a
    blow-up at e^{2G} = 1 + μ2/(|κ| φ0), or t ≈ 1/(2 |κ| φ0) where μ2 → 0); with κ > 0 its quadratic truncation would
    stop at μ2/κ, short of a focus the flow completes, so the linear growth is kept."""
    return phi_half * (mu2 - kappa * phi0) / (mu2 - kappa * phi_half) if kappa < 0 else phi_half


def first_focus(constants: ChainConstants, pi: np.ndarray, a0: float, a_attention: float,
                phi_target: float | None) -> float | None:
    """t_f = t_½ + U/(2 μ1), where (μ2/(2 μ1)) I(U) = log((2 φ_lin)^½ / a_A): the attention's growth G(t) = μ2 ∫ y² on the
    logistic y = σ(2 μ1 (t - t_½)) reaches the focus logit ``phi_target`` (the detectors' onset, ``onset_focus_logit``, or
    half focus, ``half_focus_logit``) from φ0 = a_A²/2, its nonlinear growth folded into φ_lin
    (``linear_equivalent_logit``). Past condensation (U ≫ 1) this is t_½ + 1/(2 μ1) + log(2 φ_lin/a_A²)/(2 μ2).
    None where μ2 = 0, where h* > 0 (the unstable attention, φ < 0, turns the frequent query away from the frequent
    token: not the focus of Stage II, whose mass goes to that token), or where the attention never reaches that
    logit's entropy (``phi_target`` None)."""
    x0 = float(np.linalg.norm(pi)) * a0**2 / 2
    if constants.mu2 <= 0 or constants.h_sign > 0 or a_attention <= 0 or phi_target is None or x0 >= constants.ell_norm:
        return None  # the last: a start past the logistic's midpoint, outside the formula's range (``outside_range``)
    phi_lin = linear_equivalent_logit(constants.mu2, constants.kappa, phi_target, a_attention**2 / 2)
    t_half = np.log(constants.ell_norm / x0 - 1.0) / (2 * constants.mu1)
    growth = 0.5 * np.log(2 * phi_lin / a_attention**2)  # G needed: a_A e^G = (2 φ_lin)^½
    if growth <= 0:
        return max(0.0, t_half)  # the start is already past half focus
    ratio = constants.mu2 / (2 * constants.mu1)
    upper = growth / ratio + 2.0
    u = brentq(lambda v: ratio * logistic_square_integral(v) - growth, -50.0 - growth, upper, xtol=1e-12)
    return t_half + u / (2 * constants.mu1)


FOCUSED_GRADIENT = 1e-10  # L-BFGS's goal for the rank-one gradient (sup norm) at the focused critical point ...
FOCUSED_ACCEPTED = 1e-6  # ... and what it accepts wherever it stops (its line search stalled at 1.7e-7 on a d = 4 chain)
FOCUSED_ITERATIONS = 1000  # L-BFGS iterations at most (tens to a few hundred at d = 4-64) ...
NEWTON_ITERATIONS = 200  # ... then trust-region Newton-CG's, where L-BFGS stopped short
# beyond this d the focused point is not sought: at d = 1001 (WikiText-2's surrogate) L-BFGS had the gradient at 0.012
# after 1000 iterations, far past the formula tier's budget (benchmarks/MEASUREMENTS.md)
FOCUSED_UP_TO = 64


class NoFocusedPoint(RuntimeError):
    """L-BFGS, then Newton-CG, stopped short of a critical point of the rank-one loss."""


def focused_critical_point(pi: np.ndarray, P: np.ndarray, phi_start: float) -> tuple[np.ndarray, np.ndarray, float]:
    """(γ, β, φ): a critical point of the rank-one loss L(γ, β, φ) (Φ = φ γ γ^T, M = γ β^T) reached by L-BFGS on the
    closed-form gradient (``rank_one_gradient``) from the condensed point with the half-focused attention (γ*, β*, φ_½):
    where Stage II leaves the flow. The rank-one critical points are not isolated: besides two symmetries (β along 1,
    and (γ, β, φ) → (cγ, β/c, φ/c²)) the Hessian is flat along one or two directions that no conservation law fixes and
    along which σ_max(C) moves (docs/theory.md), so this is one point near that start, not necessarily the flow's
    own; no flow is integrated. Where L-BFGS stops with the
    gradient above FOCUSED_ACCEPTED (it crawls along that curve: at d = 64 it can leave 2e-5 after 1000 iterations),
    Newton-CG with trust region (Hessian products by central differences of the gradient) goes on from there; where
    that stops short too (three d = 64 chains with μ2 ≈ 1e-6 in the benchmark families), ``NoFocusedPoint``.
    O(d²) per iteration."""
    chain = MeanFieldChain(pi, P)
    d = len(pi)
    gamma, beta = condensed_point(pi)

    def loss(z: np.ndarray) -> float:
        return chain.factored(z[:d, None], np.array([[z[2 * d]]]), z[d:2 * d, None]).loss

    def gradient(z: np.ndarray) -> np.ndarray:
        d_x, d_phi = rank_one_gradient(chain, z[:2 * d], z[2 * d])
        return np.append(d_x, d_phi)

    def hessian_product(z: np.ndarray, v: np.ndarray) -> np.ndarray:
        size = np.linalg.norm(v)
        if size == 0:
            return np.zeros_like(v)
        return (gradient(z + STEP * v / size) - gradient(z - STEP * v / size)) * size / (2 * STEP)

    found = minimize(loss, np.concatenate([gamma, beta, [phi_start]]), jac=gradient, method="L-BFGS-B",
                     options={"maxiter": FOCUSED_ITERATIONS, "gtol": FOCUSED_GRADIENT, "ftol": 1e-16})
    if not np.max(np.abs(gradient(found.x))) <= FOCUSED_ACCEPTED:  # not: a NaN gradient is no critical point either
        found = minimize(loss, found.x, jac=gradient, hessp=hessian_product, method="trust-ncg",
                         options={"maxiter": NEWTON_ITERATIONS, "gtol": FOCUSED_GRADIENT})
    residual = float(np.max(np.abs(gradient(found.x))))
    if not (residual <= FOCUSED_ACCEPTED and np.all(np.isfinite(found.x))):
        raise NoFocusedPoint(f"the focused critical point was not found ({found.message}; gradient {residual:.2g})")
    return found.x[:d], found.x[d:2 * d], float(found.x[2 * d])


def carried_transverse_part(params0, pi: np.ndarray, alpha: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(U, Y): θ(0)'s part transverse to α (E an orthonormal basis of α^⊥, one column per direction) as condensation
    leaves it. At the origin only W0's π̂ row and W1's (π - u)^ column move (G_M = ∂L/∂M is rank one there); along
    E their unstable combination is 0 by the choice of α and the stable one decays at rate μ1, the rest is still.
    So U = (I - π̂π̂^T) W0(0) E and Y = ((I - ŵŵ^T) W1(0)^T E; W_Q(0)^T E; W_K(0)^T E): O(d m²)."""
    pi_hat, w_hat = unstable_directions(pi)
    E = null_space(alpha[None, :])
    W0, W1 = np.asarray(params0["W0"]), np.asarray(params0["W1"])
    U = W0 @ E - np.outer(pi_hat, pi_hat @ W0 @ E)
    W1_part = W1.T @ E - np.outer(w_hat, w_hat @ W1.T @ E)
    return U, np.vstack([W1_part, np.asarray(params0["W_Q"]).T @ E, np.asarray(params0["W_K"]).T @ E])


@dataclass(frozen=True)
class RestartFormula:
    """σ1's restart by the formula tier: t_R = t_h + log(ℓ_1/a_s)/μ_R (``sigma1_restart``), with its ingredients."""

    time: float | None  # None: no restart by the formula (``note``)
    rate: float | None  # μ_R = σ_max(C) at the focused critical point; None where it was not found or not sought
    amplitude: float | None  # a_s: the carried transverse part along the fastest mode, as σ1(W0) sees it
    threshold: float  # ℓ_1 = restart_factor × σ1(W0(0)), the detector's
    focused_logit: float | None  # φ at the focused critical point
    note: str = ""


# C's entries are loss gradients (G_M and G_Φ's parts), which on a degenerate chain (symmetric rare tokens) vanish at the
# exact focused point; the critical-point solve leaves them at about its own gradient residual r (μ_R = 0.65-0.71 r on
# π = (0.7, 0.1, 0.1, 0.1), r from 1.5e-9 to 1.5e-7 as L-BFGS stops), so a rate within this × r is that residual
DEGENERATE_MARGIN = 10.0


def focused_state(gamma: np.ndarray, beta: np.ndarray, phi: float, xi: np.ndarray) -> ReducedState:
    """The focused critical point as a rank-one manifold point: Γ = γ, B = β, Q = |φ|^½ ξ̂, R = sign(φ) Q (Q^T R = φ),
    ξ̂ the direction of θ(0)'s attention (``attention_part``; C's singular values do not depend on it)."""
    direction = xi / np.linalg.norm(xi) if np.linalg.norm(xi) > 0 else np.eye(len(xi))[0]
    Q = np.sqrt(abs(phi)) * direction[:, None]
    return ReducedState(gamma[:, None], beta[:, None], Q, np.sign(phi) * Q)


def sigma1_restart(constants: ChainConstants, pi: np.ndarray, P: np.ndarray, params0, alpha: np.ndarray,
                   focus_time: float, phi_half: float, restart_factor: float) -> RestartFormula:
    """σ1(W0)'s restart: t_R = t_h + log(ℓ_1/a_s)/μ_R (t_h: the half focus, t_f at φ_½), the leading term of ``theory.restart`` at the focused critical
    point instead of the flow's settled one. μ_R = σ_max(C) there (``focused_critical_point``, C the transverse
    coupling of ``theory.transverse``), with top singular vectors (ā, b̄); the transverse part carried from θ(0)
    (``carried_transverse_part``) projects on the growing mode (ā, -b̄)/√2 with coefficients c = (ā^T U - b̄^T Y)/√2,
    and σ1(W0) sees a_s = ‖c‖ ‖(I - γ̂γ̂^T) ā‖/√2 of it. ℓ_1 and a_s are both O(ε), so this adds O(1) to t_f: the next
    order of t_R = (1/μ1 + 1/μ2) log(1/ε) + O(1). The mode is taken as still from the end of condensation to t_f
    (its slow growth there, and the focus's own ramp of μ, are left out). O(d²) per L-BFGS iteration, O(d³) for C's
    top triplet."""
    threshold = restart_factor * float(np.linalg.svd(np.asarray(params0["W0"]), compute_uv=False)[1])
    if len(pi) > FOCUSED_UP_TO:
        return RestartFormula(None, None, None, threshold, None,
                              note=f"no formula beyond d = {FOCUSED_UP_TO}: the focused critical point is not sought there")
    try:
        gamma, beta, phi = focused_critical_point(pi, P, phi_half)
    except NoFocusedPoint as error:  # the rows before it stand; this one says why it has no time
        return RestartFormula(None, None, None, threshold, None, note=f"no formula: {error}")
    state = focused_state(gamma, beta, phi, attention_part(params0, alpha, constants.h_sign))
    chain = MeanFieldChain(pi, P)
    rate, a_bar, b_bar = TransverseCoupling(chain, state).top()
    gradient, gradient_phi = rank_one_gradient(chain, np.concatenate([gamma, beta]), phi)
    residual = max(float(np.max(np.abs(gradient))), abs(float(gradient_phi)))
    if rate <= DEGENERATE_MARGIN * residual:
        return RestartFormula(None, rate, None, threshold, phi,
                              note=f"no restart: C = 0 at the focused point (μ_R = {rate:.2g} is the critical-point "
                                   f"solve's residual {residual:.2g})")
    U, Y = carried_transverse_part(params0, pi, alpha)
    coefficients = (a_bar @ U - b_bar @ Y) / np.sqrt(2.0)
    gamma_hat = gamma / np.linalg.norm(gamma)
    amplitude = float(np.linalg.norm(coefficients) * np.linalg.norm(a_bar - gamma_hat * (gamma_hat @ a_bar)) / np.sqrt(2.0))
    if amplitude <= 0:
        return RestartFormula(None, rate, amplitude, threshold, phi, note="no restart: θ(0) has no part along the growing mode")
    if amplitude >= threshold:  # θ(0) is past the threshold along the mode already: the restart comes with the focus
        return RestartFormula(focus_time, rate, amplitude, threshold, phi,
                              note=f"a_s = {amplitude:.3g} is past ℓ_1 = {threshold:.3g} already: t_R = t_h")
    return RestartFormula(focus_time + np.log(threshold / amplitude) / rate, rate, amplitude, threshold, phi)


@dataclass(frozen=True)
class FormulaPrediction:
    """The formula tier's times for one initial point, with the constants they came from."""

    constants: ChainConstants
    a0: float  # θ(0)'s amplitude along the origin's unstable directions
    a_attention: float  # (W_Q, W_K)'s along the condensed point's
    condensation: float | None  # None: the start is already past condensation's level
    focus: float | None  # the most frequent query's first focus, as the detectors date it; None: no focus by these formulas
    leading_condensation: float  # log(1/ε)/μ1
    leading_focus: float  # (1/μ1 + 1/μ2) log(1/ε)
    restart: RestartFormula | None = None  # σ1's restart; None where there is no first focus to start it from
    focus_half: float | None = None  # when its entropy is half H(π): where σ1's restart formula starts from
    outside_range: str | None = None  # why the focus and restart formulas do not apply to this start; None: they do


def outside_range(constants: ChainConstants, pi: np.ndarray, a0: float) -> str | None:
    """Why the focus and restart formulas do not apply to a start of amplitude ``a0`` along the origin's unstable
    directions, or None: they follow condensation's logistic from below its midpoint, a small start (ε ≪ 1)."""
    x0 = float(np.linalg.norm(pi)) * a0**2 / 2
    if x0 < constants.ell_norm:
        return None
    return (f"the start is past condensation's midpoint (‖π‖ a0²/2 = {x0:.3g} ≥ ‖ℓ‖ = {constants.ell_norm:.3g}); "
            "the formulas assume a small start (init.eps ≪ 1)")


def attention_part(params0, alpha: np.ndarray, h_sign: float) -> np.ndarray:
    """ξ = (W_Q^T α - sign(h*) W_K^T α)/√2: θ(0)'s attention along the unstable vectors W_Q = α ξ^T,
    W_K = -sign(h*) α ξ^T at the condensed point, α the direction W0 condenses along; a_A = ‖ξ‖."""
    return (np.asarray(params0["W_Q"]).T @ alpha - h_sign * np.asarray(params0["W_K"]).T @ alpha) / np.sqrt(2.0)


def predict_formulas(pi: np.ndarray, P: np.ndarray, params0, eps: float,
                     thresholds: StageThresholds | None = None) -> FormulaPrediction:
    """Condensation's end, the first focus and σ1's restart by the closed forms, for the initial point ``params0``:
    O(d² + d m) besides κ and the restart's critical point (module docstring)."""
    th = StageThresholds() if thresholds is None else thresholds
    pi = np.asarray(pi, dtype=float)
    constants = chain_constants(pi, P)
    a0, alpha = unstable_projection(params0, pi)
    a_attention = float(np.linalg.norm(attention_part(params0, alpha, constants.h_sign)))
    leading = np.log(1.0 / eps)
    phi_half = half_focus_logit(constants, pi)
    focus = first_focus(constants, pi, a0, a_attention, onset_focus_logit(constants, pi, th.focus_drop))
    focus_half = first_focus(constants, pi, a0, a_attention, phi_half)
    restart = None if focus_half is None else sigma1_restart(constants, pi, np.asarray(P, dtype=float), params0, alpha,
                                                             focus_half, phi_half, th.restart_factor)
    return FormulaPrediction(
        constants, a0, a_attention, condensation_end(constants, pi, a0, th.condensation_level), focus,
        leading / constants.mu1, leading * (1 / constants.mu1 + 1 / constants.mu2) if constants.mu2 > 0 else np.inf,
        restart, focus_half, outside_range(constants, pi, a0))
