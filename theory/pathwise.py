"""Pathwise growth factors of the upper layer's attention logits (two-layer model).

For query type i and key type j the upper logit is s_ij = h_i^T Q K^T h_j, with h the
residual stream h2 entering the upper block (rows h_k of H, d x m), Q = W_Q2, K = W_K2.
Its rate of change splits by the product rule into

    ds_ij/dt = h_i^T (Q' K^T + Q K'^T) h_j               direct path (Q/K updates)
             + h_i'^T Q K^T h_j + h_i^T Q K^T h_j'        basis-drift path (lower layers move h).

With G = ∂L/∂Φ2 (the gradient of the loss in the upper logits), the chain rule through
Φ2 = H Q K^T H^T gives ∂L/∂Q = H^T G H K and ∂L/∂K = H^T G^T H Q. Under the flow
Q' = -κ_Q ∂L/∂Q (+ a depth-coupled part when smoothing mixes in the lower block's
gradient), κ_Q = r_Q(t) × the smoothing weight on the block's own gradient, so the
direct path through the upper block's own gradient is

    own_ij = -κ_Q (H h_i)^T G (H K K^T h_j) - κ_K (H Q Q^T h_i)^T G (H h_j)

and each sum Σ_kl G_kl (h_k·h_i)(h_l^T K K^T h_j) is bounded term by term:

    |own_ij| <= max(κ_Q, κ_K)            step-size factor
                · ‖h_i‖ ‖h_j‖ max_k ‖h_k‖²   residual-energy factor
                · (‖Q‖₂² + ‖K‖₂²)            coupling factor
                · Σ_kl |G_kl|                attention-gradient mass.

Slowing the upper Q/K by ρ shrinks the first factor; a gated FFN shrinks the second
early on, because its residual write is of higher order in the weight scale
(``ffn_write_expansion``). The derivations are done by sympy on matrix symbols and
evaluated along a run's trajectory by ``pathwise_along``.

The factor product bounds the direct path only; the logits also move by the basis drift,
so it is no bound on the total ds/dt (exceeded at some pair on ~10% of the saved times of
the shipped runs). Two sharper statements that are measured against the total:

    |own_ij| <= ‖G‖₂ (κ_Q ‖H h_i‖ ‖H K K^T h_j‖ + κ_K ‖H Q Q^T h_i‖ ‖H h_j‖)     (``tight_bound``)
    |drift_ij| <= ‖Q K^T‖₂ (‖h_i'‖ ‖h_j‖ + ‖h_i‖ ‖h_j'‖)                          (``drift_bound``)

so |ds_ij/dt| <= tight_bound + |coupled_ij| + drift_bound (``total_bound``). The first uses the
operator norm of G instead of its entry mass and the alignment of h_i with the whole basis
(‖H h_i‖ = (Σ_k (h_k·h_i)²)^½ instead of ‖h_i‖ max_k ‖h_k‖); it is never looser than the
factor product.

The two-layer model over positions (sequence tasks, ``positional_pathwise_along``) has the
same decomposition per context n and key position j: s_nj = q_n^T Q K^T h_nj with q_n = h_ns
the query's stream, G_nj = ∂L/∂Φ2_nj of the exact loss, S = Σ_nj G_nj q_n h_nj^T (m x m), so
∂L/∂Q = S K, ∂L/∂K = S^T Q and

    own_nj = -κ_Q q_n^T S K K^T h_nj - κ_K q_n^T Q Q^T S h_nj,
    |own_nj| <= max(κ_Q, κ_K) · ‖q_n‖ ‖h_nj‖ max ‖h‖² · (‖Q‖₂² + ‖K‖₂²) · Σ|G|     (the factor product)
    |own_nj| <= ‖S‖₂ (κ_Q ‖q_n‖ ‖K K^T h_nj‖ + κ_K ‖Q Q^T q_n‖ ‖h_nj‖)              (tight_bound)
    |drift_nj| <= ‖Q K^T‖₂ (‖q_n'‖ ‖h_nj‖ + ‖q_n‖ ‖h_nj'‖)                           (drift_bound)

with the pairs (i, j) of the mean-field arrays read as (context n, key position j).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import sympy as sp

from flowsim.model.chains import MarkovChain
from flowsim.model.flow import GradientFlow
from flowsim.model.losses import expected_cross_entropy
from flowsim.model.models import Params, PositionalTwoLayerTransformer, TwoLayerTransformer
from flowsim.model.tasks import SequenceLaw
from flowsim.solve.trajectory import Trajectory

UPPER_QUERY, UPPER_KEY = "W_Q2", "W_K2"


# ---------------------------------------------------------------------------------
# Symbolic decomposition


@dataclass(frozen=True)
class LogitPathSymbols:
    """Matrix symbols: h_i, h_j (m x 1), H (d x m), Q, K (m x k), their time derivatives, G (d x d)."""

    h_i: sp.MatrixSymbol
    h_j: sp.MatrixSymbol
    H: sp.MatrixSymbol
    Q: sp.MatrixSymbol
    K: sp.MatrixSymbol
    dh_i: sp.MatrixSymbol
    dh_j: sp.MatrixSymbol
    dQ: sp.MatrixSymbol
    dK: sp.MatrixSymbol
    G: sp.MatrixSymbol
    kappa_Q: sp.Symbol
    kappa_K: sp.Symbol


@dataclass(frozen=True)
class LogitPaths:
    """ds_ij/dt = direct + drift, and the direct path with the flow's Q/K updates substituted."""

    symbols: LogitPathSymbols
    direct: sp.Expr  # in dQ, dK
    drift: sp.Expr  # in dh_i, dh_j
    grad_Q: sp.Expr  # ∂L/∂Q = H^T G H K
    grad_K: sp.Expr
    own_direct: sp.Expr  # direct with dQ = -κ_Q grad_Q, dK = -κ_K grad_K


