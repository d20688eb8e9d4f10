"""The instability transverse to a rank-r manifold: its Hessian block, the degenerate point, and μ_δ(δ).

**The transverse block.** At a point of the rank-r manifold (``theory.manifold``)
W0 = Γ A^T, W1 = A B^T, W_Q = A Q^T, W_K = A R^T, move the parameters off it along a unit
vector a ⊥ span(A):  W0 += ε u a^T, W1 += ε a w^T, W_Q += ε a x^T, W_K += ε a y^T. Then

    ΔΦ = ε² (Γ Q^T y u^T + u x^T R Γ^T) + O(ε⁴),    ΔM = ε² u w^T,

so Φ and M do not move at first order, the Gauss-Newton part of the Hessian vanishes there, and
L changes by ε² u^T C (w, x, y) with

    C = [ G_M | G_Φ Γ R^T | G_Φ^T Γ Q^T ]        (d × (d + 2k); G = ∂L/∂Φ, ∂L/∂M at the point).

The Hessian on z = (u, w, x, y) is H_T = [[0, C], [C^T, 0]], with eigenvalues ±σ_i(C), the same for
each of the m - r unit vectors a ⊥ span(A). The reflection a → -a fixes the manifold, so the Hessian
has no block between these directions and the manifold's: to first order the transverse part Z of a
perturbation (one column per a) evolves on its own, dZ/dt = -H_T Z, at any point of the manifold,
critical or not. At a critical point the fastest transverse growth rate is μ = σ_max(C), along
(ā, -b̄)/√2 with C b̄ = μ ā (ā, b̄ the top singular vectors). ``transverse_block_expression`` derives
H_T with sympy; tests check ``transverse_coupling`` against it and against flowsim's autodiff Hessian.

**The degenerate point.** Where C = 0 the whole transverse space, (m - r)(2d + 2k) dimensions, is
in the kernel of the Hessian (besides the manifold's own gauge directions) and nothing opens a new
direction: the rank-one flow of symmetric rare tokens (π = (0.7, 0.1, 0.1, 0.1)) settles where
G_M = 0 and G_Φ γ = G_Φ^T γ = 0.

**The settled point.** On the rank-one manifold (k = 1 suffices: Φ depends on q and r through q·r)
the loss depends on (γ, φ) only through the d numbers s_i = Σ_j A_ij γ_j, since Z_i = s_i β^T: the
rank-one critical points form a curve, not a point, and C varies along it. The point the flow
settles on is the end of the *focus orbit* (``theory.focus``), the unstable manifold of the condensed
point that every small start follows: ``settled_by_integration`` integrates it.

**Lyapunov-Schmidt.** For a family of chains π(δ) through a degenerate point, reduce onto the
kernel: the range equations are solved by the settled point θ*(δ) (the manifold is invariant, so the
kernel coordinate 0 always solves them), and since the tangent-transverse block vanishes there is no
Schur correction: the reduced function's Hessian at 0 is exactly H_T(θ*(δ)). Hence

    μ(δ) = σ_max(C(θ*(δ), δ))      over the whole range of δ (``transverse_rate_curve``),
    μ(δ) = c1 δ + O(δ²),  c1 = σ_max(dC/dδ |_0),   dθ*/dδ = -F_θ^+ F_δ + (a multiple of n),

by the implicit function theorem on the critical-point equations F = 0 (in the gauge a small start
keeps), n spanning the critical curve's tangent. At δ = 0 C vanishes all along the curve, so
C_θ n = 0 and the undetermined multiple drops out of c1 (``leading_coefficient`` checks this and
computes c1 by automatic differentiation of F and C).

Cost: C kept factored costs O(d² r) to build and O(d² c) per product with c columns (``TransverseCoupling``),
O(d³) formed; one settled point is a focus orbit, 2d + 2 equations.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import sympy as sp
from scipy.sparse.linalg import LinearOperator, svds

from flowsim.model.losses import expected_cross_entropy, mean_field_attention
from theory.focus import focus_orbit_start
from theory.manifold import BLOCKS, ReducedFlow, ReducedState
from theory.mean_field import MeanFieldChain, factored_maps


# ---------------------------------------------------------------------------------
# The block, symbolically and numerically


@functools.lru_cache(maxsize=None)
def transverse_block_expression(d: int, k: int, rank: int) -> tuple[list[sp.Symbol], sp.Matrix, sp.Matrix, bool]:
    """Derive H_T with sympy: the Hessian of tr(G_Φ^T Φ) + tr(G_M^T M) over the last column of the
    rank-(r+1) coordinates, at that column = 0, and whether Φ and M are flat there to first order.

    Returns (symbols of Γ, B, Q, R (rank r), G_Φ, G_M in order; the transverse variables z; H_T; flat).
    """
    def matrix(name: str, rows: int, cols: int) -> sp.Matrix:
        return sp.Matrix(rows, cols, lambda i, j: sp.Symbol(f"{name}{i}_{j}", real=True))

    on = [matrix(name, rows, rank) for name, rows in zip(BLOCKS, (d, d, k, k))]
    off = [matrix(f"z{name}", rows, 1) for name, rows in zip(BLOCKS, (d, d, k, k))]
    Gamma, B, Q, R = (X.row_join(x) for X, x in zip(on, off))
    G_Phi, G_M = matrix("GPhi", d, d), matrix("GM", d, d)
    Phi, M = Gamma * Q.T * R * Gamma.T, Gamma * B.T
    z = [s for x in off for s in x]
    at_manifold = {s: 0 for s in z}
    flat = all(sp.diff(entry, s).subs(at_manifold) == 0 for entry in list(Phi) + list(M) for s in z)
    first_order = sp.Add(*G_Phi.multiply_elementwise(Phi)) + sp.Add(*G_M.multiply_elementwise(M))
    hessian = sp.hessian(first_order, z).subs(at_manifold)
    symbols = [s for X in on for s in X] + list(G_Phi) + list(G_M)
    return symbols, sp.Matrix(z), hessian, flat


def attention_columns(G_Phi, Gamma, Q, R):
    """The query and key columns of C = [G_M | G_Φ Γ R^T | G_Φ^T Γ Q^T]: (G_Φ Γ R^T, G_Φ^T Γ Q^T), d × k
    each, O(d² r) (numpy or JAX arrays alike). The one place C's attention part is written."""
    return G_Phi @ Gamma @ R.T, G_Phi.T @ Gamma @ Q.T


