"""Exact population losses of the one-layer model on a Markov chain.

All losses are the expected next-token cross-entropy

    L(θ) = E[ -log softmax(f(x_{1:s}))_{x_{s+1}} ],   x_1 ~ start law, x_{t+1} ~ P[x_t, :].

* ``population_loss_mean_field``: s → ∞. The context's type frequencies converge to
  π, so A[i, :] = softmax(Φ[i, :] + log π), Z = A M and
  L = Σ_i π_i Σ_y P[i, y] (-log softmax(Z[i, :])_y). The one-layer model's loss is
  differentiated through its gradient written out (``one_layer_mean_field_gradient``),
  cheaper than autodiff's at large d.
* ``population_loss_finite``: exact for finite s. The model is permutation-invariant
  over positions, so f depends on the context only through (count vector c, query
  x_s); attention over types is softmax(Φ[x_s, j] + log c_j) over types with c_j > 0.
  ``context_count_law`` computes the exact law of (c, x_s) by a dynamic programme
  over positions (C(s+d-1, d-1)·d states at the end).
* ``population_loss_finite_second_order``: the finite-s loss to O(1/s²) at any d the d³ covariance fits: each
  query's loss expanded to second order around the window's mean composition, with the composition's exact mean and
  covariance given the query (``flowsim.model.windows``), no sampling. O(s d³) once, O(d³ m) per evaluation.
* ``finite_control_variate`` (a loss kind): the second-order loss plus the mean, over a fixed sample of windows, of
  what it leaves out (each window's loss minus its Taylor polynomial): unbiased at any s, with only the remainder
  sampled. O(N (s + d) m) per evaluation on N windows, besides the second-order loss.
* ``population_loss_enumerated``: brute force over all d^s contexts (small s; tests).
* ``loss_monte_carlo``: a sampled estimate with its standard error (the only sampled
  loss here).
* ``population_loss_task``: a sequence task's exact loss (``flowsim.model.tasks``), the sum over
  the N contexts of positive probability of p(context) · cross-entropy against the exact
  law of the next token: O(N) forward passes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.tree_util import Partial

from flowsim.common.budget import check_memory
from flowsim.model.chains import MarkovChain
from flowsim.config import LossKind
from flowsim.model.models import Model, OneLayerTransformer, Params, model_for_params
from flowsim.model.tasks import InductionTask
from flowsim.model.windows import (
    FoldedWindowComposition,
    WindowComposition,
    folded_window_composition,
    window_composition,
    window_composition_bytes,
    window_covariance_blocks,
    window_mean,
)

LOSS_KINDS: tuple[str, ...] = get_args(LossKind)

ENUMERATION_LIMIT = 2_000_000


def expected_cross_entropy(logits: jax.Array, target_probabilities: jax.Array, weights: jax.Array) -> jax.Array:
    """Σ_n w_n Σ_y q_n(y) (-log softmax(logits_n)_y) = Σ_n w_n (logsumexp(logits_n) - q_n · logits_n)."""
    per_row = jax.nn.logsumexp(logits, axis=-1) - jnp.sum(target_probabilities * logits, axis=-1)
    return jnp.sum(weights * per_row)


def mean_field_attention(phi: jax.Array, pi: jax.Array) -> jax.Array:
    """A[i, :] = softmax(Φ[i, :] + log π): attention of query type i over key types as s → ∞."""
    return jax.nn.softmax(phi + jnp.log(pi)[None, :], axis=-1)


def _mean_field_value(model: Model, params: Params, pi: jax.Array, P: jax.Array) -> jax.Array:
    return expected_cross_entropy(model.mean_field_logits(params, pi), P, pi)


def one_layer_mean_field_gradient(model: OneLayerTransformer, params: Params, pi: jax.Array, P: jax.Array) -> Params:
    """∇θ of the one-layer mean-field loss (as ``expected_cross_entropy`` computes it), the chain rule written
    out.

    With Q = W0 W_Q, K = W0 W_K, A = softmax(κ Q Kᵀ + log π) (κ the logit scale), X = A W0,
    H = X [W_V] (+ W0 with the residual path), Z = H W1 and G = diag(π)(softmax(Z) - P) = ∂L/∂Z:

        ∂W1 = Hᵀ G,   ∂H = G W1ᵀ,   ∂X = ∂H [W_Vᵀ],   ∂W_V = Xᵀ ∂H,
        ∂S = κ A ⊙ (∂X W0ᵀ - r 1ᵀ)  (the gradient in S = Q Kᵀ),  r_i = Σ_j A_ij (∂X W0ᵀ)_ij = (∂X ⊙ X) 1,
        ∂W0 = Aᵀ ∂X [+ ∂H] + ∂S K W_Qᵀ + ∂Sᵀ Q W_Kᵀ,   ∂W_Q = W0ᵀ ∂S K,   ∂W_K = W0ᵀ ∂Sᵀ Q.

    Cost: nine products of O(d² max(m, k)), as reverse-mode autodiff takes, but fewer passes over d × d
    arrays: r from d × m ones, and softmax(Z) once where logsumexp's derivative forms its exponentials
    apart (benchmarks/MEASUREMENTS.md, "The one-layer mean-field gradient written out").
    """
    mm = model._matmul
    W0, W1 = params["W0"], params["W1"]
    query, key = mm(W0, params["W_Q"]), mm(W0, params["W_K"])  # for S's gradient (XLA forms them once)
    attention = mean_field_attention(model.attention_logits(params), pi)
    mixed = mm(attention, W0)
    hidden = mm(mixed, params["W_V"]) if model.value_matrix else mixed
    if model.residual:
        hidden = hidden + W0
    logits_gradient = pi[:, None] * (jax.nn.softmax(mm(hidden, W1), axis=-1) - P)
    hidden_gradient = mm(logits_gradient, W1.T)
    mixed_gradient = mm(hidden_gradient, params["W_V"].T) if model.value_matrix else hidden_gradient
    row_mean = jnp.sum(mixed_gradient * mixed, axis=-1, keepdims=True)
    query_key_gradient = model.logit_scale_factor * attention * (mm(mixed_gradient, W0.T) - row_mean)
    query_gradient, key_gradient = mm(query_key_gradient, key), mm(query_key_gradient.T, query)
    W0_gradient = (mm(attention.T, mixed_gradient) + mm(query_gradient, params["W_Q"].T)
                   + mm(key_gradient, params["W_K"].T))
    gradient = {"W0": W0_gradient + hidden_gradient if model.residual else W0_gradient,
                "W_Q": mm(W0.T, query_gradient), "W_K": mm(W0.T, key_gradient), "W1": mm(hidden.T, logits_gradient)}
    if model.value_matrix:
        gradient["W_V"] = mm(mixed.T, hidden_gradient)
    return gradient


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _one_layer_mean_field(model: OneLayerTransformer, params: Params, pi: jax.Array, P: jax.Array) -> jax.Array:
    return _mean_field_value(model, params, pi, P)


def _one_layer_mean_field_jvp(model, primals, tangents):
    """L's tangent along the parameters from the written-out gradient (reverse mode transposes it, so a
    gradient costs that; forward mode over it gives Hessian products); along π or P, if asked, by autodiff."""
    params, pi, P = primals
    params_tangent, pi_tangent, P_tangent = tangents
    value = _mean_field_value(model, params, pi, P)
    gradient = one_layer_mean_field_gradient(model, params, pi, P)
    tangent = sum((jnp.vdot(gradient[name], step) for name, step in params_tangent.items() if not _is_zero(step)),
                  jnp.zeros_like(value))
    if not (_is_zero(pi_tangent) and _is_zero(P_tangent)):
        data_tangents = tuple(jnp.zeros_like(x) if _is_zero(t) else t for x, t in ((pi, pi_tangent), (P, P_tangent)))
        tangent = tangent + jax.jvp(lambda pi, P: _mean_field_value(model, params, pi, P), (pi, P), data_tangents)[1]
    return value, tangent


def _is_zero(tangent) -> bool:
    return isinstance(tangent, SymbolicZero)


_one_layer_mean_field.defjvp(_one_layer_mean_field_jvp, symbolic_zeros=True)


def _mean_field_core(model: Model, params: Params, pi: jax.Array, P: jax.Array) -> jax.Array:
    if isinstance(model, OneLayerTransformer):
        return _one_layer_mean_field(model, params, pi, P)
    return _mean_field_value(model, params, pi, P)


def population_loss_mean_field(params: Params, chain: MarkovChain, model: Model) -> jax.Array:
    """The s → ∞ population loss (exact)."""
    return _mean_field_core(model, params, jnp.asarray(chain.pi), jnp.asarray(chain.P))


class QueryExpansion(NamedTuple):
    """Each query's loss ℓ_q(x) at the mean composition x = μ_q and the pieces of its derivatives there (rows q):
    ℓ_q(x) is the cross-entropy against P[q] of the query q reading a window of type frequencies x, with attention
    a = x ∘ w / (w · x), w = e^{Φ[q, :]}, and logits f = a E W1 [+ the residual's], E = W0 [W_V]. With ω = a / x,
    p = softmax(f) and e = E W1 (p - P[q]), a's Jacobian in x is diag(ω) - a ωᵀ, so for a step δ of the composition

        ∇ℓ_q · δ   = Σ_j δ_j ω_j (e_j - a · e),
        δᵀ∇²ℓ_q δ = |Uᵀδ|²_N + 2 (a · e)(ω · δ)² - 2 (ω · δ)((ω ∘ e) · δ),
        U = diag(ω) (E - 1 āᵀ),  ā = Eᵀ a,  N = W1 (diag p - p pᵀ) W1ᵀ:

    the logits' curvature seen through a's Jacobian, then a's own. A type a window never holds (μ_q[j] = 0) has
    a_j = 0 and no weight."""

    loss: jax.Array  # ℓ_q(μ_q), (d,)
    values: jax.Array  # E, (d, m)
    attention: jax.Array  # a, (d, d)
    weights: jax.Array  # ω, (d, d)
    mixed: jax.Array  # ā, (d, m)
    e: jax.Array  # (d, d)
    curvature: jax.Array  # N, (d, m, m)

    @property
    def steps(self) -> jax.Array:
        """U = diag(ω) (E - 1 āᵀ) per query, (d, d, m)."""
        return self.weights[:, :, None] * (self.values[None, :, :] - self.mixed[:, None, :])


def _query_expansion(model: OneLayerTransformer, params: Params, P: jax.Array, mean: jax.Array,
                     queries: jax.Array | None = None) -> QueryExpansion:
    """``QueryExpansion`` at the mean compositions (rows of ``mean``) of every query, or of ``queries`` only (then
    ``mean`` has their rows). Cost: O(d² (m + k) + d² m²) for every query."""
    mm = model._matmul
    W1 = params["W1"]
    queries = jnp.arange(model.d) if queries is None else queries
    P = P[queries]
    values = mm(params["W0"], params["W_V"]) if model.value_matrix else params["W0"]
    held = mean > 0
    attention = jax.nn.softmax(jnp.where(held, model.attention_logits(params)[queries]
                                         + jnp.log(jnp.where(held, mean, 1.0)), -jnp.inf), axis=-1)
    logits = model.logits_from_attention(params, attention, queries)
    probabilities = jax.nn.softmax(logits, axis=-1)
    head = mm(probabilities, W1.T)  # W1 p, (q, m)
    return QueryExpansion(
        loss=jax.nn.logsumexp(logits, axis=-1) - jnp.sum(P * logits, axis=-1), values=values, attention=attention,
        weights=jnp.where(held, attention / jnp.where(held, mean, 1.0), 0.0), mixed=mm(attention, values),
        e=mm(mm(probabilities - P, W1.T), values.T),
        curvature=jnp.einsum("nd,qd,md->qnm", W1, probabilities, W1) - head[:, :, None] * head[:, None, :])


def _curvature_traces(x: QueryExpansion, U: jax.Array, CU: jax.Array, C_weights: jax.Array) -> jax.Array:
    """tr(C_q ∇²ℓ_q) per query from C_q's products with U and ω (``CU``, ``C_weights``):
    ⟨Uᵀ C U, N⟩ + 2 (a · e) ωᵀ C ω - 2 ωᵀ C (ω ∘ e). O(d² m²)."""
    logit_curvature = jnp.einsum("qjn,qjm,qnm->q", U, CU, x.curvature)
    attention_curvature = 2.0 * (jnp.sum(x.attention * x.e, axis=-1) * jnp.sum(x.weights * C_weights, axis=-1)
                                 - jnp.sum(x.weights * x.e * C_weights, axis=-1))
    return logit_curvature + attention_curvature


def _second_order_core(model: OneLayerTransformer, params: Params, P: jax.Array, query_probability: jax.Array,
                       mean: jax.Array, covariance: jax.Array, queries: jax.Array | None = None) -> jax.Array:
    """Σ_q p_q [ℓ_q(μ_q) + ½ tr(C_q ∇²ℓ_q(μ_q))], with (``QueryExpansion``)

        tr(C ∇²ℓ_q) = ⟨Uᵀ C U, N⟩ + 2 (a · e) ωᵀ C ω - 2 ωᵀ C (ω ∘ e),

    over every query, or over ``queries`` only (``query_probability``, ``mean``, ``covariance``: their rows).
    Cost: O(d³ m) for the C_q U products, O(d² m²) for the rest."""
    x = _query_expansion(model, params, P, mean, queries)
    U = x.steps
    traces = _curvature_traces(x, U, jnp.einsum("qjk,qkm->qjm", covariance, U),
                               jnp.einsum("qjk,qk->qj", covariance, x.weights))
    return jnp.sum(query_probability * (x.loss + 0.5 * traces))


def _folded_traces(model: OneLayerTransformer, params: Params, P: jax.Array, query_probability: jax.Array,
                   mean: jax.Array, others: jax.Array, independent_scale: jax.Array, kept: jax.Array,
                   correction: jax.Array) -> jax.Array:
    """Σ_q p_q ½ tr(C_q ∇²ℓ_q(μ_q)) with C_q = I_q + B_q (``flowsim.model.windows.FoldedWindowComposition``), the
    traces written out so that no (d, d, m) array is formed. With I_q = c (diag ν - ν νᵀ) (c = ``independent_scale``, ν
    = ``others``), w = ν ∘ ω², S = Σ_j w_j E_j E_jᵀ, g = Eᵀ w and u = Uᵀ ν = Eᵀ (ν ∘ ω) - (ν · ω) ā:

        ⟨Uᵀ I U, N⟩ = c (⟨S, N⟩ - 2 āᵀ N g + (Σ w) āᵀ N ā - uᵀ N u),
        ωᵀ I ω = c (Σ w - (ν · ω)²),   ωᵀ I (ω ∘ e) = c (w · e - (ν · ω)(ν · (ω ∘ e))),

    and B_q's terms on the K kept types through U's K kept rows. Cost: O(d² m²) in two matrix products (S, and N as
    in ``QueryExpansion``), O(d² m) for the rest of the independent part, O(d K² m + d K m²) for the kept block."""
    x = _query_expansion(model, params, P, mean)
    d, m = x.values.shape
    c, E, N = independent_scale, x.values, x.curvature
    w = others * x.weights**2
    S = (w @ (E[:, :, None] * E[:, None, :]).reshape(d, m * m)).reshape(-1, m, m)
    along = others * x.weights  # ν ∘ ω
    overlap = jnp.sum(along, axis=-1)  # ν · ω
    u = along @ E - overlap[:, None] * x.mixed

    def form(left: jax.Array, right: jax.Array) -> jax.Array:  # leftᵀ N right, per query
        return jnp.einsum("qn,qnm,qm->q", left, N, right)

    logit_independent = c * (jnp.sum(S * N, axis=(1, 2)) - 2.0 * form(x.mixed, w @ E)
                             + jnp.sum(w, axis=-1) * form(x.mixed, x.mixed) - form(u, u))
    U_kept = x.weights[:, kept, None] * (E[kept][None, :, :] - x.mixed[:, None, :])  # U's kept rows, (q, K, m)
    logit_kept = jnp.einsum("qjn,qjk,qkm,qnm->q", U_kept, correction, U_kept, N)
    weighted_e = x.weights * x.e  # ω ∘ e
    omega_kept, weighted_e_kept = x.weights[:, kept], weighted_e[:, kept]
    omega_omega = (c * (jnp.sum(w, axis=-1) - overlap**2)
                   + jnp.einsum("qj,qjk,qk->q", omega_kept, correction, omega_kept))
    omega_weighted_e = (c * (jnp.sum(w * x.e, axis=-1) - overlap * jnp.sum(others * weighted_e, axis=-1))
                        + jnp.einsum("qj,qjk,qk->q", weighted_e_kept, correction, omega_kept))
    traces = (logit_independent + logit_kept
              + 2.0 * (jnp.sum(x.attention * x.e, axis=-1) * omega_omega - omega_weighted_e))
    return 0.5 * jnp.sum(query_probability * traces)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _folded_traces_without_curvature(model: OneLayerTransformer, params: Params, *data: jax.Array) -> jax.Array:
    """``_folded_traces`` with its exact value and gradient and no second derivative: the flow's Jacobian is then
    the mean composition's loss's, whose products cost O(d² m), while each field evaluation stays exact. The term
    is O(1/s) of the loss, so Newton's iteration converges on the rest's Jacobian (JaxBDF with exact products)."""
    return _folded_traces(model, params, *data)


@_folded_traces_without_curvature.defjvp
def _folded_traces_without_curvature_jvp(model, primals, tangents):
    params, *data = primals
    value, gradient = jax.value_and_grad(_folded_traces, argnums=1)(model, params, *data)
    gradient = jax.lax.stop_gradient(gradient)
    return value, sum(jnp.vdot(gradient[name], tangents[0][name]) for name in gradient)


def _second_order_folded_core(model: OneLayerTransformer, params: Params, P: jax.Array, query_probability: jax.Array,
                              mean: jax.Array, others: jax.Array, independent_scale: jax.Array, kept: jax.Array,
                              correction: jax.Array) -> jax.Array:
    """``_second_order_core`` with the folded covariance: Σ_q p_q ℓ_q(μ_q) plus ``_folded_traces`` (its Hessian
    left out, ``_folded_traces_without_curvature``). Cost: O(d² (m + k) + d² m² + d K² m) an evaluation; a
    Hessian-vector product O(d² (m + k)) besides."""
    losses = _query_expansion(model, params, P, mean).loss  # only ℓ_q: the compiled loss drops the rest
    return jnp.sum(query_probability * losses) + _folded_traces_without_curvature(
        model, params, P, query_probability, mean, others, independent_scale, kept, correction)


def _sampled_remainder(model: OneLayerTransformer, params: Params, P: jax.Array, mean: jax.Array,
                       contexts: jax.Array) -> jax.Array:
    """The mean over sampled windows of what the second-order loss leaves out: for window n (query q, type
    frequencies x), ℓ_q(x) minus its second-order Taylor polynomial T_q(x) around μ_q (``QueryExpansion``). ℓ_q(x)
    takes the target's law P[q] (a Markov chain's next token depends on the window only through q), not a sampled
    target. μ_q · U = 0 and μ_q · ω = 1, so each window's Taylor terms are sums over its s tokens: O(N (s + d) m)."""
    x = _query_expansion(model, params, P, mean)
    s = contexts.shape[1]
    query = contexts[:, -1]
    logits = model.forward(params, contexts)
    window_loss = jax.nn.logsumexp(logits, axis=-1) - jnp.sum(P[query] * logits, axis=-1)
    omega = jnp.take_along_axis(x.weights[query], contexts, axis=1) / s  # ω_q[x_t] / s, (N, s)
    e = jnp.take_along_axis(x.e[query], contexts, axis=1)
    e_mean = jnp.sum(x.attention * x.e, axis=-1)[query]  # a · e
    slope = jnp.sum(omega * (e - e_mean[:, None]), axis=1)  # ∇ℓ_q · δ
    projected = jnp.einsum("nt,ntm->nm", omega, x.values[contexts]) - jnp.sum(omega, axis=1, keepdims=True) * x.mixed[query]
    weight_step = jnp.sum(omega, axis=1) - 1.0  # ω · δ
    quadratic = (jnp.einsum("nm,nmk,nk->n", projected, x.curvature[query], projected)
                 + 2.0 * weight_step * (e_mean * weight_step - (jnp.sum(omega * e, axis=1) - e_mean)))
    return jnp.mean(window_loss - x.loss[query] - slope - 0.5 * quadratic)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _remainder_without_curvature(model: OneLayerTransformer, params: Params, P: jax.Array, mean: jax.Array,
                                 contexts: jax.Array) -> jax.Array:
    """``_sampled_remainder`` with its exact value and gradient and no second derivative: the gradient flow's
    Jacobian (the loss's Hessian) then runs through the second-order loss alone, O(d³ m) a product, not through
    every sampled window; the implicit methods' Newton matrix is that much cheaper and only approximate."""
    return _sampled_remainder(model, params, P, mean, contexts)


