"""The mean-field loss of the one-layer model in closed form, at any vocabulary size.

The loss factors through the two d x d maps Φ = W0 W_Q W_K^T W0^T and M = W0 W1. With

    A = softmax(Φ + log π) (row by row),   Z = A M,   E = diag(π) (softmax(Z) - P),   F = E M^T,

    L   = Σ_i π_i (logsumexp(Z_i) - P_i · Z_i),
    G_M = ∂L/∂M = A^T E,
    G_Φ = ∂L/∂Φ = A ⊙ (F - rowsum(A ⊙ F) 1^T).

``theory.symbolic`` derives the same row by row with sympy (d <= 5): there they are checked.

On the rank-r manifolds (``theory.manifold``) the maps come factored, Φ = Γ K Γ^T with the
r x r core K = Q^T R and M = Γ B^T, and nothing of cost d³ is formed: Z = (A Γ) B^T,
F = (E B) Γ^T, and G_M enters only through products G_M X = A^T (E X) and G_M^T Y = E^T (A Y).
One evaluation is O(d² r) (plus O(d² c) per product with c columns): a handful of d x d arrays, worked on in
place by numpy, or from ``MeanFieldChain.COMPILED_FROM`` tokens on formed by one compiled function.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from flowsim.model.chains import entropy_rate


def _softmax_rows_in_place(logits: np.ndarray) -> np.ndarray:
    """Overwrite ``logits`` with its row softmax; returns the rows' logsumexp."""
    top = logits.max(axis=1, keepdims=True)
    logits -= top
    np.exp(logits, out=logits)
    sums = logits.sum(axis=1, keepdims=True)
    logits /= sums
    return (top + np.log(sums))[:, 0]


def _softmax_rows(logits: np.ndarray) -> np.ndarray:
    weights = np.array(logits, dtype=float)
    _softmax_rows_in_place(weights)
    return weights


def _logsumexp_rows(logits: np.ndarray) -> np.ndarray:
    return _softmax_rows_in_place(np.array(logits, dtype=float))


@jax.jit
def factored_maps(Gamma, core, B, pi, log_pi, P):
    """(A, E, G_Φ, L) at Φ = Γ K Γ^T, M = Γ B^T: ``MeanFieldChain.factored``'s formulas, O(d² r); compiled once
    per (d, r)."""
    A = jax.nn.softmax((Gamma @ core) @ Gamma.T + log_pi[None, :], axis=1)
    Z = (A @ Gamma) @ B.T
    log_normaliser = jax.nn.logsumexp(Z, axis=1)
    loss = pi @ (log_normaliser - jnp.sum(P * Z, axis=1))
    E = pi[:, None] * (jnp.exp(Z - log_normaliser[:, None]) - P)
    F = A * ((E @ B) @ Gamma.T)
    return A, E, F - A * jnp.sum(F, axis=1, keepdims=True), loss


@dataclass(frozen=True)
class FactoredGradients:
    """(G_Φ, G_M) at a point of a rank-r manifold, with G_M kept as the pair (A, E): G_M = A^T E."""

    A: np.ndarray  # d x d attention
    E: np.ndarray  # d x d, diag(π)(softmax(Z) - P)
    G_Phi: np.ndarray  # d x d
    loss: float

    def G_M_times(self, X: np.ndarray) -> np.ndarray:
        """G_M X = A^T (E X), O(d² c) for c columns."""
        return self.A.T @ (self.E @ X)

    def G_M_transpose_times(self, Y: np.ndarray) -> np.ndarray:
        """G_M^T Y = E^T (A Y), O(d² c)."""
        return self.E.T @ (self.A @ Y)

    def G_M(self) -> np.ndarray:
        """G_M formed, O(d³): for a dense SVD of the transverse coupling at small d."""
        return self.A.T @ self.E