def transverse_coupling(G_Phi: np.ndarray, G_M: np.ndarray, state: ReducedState) -> np.ndarray:
    """C = [G_M | G_Φ Γ R^T | G_Φ^T Γ Q^T] (d × (d + 2k)): H_T = [[0, C], [C^T, 0]] on z = (u, w, x, y)."""
    return np.hstack([G_M, *attention_columns(G_Phi, state.Gamma, state.Q, state.R)])


def transverse_hessian(C: np.ndarray) -> np.ndarray:
    """H_T = [[0, C], [C^T, 0]]."""
    d, rest = C.shape
    return np.block([[np.zeros((d, d)), C], [C.T, np.zeros((rest, rest))]])


WARM_LANCZOS_VECTORS = 6  # Lanczos basis size for σ_max(C) from a nearby point's vector (ARPACK's default: 20)


class TransverseCoupling:
    """C = [G_M | G_Φ Γ R^T | G_Φ^T Γ Q^T] at a point of a rank-r manifold, kept factored (G_M = A^T E):
    products with C and C^T cost O(d² c) for c columns, the dense C O(d³)."""

    DENSE_UP_TO = 400  # vocabulary sizes up to which σ_max(C) comes from a dense SVD (cheaper than iterating)

    def __init__(self, chain: MeanFieldChain, state: ReducedState):
        self.gradients = chain.factored(state.Gamma, state.Q.T @ state.R, state.B)
        self.query_part, self.key_part = attention_columns(self.gradients.G_Phi, state.Gamma, state.Q, state.R)  # d x k each
        self.d, self.k = chain.d, state.Q.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.d, self.d + 2 * self.k

    def times(self, Y: np.ndarray) -> np.ndarray:
        """C Y for Y of d + 2k rows."""
        d, k = self.d, self.k
        return self.gradients.G_M_times(Y[:d]) + self.query_part @ Y[d:d + k] + self.key_part @ Y[d + k:]

    def transpose_times(self, U: np.ndarray) -> np.ndarray:
        """C^T U for U of d rows."""
        return np.concatenate([self.gradients.G_M_transpose_times(U), self.query_part.T @ U, self.key_part.T @ U])

    def dense(self) -> np.ndarray:
        return np.hstack([self.gradients.G_M(), self.query_part, self.key_part])

    def top(self, start: np.ndarray | None = None) -> tuple[float, np.ndarray, np.ndarray]:
        """(σ_max(C), left and right singular vectors): a dense SVD up to ``DENSE_UP_TO``, Lanczos
        (``scipy.sparse.linalg.svds`` on the products, O(d²) per iteration) beyond, from ``start`` (a left singular
        vector of a nearby point: at d = 1001, 27 products against 43 from a random start) where given."""
        if self.d <= self.DENSE_UP_TO:
            left, values, right_t = np.linalg.svd(self.dense())
            return float(values[0]), left[:, 0], right_t[0]
        operator = LinearOperator(self.shape, matvec=lambda y: self.times(y.reshape(-1, 1)).ravel(),
                                  rmatvec=lambda u: self.transpose_times(u.reshape(-1, 1)).ravel(), dtype=float)
        # a random part keeps every singular vector in the start, so that one which has overtaken the last is found
        warm = {} if start is None else {"v0": start + 1e-2 * np.random.default_rng(0).standard_normal(self.d) / np.sqrt(self.d),
                                         "ncv": WARM_LANCZOS_VECTORS}
        left, values, right_t = svds(operator, k=1, tol=1e-12, random_state=0, **warm)
        return float(values[0]), left[:, 0], right_t[0]

    def rate(self) -> float:
        return self.top()[0]