def _linear_part(expression: sp.Expr, tau: sp.Symbol) -> sp.Expr:
    """The coefficient of τ in a matrix expression polynomial in τ."""
    return sp.expand(sp.diff(expression, tau)).subs(tau, 0).doit()


@functools.lru_cache(maxsize=None)
def logit_paths(d: int, m: int, k: int) -> LogitPaths:
    """Derive the path decomposition of ds_ij/dt and the chain rule through Φ2 = H Q K^T H^T."""
    h_i, h_j, dh_i, dh_j = (sp.MatrixSymbol(name, m, 1) for name in ("h_i", "h_j", "dh_i", "dh_j"))
    H, G = sp.MatrixSymbol("H", d, m), sp.MatrixSymbol("G", d, d)
    Q, K, dQ, dK = (sp.MatrixSymbol(name, m, k) for name in ("Q", "K", "dQ", "dK"))
    kappa_Q, kappa_K, tau = sp.symbols("kappa_Q kappa_K tau", positive=True)
    symbols = LogitPathSymbols(h_i, h_j, H, Q, K, dh_i, dh_j, dQ, dK, G, kappa_Q, kappa_K)

    moved = ((h_i + tau * dh_i).T * (Q + tau * dQ) * (K + tau * dK).T * (h_j + tau * dh_j))
    rate = _linear_part(moved, tau)
    drift = rate.subs({dQ: sp.ZeroMatrix(m, k), dK: sp.ZeroMatrix(m, k)}).doit()
    direct = rate.subs({dh_i: sp.ZeroMatrix(m, 1), dh_j: sp.ZeroMatrix(m, 1)}).doit()

    # dL = tr(G^T dΦ2) with Φ2 = H Q K^T H^T; sympy's matrix calculus gives the gradients.
    linearised_loss = sp.Trace(G.T * H * Q * K.T * H.T)
    grad_Q, grad_K = linearised_loss.diff(Q), linearised_loss.diff(K)
    own = direct.subs({dQ: -kappa_Q * grad_Q, dK: -kappa_K * grad_K}).doit()
    return LogitPaths(symbols, direct, drift, grad_Q, grad_K, own)


@functools.lru_cache(maxsize=None)
def own_direct_path_function(d: int, m: int, k: int):
    """Numeric own-direct path (h_i, h_j, H, Q, K, G, κ_Q, κ_K) -> h_i^T (...) h_j.

    Passing H^T for both h_i and h_j evaluates every pair (i, j) at once (a d x d array)."""
    paths = logit_paths(d, m, k)
    s = paths.symbols
    return sp.lambdify((s.h_i, s.h_j, s.H, s.Q, s.K, s.G, s.kappa_Q, s.kappa_K), paths.own_direct, modules="numpy")