@_remainder_without_curvature.defjvp
def _remainder_without_curvature_jvp(model, primals, tangents):
    params, P, mean, contexts = primals
    value, gradient = jax.value_and_grad(_sampled_remainder, argnums=1)(model, params, P, mean, contexts)
    gradient = jax.lax.stop_gradient(gradient)
    return value, sum(jnp.vdot(gradient[name], tangents[0][name]) for name in gradient)


def _control_variate_core(model: OneLayerTransformer, params: Params, P: jax.Array, query_probability: jax.Array,
                          mean: jax.Array, covariance: jax.Array, contexts: jax.Array) -> jax.Array:
    """The second-order loss plus ``_sampled_remainder`` on the windows ``contexts``. E[T_q(x) | q] is exactly the
    second-order loss's term for q, so the sum is an unbiased estimate of the finite-s loss whatever the
    expansion's error; where the expansion holds only the small remainder is sampled. Its Hessian is the
    second-order loss's (``_remainder_without_curvature``)."""
    return (_second_order_core(model, params, P, query_probability, mean, covariance)
            + _remainder_without_curvature(model, params, P, mean, contexts))


# ---------------------------------------------------------------------------------
# Exact law of (count vector, query token) for a context of length s


@dataclass(frozen=True)
class ContextCountLaw:
    """The exact joint law of (c, x_s) for contexts of length s: one row per support point.

    ``counts`` (S, d) are the type counts of x_1..x_s, ``query`` (S,) is x_s and
    ``probability`` (S,) sums to 1.
    """

    s: int
    counts: np.ndarray
    query: np.ndarray
    probability: np.ndarray