def transverse_field(C: TransverseCoupling, Z: np.ndarray) -> np.ndarray:
    """dZ/dt = -H_T Z: (dU, dY) = -(C Y, C^T U), O(d² (m - r)); Z has d + (d + 2k) rows."""
    d = C.d
    return -np.vstack([C.times(Z[d:]), C.transpose_times(Z[:d])])


@jax.jit
def _transverse_field_compiled(Gamma, B, Q, R, Z, pi, log_pi, P):
    """``transverse_field`` at the point (Γ, B, Q, R), the maps' gradients included, as one compiled function."""
    d, k = Gamma.shape[0], Q.shape[0]
    A, E, G_Phi, _ = factored_maps(Gamma, Q.T @ R, B, pi, log_pi, P)
    query_part, key_part = attention_columns(G_Phi, Gamma, Q, R)
    U, W, X, Y = Z[:d], Z[d:2 * d], Z[2 * d:2 * d + k], Z[2 * d + k:]
    C_times = A.T @ (E @ W) + query_part @ X + key_part @ Y  # G_M = A^T E
    C_transpose_times = jnp.concatenate([E.T @ (A @ U), query_part.T @ U, key_part.T @ U])
    return -jnp.concatenate([C_times, C_transpose_times])


def transverse_velocity(chain: MeanFieldChain, state: ReducedState, Z: np.ndarray) -> np.ndarray:
    """dZ/dt = -H_T Z at a point of the rank-r manifold, C formed factored there: O(d² m). From
    ``MeanFieldChain.COMPILED_FROM`` tokens on, one compiled function (d = 1001: 15 ms against 20 ms at rank 3, m = 16)."""
    if chain.d >= chain.COMPILED_FROM:
        return np.asarray(_transverse_field_compiled(state.Gamma, state.B, state.Q, state.R, Z, *chain.device_arrays))
    return transverse_field(TransverseCoupling(chain, state), Z)


def coupling_at(chain: MeanFieldChain, state: ReducedState) -> np.ndarray:
    """C formed, at a point of the rank-r manifold of the chain (O(d³): for checks)."""
    return TransverseCoupling(chain, state).dense()


@dataclass(frozen=True)
class TransverseMode:
    """The fastest transverse growth at a point: rate μ = σ_max(C) and its direction z = (ā, -b̄)/√2."""

    rate: float
    direction: np.ndarray  # (2d + 2k,) unit vector on (u, w, x, y)
    u: np.ndarray  # its W0 part ā/√2 (d,)


def fastest_transverse_mode(coupling: TransverseCoupling) -> TransverseMode:
    rate, left, right = coupling.top()
    direction = np.concatenate([left, -right]) / np.sqrt(2.0)
    return TransverseMode(rate, direction, left / np.sqrt(2.0))


# ---------------------------------------------------------------------------------
# The settled rank-one point as a function of the chain, and μ(δ)


