"""The composition of an s-token window of a Markov chain, given its last token: mean and covariance, exactly.

A window x_1..x_s (x_1 from the chain's start law ρ_1, x_{t+1} ~ P[x_t, :]) has type counts c_j = #{t : x_t = j}
and query q = x_s. The one-layer model reads the window only through (c, q) (its attention over types is
∝ c_j e^{Φ[q, j]}), so its finite-s loss is E_q E[ℓ_q(c / s) | q]. Expanding ℓ_q around the mean composition
μ_q = E[c / s | q] to second order,

    L_s = Σ_q p_q [ ℓ_q(μ_q) + ½ tr(C_q ∇²ℓ_q(μ_q)) ] + O(s⁻²),   C_q = Cov(c / s | q) = O(1 / s),

needs only μ_q and C_q, which follow from P by sums over positions, with no sampling:

    E[c_j ; q]      = Σ_t ρ_t[j] P^{s-t}[j, q],
    E[c_j c_k ; q]  = δ_jk E[c_j ; q] + Σ_{t<t'} (ρ_t[j] P^{t'-t}[j, k] P^{s-t'}[k, q] + (j ↔ k)),

with ρ_t = ρ_1 P^{t-1} and E[· ; q] = E[· 1{x_s = q}]. The pair sum is carried position by position: F_{t'}[j, k]
= Σ_{t<t'} Prob(x_t = j, x_{t'} = k) obeys F_{t'+1} = (F_{t'} + diag ρ_{t'}) P.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowsim.common.budget import check_memory
from flowsim.model.chains import MarkovChain


@dataclass(frozen=True)
class WindowComposition:
    """Moments of an s-token window's type frequencies c / s given its last token q.

    ``query_probability`` (d,): p_q = Prob(x_s = q); ``mean`` (d, d): row q is μ_q = E[c / s | q];
    ``covariance`` (d, d, d): block q is C_q = Cov(c / s | q). A query of probability 0 gets the window that holds
    only itself (μ_q = e_q, C_q = 0), so every row is a composition."""

    s: int
    query_probability: np.ndarray
    mean: np.ndarray
    covariance: np.ndarray


def window_composition_bytes(d: int) -> float:
    """The memory the moments take while they are built: about four d³ float64 arrays."""
    return 4 * 8.0 * d**3


def window_composition(chain: MarkovChain, s: int) -> WindowComposition:
    """The exact mean and covariance of c / s given x_s for windows of length s (module docstring).

    Cost: O(s d³) time (one d × d product and one d³ outer product per position), O(d³ + s d²) memory."""
    if not isinstance(s, (int, np.integer)) or s < 1:
        raise ValueError(f"the window length s must be a positive integer, got {s!r}")
    d = chain.d
    check_memory(window_composition_bytes(d), f"the window composition's covariance at d = {d} ({d}³ entries)",
                 "use a smaller vocabulary")
    P = np.asarray(chain.P, dtype=float)
    marginals = [np.asarray(chain.start_distribution, dtype=float)]  # ρ_t, t = 1..s
    for _ in range(1, s):
        marginals.append(marginals[-1] @ P)
    powers = [np.eye(d)]  # P^u, u = 0..s-1
    for _ in range(1, s):
        powers.append(powers[-1] @ P)

    first = np.zeros((d, d))  # E[c_j ; q] as [j, q]
    for t in range(1, s + 1):
        first += marginals[t - 1][:, None] * powers[s - t]
    pairs = np.zeros((d, d, d))  # Σ_{t<t'} Prob(x_t = j, x_t' = k, x_s = q) as [j, k, q]
    earlier = np.zeros((d, d))  # F_{t'}
    for t_later in range(2, s + 1):
        earlier = (earlier + np.diag(marginals[t_later - 2])) @ P
        pairs += earlier[:, :, None] * powers[s - t_later][None, :, :]

    query_probability = marginals[-1]
    seen = query_probability > 0
    scale = np.where(seen, 1.0 / np.where(seen, query_probability, 1.0), 0.0)
    mean = first.T * scale[:, None] / s
    second = np.transpose(pairs + np.transpose(pairs, (1, 0, 2)), (2, 0, 1))  # [q, j, k]
    second[:, np.arange(d), np.arange(d)] += first.T
    mean[~seen] = np.eye(d)[~seen]
    covariance = second * (scale / s**2)[:, None, None] - mean[:, :, None] * mean[:, None, :]
    covariance[~seen] = 0.0
    return WindowComposition(s=int(s), query_probability=query_probability, mean=mean, covariance=covariance)