# ---------------------------------------------------------------------------------
# Small-weight expansion of the FFN's residual write


@dataclass(frozen=True)
class FFNWriteExpansion:
    """FFN(h) at weight scale ε (h = ε x, every weight = ε w): leading order ε^order."""

    kind: str
    order: int
    leading_term: sp.Expr  # the coefficient of ε^order in the first output coordinate


def _gelu(x: sp.Expr) -> sp.Expr:
    return x * (1 + sp.erf(x / sp.sqrt(2))) / 2


def _silu(x: sp.Expr) -> sp.Expr:
    return x / (1 + sp.exp(-x))


@functools.lru_cache(maxsize=None)
def ffn_write_expansion(kind: str, width: int = 2, max_order: int = 8) -> FFNWriteExpansion:
    """Series of the FFN write in the weight scale ε (residual width 2, hidden ``width``).

    mlp: GELU(h W_in) W_out;  glu: (SiLU(h W_gate) * (h W_up)) W_down."""
    if kind not in ("mlp", "glu"):
        raise ValueError(f"the FFN write expansion is for ffn 'mlp' or 'glu', got {kind!r}")
    eps = sp.Symbol("epsilon", positive=True)
    x = sp.Matrix(1, 2, sp.symbols("x0:2"))
    h = eps * x

    def weight(name: str, rows: int, cols: int) -> sp.Matrix:
        return eps * sp.Matrix(rows, cols, sp.symbols(f"{name}0:{rows * cols}"))

    if kind == "mlp":
        hidden = (h * weight("w_in", 2, width)).applyfunc(_gelu)
        write = hidden * weight("w_out", width, 2)
    else:
        gate = (h * weight("w_gate", 2, width)).applyfunc(_silu)
        up = h * weight("w_up", 2, width)
        write = gate.multiply_elementwise(up) * weight("w_down", width, 2)
    series = sp.expand(sp.series(write[0, 0], eps, 0, max_order + 1).removeO())
    for order in range(1, max_order + 1):
        coefficient = sp.simplify(series.coeff(eps, order))
        if coefficient != 0:
            return FFNWriteExpansion(kind, order, coefficient)
    raise ValueError(f"the {kind} write vanishes to order {max_order} in ε")


# ---------------------------------------------------------------------------------
# Evaluation along a trajectory


@dataclass(frozen=True)
class PathwiseFactors:
    """The decomposition and the bound at each saved time (arrays with a leading time axis).

    Per pair (i, j), shape (T, d, d): ``total`` (ds/dt by autodiff along the flow),
    ``direct`` and ``drift`` (the two paths), ``own_direct`` (the direct path through
    the upper block's own gradient, from the symbolic formula), ``coupled_direct``
    (direct - own_direct: what depth smoothing carries over from the lower block) and
    ``bound`` (of |own_direct|), ``tight_bound`` (of |own_direct|), ``drift_bound`` (of |drift|)
    and ``total_bound`` (of |total|). Scalars per time (T,): ``step`` = max(κ_Q, κ_K),
    ``residual_energy`` = max_k ‖h_k‖⁴, ``coupling`` = ‖Q‖₂² + ‖K‖₂², ``mass`` = Σ|G|,
    ``ffn_write`` = max_i ‖FFN(h1_i)‖ (the lower FFN's residual write).
    """

    t: np.ndarray
    total: np.ndarray
    direct: np.ndarray
    drift: np.ndarray
    own_direct: np.ndarray
    coupled_direct: np.ndarray
    bound: np.ndarray
    tight_bound: np.ndarray
    drift_bound: np.ndarray
    total_bound: np.ndarray
    step: np.ndarray
    residual_energy: np.ndarray
    coupling: np.ndarray
    mass: np.ndarray
    ffn_write: np.ndarray

    def summary(self, window_end: float | None = None) -> dict[str, float]:
        """Scalars for a table: factors at t = 0, the largest bound, the share of the logit motion
        (∫ Σ_ij |.| dt) carried by the direct path, the share of saved times at which |ds/dt| exceeds
        the factor bound at some pair, and the median over time of each bound's looseness
        max_ij bound / max_ij |own_direct|."""
        direct = np.abs(self.direct).sum(axis=(1, 2))
        drift = np.abs(self.drift).sum(axis=(1, 2))
        moved = np.trapezoid(direct + drift, self.t)
        own = np.abs(self.own_direct).max(axis=(1, 2))
        moving = own > 0
        return {
            "step_0": float(self.step[0]),
            "residual_energy_0": float(self.residual_energy[0]),
            "ffn_write_0": float(self.ffn_write[0]),
            "peak_bound": float(self.bound.max()),
            "peak_direct": float(np.abs(self.direct).max()),
            "direct_share": float(np.trapezoid(direct, self.t) / moved) if moved > 0 else 0.0,
            "exceeded_share": float(np.mean((np.abs(self.total) > self.bound).any(axis=(1, 2)))),
            "looseness": float(np.median(self.bound.max(axis=(1, 2))[moving] / own[moving])) if moving.any() else np.inf,
            "tight_looseness": float(np.median(self.tight_bound.max(axis=(1, 2))[moving] / own[moving])) if moving.any() else np.inf,
        }