@dataclass(frozen=True)
class ChainFamily:
    """π(δ) = π0 + δ·direction with the paper's P = λ I + (1 - λ) 1 π^T (``direction`` sums to 0)."""

    pi0: tuple[float, ...]
    direction: tuple[float, ...]
    lam: float

    def __post_init__(self) -> None:
        if len(self.direction) != len(self.pi0):
            raise ValueError(f"direction has {len(self.direction)} entries, expected one per token ({len(self.pi0)})")
        if abs(sum(self.direction)) > 1e-12:
            raise ValueError(f"direction must sum to 0 (π(δ) stays a distribution), got sum {sum(self.direction)!r}")
        if not 0 <= self.lam < 1:
            raise ValueError(f"lam must be in [0, 1), got {self.lam!r}")

    def __call__(self, delta):
        pi = jnp.asarray(self.pi0) + delta * jnp.asarray(self.direction)
        d = len(self.pi0)
        return pi, self.lam * jnp.eye(d) + (1.0 - self.lam) * jnp.outer(jnp.ones(d), pi)

    @staticmethod
    def rare_asymmetry(pi0: tuple[float, ...], lam: float, first: int, last: int) -> "ChainFamily":
        """Tokens ``first`` and ``last`` move apart: π_first + δ/2, π_last - δ/2 (docs/model.md's asymmetric rare
        tokens)."""
        if first == last or not (0 <= first < len(pi0) and 0 <= last < len(pi0)):
            raise ValueError(f"first and last must be two different tokens of 0..{len(pi0) - 1}, got {first} and {last}")
        direction = np.zeros(len(pi0))
        direction[first], direction[last] = 0.5, -0.5
        return ChainFamily(tuple(map(float, pi0)), tuple(map(float, direction)), float(lam))


def _map_gradients(Phi, M, pi, P):
    """(G_Φ, G_M) of the mean-field loss L(Φ, M), by autodiff."""
    def loss(Phi, M):
        return expected_cross_entropy(mean_field_attention(Phi, pi) @ M, P, pi)
    return jax.grad(loss, argnums=(0, 1))(Phi, M)


def _unpack_balanced(y, d):
    """Rank one, k = 1, balanced (|q| = |r|): y = (γ, β, q) and r = sign · q."""
    return y[:d], y[d:2 * d], y[2 * d]


def _critical_equations(y, delta, family: ChainFamily, sign: float):
    """F = (∂ℓ/∂γ, ∂ℓ/∂β, γ^T G_Φ γ, |γ|² - |β|² - 2q², Σβ): a rank-one critical point with attention on,
    in the gauge the flow from a small start keeps (W0^T W0 - W1 W1^T - W_Q W_Q^T - W_K W_K^T and
    W_Q^T W_Q - W_K^T W_K are conserved, and so is Σβ: L does not change when β moves along 1)."""
    d = len(family.pi0)
    gamma, beta, q = _unpack_balanced(y, d)
    pi, P = family(delta)
    G_Phi, G_M = _map_gradients(sign * q**2 * jnp.outer(gamma, gamma), jnp.outer(gamma, beta), pi, P)
    phi = sign * q**2
    d_gamma = phi * (G_Phi + G_Phi.T) @ gamma + G_M @ beta
    d_beta = G_M.T @ gamma
    return jnp.concatenate([d_gamma, d_beta, jnp.array([gamma @ G_Phi @ gamma, gamma @ gamma - beta @ beta - 2 * q**2,
                                                         jnp.sum(beta)])])


def _coupling_balanced(y, delta, family: ChainFamily, sign: float):
    """C on the balanced rank-one coordinates (k = 1, r = sign · q)."""
    d = len(family.pi0)
    gamma, beta, q = _unpack_balanced(y, d)
    pi, P = family(delta)
    G_Phi, G_M = _map_gradients(sign * q**2 * jnp.outer(gamma, gamma), jnp.outer(gamma, beta), pi, P)
    # rank one, k = 1: Γ = γ, Q = q, R = sign · q
    return jnp.hstack([G_M, *attention_columns(G_Phi, gamma[:, None], jnp.reshape(q, (1, 1)), jnp.reshape(sign * q, (1, 1)))])


class _Compiled(NamedTuple):
    """F_θ, F_δ, C, C_θ and C_δ on the balanced rank-one coordinates, compiled once per family."""

    jac_y: Callable
    jac_delta: Callable
    coupling: Callable
    coupling_y: Callable
    coupling_delta: Callable


@functools.lru_cache(maxsize=None)
def _compiled(family: ChainFamily, sign: float) -> _Compiled:
    def equations(y, delta):
        return _critical_equations(y, delta, family, sign)

    def coupling(y, delta):
        return _coupling_balanced(y, delta, family, sign)

    return _Compiled(jax.jit(jax.jacfwd(equations)), jax.jit(jax.jacfwd(equations, argnums=1)), jax.jit(coupling),
                     jax.jit(jax.jacfwd(coupling)), jax.jit(jax.jacfwd(coupling, argnums=1)))


