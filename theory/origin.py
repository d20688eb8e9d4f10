"""Stage I: the linearisation at θ = 0 and the predicted end of condensation.

At θ = 0 attention is uniform over the context's type frequencies and the logits
vanish, so the only first-order term of the loss is tr(G_0^T W0 W1) with

    G_0 = ∂L/∂M |_0 = π (u - π)^T          (u the uniform vector; derived below).

Per column c of W0 and row c of W1 the Hessian is the 2d x 2d block [[0, G_0], [G_0^T, 0]],
with eigenvalues ±‖π‖‖π - u‖ = ±μ1 and 0 (2d - 2 times); W_Q, W_K enter at third order.
The unstable directions are W0 = π̂ α^T, W1 = α (π - u)^^T for any unit α in R^m.

Condensation: the initial point's amplitude a0 along the unstable subspace grows like
a0 e^{μ1 t} until the heteroclinic orbit from 0 to the condensed critical point bends
it over. Matching the linear phase to that orbit gives

    t_c = (1/μ1) log(C / a0) = log(1/ε)/μ1 + log(C / κ)/μ1,   a0 = κ ε,

with C a property of the chain (the orbit's clock offset) and κ of the seed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import sympy as sp
from scipy.integrate import solve_ivp
from scipy.special import logsumexp, softmax

from flowsim.config import ConfigError
from flowsim.observe.stages import StageThresholds, detect_condensation
from theory.mean_field import origin_rate
from theory.symbolic import row_loss


@functools.lru_cache(maxsize=None)
def origin_gradient(d: int) -> sp.Matrix:
    """G_0 = ∂L/∂M at θ = 0 in terms of π, derived from the row loss.

    ∂ℓ/∂M at (φ, M) = 0 is affine in the next-token law p; averaging over queries with
    weights π_i replaces p by π^T P = π (stationarity) and Σπ = 1.
    """
    row = row_loss(d)
    at_zero = {v: 0 for v in row.variables}
    pi = sp.Matrix(row.pi)
    G = sp.Matrix(d, d, lambda j, y: row.gradient[d + d * j + y].subs(at_zero))
    G = G.subs(dict(zip(row.p, row.pi)))
    return G.subs(row.pi[-1], 1 - sum(pi[:-1])).applyfunc(sp.factor)


@functools.lru_cache(maxsize=None)
def origin_block_spectrum(d: int) -> dict[sp.Expr, int]:
    """Eigenvalues (with multiplicities) of the per-column Hessian block [[0, G_0], [G_0^T, 0]]."""
    G = origin_gradient(d)
    block = sp.BlockMatrix([[sp.zeros(d), G], [G.T, sp.zeros(d)]]).as_explicit()
    x = sp.Symbol("x")
    polynomial = sp.factor(block.charpoly(x).as_expr())
    roots = sp.roots(sp.Poly(polynomial, x))
    return {sp.simplify(root): multiplicity for root, multiplicity in roots.items()}


@functools.lru_cache(maxsize=None)
def mu1_expression(d: int) -> sp.Expr:
    """μ1, the positive eigenvalue of the origin block, as an expression in π0..π_{d-2}."""
    nonzero = {sp.factor(sp.expand(root**2)) for root in origin_block_spectrum(d) if root != 0}
    if len(nonzero) != 1:
        raise RuntimeError(f"expected one pair ±μ1 of non-zero eigenvalues at the origin, got {nonzero}")
    return sp.sqrt(nonzero.pop())


def _at(pi: np.ndarray) -> dict:
    """Values of the free symbols π0..π_{d-2} (π_{d-1} = 1 - their sum)."""
    return dict(zip(row_loss(len(pi)).pi[:-1], np.asarray(pi, dtype=float)[:-1]))


def mu1(pi: np.ndarray) -> float:
    """μ1 = ‖π‖ ‖π - u‖ for any d, O(d): the closed form ``mu1_expression`` derives (checked there for d <= 5)."""
    return origin_rate(pi)


def origin_hessian_spectrum(pi: np.ndarray, m: int, k: int) -> np.ndarray:
    """All eigenvalues of ∂²L/∂θ² at θ = 0 for an (m, k) model, sorted: ±μ1 m times each, 0 otherwise."""
    values = []
    for root, multiplicity in origin_block_spectrum(len(pi)).items():
        values += [float(root.subs(_at(pi)))] * (multiplicity * m)
    values += [0.0] * (2 * m * k)
    return np.sort(np.array(values))


def unstable_directions(pi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unit vectors (π̂, (π - u)^) along which W0's columns and W1's rows grow."""
    pi = np.asarray(pi, dtype=float)
    w1 = pi - 1.0 / len(pi)
    return pi / np.linalg.norm(pi), w1 / np.linalg.norm(w1)