def _compositions(total: int, n_parts: int, cache: dict) -> np.ndarray:
    """All non-negative integer vectors of length n_parts summing to ``total``, in lexicographic order."""
    if (total, n_parts) not in cache:
        if n_parts == 1:
            block = np.array([[total]], dtype=np.int64)
        else:
            block = np.concatenate(
                [
                    np.column_stack([np.full(len(tail), first, dtype=np.int64), tail])
                    for first in range(total + 1)
                    for tail in [_compositions(total - first, n_parts - 1, cache)]
                ]
            )
        cache[total, n_parts] = block
    return cache[total, n_parts]


def _graded_rank(vectors: np.ndarray) -> np.ndarray:
    """Position of each row in the order of ``_graded_vectors`` (by sum, then lexicographic).

    Vectors of length p with sum < g number C(g-1+p, p); inside sum g, those whose
    first entry is below a number C(g+p-1, p-1) - C(g-a+p-1, p-1) (hockey stick), and
    the rank continues on the tail.
    """
    n_parts = vectors.shape[1]
    remaining = vectors.sum(axis=1)
    rank = _binomial(remaining - 1 + n_parts, n_parts)
    for i in range(n_parts - 1):
        parts_left = n_parts - i
        rank += _binomial(remaining + parts_left - 1, parts_left - 1) - _binomial(
            remaining - vectors[:, i] + parts_left - 1, parts_left - 1
        )
        remaining = remaining - vectors[:, i]
    return rank


