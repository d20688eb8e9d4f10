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

The covariance has d³ entries (8 GB at d = 1001). ``folded_window_composition`` keeps it exactly only among K kept
types: C_q = I_q + B_q, with I_q the covariance of a window whose other s - 1 tokens are independent draws from its
mean composition (diagonal plus rank one: O(d) numbers) and B_q = C_q - I_q on the kept types only, zero elsewhere.
So a window's Markov correlations are kept between the kept types and dropped for the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
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


@dataclass(frozen=True)
class FoldedWindowComposition:
    """``WindowComposition`` with C_q = I_q + B_q (module docstring): ``kept`` (K,) the types whose Markov correlations
    are kept, ``correction`` (d, K, K) block q is B_q. O(d K²) numbers instead of d³."""

    s: int
    query_probability: np.ndarray
    mean: np.ndarray
    kept: np.ndarray
    correction: np.ndarray

    @property
    def others(self) -> np.ndarray:
        """ν_q = (s μ_q - e_q)/(s - 1): the mean composition of the s - 1 tokens besides the query (rows q)."""
        return independent_others(self.mean, self.s)

    def covariance(self) -> np.ndarray:
        """The folded C_q as a (d, d, d) array (for checks at small d)."""
        d = self.mean.shape[0]
        covariance = independent_covariance(self.mean, self.s)
        covariance[np.ix_(np.arange(d), self.kept, self.kept)] += self.correction
        return covariance


def independent_others(mean: np.ndarray, s: int) -> np.ndarray:
    """ν_q = (s μ_q - e_q)/(s - 1) for each row q of ``mean`` (s = 1: the query alone, ν = 0)."""
    d = mean.shape[1]
    return (s * mean - np.eye(d)) / (s - 1) if s > 1 else np.zeros_like(mean)


def independent_covariance(mean: np.ndarray, s: int) -> np.ndarray:
    """I_q = (s - 1)/s² (diag ν_q - ν_q ν_qᵀ): Cov(c / s | q) for a window whose s - 1 tokens besides the query are
    independent draws from ν_q (``independent_others``), as (d, d, d). O(d³): for checks and small d."""
    others = independent_others(mean, s)
    d = mean.shape[1]
    return (s - 1) / s**2 * (np.einsum("qj,jk->qjk", others, np.eye(d)) - others[:, :, None] * others[:, None, :])


def window_composition_bytes(d: int) -> float:
    """The memory the moments take while they are built: about four d³ float64 arrays."""
    return 4 * 8.0 * d**3


def _position_laws(chain: MarkovChain, s: int) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray], np.ndarray]:
    """(P, the marginals ρ_1..ρ_s, the powers P^0..P^{s-1}, E[c_j ; x_s = q] as [j, q]). O(s d³)."""
    if not isinstance(s, (int, np.integer)) or s < 1:
        raise ValueError(f"the window length s must be a positive integer, got {s!r}")
    P = np.asarray(chain.P, dtype=float)
    marginals = [np.asarray(chain.start_distribution, dtype=float)]
    for _ in range(1, s):
        marginals.append(marginals[-1] @ P)
    powers = [np.eye(chain.d)]
    for _ in range(1, s):
        powers.append(powers[-1] @ P)
    first = sum(marginals[t - 1][:, None] * powers[s - t] for t in range(1, s + 1))
    return P, marginals, powers, first