def upper_logit_gradient(model: TwoLayerTransformer, params: Params, pi: jax.Array, P: jax.Array) -> jax.Array:
    """G = ∂L/∂Φ2 of the mean-field loss: the loss's gradient in the upper attention logits."""
    d = pi.shape[0]
    log_weights = jnp.broadcast_to(jnp.log(pi), (d, d))

    def loss_of_shift(shift):
        return expected_cross_entropy(model.logits_over_types(params, log_weights, jnp.arange(d), shift), P, pi)

    return jax.grad(loss_of_shift)(jnp.zeros((d, d)))


def _streams_and_logits(model: TwoLayerTransformer, params: Params, pi: jax.Array):
    """(h1, h2, Φ2 = H Q K^T H^T) in the mean-field model."""
    h1, h2, _ = model.residual_streams(params, jnp.log(pi))
    return h1, h2, h2 @ params[UPPER_QUERY] @ params[UPPER_KEY].T @ h2.T


def pathwise_applies(config) -> bool:
    """Whether a two-layer run's loss is the one the factors are derived for: mean-field on a
    Markov chain, the exact (finite) loss on a sequence task."""
    return config.loss.kind == ("mean_field" if config.task.kind == "markov" else "finite")


def check_pathwise_supported(model, loss_kind: str) -> None:
    if isinstance(model, PositionalTwoLayerTransformer):
        if loss_kind != "finite":
            raise ValueError("pathwise growth factors on a sequence task use its exact loss (loss.kind = 'finite'); "
                             f"this run has loss.kind = {loss_kind!r}")
        return
    if not isinstance(model, TwoLayerTransformer):
        raise ValueError("pathwise growth factors are defined for the two-layer model (model.kind = 'two_layer')")
    if loss_kind != "mean_field":
        raise ValueError(f"pathwise growth factors of the two-layer model on a Markov chain use the mean-field loss; "
                         f"this run has loss.kind = {loss_kind!r}")


