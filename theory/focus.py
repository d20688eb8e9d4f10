"""Stage II: the condensed critical point, the attention block there, and the focus onset.

With attention at zero every query sees the same logits z = π^T M, so the condensation
orbit ends where softmax(z) = π. On the orbit W0 = γ α^T stays along π̂, Σβ = 0 and
‖γ‖ = ‖β‖ (both conserved from the unstable direction), which fixes the point:

    γ* = g π̂,   β* = ℓ / (g ‖π‖),   ℓ = log π - mean(log π),   g² = ‖ℓ‖ / ‖π‖.

There L = L(0, M*) + tr(H^T Φ) + ..., H = ∂L/∂Φ at (0, M*), and Φ = W0 W_Q W_K^T W0^T
makes the attention block of the Hessian [[0, b ⊗ I_k], [b^T ⊗ I_k, 0]] with
b = W0^T H W0 = h α α^T, h = γ*^T H γ*. Its eigenvalues are ±μ2 = ±|h| (k times each);
the unstable vectors are W_Q = α ξ^T, W_K = -sign(h) α ξ^T. Along them Φ = φ γ*γ*^T,
φ = -sign(h) a²/2 for amplitude a, so query i's logits grow ∝ π_i π_j: the most frequent
token's query focuses first, on the most frequent token.

Focus onset, by matched asymptotics (as condensation matches its orbit). While the
attention is small its amplitude obeys the linear equation a' = |h(t)| a along the
condensation orbit (h rises from 0 to -μ2 as M condenses; φ = q·r enters the loss at
second order, so the attention does not feed back on condensation), hence

    a(t) = a_attn(0) exp(G(t)),   G(t) = ∫_0^t |h(s)| ds,   G(t) = μ2 t + K for t past condensation.

The nonlinear phase is the *focus orbit*: the rank-one flow from the condensed point
(γ*, β*) along the unstable attention vector, started at a tiny amplitude δ (computed
once per chain, ``focus_orbit``). Along it the amplitude is δ e^{μ2 τ} while linear, so
the two clocks match where a(t) = δ:

    t = τ + t_shift,   t_shift = T + (log δ - log a_attn(0) - G(T)) / μ2,

for any T at which condensation has settled and the attention is still linear; the
result does not depend on δ as δ → 0. The first query's focus onset is then the
detector's own (``detect_focus_and_dilution``: where the entropy first falls the focus drop
below its running maximum) read on the orbit's entropy on that clock.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import sympy as sp
from scipy.integrate import cumulative_trapezoid
from scipy.special import softmax

from flowsim.observe.observables import attention_entropy
from flowsim.observe.stages import StageThresholds, detect_focus_and_dilution
from theory.origin import CondensationPrediction
from theory.manifold import ReducedFlow, ReducedState
from theory.mean_field import MeanFieldChain, condensed_point


@functools.lru_cache(maxsize=None)
def condensed_point_expressions(d: int) -> tuple[tuple[sp.Symbol, ...], sp.Expr, sp.Matrix, sp.Matrix]:
    """(π symbols, g, γ*, β*) solved from softmax((π·γ) β) = π, Σβ = 0, ‖γ‖ = ‖β‖, γ ∥ π."""
    pi = sp.symbols(f"pi0:{d}", positive=True)
    g, c = sp.Symbol("g", positive=True), sp.Symbol("c", real=True)
    norm_pi = sp.sqrt(sum(p**2 for p in pi))
    # softmax(z) = π  <=>  z = log π + c; with π·γ = g ‖π‖: β = (log π + c) / (g ‖π‖)
    beta = sp.Matrix([(sp.log(p) + c) / (g * norm_pi) for p in pi])
    c_value = sp.solve(sp.Eq(sum(beta), 0), c)[0]
    beta = beta.subs(c, c_value)
    # balance ‖γ‖ = ‖β‖ reads g = ‖g β‖ / g, i.e. g² = ‖g β‖ (g β does not depend on g)
    g_squared = sp.Symbol("g_squared", positive=True)
    g_value = sp.sqrt(sp.solve(sp.Eq(g_squared, sp.simplify((g * beta).norm())), g_squared)[0])
    gamma = sp.Matrix(pi) * g_value / norm_pi
    return pi, g_value, gamma, beta.subs(g, g_value)


def attention_coupling(chain: MeanFieldChain, gamma: np.ndarray, beta: np.ndarray) -> float:
    """h = γ^T (∂L/∂Φ at Φ = 0, M = γβ^T) γ: the attention block's off-diagonal scale, O(d²)."""
    G_Phi = chain.factored(gamma[:, None], np.zeros((1, 1)), beta[:, None]).G_Phi
    return float(gamma @ G_Phi @ gamma)