def _binomial(n: np.ndarray, k: int) -> np.ndarray:
    """C(n, k) elementwise for integer arrays n (0 where n < k), exact in int64 for our sizes."""
    value = np.ones_like(n)
    for i in range(k):
        value = value * (n - i) // (i + 1)  # each partial product is itself a binomial: exact
    return np.where(n >= k, value, 0)


def _graded_vectors(n_parts: int, total_max: int) -> np.ndarray:
    """All non-negative integer vectors of length n_parts with sum <= total_max, ordered
    by sum (then lexicographically), so that those with sum <= t form a prefix."""
    cache: dict = {}
    return np.concatenate([_compositions(total, n_parts, cache) for total in range(total_max + 1)])


def context_count_law(chain: MarkovChain, s: int) -> ContextCountLaw:
    """Exact law of (c, x_s) by a dynamic programme over positions t = 1..s.

    The state after t positions is (c, x_t) with c a composition of t into d parts. It
    is stored by its first d-1 counts (the last is t minus their sum) in an order where
    the states reachable at step t are a prefix, so each step is one (d, d) @ (d, n)
    product (mix by P[x_t, :]) and d-1 gathers (add the new token to its count).
    Results are cached per chain and s.
    """
    if not isinstance(s, (int, np.integer)) or s < 1:
        raise ValueError(f"the context length s must be a positive integer, got {s!r}")
    key = (chain.cache_key(), int(s))
    if key not in _COUNT_LAW_CACHE:
        if len(_COUNT_LAW_CACHE) >= 8:
            _COUNT_LAW_CACHE.pop(next(iter(_COUNT_LAW_CACHE)))
        _COUNT_LAW_CACHE[key] = _compute_count_law(chain.P, chain.start_distribution, int(s))
    return _COUNT_LAW_CACHE[key]


