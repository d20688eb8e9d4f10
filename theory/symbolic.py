"""The mean-field loss of the one-layer model in sympy, and its numeric twins.

The loss factors through the two d x d maps Φ = W0 W_Q W_K^T W0^T and M = W0 W1:

    L(θ) = Σ_i π_i ℓ(Φ[i, :], M; π, P[i, :]),
    ℓ(φ, M; π, p) = logsumexp(z) - p·z,   z = a M,   a_j = π_j e^{φ_j} / Σ_l π_l e^{φ_l}.

``row_loss(d)`` holds ℓ for one query row with its gradient and Hessian in (φ, M),
derived by sympy. ``parameter_chain_rule()`` derives, by sympy's matrix calculus, the
parameter gradient from G_Φ = ∂L/∂Φ and G_M = ∂L/∂M,

    ∂L/∂W0 = G_Φ W0 W_K W_Q^T + G_Φ^T W0 W_Q W_K^T + G_M W1^T,   ∂L/∂W1 = W0^T G_M,
    ∂L/∂W_Q = W0^T G_Φ W0 W_K,   ∂L/∂W_K = W0^T G_Φ^T W0 W_Q,

and the differentials of Φ, M and of these gradients, from which the Jacobian of the
gradient field follows. ``MeanFieldTwin`` evaluates all of it with lambdified code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np
import sympy as sp

PARAMETER_NAMES = ("W0", "W_Q", "W_K", "W1")


@dataclass(frozen=True)
class RowLoss:
    """ℓ(φ, M; π, p) for one query row, with its derivatives in v = (φ, vec M)."""

    d: int
    phi: tuple[sp.Symbol, ...]
    M: sp.Matrix
    pi: tuple[sp.Symbol, ...]
    p: tuple[sp.Symbol, ...]
    expression: sp.Expr
    gradient: tuple[sp.Expr, ...]
    hessian: sp.Matrix
    loss_fn: Callable
    gradient_fn: Callable
    hessian_fn: Callable

    @property
    def variables(self) -> list[sp.Symbol]:
        return list(self.phi) + list(self.M)


@functools.lru_cache(maxsize=None)
def row_loss(d: int) -> RowLoss:
    """Build ℓ for vocabulary size d (2 <= d <= 5: the expressions grow fast with d; d = 5 takes about 10 s)."""
    if d not in (2, 3, 4, 5):
        raise ValueError(f"the symbolic model is built for d = 2 to 5, got d = {d}")
    phi = sp.symbols(f"phi0:{d}", real=True)
    pi = sp.symbols(f"pi0:{d}", positive=True)
    p = sp.symbols(f"p0:{d}", nonnegative=True)
    M = sp.Matrix(d, d, lambda i, j: sp.Symbol(f"M{i}{j}", real=True))
    weights = [pi[j] * sp.exp(phi[j]) for j in range(d)]
    total = sp.Add(*weights)
    z = [sp.Add(*(weights[j] * M[j, y] for j in range(d))) / total for y in range(d)]
    expression = sp.log(sp.Add(*(sp.exp(zy) for zy in z))) - sp.Add(*(p[y] * z[y] for y in range(d)))
    variables = list(phi) + list(M)
    gradient = tuple(sp.diff(expression, v) for v in variables)
    n = len(variables)
    hessian = sp.Matrix(n, n, lambda a, b: sp.diff(gradient[a], variables[b]) if b >= a else 0)
    hessian = hessian + hessian.T - sp.diag(*hessian.diagonal())
    args = [variables, list(pi), list(p)]
    return RowLoss(
        d, phi, M, pi, p, expression, gradient, hessian,
        sp.lambdify(args, expression, "numpy", cse=True),
        sp.lambdify(args, list(gradient), "numpy", cse=True),
        sp.lambdify(args, hessian, "numpy", cse=True),
    )


def loss_expression(d: int, family: Literal["general", "lambda"] = "general") -> tuple[sp.Expr, dict]:
    """The whole mean-field loss L(Φ, M) as one sympy expression.

    ``family="general"``: P is a matrix of symbols P_iy; ``"lambda"``: P = λ I + (1-λ) 1 π^T.
    Returns the expression and its symbols (``Phi``, ``M``, ``pi``, and ``P`` or ``lam``).
    """
    row = row_loss(d)
    Phi = sp.Matrix(d, d, lambda i, j: sp.Symbol(f"Phi{i}{j}", real=True))
    symbols = {"Phi": Phi, "M": row.M, "pi": row.pi}
    if family == "general":
        P = sp.Matrix(d, d, lambda i, y: sp.Symbol(f"P{i}{y}", nonnegative=True))
        symbols["P"] = P
    elif family == "lambda":
        lam = sp.Symbol("lam", nonnegative=True)
        P = sp.Matrix(d, d, lambda i, y: lam * sp.KroneckerDelta(i, y) + (1 - lam) * row.pi[y])
        symbols["lam"] = lam
    else:
        raise ValueError(f"family must be 'general' or 'lambda', got {family!r}")
    rows = [row.pi[i] * row.expression.subs({**dict(zip(row.phi, Phi.row(i))), **dict(zip(row.p, P.row(i)))})
            for i in range(d)]
    return sp.Add(*rows), symbols


@dataclass(frozen=True)
class ChainRule:
    """Lambdified matrix formulas: the maps, the parameter gradient and their differentials."""

    maps: Callable  # (W0, W_Q, W_K, W1) -> (Φ, M)
    maps_differential: Callable  # (W, V) -> (dΦ, dM)
    gradient: Callable  # (W, G_Φ, G_M) -> (∂L/∂W0, ∂L/∂W_Q, ∂L/∂W_K, ∂L/∂W1)
    gradient_differential: Callable  # (W, V, G_Φ, G_M, dG_Φ, dG_M) -> d(∂L/∂W)
    formulas: dict[str, sp.Expr]


@functools.lru_cache(maxsize=None)
def parameter_chain_rule() -> ChainRule:
    """Derive ∂L/∂W from dL = tr(G_Φ^T dΦ) + tr(G_M^T dM) with sympy's matrix calculus."""
    n = sp.Symbol("n", integer=True, positive=True)  # shapes do not enter the formulas
    W0, WQ, WK, W1, GP, GM = (sp.MatrixSymbol(name, n, n) for name in ("W0", "W_Q", "W_K", "W1", "G_Phi", "G_M"))
    V0, VQ, VK, V1, dGP, dGM = (sp.MatrixSymbol(name, n, n) for name in ("V0", "V_Q", "V_K", "V1", "dG_Phi", "dG_M"))
    Phi, M = W0 * WQ * WK.T * W0.T, W0 * W1
    # sympy differentiates one trace at a time (a sum of traces is not split)
    terms = (sp.Trace(GP.T * Phi), sp.Trace(GM.T * M))
    grads = [sp.Add(*(sp.diff(term, X) for term in terms)) for X in (W0, WQ, WK, W1)]
    h = sp.Symbol("h")
    moved = {W0: W0 + h * V0, WQ: WQ + h * VQ, WK: WK + h * VK, W1: W1 + h * V1, GP: GP + h * dGP, GM: GM + h * dGM}

    def differential(expr: sp.MatrixExpr) -> sp.MatrixExpr:
        # the terms linear in h of the expanded product (sympy's d/dh drops transposes)
        expanded = sp.expand(expr.subs(moved))
        terms = expanded.args if isinstance(expanded, sp.MatAdd) else (expanded,)
        linear = []
        for term in terms:
            coefficient, product = term.as_coeff_mmul()
            if sp.Poly(coefficient, h).degree() == 1:
                linear.append(sp.cancel(coefficient / h) * product)
        return sp.MatAdd(*linear)

    W, V = [W0, WQ, WK, W1], [V0, VQ, VK, V1]
    d_maps = [differential(Phi), differential(M)]
    d_grads = [differential(g) for g in grads]
    formulas = {f"dL/d{X.name}": g for X, g in zip(W, grads)}
    formulas.update({"dPhi": d_maps[0], "dM": d_maps[1]})
    return ChainRule(
        maps=sp.lambdify(W, [Phi, M], "numpy"),
        maps_differential=sp.lambdify(W + V, d_maps, "numpy"),
        gradient=sp.lambdify(W + [GP, GM], grads, "numpy"),
        gradient_differential=sp.lambdify(W + V + [GP, GM, dGP, dGM], d_grads, "numpy"),
        formulas=formulas,
    )