def unstable_projection(params, pi: np.ndarray) -> tuple[float, np.ndarray]:
    """(a0, α): the amplitude of ``params`` along the unstable subspace and its direction in R^m.

    The unit unstable vectors are (π̂ e_c^T, e_c w^T)/√2, so the coordinates are
    y_c = (π̂·W0[:, c] + w·W1[c, :])/√2; a0 = ‖y‖ and α = y/‖y‖.
    """
    w0, w1 = unstable_directions(pi)
    y = (np.asarray(params["W0"]).T @ w0 + np.asarray(params["W1"]) @ w1) / np.sqrt(2.0)
    a0 = float(np.linalg.norm(y))
    if a0 == 0:
        raise ValueError("the initial point has no component along the unstable directions at the origin")
    return a0, y / a0


@dataclass(frozen=True)
class CondensationOrbit:
    """The heteroclinic orbit from 0 along the unstable direction, started at amplitude ``delta``."""

    mu1: float
    delta: float
    t: np.ndarray
    sigma0: np.ndarray  # σ0(W0) = ‖γ‖ along the orbit
    gamma: np.ndarray
    beta: np.ndarray


class CondensationFlow:
    """The rank-one flow with attention zero (Q = R = 0, which it keeps) in its d + 1 coordinates (g, β).

    With Φ = 0 every query attends with the weights π, so Z = 1 (π·γ) β^T: every row has the logits s β,
    s = π·γ, and L = lse(s β) - π̄·(s β), π̄ = P^T π. Then G_M β = π (e·β) and G_M^T γ = s e with
    e = softmax(s β) - π̄, so dγ/dt = -G_M β stays along π: γ = g π̂, s = g ‖π‖, and

        dg/dt = -‖π‖ e·β,    dβ/dt = -s e,

    the gradient flow of L(g, β). Exact on the orbit from the unstable direction (γ ∥ π̂), O(d) per
    evaluation and O(d²) per Jacobian, where the rank-one flow in (γ, β, q, r) costs O(d²) and O(d³)."""

    def __init__(self, pi: np.ndarray, P: np.ndarray):
        pi = np.asarray(pi, dtype=float)
        self.norm, self.pi_bar = float(np.linalg.norm(pi)), np.asarray(P, dtype=float).T @ pi

    def _parts(self, y: np.ndarray):
        g, beta = y[0], y[1:]
        s = g * self.norm
        p = softmax(s * beta)
        return g, beta, s, p, p - self.pi_bar

    def loss(self, y: np.ndarray) -> float:
        g, beta, s, p, e = self._parts(y)
        return float(logsumexp(s * beta) - self.pi_bar @ (s * beta))

    def field(self, t: float, y: np.ndarray) -> np.ndarray:
        g, beta, s, p, e = self._parts(y)
        return -np.concatenate([[self.norm * (e @ beta)], s * e])

    def jacobian(self, t: float, y: np.ndarray) -> np.ndarray:
        """Minus the Hessian of L(g, β), with S = diag(p) - p p^T the softmax's Jacobian."""
        g, beta, s, p, e = self._parts(y)
        S_beta = p * beta - p * (p @ beta)
        cross = self.norm * (e + s * S_beta)
        top = np.concatenate([[self.norm**2 * (beta @ S_beta)], cross])
        block = s * s * (np.diag(p) - np.outer(p, p))
        return -np.vstack([top, np.column_stack([cross, block])])