_COUNT_LAW_CACHE: dict[tuple[bytes, int], ContextCountLaw] = {}


def _compute_count_law(P: np.ndarray, start: np.ndarray, s: int) -> ContextCountLaw:
    d = P.shape[0]
    free = _graded_vectors(d - 1, s)  # first d-1 counts; the count of token d-1 is implied
    grade = free.sum(axis=1)
    prefix_size = np.searchsorted(grade, np.arange(s + 1), side="right")  # states with sum <= t

    # Arrays below are stored token-major with a zero column 0 in front, so that "row r"
    # lives at index r + 1 and index 0 stands for an impossible predecessor.
    # source[j][r]: where (c - e_j) lives, for the state c of row r (0 when c_j = 0).
    source = []
    for j in range(d - 1):
        has_j = free[:, j] > 0
        index = np.zeros(len(free), dtype=np.int64)
        index[has_j] = _graded_rank(free[has_j] - np.eye(d - 1, dtype=np.int64)[j]) + 1
        source.append(index)

    # Two buffers reused across steps (fresh allocations would page-fault every step).
    state = np.zeros((d, len(free)))
    mixed = np.zeros((d, len(free) + 1))
    for token in range(d):  # t = 1: c = e_{x_1}, query = x_1
        coords = np.zeros((1, d - 1), dtype=np.int64)
        if token < d - 1:
            coords[0, token] = 1
        state[token, _graded_rank(coords)[0]] = start[token]

    transposed_P = np.ascontiguousarray(P.T)
    for t in range(2, s + 1):
        n_prev, n_new = prefix_size[t - 1], prefix_size[t]
        np.matmul(transposed_P, state[:, :n_prev], out=mixed[:, 1 : n_prev + 1])  # Σ_i P[i, j] state[i, r]
        for j in range(d - 1):
            np.take(mixed[j], source[j][:n_new], out=state[j, :n_new])
        state[d - 1, :n_prev] = mixed[d - 1, 1 : n_prev + 1]  # token d-1: the free counts stay put
        state[d - 1, n_prev:n_new] = 0.0

    query, rows = np.nonzero(state > 0)
    counts = np.empty((len(rows), d), dtype=np.int64)
    counts[:, : d - 1] = free[rows]
    counts[:, d - 1] = s - grade[rows]
    return ContextCountLaw(s=s, counts=counts, query=query, probability=state[query, rows])


def _count_law_core(
    model: Model,
    params: Params,
    P: jax.Array,
    log_counts: jax.Array,
    query: jax.Array,
    probability: jax.Array,
) -> jax.Array:
    """Σ_(c, q) Prob(c, q) · E_{y ~ P[q]} [-log softmax(f(c, q))_y], attention ∝ c_j exp(logit)."""
    logits = model.logits_over_types(params, log_counts, query)
    return expected_cross_entropy(logits, P[query], probability)


