"""Stage III: the reduced flow on the invariant rank-r manifolds (r = 1: the rank-one one).

For an m x r matrix A with orthonormal columns (r = 1: a unit vector α) the set

    W0 = Γ A^T,   W1 = A B^T,   W_Q = A Q^T,   W_K = A R^T     (Γ, B: d x r;  Q, R: k x r)

is invariant under the gradient flow: there Φ = Γ Q^T R Γ^T and M = Γ B^T, and every
parameter gradient stays in the set. The flow on it is the gradient flow of
ℓ(Γ, B, Q, R) = L(Φ, M) in these coordinates; for r = 1 (Γ = γ, B = β, Q = q, R = r)

    dγ/dt = -(φ (G_Φ + G_Φ^T) γ + G_M β),   dβ/dt = -G_M^T γ,
    dq/dt = -(γ^T G_Φ γ) r,                 dr/dt = -(γ^T G_Φ γ) q,      φ = q·r,

2d + 2k equations that carry condensation (q = r = 0) and focus. ``reduced_gradient_formulas``
derives these gradients with sympy for any r.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
import sympy as sp
from scipy.integrate import solve_ivp

from flowsim.model.chains import MarkovChain
from flowsim.model.flow import GradientFlow
from flowsim.model.losses import make_loss_function
from flowsim.model.models import OneLayerTransformer
from flowsim.solve.rkc import RKC, power_iteration
from flowsim.solve.solvers import solve_flow
from theory.mean_field import FactoredGradients, MeanFieldChain

BLOCKS = ("Gamma", "B", "Q", "R")  # the coordinate blocks of a rank-r manifold point, in packing order


@functools.lru_cache(maxsize=None)
def reduced_gradient_formulas(d: int, k: int, rank: int) -> tuple[tuple[sp.Matrix, ...], dict[str, sp.Matrix]]:
    """∂ℓ/∂(Γ, B, Q, R) from dℓ = tr(G_Φ^T dΦ) + tr(G_M^T dM), Φ = Γ Q^T R Γ^T, M = Γ B^T.

    Returns the symbols (Γ, B, Q, R, G_Φ, G_M) and the four gradients (as matrices).
    """
    def matrix(name: str, rows: int, cols: int) -> sp.Matrix:
        return sp.Matrix(rows, cols, lambda i, j: sp.Symbol(f"{name}{i}_{j}", real=True))

    Gamma, B, Q, R = matrix("Gamma", d, rank), matrix("B", d, rank), matrix("Q", k, rank), matrix("R", k, rank)
    G_Phi, G_M = matrix("GPhi", d, d), matrix("GM", d, d)
    Phi, M = Gamma * Q.T * R * Gamma.T, Gamma * B.T
    first_order = sp.Add(*G_Phi.multiply_elementwise(Phi)) + sp.Add(*G_M.multiply_elementwise(M))
    gradients = {name: X.applyfunc(lambda x: sp.diff(first_order, x))
                 for name, X in zip(BLOCKS, (Gamma, B, Q, R))}
    return (Gamma, B, Q, R, G_Phi, G_M), gradients


@dataclass(frozen=True)
class ReducedState:
    """A point of a rank-r manifold in its coordinates (each block has r columns)."""

    Gamma: np.ndarray  # d x r
    B: np.ndarray  # d x r
    Q: np.ndarray  # k x r
    R: np.ndarray  # k x r

    def pack(self) -> np.ndarray:
        return np.concatenate([self.Gamma.ravel(), self.B.ravel(), self.Q.ravel(), self.R.ravel()])

    @staticmethod
    def unpack(y: np.ndarray, d: int, k: int) -> "ReducedState":
        rank = len(y) // (2 * d + 2 * k)
        sizes = np.cumsum([d * rank, d * rank, k * rank])
        Gamma, B, Q, R = np.split(np.asarray(y, dtype=float), sizes)
        return ReducedState(Gamma.reshape(d, rank), B.reshape(d, rank), Q.reshape(k, rank), R.reshape(k, rank))


def embed(state: ReducedState, A: np.ndarray) -> dict[str, np.ndarray]:
    """The full parameters W0 = ΓA^T, W1 = AB^T, W_Q = AQ^T, W_K = AR^T."""
    A = np.asarray(A, dtype=float).reshape(-1, state.Gamma.shape[1])
    return {"W0": state.Gamma @ A.T, "W1": A @ state.B.T, "W_Q": A @ state.Q.T, "W_K": A @ state.R.T}


def project(params, A: np.ndarray) -> ReducedState:
    """The orthogonal projection of full parameters onto the manifold of A (orthonormal columns)."""
    A = np.asarray(A, dtype=float)
    A = A.reshape(-1, 1) if A.ndim == 1 else A
    return ReducedState(np.asarray(params["W0"]) @ A, np.asarray(params["W1"]).T @ A,
                        np.asarray(params["W_Q"]).T @ A, np.asarray(params["W_K"]).T @ A)


JACOBIAN_CHUNK_FLOATS = 2e7  # Hessian columns are computed in chunks whose d x d intermediates hold about this many floats


class CompiledReducedFlow(NamedTuple):
    """ℓ's negative gradient and its Jacobian (minus the Hessian) on the packed coordinates, compiled once
    per (d, k, rank); each takes (y, π, log π, P)."""

    field: Callable
    jacobian: Callable


def _reduced_loss(y: jax.Array, pi: jax.Array, log_pi: jax.Array, P: jax.Array, d: int, k: int, rank: int) -> jax.Array:
    """ℓ(Γ, B, Q, R) = L(Γ Q^T R Γ^T, Γ B^T) on the factored maps, O(d² r)."""
    sizes = np.cumsum([d * rank, d * rank, k * rank])
    Gamma, B, Q, R = jnp.split(y, sizes)
    Gamma, B, Q, R = Gamma.reshape(d, rank), B.reshape(d, rank), Q.reshape(k, rank), R.reshape(k, rank)
    A = jax.nn.softmax((Gamma @ (Q.T @ R)) @ Gamma.T + log_pi[None, :], axis=1)
    Z = (A @ Gamma) @ B.T
    return pi @ (jax.nn.logsumexp(Z, axis=1) - jnp.sum(P * Z, axis=1))


@functools.lru_cache(maxsize=None)
def compiled_reduced_flow(d: int, k: int, rank: int) -> CompiledReducedFlow:
    """-∇ℓ (O(d² r) per call) and -∇²ℓ by forward-over-reverse products in chunks (O(d² r n), n = (2d + 2k) r)."""
    n = (2 * d + 2 * k) * rank
    chunk = int(max(1, min(n, JACOBIAN_CHUNK_FLOATS // (d * d))))
    padded = -(-n // chunk) * chunk

    def gradient(y, pi, log_pi, P):
        return jax.grad(_reduced_loss)(y, pi, log_pi, P, d, k, rank)

    def hessian(y, pi, log_pi, P):
        def columns(V):
            return jax.vmap(lambda v: jax.jvp(lambda x: gradient(x, pi, log_pi, P), (y,), (v,))[1])(V)
        basis = jnp.eye(padded, n).reshape(padded // chunk, chunk, n)
        return jax.lax.map(columns, basis).reshape(padded, n)[:n]

    return CompiledReducedFlow(jax.jit(lambda *a: -gradient(*a)), jax.jit(lambda *a: -hessian(*a)))


class ParametersOnly(GradientFlow):
    """A gradient flow whose solves save its parameters only: the loss along the saved points, which ``solve_flow``
    evaluates for its trajectory (a d x d softmax per point: at d = 1001 a third of the reduced tier's time), is
    not (NaN)."""

    def loss_along(self, thetas: np.ndarray) -> np.ndarray:
        return np.full(len(np.asarray(thetas).reshape(-1, self.size)), np.nan)


class FlowTurnedStiff(Exception):
    """LSODA asked for a Jacobian (``ReducedFlow.solve(..., until_stiff=True)``): the flow has turned stiff."""


class ReducedFlow:
    """The gradient flow of ℓ(Γ, B, Q, R) for one chain. With G = ∂L/∂Φ, ∂L/∂M at the maps,

        ∂ℓ/∂Γ = G_Φ Γ R^T Q + G_Φ^T Γ Q^T R + G_M B,   ∂ℓ/∂B = G_M^T Γ,
        ∂ℓ/∂Q = R Γ^T G_Φ^T Γ,                        ∂ℓ/∂R = Q Γ^T G_Φ Γ,

    evaluated in closed form on the factored maps (``MeanFieldChain.factored``): O(d² r) per
    evaluation; ``reduced_gradient_formulas`` derives the same with sympy and is its check. The
    integrator uses the same field compiled with JAX, and its exact Jacobian (``compiled_reduced_flow``):
    the flow is stiff once attention sharpens."""

    def __init__(self, chain: MeanFieldChain, k: int, rank: int = 1):
        self.chain, self.d, self.k, self.rank = chain, chain.d, k, rank
        self._arrays = tuple(jnp.asarray(x) for x in (chain.pi, chain.log_pi, chain.P))

    def maps(self, state: ReducedState) -> tuple[np.ndarray, np.ndarray]:
        """(Φ, M) formed, O(d² r): for checks and small d."""
        return state.Gamma @ state.Q.T @ state.R @ state.Gamma.T, state.Gamma @ state.B.T

    def gradients_of_maps(self, state: ReducedState) -> FactoredGradients:
        """G_Φ and G_M (factored) at ``state``, O(d² r)."""
        return self.chain.factored(state.Gamma, state.Q.T @ state.R, state.B)

    def loss(self, state: ReducedState) -> float:
        return self.gradients_of_maps(state).loss

    def gradient(self, state: ReducedState, G: FactoredGradients | None = None) -> ReducedState:
        """∂ℓ/∂(Γ, B, Q, R) at ``state``, O(d² r) (the gradients of the maps there, ``G``, are formed unless given)."""
        G = self.gradients_of_maps(state) if G is None else G
        Gamma, B, Q, R = state.Gamma, state.B, state.Q, state.R
        phi_gamma, phi_t_gamma = G.G_Phi @ Gamma, G.G_Phi.T @ Gamma
        return ReducedState(phi_gamma @ R.T @ Q + phi_t_gamma @ Q.T @ R + G.G_M_times(B), G.G_M_transpose_times(Gamma),
                            R @ (Gamma.T @ phi_t_gamma), Q @ (Gamma.T @ phi_gamma))

    def vector_field(self, t: float, y: np.ndarray) -> np.ndarray:
        return -self.gradient(ReducedState.unpack(y, self.d, self.k)).pack()

    def spectral_radius(self, state: ReducedState) -> float:
        """ρ, the largest |eigenvalue| of the field's Jacobian (the Hessian's largest) at ``state``: a power
        iteration of ``flowsim.solve.rkc.POWER_ITERATIONS`` Hessian-vector products (forward differences of the field),
        O(d² r) each (from below)."""
        y = state.pack()
        compiled = compiled_reduced_flow(self.d, self.k, len(y) // (2 * self.d + 2 * self.k))
        start = np.random.default_rng(0).standard_normal(len(y))
        return float(np.linalg.norm(power_iteration(compiled.field)(y, compiled.field(y, *self._arrays), start, self._arrays)[1]))

    @functools.cached_property
    def exact_flow(self) -> GradientFlow:
        """The rank-r flow as flowsim's exact flow of the one-layer model with m = r: on the manifold of A the loss is
        ℓ(Γ, B, Q, R) = L(W0 = Γ, W1 = B^T, W_Q = Q^T, W_K = R^T) of that model, and A's orthonormal columns make the
        metric Euclidean, so the two gradient flows are one (``to_model``)."""
        model = OneLayerTransformer(d=self.d, m=self.rank, k=self.k)
        chain = MarkovChain(P=self.chain.P, pi=self.chain.pi)
        return ParametersOnly(make_loss_function(model, chain, "mean_field"), self.to_model(np.zeros(self.size)))

    @property
    def size(self) -> int:
        return (2 * self.d + 2 * self.k) * self.rank

    def to_model(self, y: np.ndarray) -> dict[str, np.ndarray]:
        """The m = r model's parameters at the packed coordinates y: W0 = Γ, W1 = B^T, W_Q = Q^T, W_K = R^T."""
        state = ReducedState.unpack(y, self.d, self.k)
        return {"W0": state.Gamma, "W1": state.B.T, "W_Q": state.Q.T, "W_K": state.R.T}

    def from_model(self, params: dict[str, np.ndarray]) -> np.ndarray:
        """``to_model``'s inverse, on a leading time axis: (T, n) packed coordinates."""
        parts = [np.asarray(params["W0"]), np.swapaxes(params["W1"], 1, 2), np.swapaxes(params["W_Q"], 1, 2),
                 np.swapaxes(params["W_K"], 1, 2)]
        return np.concatenate([part.reshape(len(part), -1) for part in parts], axis=1)

    def solve(self, state0: ReducedState, t_eval: np.ndarray, *, t_start: float = 0.0,
              rtol: float = 1e-10, atol: float = 1e-14, method: str = "LSODA", until_stiff: bool = False):
        """Integrate from ``state0`` at ``t_start``; the scipy result (dense output on).

        ``method``: "LSODA" with the exact Jacobian (n Hessian-vector products, O(d² r n), per refresh: for
        small n and tight tolerances), "FLOW" (``solve_flow``'s default stiff method on ``exact_flow``, compiled once
        per shape, its dense output a C¹ piecewise cubic through saved points: for large n), or "RKC"
        (``flowsim.solve.rkc``: field evaluations only, O(d² r) each, about √(h ρ) per step). ``until_stiff``:
        LSODA raises ``FlowTurnedStiff`` where it would first need the Jacobian instead of forming it."""
        t_eval = np.asarray(t_eval, dtype=float)
        y0 = state0.pack()
        compiled = compiled_reduced_flow(self.d, self.k, len(y0) // (2 * self.d + 2 * self.k))
        span = (t_start, float(t_eval[-1]))
        if method == "FLOW":
            solution = self._solve_exact(y0, t_eval, t_start, rtol, atol)
        elif method == "RKC":
            solution = solve_ivp(None, span, y0, method=RKC, field=compiled.field, field_args=self._arrays, t_eval=t_eval,
                                 rtol=rtol, atol=atol, dense_output=True)
        elif method == "LSODA":
            solution = solve_ivp(lambda t, y: np.asarray(compiled.field(y, *self._arrays)), span, y0,
                                 method="LSODA", t_eval=t_eval, rtol=rtol, atol=atol, dense_output=True,
                                 jac=stiff_signal if until_stiff else lambda t, y: np.asarray(
                                     compiled.jacobian(y, *self._arrays)))
        else:
            raise ValueError(f"method = {method!r} is not one of 'LSODA', 'FLOW', 'RKC'")
        if solution.status != 0:
            reached = solution.t[-1] if len(solution.t) else t_start
            size = np.linalg.norm(solution.y[:, -1]) if solution.y.size else np.linalg.norm(y0)
            raise RuntimeError(f"the rank-{len(y0) // (2 * self.d + 2 * self.k)} reduced flow failed at t ≈ {reached:.6g}, "
                               f"where its coordinates have norm {size:.4g}: {solution.message}")
        return solution

    def _solve_exact(self, y0: np.ndarray, t_eval: np.ndarray, t_start: float, rtol: float, atol: float) -> "FlowSolution":
        """``solve``'s "FLOW": ``exact_flow`` saved at ``t_eval``, at FLOW_SAVES evenly spaced times and at as many
        log-spaced ones from FLOW_FIRST_SAVE × the span on (saving adds no step), its dense output a C¹ piecewise
        cubic through them (``LocalCubic``). Where its error estimate (``interpolation_error``) is above ``rtol`` the
        call is solved again with those intervals split evenly, as many times as its h³ error needs (FLOW_REFINEMENTS
        times at most: a sharp front first met between two saved points is only seen once a refinement brackets it)."""
        if len(y0) != self.size:
            raise ValueError(f"a rank-{self.rank} flow needs {self.size} coordinates, got {len(y0)}")
        if not t_eval[-1] > t_start:
            raise ValueError(f"the save times must end after t_start = {t_start:g}, got a last one of {t_eval[-1]:g}")
        length = t_eval[-1] - t_start
        saved = apart(np.concatenate([np.linspace(t_start, t_eval[-1], FLOW_SAVES), t_eval[t_eval > t_start],
                                      t_start + np.geomspace(FLOW_FIRST_SAVE * length, length, FLOW_SAVES)]), t_eval)
        for attempt in range(FLOW_REFINEMENTS + 1):
            result = solve_flow(self.exact_flow, self.to_model(y0), saved - t_start, rtol=rtol, atol=atol)
            y = self.from_model(result.trajectory.params)
            if not result.success:
                return FlowSolution(np.array([t_start + float(result.trajectory.t[-1])]), y[-1:].T, None, 1, result.message)
            error = self.interpolation_error(saved, y)
            if attempt == FLOW_REFINEMENTS or error.max() <= rtol:
                break
            splits = np.ceil(np.maximum(error / rtol, 1.0) ** (1 / 3)).astype(int)
            saved = apart(np.concatenate([np.linspace(a, b, n + 1) for a, b, n in zip(saved[:-1], saved[1:], splits)]), t_eval)
        dense = LocalCubic(saved, y)
        return FlowSolution(t_eval, np.stack([dense(t) for t in t_eval], axis=1), dense, 0, result.message)

    def interpolation_error(self, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Per interval of t, an estimate of ``LocalCubic``'s error through (t, y): the one through every other point
        misses the points left out by about 2³ times the full one's error there (its step is twice as long), each
        block (Γ, B, Q, R) measured against its largest norm along y. O(T n)."""
        error = np.zeros(len(t) - 1)
        if len(t) < 5:
            return error
        kept = np.union1d(np.arange(0, len(t), 2), [len(t) - 1])
        left_out = np.arange(1, len(t) - 1, 2)
        coarse = LocalCubic(t[kept], y[kept])
        missed = np.abs(np.stack([coarse(x) for x in t[left_out]]) - y[left_out]) / 8
        sizes = np.cumsum([self.d * self.rank, self.d * self.rank, self.k * self.rank])
        scales = [max(np.linalg.norm(block, axis=1).max(), np.finfo(float).tiny) for block in np.split(y, sizes, axis=1)]
        at = np.max([part.max(axis=1) / scale for part, scale in zip(np.split(missed, sizes, axis=1), scales)], axis=0)
        error[left_out - 1] = at  # a left-out point j lies between intervals j - 1 and j
        error[left_out] = np.maximum(error[left_out], at)
        return error


# the exact flow's saved points per ``ReducedFlow.solve`` call ("FLOW"), evenly spaced and as many log-spaced from
# FLOW_FIRST_SAVE × the call's span, refined where the error estimate of their interpolation is above the call's rtol (its error
# against LSODA's dense output, and how often a call is solved again: benchmarks/MEASUREMENTS.md)
FLOW_SAVES, FLOW_FIRST_SAVE, FLOW_REFINEMENTS, FLOW_SAVE_GAP = 129, 1e-7, 3, 1e-9


def apart(times: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The sorted times with those closer than FLOW_SAVE_GAP × their range to a kept neighbour dropped (``keep``'s
    stay): near-equal nodes would make the interpolating cubic's weights cancel."""
    times, asked = np.unique(times), set(np.asarray(keep).tolist())
    gap = FLOW_SAVE_GAP * (times[-1] - times[0])
    kept = [times[0]]
    for t in times[1:]:
        if t - kept[-1] > gap:
            kept.append(t)
        elif t in asked and len(kept) > 1:  # a time asked for replaces the near one before it (never the start)
            kept[-1] = t
    return np.array(kept)


class LocalCubic:
    """A C¹ piecewise cubic through saved points: on each interval the cubic Hermite whose slopes at its two ends are
    those of the parabola through each end and its two neighbours (one-sided at the first and last point). O(h³)
    accurate; it keeps only the saved points (a global spline would keep four times as much), and its slope is
    continuous, so an adaptive integrator reading it (the transverse equation) is not stopped at every point.
    O(n) per call."""

    def __init__(self, t: np.ndarray, y: np.ndarray):
        self.t, self.y = np.asarray(t, dtype=float), np.asarray(y, dtype=float)
        self.t_min, self.t_max = float(self.t[0]), float(self.t[-1])  # as scipy's OdeSolution names its span

    def slope(self, i: int) -> np.ndarray:
        """dy/dt at point i from the parabola through i and its two neighbours (or the two nearest, at an end)."""
        if len(self.t) == 2:
            return (self.y[1] - self.y[0]) / (self.t[1] - self.t[0])
        centre = int(np.clip(i, 1, len(self.t) - 2))
        (a, b, c), x = self.t[centre - 1:centre + 2], self.t[i]
        weights = ((2 * x - b - c) / ((a - b) * (a - c)), (2 * x - a - c) / ((b - a) * (b - c)),
                   (2 * x - a - b) / ((c - a) * (c - b)))
        return weights[0] * self.y[centre - 1] + weights[1] * self.y[centre] + weights[2] * self.y[centre + 1]

    def __call__(self, x: float) -> np.ndarray:
        i = int(np.clip(np.searchsorted(self.t, x) - 1, 0, len(self.t) - 2))
        h = self.t[i + 1] - self.t[i]
        s = (x - self.t[i]) / h
        return ((2 * s**3 - 3 * s**2 + 1) * self.y[i] + h * (s**3 - 2 * s**2 + s) * self.slope(i)
                + (-2 * s**3 + 3 * s**2) * self.y[i + 1] + h * (s**3 - s**2) * self.slope(i + 1))


@dataclass(frozen=True)
class FlowSolution:
    """``ReducedFlow.solve``'s result by "FLOW", in the shape of scipy's: t, y (n × len(t)), sol (the dense output,
    None where the solve failed), status (0: reached t[-1]) and message."""

    t: np.ndarray
    y: np.ndarray
    sol: Callable | None
    status: int
    message: str


def stiff_signal(t: float, y: np.ndarray) -> NoReturn:
    """LSODA's Jacobian where it must not be formed (at d = 1001, rank 1, one costs 2064 Hessian-vector products)."""
    raise FlowTurnedStiff(f"LSODA switched to its stiff method at t = {t:.6g}")