@functools.lru_cache(maxsize=16)
def condensation_orbit(pi: tuple[float, ...], P: tuple[tuple[float, ...], ...], delta: float = 1e-7,
                       t_max_over_mu: float = 60.0) -> CondensationOrbit:
    """Integrate the flow with attention zero (``CondensationFlow``) from δ times the unit unstable vector,
    (γ, β) = δ (π̂, (π - u)^)/√2, by LSODA with its exact Jacobian: O(d) per evaluation."""
    pi_arr = np.asarray(pi, dtype=float)
    rate = mu1(pi_arr)
    w0, w1 = unstable_directions(pi_arr)
    flow = CondensationFlow(pi_arr, np.asarray(P))
    t = np.concatenate([[0.0], np.geomspace(1e-3, t_max_over_mu / rate, 4000)])
    y0 = np.concatenate([[delta / np.sqrt(2)], delta * w1 / np.sqrt(2)])
    solution = solve_ivp(flow.field, (0.0, t[-1]), y0, method="LSODA", t_eval=t, rtol=1e-11, atol=1e-9 * delta,
                         jac=flow.jacobian)
    if solution.status != 0:
        raise RuntimeError(f"the condensation orbit failed: {solution.message}")
    g, beta = solution.y[0], solution.y[1:].T
    return CondensationOrbit(rate, delta, solution.t, np.abs(g), np.outer(g, w0), beta)


@dataclass(frozen=True)
class CondensationPrediction:
    """Stage I's prediction of the end of condensation for one initial point."""

    mu1: float
    a0: float  # amplitude of θ(0) along the unstable subspace
    alpha: np.ndarray  # its direction in R^m
    t_end: float  # predicted time σ0(W0) reaches condensation_level × its condensed scale
    leading_order: float  # log(1/ε)/μ1
    correction: float  # t_end - leading_order = log(C/κ)/μ1
    condensed_scale: float  # ‖γ‖ at the end of the orbit
    orbit: CondensationOrbit
    shift: float  # real time = orbit time + shift, for this initial point


def predict_condensation(pi: np.ndarray, P: np.ndarray, params0, eps: float,
                         thresholds: StageThresholds | None = None) -> CondensationPrediction:
    """t_c = (1/μ1) log(C/a0): the orbit's detected end of condensation, shifted to amplitude a0."""
    th = StageThresholds() if thresholds is None else thresholds
    orbit = condensation_orbit(tuple(map(float, pi)), tuple(map(tuple, np.asarray(P, dtype=float))))
    a0, alpha = unstable_projection(params0, pi)
    shift = np.log(orbit.delta / a0) / orbit.mu1  # real time = orbit time + shift
    t_real = orbit.t + shift
    keep = t_real > 0
    interval = detect_condensation(t_real[keep], orbit.sigma0[keep], th)
    if interval is None and shift < 0:  # θ(0) lies further along the orbit than its start: past its first part
        raise ConfigError(f"the start is beyond the small start the predictions describe (amplitude a0 = {a0:.3g} along "
                          f"the origin's unstable directions, ε = {eps:g}, past the condensation orbit's start at "
                          f"{orbit.delta:.3g}): lower init.eps")
    if interval is None:
        raise RuntimeError("the condensation orbit does not condense; is the chain degenerate?")
    if interval.t_end is None:  # σ0 still creeps up at the orbit's end (60/μ1, no attention): its last value is the scale
        level = th.condensation_level * float(orbit.sigma0[keep][-1])
        interval = replace(interval, t_end=float(10 ** np.interp(level, orbit.sigma0[keep], np.log10(t_real[keep]))))
    leading = np.log(1.0 / eps) / orbit.mu1
    return CondensationPrediction(
        mu1=orbit.mu1, a0=a0, alpha=alpha, t_end=interval.t_end, leading_order=leading,
        correction=interval.t_end - leading,
        condensed_scale=float(orbit.sigma0[-1]), orbit=orbit, shift=shift,
    )