_count_law_core_jit = jax.jit(_count_law_core, static_argnums=0)


def _count_law_arrays(chain: MarkovChain, law: ContextCountLaw) -> tuple[jax.Array, ...]:
    """(P, log c with -inf for absent types, query, probability) as JAX arrays."""
    counts = law.counts.astype(np.float64)
    with np.errstate(divide="ignore"):
        log_counts = np.log(counts)  # log 0 = -inf: an absent type gets no attention
    return tuple(jnp.asarray(a) for a in (chain.P, log_counts, law.query, law.probability))


def second_order_loss(model: OneLayerTransformer, chain: MarkovChain, composition: WindowComposition) -> Partial:
    """``loss(params)``: the finite-s loss to second order (``_second_order_core``) with the window moments given."""
    return Partial(ModelLoss(_second_order_core, model), P=jnp.asarray(chain.P),
                   query_probability=jnp.asarray(composition.query_probability),
                   mean=jnp.asarray(composition.mean), covariance=jnp.asarray(composition.covariance))


def folded_second_order_loss(model: OneLayerTransformer, chain: MarkovChain,
                             composition: FoldedWindowComposition) -> Partial:
    """``loss(params)``: the finite-s loss to second order with the folded covariance (``_second_order_folded_core``)."""
    return Partial(ModelLoss(_second_order_folded_core, model), P=jnp.asarray(chain.P),
                   query_probability=jnp.asarray(composition.query_probability), mean=jnp.asarray(composition.mean),
                   others=jnp.asarray(composition.others),
                   independent_scale=jnp.asarray((composition.s - 1) / composition.s**2),
                   kept=jnp.asarray(composition.kept), correction=jnp.asarray(composition.correction))


@functools.partial(jax.jit, static_argnums=0)
def _second_order_block_and_gradient(model: OneLayerTransformer, params: Params, P: jax.Array,
                                     query_probability: jax.Array, mean: jax.Array, covariance: jax.Array,
                                     queries: jax.Array) -> tuple[jax.Array, Params]:
    """A block of queries' share of ``_second_order_core`` and its gradient."""
    return jax.value_and_grad(_second_order_core, argnums=1)(model, params, P, query_probability, mean, covariance,
                                                             queries)


def second_order_losses_by_blocks(model: OneLayerTransformer, chain: MarkovChain, s: int, points: list[Params],
                                  block: int = 64) -> list[tuple[float, Params]]:
    """The second-order loss and its gradient (``_second_order_core``) at each parameter point, with every C_q exact,
    built ``block`` queries at a time (``flowsim.model.windows.window_covariance_blocks``) and shared by the points:
    the reference for the fold at a d whose d³ covariance does not fit. Cost: O(s d³) for the moments, O(d³ m) a
    point for the traces; memory O(s d² + block d² m). For checks at a few points, not for a flow."""
    query_probability, mean = window_mean(chain, s)
    P = jnp.asarray(chain.P)
    totals, gradients = [0.0] * len(points), [None] * len(points)
    for queries, covariance in window_covariance_blocks(chain, s, block):
        block_data = (P, jnp.asarray(query_probability[queries]), jnp.asarray(mean[queries]), jnp.asarray(covariance),
                      jnp.asarray(queries))
        for i, params in enumerate(points):
            value, share = _second_order_block_and_gradient(model, params, *block_data)
            totals[i] += float(value)
            gradients[i] = share if gradients[i] is None else jax.tree_util.tree_map(jnp.add, gradients[i], share)
    return list(zip(totals, gradients))


def population_loss_finite_second_order(params: Params, chain: MarkovChain, s: int, model: OneLayerTransformer) -> jax.Array:
    """The finite-s loss to second order in the window's composition (``_second_order_core``): error O(1/s²)."""
    return second_order_loss(model, chain, window_composition(chain, s))(params)


def population_loss_finite(params: Params, chain: MarkovChain, s: int, model: Model) -> jax.Array:
    """The exact population loss for contexts of length s (x_1 from the chain's start law)."""
    return _count_law_core_jit(model, params, *_count_law_arrays(chain, context_count_law(chain, s)))


def population_loss_enumerated(params: Params, chain: MarkovChain, s: int, model: Model) -> jax.Array:
    """The finite-s loss by brute force over all d^s contexts and the positional forward pass."""
    if chain.d**s > ENUMERATION_LIMIT:
        raise ValueError(f"enumeration of d^s = {chain.d}^{s} contexts exceeds the limit {ENUMERATION_LIMIT}")
    contexts = np.array(list(itertools.product(range(chain.d), repeat=s)), dtype=np.int64)
    probability = chain.start_distribution[contexts[:, 0]].copy()
    for t in range(1, s):
        probability *= chain.P[contexts[:, t - 1], contexts[:, t]]
    return _enumerated_core_jit(model, params, contexts, jnp.asarray(chain.P)[contexts[:, -1]], probability)


def _enumerated_core(model: Model, params: Params, contexts, target_probabilities, probability):
    return expected_cross_entropy(model.forward(params, contexts), target_probabilities, probability)


_enumerated_core_jit = jax.jit(_enumerated_core, static_argnums=0)


@dataclass(frozen=True)
class MonteCarloEstimate:
    """A sampled loss: mean over ``n`` sequences and its standard error."""

    mean: float
    stderr: float
    n: int


def _sampled_cross_entropy(
    model: Model, params: Params, contexts: jax.Array, targets: jax.Array
) -> jax.Array:
    logits = model.forward(params, contexts)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]


_sampled_cross_entropy_jit = jax.jit(_sampled_cross_entropy, static_argnums=0)