def _as_arrays(params) -> list[np.ndarray]:
    return [np.asarray(params[name], dtype=float) for name in PARAMETER_NAMES]


class MeanFieldTwin:
    """Numeric twins of the symbolic loss, gradient and Jacobian for one chain (π, P).

    Parameters are dicts with W0, W_Q, W_K, W1 of any compatible shapes (the default
    one-layer model: no value matrix, no residual, logit scale 1).
    """

    def __init__(self, pi: np.ndarray, P: np.ndarray):
        self.pi, self.P = np.asarray(pi, dtype=float), np.asarray(P, dtype=float)
        self.d = len(self.pi)
        self.row = row_loss(self.d)
        self.rules = parameter_chain_rule()

    def maps(self, params) -> tuple[np.ndarray, np.ndarray]:
        return tuple(np.asarray(x) for x in self.rules.maps(*_as_arrays(params)))

    def _row_args(self, Phi: np.ndarray, M: np.ndarray, i: int) -> list:
        return [list(Phi[i]) + list(M.ravel()), list(self.pi), list(self.P[i])]

    def loss_of_maps(self, Phi: np.ndarray, M: np.ndarray) -> float:
        return float(sum(self.pi[i] * self.row.loss_fn(*self._row_args(Phi, M, i)) for i in range(self.d)))

    def loss(self, params) -> float:
        return self.loss_of_maps(*self.maps(params))

    def gradient_of_maps(self, Phi: np.ndarray, M: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(G_Φ, G_M) = (∂L/∂Φ, ∂L/∂M)."""
        d = self.d
        G_Phi, G_M = np.zeros((d, d)), np.zeros((d, d))
        for i in range(d):
            g = np.asarray(self.row.gradient_fn(*self._row_args(Phi, M, i)), dtype=float)
            G_Phi[i] = self.pi[i] * g[:d]
            G_M += self.pi[i] * g[d:].reshape(d, d)
        return G_Phi, G_M

    def hessian_of_maps(self, Phi: np.ndarray, M: np.ndarray) -> list[np.ndarray]:
        """π_i × the Hessian of row i's ℓ in (φ_i, vec M), one per query row."""
        return [self.pi[i] * np.asarray(self.row.hessian_fn(*self._row_args(Phi, M, i)), dtype=float) for i in range(self.d)]

    def gradient(self, params) -> dict[str, np.ndarray]:
        W = _as_arrays(params)
        G_Phi, G_M = self.gradient_of_maps(*self.rules.maps(*W))
        return dict(zip(PARAMETER_NAMES, (np.asarray(g) for g in self.rules.gradient(*W, G_Phi, G_M))))

    def hessian(self, params, order: tuple[str, ...] = ("W0", "W1", "W_K", "W_Q")) -> np.ndarray:
        """∂²L/∂θ² with θ the entries of the parameters laid out in ``order``, row-major.

        The default order is flowsim's (sorted names), so this compares directly with
        ``GradientFlow.jacobian`` (which is minus this matrix at unit rates).
        """
        W = _as_arrays(params)
        named = dict(zip(PARAMETER_NAMES, W))
        Phi, M = (np.asarray(x) for x in self.rules.maps(*W))
        G_Phi, G_M = self.gradient_of_maps(Phi, M)
        row_hessians = self.hessian_of_maps(Phi, M)
        sizes = [named[name].size for name in order]
        columns = []
        d = self.d
        for block, name in enumerate(order):
            for entry in range(sizes[block]):
                V = {key: np.zeros_like(value) for key, value in named.items()}
                V[name].flat[entry] = 1.0
                dPhi, dM = (np.asarray(x) for x in self.rules.maps_differential(*W, *(V[n] for n in PARAMETER_NAMES)))
                dG_Phi, dG_M = np.zeros((d, d)), np.zeros((d, d))
                for i, H in enumerate(row_hessians):
                    change = H @ np.concatenate([dPhi[i], dM.ravel()])
                    dG_Phi[i] = change[:d]
                    dG_M += change[d:].reshape(d, d)
                d_grads = dict(zip(PARAMETER_NAMES, self.rules.gradient_differential(
                    *W, *(V[n] for n in PARAMETER_NAMES), G_Phi, G_M, dG_Phi, dG_M)))
                columns.append(np.concatenate([np.asarray(d_grads[n], dtype=float).ravel() for n in order]))
        return np.column_stack(columns)