def pathwise_along(trajectory: Trajectory, model: TwoLayerTransformer, chain: MarkovChain,
                   flow: GradientFlow) -> PathwiseFactors:
    """Evaluate the path decomposition and the bound at every saved time of a mean-field run."""
    pi, P = jnp.asarray(chain.pi), jnp.asarray(chain.P)
    thetas, velocities = _states_and_velocities(trajectory, flow)

    def paths(theta, velocity):
        params, dparams = flow.unravel(theta), flow.unravel(velocity)
        (h1, h2, _), (_, dh2, dphi2) = jax.jvp(lambda p: _streams_and_logits(model, p, pi), (params,), (dparams,))
        Q, K = params[UPPER_QUERY], params[UPPER_KEY]
        direct = h2 @ (dparams[UPPER_QUERY] @ K.T + Q @ dparams[UPPER_KEY].T) @ h2.T
        drift = dh2 @ Q @ K.T @ h2.T + h2 @ Q @ K.T @ dh2.T
        write = jnp.linalg.norm(model.feed_forward(params, h1), axis=-1).max()
        return dphi2, direct, drift, h2, dh2, Q, K, upper_logit_gradient(model, params, pi, P), write

    total, direct, drift, H, dH, Q, K, G, write = (
        np.asarray(x) for x in jax.jit(jax.vmap(paths))(jnp.asarray(thetas), jnp.asarray(velocities)))

    kappa = _upper_rates(trajectory, flow, thetas)
    d, m = H.shape[1:]
    own_path = own_direct_path_function(d, m, Q.shape[2])
    own = np.stack([own_path(h.T, h.T, h, q, k, g, kq, kk) for h, q, k, g, (kq, kk) in zip(H, Q, K, G, kappa)])

    norms = np.linalg.norm(H, axis=2)  # (T, d)
    largest = norms.max(axis=1)
    step = kappa.max(axis=1)
    coupling = np.linalg.norm(Q, ord=2, axis=(1, 2)) ** 2 + np.linalg.norm(K, ord=2, axis=(1, 2)) ** 2
    mass = np.abs(G).sum(axis=(1, 2))
    pair_energy = norms[:, :, None] * norms[:, None, :] * largest[:, None, None] ** 2
    bound = (step * coupling * mass)[:, None, None] * pair_energy
    tight = _tight_bound(H, Q, K, G, kappa)
    drift_bound = np.linalg.norm(Q @ np.swapaxes(K, 1, 2), ord=2, axis=(1, 2))[:, None, None] * (
        np.linalg.norm(dH, axis=2)[:, :, None] * norms[:, None, :] + norms[:, :, None] * np.linalg.norm(dH, axis=2)[:, None, :])
    total_bound = tight + np.abs(direct - own) + drift_bound
    return PathwiseFactors(np.asarray(trajectory.t), total, direct, drift, own, direct - own, bound, tight, drift_bound,
                           total_bound, step, largest**4, coupling, mass, write)


def positional_pathwise_along(trajectory: Trajectory, model: PositionalTwoLayerTransformer, law: SequenceLaw,
                              flow: GradientFlow) -> PathwiseFactors:
    """The path decomposition and the bounds at every saved time of a run on a sequence task
    (module docstring), pairs = (context n, key position j), G from the exact loss.
    O(T (N s m² + n)) for T saved times, N contexts and n parameters."""
    contexts, probability, next_law = (jnp.asarray(x) for x in (law.contexts, law.probability, law.next_law))
    thetas, velocities = _states_and_velocities(trajectory, flow)

    def stream_and_logits(params):
        _, _, h2 = model.streams(params, contexts)
        query = h2[:, -1, :]
        return h2, jnp.einsum("nk,njk->nj", query @ params[UPPER_QUERY], h2 @ params[UPPER_KEY])

    def paths(theta, velocity):
        params, dparams = flow.unravel(theta), flow.unravel(velocity)
        (h2, _), (dh2, dphi2) = jax.jvp(stream_and_logits, (params,), (dparams,))
        Q, K = params[UPPER_QUERY], params[UPPER_KEY]
        query, dquery = h2[:, -1, :], dh2[:, -1, :]
        direct = jnp.einsum("nk,njk->nj", query, h2 @ (dparams[UPPER_QUERY] @ K.T + Q @ dparams[UPPER_KEY].T).T)
        drift = jnp.einsum("nk,njk->nj", dquery @ Q @ K.T, h2) + jnp.einsum("nk,njk->nj", query @ Q @ K.T, dh2)
        G = jax.grad(lambda shift: expected_cross_entropy(model.forward(params, contexts, shift), next_law, probability))(
            jnp.zeros(contexts.shape))
        write = jnp.linalg.norm(model.feed_forward(params, model.lower_block(params, contexts)[1]), axis=-1).max()
        return dphi2, direct, drift, h2, dh2, Q, K, G, write

    total, direct, drift, H, dH, Q, K, G, write = (
        np.asarray(x) for x in jax.jit(jax.vmap(paths))(jnp.asarray(thetas), jnp.asarray(velocities)))
    kappa = _upper_rates(trajectory, flow, thetas)
    query, dquery = H[:, :, -1, :], dH[:, :, -1, :]  # (T, N, m)
    S = np.einsum("tnj,tnk,tnjl->tkl", G, query, H)  # Σ_nj G_nj q_n h_nj^T
    KKt, QQt = K @ np.swapaxes(K, 1, 2), Q @ np.swapaxes(Q, 1, 2)
    own = -(kappa[:, 0, None, None] * np.einsum("tnk,tkl,tlp,tnjp->tnj", query, S, KKt, H)
            + kappa[:, 1, None, None] * np.einsum("tnk,tkl,tlp,tnjp->tnj", query, QQt, S, H))

    norms, query_norms = np.linalg.norm(H, axis=3), np.linalg.norm(query, axis=2)  # (T, N, s), (T, N)
    largest = norms.max(axis=(1, 2))
    step = kappa.max(axis=1)
    coupling = np.linalg.norm(Q, ord=2, axis=(1, 2)) ** 2 + np.linalg.norm(K, ord=2, axis=(1, 2)) ** 2
    mass = np.abs(G).sum(axis=(1, 2))
    bound = (step * coupling * mass * largest**2)[:, None, None] * query_norms[:, :, None] * norms
    tight = np.linalg.norm(S, ord=2, axis=(1, 2))[:, None, None] * (
        kappa[:, 0, None, None] * query_norms[:, :, None] * np.linalg.norm(H @ KKt[:, None], axis=3)
        + kappa[:, 1, None, None] * np.linalg.norm(np.einsum("tnk,tkl->tnl", query, QQt), axis=2)[:, :, None] * norms)
    drift_bound = np.linalg.norm(Q @ np.swapaxes(K, 1, 2), ord=2, axis=(1, 2))[:, None, None] * (
        np.linalg.norm(dquery, axis=2)[:, :, None] * norms + query_norms[:, :, None] * np.linalg.norm(dH, axis=3))
    total_bound = tight + np.abs(direct - own) + drift_bound
    return PathwiseFactors(np.asarray(trajectory.t), total, direct, drift, own, direct - own, bound, tight, drift_bound,
                           total_bound, step, largest**4, coupling, mass, write)