def _sampled_loss_core(model: Model, params: Params, contexts: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean(_sampled_cross_entropy(model, params, contexts, targets))


def loss_monte_carlo(
    params: Params, chain: MarkovChain, s: int, n_samples: int, seed: int, model: Model
) -> MonteCarloEstimate:
    """Monte Carlo estimate of the finite-s loss from ``n_samples`` sampled sequences."""
    sequences = chain.sample(n_samples, s + 1, seed)
    losses = np.asarray(_sampled_cross_entropy_jit(model, params, sequences[:, :-1], sequences[:, -1]))
    return MonteCarloEstimate(mean=float(losses.mean()), stderr=float(losses.std(ddof=1) / np.sqrt(n_samples)), n=n_samples)


@dataclass(frozen=True)
class ModelLoss:
    """``core`` with ``model`` bound: compares by value, so the losses of equal models
    share one treedef and hence one compiled flow (functools.partial compares by identity)."""

    core: object
    model: Model

    def __call__(self, params: Params, **data) -> jax.Array:
        return self.core(self.model, params, **data)


def with_fused_products(loss: Partial) -> Partial:
    """The same loss with the model's small matrix products in fusible form
    (``fused_products=True``, ``models.small_matmul``); a loss that is not a ``ModelLoss``
    (a user's own function) is returned unchanged. Being part of the treedef, the choice
    also keeps JAX's trace caches of the two forms apart."""
    if not isinstance(loss.func, ModelLoss):
        return loss
    fused = dataclasses.replace(loss.func, model=dataclasses.replace(loss.func.model, fused_products=True))
    return Partial(fused, *loss.args, **loss.keywords)


def finite_loss_states(d: int, s: int) -> int:
    """The size of the dynamic programme's arrays, C(s+d-1, d-1)·d (count vectors × last token):
    an upper bound on the states the exact finite-s loss sums over (those with c_{x_s} ≥ 1,
    d·C(s+d-2, d-1) of them)."""
    return math.comb(s + d - 1, d - 1) * d


LOSS_SETTINGS = {"s": "loss.s", "mc_samples": "loss.mc_samples"}  # the settings a message names


def check_loss_size(kind: str, d: int, s: int, model: Model, mc_samples: int = 0,
                    settings: dict[str, str] = LOSS_SETTINGS, kept_types: int | None = None) -> None:
    """Refuse (``flowsim.common.budget.BudgetError``) a finite-s or Monte Carlo loss too large for the
    memory budget, before anything is allocated. Per state (or sampled context) the estimate
    counts its arrays and the activations of a Hessian-vector product: 8·(8d + 2m) bytes per
    state; 8·((s + 1)·(2 min(d, m) + 2m) + 4d) bytes per sampled sequence (the models read a context
    through its m-wide embedding rows where d > m, ``OneLayerTransformer.context_mixture``). The message
    also gives the dynamic programme's work, about s·d·states operations, and names s and the sample count
    by ``settings`` (the bridge sets them through its own keys)."""
    width = int(getattr(model, "m", d))
    if kind == "finite":
        states = finite_loss_states(d, s)
        operations = float(s) * d * states  # the dynamic programme: s steps of a (d, d) @ (d, states / d) product
        check_memory(8.0 * states * (8 * d + 2 * width),
                     f"loss.kind = 'finite' with s = {s}, d = {d} ({states:.3g} count states; building them takes "
                     f"about {operations:.2g} operations, {operations / 1e9:.2g} s at 1e9 per second)",
                     f"lower {settings['s']}, or use loss.kind = 'monte_carlo' or 'mean_field'")
    elif kind in ("finite_second_order", "finite_control_variate") and kept_types is not None and kept_types < d:
        check_memory(8.0 * (s * d * d + 3 * d * kept_types**2 + 16 * d * d + 8 * d * width * (width + kept_types)),
                     f"loss.kind = 'finite_second_order' at d = {d} with {kept_types} kept types (P's s powers, "
                     "the kept block of every query's covariance)", "keep fewer types or lower s")
    elif kind in ("finite_second_order", "finite_control_variate"):
        check_memory(window_composition_bytes(d) + 8.0 * 8 * d * d * width,
                     f"loss.kind = {kind!r} at d = {d} (the window composition's covariance, d³ entries)",
                     "use fewer tokens, keep fewer types (kept_types), or loss.kind = 'monte_carlo' or 'mean_field'")
    elif kind == "monte_carlo":
        check_memory(8.0 * mc_samples * ((s + 1) * (2 * min(d, width) + 2 * width) + 4 * d),
                     f"the Monte Carlo loss on {mc_samples} sequences of s = {s}",
                     f"lower {settings['mc_samples']} or {settings['s']}")


def make_loss_function(
    model: Model,
    chain: MarkovChain,
    kind: LossKind = "mean_field",
    s: int | None = None,
    mc_samples: int = 4096,
    mc_seed: int = 0,
    settings: dict[str, str] = LOSS_SETTINGS,
    kept_types: int | None = None,
) -> Partial:
    """The loss as a function of the parameters alone, ``loss(params) -> scalar``.

    It is a ``jax.tree_util.Partial`` whose leaves are the chain's data, so a jitted
    function that takes it as an argument traces the data instead of baking large
    constants into the compiled code. ``monte_carlo`` is the empirical loss on one
    fixed set of ``mc_samples`` sampled sequences (seeded): its flow is deterministic.
    ``settings`` names s and ``mc_samples`` in error messages (``LOSS_SETTINGS``: the run config's keys).
    ``kept_types`` (``finite_second_order``): keep the window covariance's Markov correlations among that many most
    frequent types only (``folded_window_composition``: O(d K²) memory instead of d³, O(d² m² + d K² m) an
    evaluation instead of O(d³ m)); None keeps them all.
    """
    if model.d != chain.d:
        raise ValueError(f"the model has d = {model.d} tokens but the chain has d = {chain.d}")
    if kind not in LOSS_KINDS:
        raise ValueError(f"loss.kind must be one of {LOSS_KINDS}, got {kind!r}")
    if kind == "mean_field":
        return Partial(ModelLoss(_mean_field_core, model), pi=jnp.asarray(chain.pi), P=jnp.asarray(chain.P))
    if s is None or not isinstance(s, (int, np.integer)) or s < 1:
        raise ValueError(f"loss.kind = {kind!r} needs a positive integer context length {settings['s']}, got {s!r}")
    check_loss_size(kind, chain.d, int(s), model, mc_samples, settings,
                    kept_types if kind == "finite_second_order" else None)
    if kind == "finite":
        P, log_counts, query, probability = _count_law_arrays(chain, context_count_law(chain, s))
        core = ModelLoss(_count_law_core, model)
        return Partial(core, P=P, log_counts=log_counts, query=query, probability=probability)
    if kind in ("finite_second_order", "finite_control_variate"):
        if not isinstance(model, OneLayerTransformer):
            raise ValueError(f"loss.kind = {kind!r} is written for the one-layer model, got {type(model).__name__}")
        if kind == "finite_second_order" and kept_types is not None and kept_types < chain.d:
            return folded_second_order_loss(model, chain, folded_window_composition(chain, int(s), int(kept_types)))
        if kind == "finite_second_order":
            return second_order_loss(model, chain, window_composition(chain, int(s)))
    if not isinstance(mc_samples, (int, np.integer)) or mc_samples < 2:
        raise ValueError(f"{settings['mc_samples']} must be an integer >= 2, got {mc_samples!r}")
    if kind == "finite_control_variate":
        composition = window_composition(chain, int(s))
        return Partial(ModelLoss(_control_variate_core, model), P=jnp.asarray(chain.P),
                       query_probability=jnp.asarray(composition.query_probability),
                       mean=jnp.asarray(composition.mean), covariance=jnp.asarray(composition.covariance),
                       contexts=jnp.asarray(chain.sample(mc_samples, s, mc_seed)))
    sequences = chain.sample(mc_samples, s + 1, mc_seed)
    core = ModelLoss(_sampled_loss_core, model)
    return Partial(core, contexts=jnp.asarray(sequences[:, :-1]), targets=jnp.asarray(sequences[:, -1]))


def make_window_loss(model: Model, windows) -> Partial:
    """The empirical next-token loss on fixed token windows (N × (s + 1) integers: each window's first s
    tokens are the context, its last the target): the mean cross-entropy the bridge's SGD takes one batch
    of at a time, here over all N at once, so its gradient flow is the full-batch flow. O(N s (m + k) + N d m)
    per evaluation."""
    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be N x (s + 1) token ids with s >= 1, got shape {windows.shape}")
    if windows.min() < 0 or windows.max() >= model.d:
        raise ValueError(f"window tokens must lie in 0 .. {model.d - 1}, got {windows.min()} .. {windows.max()}")
    return Partial(ModelLoss(_sampled_loss_core, model), contexts=jnp.asarray(windows[:, :-1]), targets=jnp.asarray(windows[:, -1]))


def population_loss_task(params: Params, task: InductionTask, model: Model) -> jax.Array:
    """The exact population loss of ``model`` on a sequence task (every context of positive
    probability, weighted by it, against the exact law of the next token)."""
    law = task.law
    return _enumerated_core_jit(model, params, law.contexts, law.next_law, law.probability)


def make_task_loss(model: Model, task: InductionTask, kind: LossKind = "finite", mc_samples: int = 4096,
                   mc_seed: int = 0) -> Partial:
    """``loss(params)`` on a sequence task: exact (``finite``, the default) or the empirical
    loss on ``mc_samples`` sampled sequences (``monte_carlo``, seeded, so its flow is
    deterministic). A task has no s → ∞ limit: ``mean_field`` is refused."""
    if getattr(model, "s", None) != task.s or model.d != task.d:
        raise ValueError(f"the model (d = {model.d}, s = {getattr(model, 's', None)}) does not fit the task "
                         f"(d = {task.d}, s = {task.s}); a task needs model.kind = 'two_layer', which takes its d and s")
    if kind == "finite":
        law = task.law
        return Partial(ModelLoss(_enumerated_core, model), contexts=jnp.asarray(law.contexts),
                       target_probabilities=jnp.asarray(law.next_law), probability=jnp.asarray(law.probability))
    if kind == "monte_carlo":
        if not isinstance(mc_samples, (int, np.integer)) or mc_samples < 2:
            raise ValueError(f"loss.mc_samples must be an integer >= 2, got {mc_samples!r}")
        sequences = task.sample(mc_samples, mc_seed)
        return Partial(ModelLoss(_sampled_loss_core, model), contexts=jnp.asarray(sequences[:, :-1]),
                       targets=jnp.asarray(sequences[:, -1]))
    raise ValueError(f"loss.kind = {kind!r} does not apply to a sequence task (it has no s -> infinity limit); "
                     "expected 'finite' (exact) or 'monte_carlo'")


def population_loss(
    params: Params, chain: MarkovChain, s: int | None = None, *, model: Model | None = None
) -> jax.Array:
    """The exact population loss: mean-field for ``s=None``, else exact for context length s.

    ``model`` defaults to the paper model with the shapes of ``params``.
    """
    model = model_for_params(params) if model is None else model
    model.check_params(params)
    if model.d != chain.d:
        raise ValueError(f"the model has d = {model.d} tokens and the chain d = {chain.d}: they must be equal")
    if s is None:
        return population_loss_mean_field(params, chain, model)
    return population_loss_finite(params, chain, s, model)