def _normalised(first: np.ndarray, query_probability: np.ndarray, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seen queries, 1 / p_q where seen, μ as rows q; an unseen query's row e_q)."""
    seen = query_probability > 0
    scale = np.where(seen, 1.0 / np.where(seen, query_probability, 1.0), 0.0)
    mean = first.T * scale[:, None] / s
    mean[~seen] = np.eye(len(seen))[~seen]
    return seen, scale, mean


def window_composition(chain: MarkovChain, s: int) -> WindowComposition:
    """The exact mean and covariance of c / s given x_s for windows of length s (module docstring): every query in
    one block of ``_moments_in_blocks``.

    Cost: O(s d³) time, O(d³ + s d²) memory."""
    d = chain.d
    check_memory(window_composition_bytes(d), f"the window composition's covariance at d = {d} ({d}³ entries)",
                 "use a smaller vocabulary")
    query_probability, mean, blocks = _moments_in_blocks(chain, s, d)
    (_, covariance), = blocks
    return WindowComposition(s=int(s), query_probability=query_probability, mean=mean, covariance=covariance)


def folded_window_composition(chain: MarkovChain, s: int, kept: int) -> FoldedWindowComposition:
    """The window's exact mean and its covariance with the Markov correlations kept among the ``kept`` most frequent
    types (by π; ties by index) and dropped for the rest (module docstring). ``kept`` = d gives the exact covariance.

    Cost: O(s d³) time for P's powers, O(s d² + d K²) memory (K = ``kept``)."""
    d = chain.d
    if not isinstance(kept, (int, np.integer)) or not 1 <= kept <= d:
        raise ValueError(f"the kept types must be a count from 1 to d = {d}, got {kept!r}")
    types = np.sort(np.argsort(-np.asarray(chain.pi), kind="stable")[:kept])
    check_memory(8.0 * (s * d * d + 3 * d * kept * kept), f"the folded window composition at d = {d}, s = {s}, "
                 f"{kept} kept types", "keep fewer types or lower s")
    P, marginals, powers, first = _position_laws(chain, s)
    pairs = np.zeros((kept, kept, d))  # as in window_composition, j and k among the kept types
    earlier = np.zeros((kept, d))  # F_{t'} on the kept rows
    for t_later in range(2, s + 1):
        earlier = (earlier + np.eye(d)[types] * marginals[t_later - 2][types, None]) @ P
        pairs += earlier[:, types, None] * powers[s - t_later][types][None, :, :]
    seen, scale, mean = _normalised(first, marginals[-1], s)
    second = np.transpose(pairs + np.transpose(pairs, (1, 0, 2)), (2, 0, 1))  # [q, j, k] over the kept types
    second[:, np.arange(kept), np.arange(kept)] += first[types].T
    kept_mean = mean[:, types]
    covariance = second * (scale / s**2)[:, None, None] - kept_mean[:, :, None] * kept_mean[:, None, :]
    others = independent_others(mean, s)[:, types]
    independent = (s - 1) / s**2 * (np.einsum("qj,jk->qjk", others, np.eye(kept)) - others[:, :, None] * others[:, None, :])
    correction = covariance - independent
    correction[~seen] = 0.0
    return FoldedWindowComposition(s=int(s), query_probability=marginals[-1], mean=mean, kept=types,
                                   correction=correction)


def window_mean(chain: MarkovChain, s: int) -> tuple[np.ndarray, np.ndarray]:
    """(p_q, μ_q as rows q) alone (``WindowComposition``'s query_probability and mean). O(s d³) time, O(s d²) memory."""
    _, marginals, _, first = _position_laws(chain, s)
    return marginals[-1], _normalised(first, marginals[-1], s)[2]


def window_covariance_blocks(chain: MarkovChain, s: int, block: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The exact C_q (module docstring) for ``block`` queries at a time: yields (queries (n,), C (n, d, d)), every
    query once. ``window_composition`` at a d whose d³ does not fit, for checks (of the fold, at d = 1001).

    Cost: O(s d³) time in all; O(s d² + block d²) memory (every F_t' and power of P are kept)."""
    d = chain.d
    if not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"the block of queries must be a positive integer, got {block!r}")
    check_memory(8.0 * (3 * s * d * d + 3 * block * d * d), f"the window covariance at d = {d}, s = {s} in blocks of "
                 f"{block} queries", "use smaller blocks or lower s")
    return _moments_in_blocks(chain, s, block)[2]


def _moments_in_blocks(chain: MarkovChain, s: int, block: int) -> tuple[np.ndarray, np.ndarray, Iterator]:
    """(p_q, μ_q as rows q, the C_q of ``block`` queries at a time as (queries, C) pairs). The pair sums
    Σ_t' F_t'[j, k] P^{s-t'}[k, q] of a block are, for each k, one (d × s) @ (s × n) product over positions."""
    d = chain.d
    P, marginals, powers, first = _position_laws(chain, s)
    earlier, F = [], np.zeros((d, d))
    for t_later in range(2, s + 1):
        F = (F + np.diag(marginals[t_later - 2])) @ P
        earlier.append(F)
    by_type = np.ascontiguousarray(np.stack(earlier).transpose(2, 1, 0)) if earlier else np.zeros((d, d, 0))  # [k, j, t']
    later = np.stack([powers[s - t_later] for t_later in range(2, s + 1)]) if earlier else np.zeros((0, d, d))  # [t', k, q]
    seen, scale, mean = _normalised(first, marginals[-1], s)

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start in range(0, d, block):
            queries = np.arange(start, min(start + block, d))
            pairs = np.matmul(by_type, later[:, :, queries].transpose(1, 0, 2)).transpose(2, 1, 0)  # [q, j, k]
            second = pairs + np.transpose(pairs, (0, 2, 1))
            second[:, np.arange(d), np.arange(d)] += first[:, queries].T
            covariance = second * (scale[queries] / s**2)[:, None, None] - mean[queries, :, None] * mean[queries, None, :]
            covariance[~seen[queries]] = 0.0
            yield queries, covariance

    return marginals[-1], mean, blocks()