def _tight_bound(H: np.ndarray, Q: np.ndarray, K: np.ndarray, G: np.ndarray, kappa: np.ndarray) -> np.ndarray:
    """‖G‖₂ (κ_Q ‖H h_i‖ ‖H K K^T h_j‖ + κ_K ‖H Q Q^T h_i‖ ‖H h_j‖) per time and pair (T, d, d)."""
    Ht = np.swapaxes(H, 1, 2)
    gram = np.linalg.norm(H @ Ht, axis=1)  # ‖H h_i‖: column norms of H H^T
    through_K = np.linalg.norm(H @ K @ np.swapaxes(K, 1, 2) @ Ht, axis=1)
    through_Q = np.linalg.norm(H @ Q @ np.swapaxes(Q, 1, 2) @ Ht, axis=1)
    spectral = np.linalg.norm(G, ord=2, axis=(1, 2))[:, None, None]
    return spectral * (kappa[:, 0, None, None] * gram[:, :, None] * through_K[:, None, :]
                       + kappa[:, 1, None, None] * through_Q[:, :, None] * gram[:, None, :])


def _states_and_velocities(trajectory: Trajectory, flow: GradientFlow) -> tuple[np.ndarray, np.ndarray]:
    """The flat parameters at each saved time and the flow's velocity there, (T, n) each."""
    thetas = np.stack([flow.flatten(trajectory.at(i)) for i in range(len(trajectory))])
    return thetas, np.stack([flow.vector_field(t, theta) for t, theta in zip(trajectory.t, thetas)])


def _upper_rates(trajectory: Trajectory, flow: GradientFlow, thetas: np.ndarray) -> np.ndarray:
    """(T, 2): κ_Q, κ_K, the upper Q/K rate times the smoothing weight on each block's own gradient."""
    step_rates = np.array([np.asarray(flow.rates.rates(t, (UPPER_QUERY, UPPER_KEY))) for t in trajectory.t])
    return step_rates * np.array([_own_weights(flow, theta) for theta in thetas])


def _own_weights(flow: GradientFlow, theta: np.ndarray) -> tuple[float, float]:
    """The smoothing weight on each upper Q/K block's own gradient (1 without smoothing)."""
    coupling = flow.depth_coupling(theta)
    return tuple(coupling.get(group, {}).get(group, 1.0) for group in (UPPER_QUERY, UPPER_KEY))
