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

Focus onset: the amplitude grows as a(t) = a_attn(0) exp(∫ |h(s)| ds) along the
condensation orbit (h rises from 0 to -μ2 as M condenses), and the onset is when the
query's attention entropy at γ* falls halfway from H(π) to 0.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import sympy as sp
from scipy.integrate import cumulative_trapezoid
from scipy.optimize import brentq
from scipy.special import softmax

from flowsim.observables import attention_entropy
from theory.origin import CondensationPrediction
from theory.symbolic import MeanFieldTwin


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


def condensed_point(pi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(γ*, β*) evaluated for π (all entries > 0)."""
    pi = np.asarray(pi, dtype=float)
    if np.any(pi <= 0):
        raise ValueError(f"the condensed point needs π > 0 everywhere, got {pi}")
    symbols, _, gamma, beta = condensed_point_expressions(len(pi))
    values = dict(zip(symbols, pi))
    return (np.array([float(x.subs(values)) for x in gamma]), np.array([float(x.subs(values)) for x in beta]))


def attention_coupling(twin: MeanFieldTwin, gamma: np.ndarray, beta: np.ndarray) -> float:
    """h = γ^T (∂L/∂Φ at Φ = 0, M = γβ^T) γ: the attention block's off-diagonal scale."""
    G_Phi, _ = twin.gradient_of_maps(np.zeros((twin.d, twin.d)), np.outer(gamma, beta))
    return float(gamma @ G_Phi @ gamma)


def query_entropy(phi: float, gamma: np.ndarray, pi: np.ndarray, query: int) -> float:
    """Entropy of softmax(φ γ_query γ + log π), the query's attention at scale φ."""
    return float(attention_entropy(softmax(phi * gamma[query] * gamma + np.log(pi))))


@dataclass(frozen=True)
class FocusPrediction:
    """Stage II for one initial point."""

    mu2: float
    h: float  # sign of the coupling: h < 0 means W_K = W_Q along the unstable vector
    gamma_star: np.ndarray
    beta_star: np.ndarray
    order: list[int]  # queries in the order they focus (most frequent first)
    a_attn0: float  # initial amplitude of (W_Q, W_K) along the unstable vectors
    t_onset: dict[int, float]  # predicted focus onset per query, for the first query
    phi_half: float  # attention scale at which the first query's entropy is halved


def predict_focus(twin: MeanFieldTwin, params0, condensation: CondensationPrediction, k: int) -> FocusPrediction:
    """Focus onset of the first query: ∫|h| along the orbit reaches log(a_half / a_attn(0))."""
    pi = twin.pi
    gamma_star, beta_star = condensed_point(pi)
    h = attention_coupling(twin, gamma_star, beta_star)
    mu2 = abs(h)
    alpha = condensation.alpha
    xi = (np.asarray(params0["W_Q"]).T @ alpha - np.sign(h) * np.asarray(params0["W_K"]).T @ alpha) / np.sqrt(2.0)
    a_attn0 = float(np.linalg.norm(xi))
    order = [int(i) for i in np.argsort(-pi, kind="stable") if pi[i] > 0]
    first = order[0]
    h0 = query_entropy(0.0, gamma_star, pi, first)
    sign = -np.sign(h)
    phi_half = brentq(lambda phi: query_entropy(sign * phi, gamma_star, pi, first) - h0 / 2, 0.0, 1e3)
    log_growth_needed = np.log(np.sqrt(2.0 * phi_half) / a_attn0)
    orbit = condensation.orbit
    rates = np.array([abs(attention_coupling(twin, g, b)) for g, b in zip(orbit.gamma, orbit.beta)])
    growth = cumulative_trapezoid(rates, orbit.t, initial=0.0)
    if growth[-1] >= log_growth_needed:
        tau = float(np.interp(log_growth_needed, growth, orbit.t))
    else:
        tau = float(orbit.t[-1] + (log_growth_needed - growth[-1]) / mu2)
    return FocusPrediction(mu2, h, gamma_star, beta_star, order, a_attn0, {first: tau + condensation.shift}, phi_half)