class MeanFieldChain:
    """The mean-field loss of one chain (π, P) and its gradient in the maps, in closed form."""

    # vocabulary sizes from which ``factored`` runs compiled: XLA fuses the softmaxes' passes, which pays at large d,
    # while at small d numpy's and XLA's threads contend on two cores (benchmarks/MEASUREMENTS.md)
    COMPILED_FROM = 256

    def __init__(self, pi: np.ndarray, P: np.ndarray):
        self.pi, self.P = np.asarray(pi, dtype=float), np.asarray(P, dtype=float)
        if np.any(self.pi <= 0):
            raise ValueError(f"the mean-field loss needs π > 0 for every token, got min π = {self.pi.min():g}")
        self.d = len(self.pi)
        self.log_pi = np.log(self.pi)

    @functools.cached_property
    def device_arrays(self) -> tuple[jax.Array, ...]:
        """(π, log π, P) on the device, once, for the compiled functions of the maps."""
        return tuple(jnp.asarray(x) for x in (self.pi, self.log_pi, self.P))

    def bayes_loss(self) -> float:
        """Σ_i π_i H(P_i): the infimum of L (the logits log P_i), O(d²)."""
        return entropy_rate(self.pi, self.P)

    def loss_of_maps(self, Phi: np.ndarray, M: np.ndarray) -> float:
        """L(Φ, M), O(d³) (dense M)."""
        Z = _softmax_rows(Phi + self.log_pi[None, :]) @ M
        return float(self.pi @ (_logsumexp_rows(Z) - np.sum(self.P * Z, axis=1)))

    def gradient_of_maps(self, Phi: np.ndarray, M: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(G_Φ, G_M) = (∂L/∂Φ, ∂L/∂M) for dense maps, O(d³)."""
        A = _softmax_rows(Phi + self.log_pi[None, :])
        Z = A @ M
        E = self.pi[:, None] * (_softmax_rows(Z) - self.P)
        F = E @ M.T
        return A * (F - np.sum(A * F, axis=1, keepdims=True)), A.T @ E

    def factored(self, Gamma: np.ndarray, core: np.ndarray, B: np.ndarray) -> FactoredGradients:
        """The gradients and the loss at Φ = Γ K Γ^T, M = Γ B^T (Γ, B: d x r; K: r x r), O(d² r).

        Below COMPILED_FROM three d x d arrays are allocated and worked on in place: at d = 1001 a fresh d x d array
        costs more than the arithmetic on it (38 ms an evaluation at rank 1 written out of place, 26 ms in place)."""
        if self.d >= self.COMPILED_FROM:
            A, E, G_Phi, loss = factored_maps(np.asarray(Gamma, dtype=float), np.asarray(core, dtype=float),
                                              np.asarray(B, dtype=float), *self.device_arrays)
            return FactoredGradients(np.asarray(A), np.asarray(E), np.asarray(G_Phi), float(loss))
        A = (Gamma @ core) @ Gamma.T
        A += self.log_pi[None, :]
        _softmax_rows_in_place(A)
        Z = (A @ Gamma) @ B.T
        cross = np.einsum("ij,ij->i", self.P, Z)  # P_i · Z_i
        E = Z.copy()
        log_normaliser = _softmax_rows_in_place(E)
        loss = float(self.pi @ (log_normaliser - cross))
        E -= self.P
        E *= self.pi[:, None]
        F = np.matmul(E @ B, Gamma.T, out=Z)  # Z is not needed again
        F *= A
        F -= A * F.sum(axis=1, keepdims=True)  # G_Φ = A ⊙ (F - rowsum(A ⊙ F) 1^T)
        return FactoredGradients(A, E, F, loss)


def origin_rate(pi: np.ndarray) -> float:
    """μ1 = ‖π‖ ‖π - u‖, the growth rate at θ = 0 (``theory.origin`` derives it with sympy), O(d)."""
    pi = np.asarray(pi, dtype=float)
    return float(np.linalg.norm(pi) * np.linalg.norm(pi - 1.0 / len(pi)))


def condensed_point(pi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(γ*, β*): where the condensation orbit ends, softmax((π·γ) β) = π with Σβ = 0, ‖γ‖ = ‖β‖, γ ∥ π:

        γ* = g π̂,   β* = ℓ / (g ‖π‖),   ℓ = log π - mean(log π),   g² = ‖ℓ‖ / ‖π‖      (O(d);
    ``theory.focus.condensed_point_expressions`` solves the same equations with sympy)."""
    pi = np.asarray(pi, dtype=float)
    if np.any(pi <= 0):
        raise ValueError(f"the condensed point needs π > 0 everywhere, got min π = {pi.min():g}")
    ell = np.log(pi) - np.mean(np.log(pi))
    norm_pi = np.linalg.norm(pi)
    g = np.sqrt(np.linalg.norm(ell) / norm_pi)
    return g * pi / norm_pi, ell / (g * norm_pi)