def settled_by_integration(pi: np.ndarray, P: np.ndarray, t_settle_over_mu: float = 400.0,
                           amplitude: float = 1e-6) -> tuple[np.ndarray, float]:
    """The rank-one flow from the condensed point along the unstable attention vector (the focus
    orbit), integrated for ``t_settle_over_mu`` / μ2: (γ, β, q) balanced, and sign(q·r)."""
    chain = MeanFieldChain(pi, P)
    start, h = focus_orbit_start(chain, np.sqrt(2.0) * amplitude)
    end = ReducedFlow(chain, k=1).solve(start, np.array([t_settle_over_mu / abs(h)]), rtol=1e-10, atol=1e-14)
    state = ReducedState.unpack(end.y[:, -1], len(pi), 1)
    phi = float(state.Q[0, 0] * state.R[0, 0])
    return np.concatenate([state.Gamma[:, 0], state.B[:, 0], [np.sqrt(abs(phi))]]), float(np.sign(phi))


@dataclass(frozen=True)
class TransverseRateCurve:
    """μ(δ) = σ_max(C) at the end of the focus orbit of each chain of a family."""

    family: ChainFamily
    delta: np.ndarray
    rate: np.ndarray
    points: np.ndarray  # (len(delta), 2d + 1): (γ, β, q) balanced
    sign: float


def transverse_rate_curve(family: ChainFamily, deltas) -> TransverseRateCurve:
    """μ where the rank-one flow of each chain π(δ) settles (its focus orbit, integrated per δ)."""
    deltas = np.asarray(deltas, dtype=float)
    points, rates, signs = [], [], set()
    for delta in deltas:
        pi, P = (np.asarray(x) for x in family(float(delta)))
        if np.any(pi <= 0):
            raise ValueError(f"π(δ = {delta:g}) = {pi.tolist()} has a token with π <= 0")
        point, sign = settled_by_integration(pi, P)
        signs.add(sign)
        points.append(point)
        coupling = _compiled(family, sign).coupling(point, float(delta))
        rates.append(float(np.linalg.svd(np.asarray(coupling), compute_uv=False)[0]))
    if len(signs) != 1:
        raise ValueError(f"the attention coupling changes sign over δ = {deltas.tolist()}")
    return TransverseRateCurve(family, deltas, np.array(rates), np.array(points), signs.pop())


def coupling_derivative(family: ChainFamily, point: np.ndarray, delta: float, sign: float) -> tuple[np.ndarray, float]:
    """dC/dδ along the settled point, C_θ θ*' + C_δ with θ*' = -F_θ^+ F_δ (implicit function theorem), and
    the largest change of C along the null directions of F_θ (where θ*' is not determined)."""
    compiled = _compiled(family, sign)
    F_y, C_y = np.asarray(compiled.jac_y(point, delta)), np.asarray(compiled.coupling_y(point, delta))
    velocity = -np.linalg.lstsq(F_y, np.asarray(compiled.jac_delta(point, delta)), rcond=None)[0]
    _, singular, right = np.linalg.svd(F_y)
    null = right[singular < 1e-10 * singular[0]]
    along_null = max((float(np.abs(np.tensordot(C_y, n, axes=1)).max()) for n in null), default=0.0)
    return np.tensordot(C_y, velocity, axes=1) + np.asarray(compiled.coupling_delta(point, delta)), along_null


def leading_coefficient(curve: TransverseRateCurve) -> float:
    """c1 = σ_max(dC/dδ) at the curve's first δ, where C must vanish (the degenerate point)."""
    C0 = np.asarray(_compiled(curve.family, curve.sign).coupling(curve.points[0], float(curve.delta[0])))
    if np.abs(C0).max() > 1e-9:
        raise ValueError(f"the point at δ = {curve.delta[0]:g} is not degenerate: max |C| = {np.abs(C0).max():.2g}")
    derivative, along_null = coupling_derivative(curve.family, curve.points[0], float(curve.delta[0]), curve.sign)
    if along_null > 1e-8:
        raise ValueError(f"C changes along the critical curve at δ = {curve.delta[0]:g} ({along_null:.2g}): c1 is not determined")
    return float(np.linalg.svd(derivative, compute_uv=False)[0])