def condensation_coupling(chain: MeanFieldChain, g: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """h along the condensation orbit (γ = g π̂, attention zero; g of shape (T,), β (T, d)) in closed form: with
    A = 1 π^T, F = E β γ^T and s = π·γ, G_Φ = (E β)(π ⊙ (γ - s))^T, so

        h = γ^T G_Φ γ = (γ·E β)(Σ_j π_j γ_j² - s²),   E β = diag(π)(p·β - P β),  p = softmax(s β),

    O(d²) per point for P β, where ``attention_coupling`` forms the d × d attention (``tests`` compare them)."""
    pi = chain.pi
    norm = np.linalg.norm(pi)
    s = g * norm
    p = softmax(s[:, None] * beta, axis=1)
    E_beta = pi[None, :] * (np.sum(p * beta, axis=1, keepdims=True) - beta @ chain.P.T)  # (T, d): (E β)_i per point
    gamma_E_beta = (g / norm) * (E_beta @ pi)
    return gamma_E_beta * (g**2 * np.sum(pi**3) / norm**2 - s**2)


@dataclass(frozen=True)
class FocusOrbit:
    """The rank-one flow from (γ*, β*) along the unstable attention vector, started at amplitude ``delta``."""

    mu2: float
    h: float
    delta: float
    tau: np.ndarray  # the orbit's own clock, from 0
    query: int  # the query that focuses first (the most frequent token)
    entropy: np.ndarray  # (T,) its attention entropy along the orbit


def focus_orbit_start(chain: MeanFieldChain, delta: float) -> tuple[ReducedState, float]:
    """The condensed point (γ*, β*) with the unstable attention vector at amplitude δ (k = 1:
    q = δ/√2, r = -sign(h) δ/√2), and the coupling h."""
    gamma, beta = condensed_point(chain.pi)
    h = attention_coupling(chain, gamma, beta)
    u = delta / np.sqrt(2.0)
    return ReducedState(gamma[:, None], beta[:, None], np.array([[u]]), np.array([[-np.sign(h) * u]])), h


# the focus orbit's equations (2d + 2) from which it is integrated by RKC at RKC_RTOL instead of LSODA at rtol 1e-10:
# LSODA turns stiff as attention sharpens and then refreshes an exact Jacobian (2d + 2 Hessian-vector products,
# minutes at d = 1001) every few steps. RKC is second order; 1e-7 is the loosest tolerance that keeps the entropy's
# halfway fall within 1e-5 of LSODA's (rows print 4 digits); times in benchmarks/MEASUREMENTS.md
RKC_FROM_EQUATIONS, RKC_RTOL = 400, 1e-7


@functools.lru_cache(maxsize=16)
def focus_orbit(pi: tuple[float, ...], P: tuple[tuple[float, ...], ...], delta: float = 1e-10,
                tau_over_mu: float = 80.0) -> FocusOrbit:
    """Integrate the focus orbit for ``tau_over_mu`` / μ2 time units: log(1/δ)/μ2 of linear growth, then the
    nonlinear focus. The attention amplitude u splits as q = u/√2, r = -sign(h) u/√2 (k = 1 suffices:
    Φ depends on q and r only through q·r). Cost: 2d + 2 equations at O(d²) per evaluation; the entropy of
    the first query (Φ = φ γ γ^T is rank one) O(d) per saved time."""
    pi_arr, P_arr = np.asarray(pi), np.asarray(P)
    chain = MeanFieldChain(pi_arr, P_arr)
    start, h = focus_orbit_start(chain, delta)
    mu2 = abs(h)
    tau = np.concatenate([[0.0], np.geomspace(1e-3 / mu2, tau_over_mu / mu2, 3000)])
    if 2 * chain.d + 2 < RKC_FROM_EQUATIONS:
        solution = ReducedFlow(chain, k=1).solve(start, tau, rtol=1e-10, atol=1e-12 * delta)
    else:
        solution = ReducedFlow(chain, k=1).solve(start, tau, rtol=RKC_RTOL, atol=1e-12 * delta, method="RKC")
    query = int(np.argmax(pi_arr))
    entropy = []
    for y in solution.y.T:
        state = ReducedState.unpack(y, chain.d, 1)
        logits = (state.Gamma[query] @ state.Q.T @ state.R) @ state.Gamma.T + np.log(pi_arr)
        entropy.append(attention_entropy(softmax(logits)[None, :])[0])
    return FocusOrbit(mu2, h, delta, solution.t, query, np.array(entropy))


@dataclass(frozen=True)
class FocusPrediction:
    """Stage II for one initial point."""

    mu2: float
    h: float  # sign of the coupling: h < 0 means W_K = W_Q along the unstable vector
    gamma_star: np.ndarray
    beta_star: np.ndarray
    order: list[int]  # queries in the order of π (most frequent first)
    a_attn0: float  # initial amplitude of (W_Q, W_K) along the unstable vectors
    t_onset: dict[int, float]  # predicted focus onset of the first query (empty if the orbit does not focus it)
    t_shift: float  # real time = focus-orbit time + t_shift, for this initial point
    orbit: FocusOrbit


def predict_focus(chain: MeanFieldChain, params0, condensation: CondensationPrediction, k: int,
                  thresholds: StageThresholds | None = None) -> FocusPrediction:
    """The first query's focus onset: the linear growth along the condensation orbit matched to the focus orbit."""
    th = StageThresholds() if thresholds is None else thresholds
    pi = chain.pi
    orbit = focus_orbit(tuple(map(float, pi)), tuple(map(tuple, np.asarray(chain.P, dtype=float))))
    gamma_star, beta_star = condensed_point(pi)
    alpha = condensation.alpha
    xi = (np.asarray(params0["W_Q"]).T @ alpha - np.sign(orbit.h) * np.asarray(params0["W_K"]).T @ alpha) / np.sqrt(2.0)
    a_attn0 = float(np.linalg.norm(xi))
    stage_one = condensation.orbit
    rates = np.abs(condensation_coupling(chain, stage_one.gamma @ pi / np.linalg.norm(pi), stage_one.beta))
    growth = cumulative_trapezoid(rates, stage_one.t, initial=0.0)
    matched_at = stage_one.t[-1] + condensation.shift  # real time of the condensation orbit's end
    t_shift = matched_at + (np.log(orbit.delta) - np.log(a_attn0) - growth[-1]) / orbit.mu2
    order = [int(i) for i in np.argsort(-pi, kind="stable") if pi[i] > 0]
    first = order[0]
    if orbit.query != first:
        raise RuntimeError(f"the focus orbit reads query {orbit.query}, but the most frequent query is {first}")
    t_real = orbit.tau + t_shift
    keep = t_real > 0
    focused = [i for i in detect_focus_and_dilution(t_real[keep], orbit.entropy[keep], first, th) if i.stage == "focus"]
    t_onset = {first: focused[0].t_start} if focused else {}
    return FocusPrediction(orbit.mu2, orbit.h, gamma_star, beta_star, order, a_attn0, t_onset, float(t_shift), orbit)
