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

import numpy as np
import sympy as sp
from scipy.integrate import solve_ivp

from theory.symbolic import MeanFieldTwin, closed_form_map_gradients

_BLOCKS = ("Gamma", "B", "Q", "R")


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
                 for name, X in zip(_BLOCKS, (Gamma, B, Q, R))}
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


class ReducedFlow:
    """The gradient flow of ℓ(Γ, B, Q, R) for one chain. With G = ∂L/∂Φ, ∂L/∂M at the maps,

        ∂ℓ/∂Γ = G_Φ Γ R^T Q + G_Φ^T Γ Q^T R + G_M B,   ∂ℓ/∂B = G_M^T Γ,
        ∂ℓ/∂Q = R Γ^T G_Φ^T Γ,                        ∂ℓ/∂R = Q Γ^T G_Φ Γ,

    evaluated in closed form (O(d³ + d² r), ``closed_form_map_gradients``); ``reduced_gradient_formulas``
    derives the same with sympy and is its check."""

    def __init__(self, twin: MeanFieldTwin, k: int, rank: int = 1):
        self.twin, self.d, self.k, self.rank = twin, twin.d, k, rank

    def maps(self, state: ReducedState) -> tuple[np.ndarray, np.ndarray]:
        return state.Gamma @ state.Q.T @ state.R @ state.Gamma.T, state.Gamma @ state.B.T

    def loss(self, state: ReducedState) -> float:
        return self.twin.loss_of_maps(*self.maps(state))

    def gradient(self, state: ReducedState) -> ReducedState:
        """∂ℓ/∂(Γ, B, Q, R) at ``state``."""
        G_Phi, G_M = closed_form_map_gradients(*self.maps(state), self.twin.pi, self.twin.P)
        Gamma, B, Q, R = state.Gamma, state.B, state.Q, state.R
        return ReducedState(G_Phi @ Gamma @ R.T @ Q + G_Phi.T @ Gamma @ Q.T @ R + G_M @ B, G_M.T @ Gamma,
                            R @ Gamma.T @ G_Phi.T @ Gamma, Q @ Gamma.T @ G_Phi @ Gamma)

    def vector_field(self, t: float, y: np.ndarray) -> np.ndarray:
        return -self.gradient(ReducedState.unpack(y, self.d, self.k)).pack()

    def solve(self, state0: ReducedState, t_eval: np.ndarray, *, t_start: float = 0.0,
              rtol: float = 1e-10, atol: float = 1e-14):
        """Integrate from ``state0`` at ``t_start``; the scipy result (dense output on)."""
        t_eval = np.asarray(t_eval, dtype=float)
        solution = solve_ivp(self.vector_field, (t_start, float(t_eval[-1])), state0.pack(), method="LSODA",
                             t_eval=t_eval, rtol=rtol, atol=atol, dense_output=True)
        if solution.status != 0:
            raise RuntimeError(f"the reduced flow failed: {solution.message}")
        return solution
