"""Stage IV: the restart of direction r, from the transverse equation on the rank-r manifold.

Split the parameters at the manifold of span(A) (A: m × r, orthonormal) and an orthonormal basis E
of its complement: θ = the manifold point of coordinates (Γ, B, Q, R) = (W0 A, W1^T A, W_Q^T A, W_K^T A)
plus the transverse part Z = (W0 E; W1^T E; W_Q^T E; W_K^T E), one column per direction of E. To
first order in Z the coordinates follow the reduced flow (``theory.manifold``) and Z the linear
transverse equation dZ/dt = -H_T(t) Z, H_T = [[0, C], [C^T, 0]] (``theory.transverse``). Direction r
restarts when σ_r(W0) passes the detector's threshold ℓ_r = restart_factor × σ_r(W0(0)).

The prediction, per direction:

* **settled, then the formula.** Once the rank-r flow has settled (its transverse rate σ_max(C(t))
  stays within ``SETTLED`` of its final value μ from t_s on) H_T is constant and
  Z(t_s + τ) = exp(-τ H_T) Z(t_s) = W e^{-τΛ} W^T Z(t_s) in closed form (H_T = W Λ W^T; the
  eigenvalues are ±σ_i(C)). The prediction is where σ_r(W0) of that closed form passes ℓ_r. Its
  leading term, once the fastest mode v (rate μ = σ_max(C)) dominates, is

      t_restart ≈ t_s + log(ℓ_r / a_s) / μ,   a_s = ‖v^T Z(t_s)‖ ‖P ā‖ / √2,

  with ā/√2 the W0 part of v and P the projection off the directions already open (off the range
  of Γ): a_s is the transverse amplitude carried from θ(0) to t_s. The two differ where the other
  modes still cancel part of v's W0 part at t_s (``t_leading`` keeps the leading term).
* **the rule for what comes first.** If σ_r(W0) passes ℓ_r before t_s, the restart comes during the
  focus, while the rank-r flow still moves: the prediction is that crossing of the transverse
  equation (no constant rate to extrapolate with).
* **degenerate.** μ below ``DEGENERATE_RATE`` × the largest transverse rate met on the way: the point
  is degenerate (C = 0 at symmetric rare tokens) and no direction opens.

The transverse equation integrated to the threshold is kept beside the formula as its check
(``t_integrated``). Cost per direction: the reduced flow (2d + 2k) r equations and the linear
transverse equation (2d + 2k)(m - r), each C O(d² (d + k) r).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
from scipy.integrate import solve_ivp
from scipy.optimize import brentq
from scipy.linalg import null_space

from theory.manifold import ReducedFlow, ReducedState, project
from theory.symbolic import MeanFieldTwin
from theory.transverse import coupling_at, fastest_transverse_mode, transverse_hessian

SETTLED = 0.01  # the transverse rate within 1% of its final value: settled
DEGENERATE_RATE = 1e-8  # μ below this × the largest rate on the way: a degenerate point


@dataclass(frozen=True)
class RestartPrediction:
    """The restart of direction r (σ_r(W0) passing ``threshold``)."""

    direction: int
    t_onset: float | None  # the prediction (None: degenerate, or never within reach)
    rule: str  # "formula", "before settling", "degenerate", "not settled", "full rank" (no direction left)
    t_integrated: float | None  # the transverse equation integrated to the threshold (None: not by t_end)
    t_settle: float | None  # when the rank-r flow settled (None: not by t_end)
    rate: float  # μ = σ_max(C) where the rank-r flow ends (settled or at t_end)
    peak_rate: float  # the largest transverse rate met on the way
    amplitude: float | None  # a_s, the transverse W0 amplitude along the fastest mode at t_settle
    t_leading: float | None  # the formula's leading term t_s + log(ℓ / a_s) / μ
    threshold: float


@dataclass(frozen=True)
class RankStage:
    """The predicted trajectory while the manifold has rank r, up to the restart of direction r."""

    rank: int
    A: np.ndarray  # m × r
    t: np.ndarray
    params: dict[str, np.ndarray]  # full parameters on ``t`` (manifold point + transverse part)
    velocity: dict[str, np.ndarray]  # their time derivative: reduced field + transverse equation
    restart: RestartPrediction


def complement(A: np.ndarray) -> np.ndarray:
    """An orthonormal basis E of span(A)^⊥ (m × (m - r))."""
    return null_space(A.T)


def transverse_part(params, E: np.ndarray) -> np.ndarray:
    """Z = (W0 E; W1^T E; W_Q^T E; W_K^T E): (2d + 2k) × (m - r)."""
    return np.vstack([np.asarray(params["W0"]) @ E, np.asarray(params["W1"]).T @ E,
                      np.asarray(params["W_Q"]).T @ E, np.asarray(params["W_K"]).T @ E])


def assemble(state: ReducedState, A: np.ndarray, Z: np.ndarray, E: np.ndarray) -> dict[str, np.ndarray]:
    """θ = the manifold point of ``state`` + the transverse part Z."""
    d, k = state.Gamma.shape[0], state.Q.shape[0]
    U, W, X, Y = np.split(Z, np.cumsum([d, d, k]), axis=0)
    return {"W0": state.Gamma @ A.T + U @ E.T, "W1": A @ state.B.T + E @ W.T,
            "W_Q": A @ state.Q.T + E @ X.T, "W_K": A @ state.R.T + E @ Y.T}


def _sigma(W0: np.ndarray, r: int) -> float:
    values = np.linalg.svd(W0, compute_uv=False)
    return float(values[r]) if r < len(values) else 0.0


def propagate_rank(twin: MeanFieldTwin, params, A: np.ndarray, t_start: float, t_end: float,
                   threshold: float, grid: np.ndarray) -> RankStage:
    """Integrate the rank-r flow and the transverse equation from ``params`` at ``t_start``; predict
    the restart of direction r = A.shape[1] (σ_r(W0) passing ``threshold``)."""
    A = np.asarray(A, dtype=float)
    rank, E = A.shape[1], complement(A)
    k = np.shape(params["W_Q"])[1]
    d = twin.d
    times = np.concatenate([[t_start], grid[(grid > t_start) & (grid <= t_end)]])
    reduced_flow = ReducedFlow(twin, k, rank)
    reduced_field = reduced_flow.vector_field
    reduced = reduced_flow.solve(project(params, A), times, t_start=t_start)

    def state_at(t: float) -> ReducedState:
        return ReducedState.unpack(reduced.sol(t), d, k)

    rows, columns = 2 * d + 2 * k, E.shape[1]

    def field(t, z):
        H = transverse_hessian(coupling_at(twin, state_at(t)))
        return -(H @ z.reshape(rows, columns)).ravel()

    def jacobian(t, z):
        return -np.kron(transverse_hessian(coupling_at(twin, state_at(t))), np.eye(columns))

    def passes(t, z):
        return _sigma(assemble(state_at(t), A, z.reshape(rows, columns), E)["W0"], rank) - threshold

    passes.terminal = True
    Z0 = transverse_part(params, E)
    if columns == 0:  # A spans R^m: nothing is transverse
        transverse = SimpleNamespace(t=times, y=np.zeros((0, len(times))), t_events=[np.array([])],
                                     sol=lambda t: np.zeros(0))
    else:
        scale = float(np.abs(Z0).max()) or 1.0  # the transverse part starts at the initial scale and does not shrink much
        transverse = solve_ivp(field, (t_start, float(times[-1])), Z0.ravel(), method="LSODA", t_eval=times, events=passes,
                               jac=jacobian, dense_output=True, rtol=1e-8, atol=1e-9 * scale)
        if transverse.status == -1:
            raise RuntimeError(f"the transverse equation failed: {transverse.message}")
    crossing = transverse.t_events[0]
    t_integrated = float(crossing[0]) if len(crossing) else None

    # the transverse rate along the whole rank-r flow (to t_end), and where it settles
    def rate_at(y: np.ndarray) -> float:
        return float(np.linalg.svd(coupling_at(twin, ReducedState.unpack(y, d, k)), compute_uv=False)[0])

    rates = np.array([rate_at(y) for y in reduced.y.T])
    rate, peak = float(rates[-1]), float(rates.max())
    t_settle = None
    if peak > 0 and rate > DEGENERATE_RATE * peak:
        moving = np.flatnonzero(np.abs(rates - rate) > SETTLED * rate)
        first_settled = 0 if len(moving) == 0 else int(moving[-1]) + 1
        if 0 < first_settled < len(times) - 1:  # refine between the save times on the dense output
            t_settle = float(brentq(lambda t: abs(rate_at(reduced.sol(t)) - rate) - SETTLED * rate,
                                    times[first_settled - 1], times[first_settled], xtol=1e-9 * times[first_settled]))
        elif first_settled == 0:
            t_settle = float(times[0])

    amplitude = t_leading = None
    if columns == 0 or not np.isfinite(threshold):
        rule, t_onset = "full rank", None
    elif peak == 0 or rate <= DEGENERATE_RATE * peak:
        rule, t_onset = "degenerate", None
    elif t_integrated is not None and (t_settle is None or t_integrated <= t_settle):
        rule, t_onset = "before settling", t_integrated
    elif t_settle is None:
        rule, t_onset = "not settled", None
    else:
        settled_state = state_at(t_settle)
        C = coupling_at(twin, settled_state)
        mode = fastest_transverse_mode(C)
        Z_settle = transverse.sol(t_settle).reshape(rows, columns)
        basis = np.linalg.svd(settled_state.Gamma, full_matrices=True)[0]
        off_open = basis[:, rank:] @ basis[:, rank:].T
        amplitude = float(np.linalg.norm(mode.direction @ Z_settle) * np.linalg.norm(off_open @ mode.u))
        t_leading = t_settle + float(np.log(threshold / amplitude)) / rate
        t_onset = settled_crossing(settled_state, A, E, Z_settle, transverse_hessian(C), rank, threshold, rate)
        rule, t_onset = "formula", None if t_onset is None else t_settle + t_onset

    kept = transverse.t
    if t_integrated is not None:
        kept = np.append(kept, t_integrated)
        Z_path = np.vstack([transverse.y.T, transverse.y_events[0][0][None]])
    else:
        Z_path = transverse.y.T
    full = [assemble(state_at(t), A, z.reshape(rows, columns), E) for t, z in zip(kept, Z_path)]
    # assemble is linear in (coordinates, Z), so the predicted velocity is assemble of their fields
    speeds = [assemble(ReducedState.unpack(reduced_field(t, reduced.sol(t)), d, k), A, field(t, z).reshape(rows, columns), E)
              for t, z in zip(kept, Z_path)]
    stacked = {name: np.stack([p[name] for p in full]) for name in full[0]}
    velocity = {name: np.stack([v[name] for v in speeds]) for name in speeds[0]}
    restart = RestartPrediction(rank, t_onset, rule, t_integrated, t_settle, rate, peak, amplitude, t_leading, threshold)
    return RankStage(rank, A, np.asarray(kept), stacked, velocity, restart)



def settled_crossing(state: ReducedState, A: np.ndarray, E: np.ndarray, Z: np.ndarray, H_T: np.ndarray, rank: int,
                     threshold: float, rate: float, decades: float = 12.0) -> float | None:
    """The first τ at which σ_r(W0) of Z(τ) = exp(-τ H_T) Z passes ``threshold`` at the frozen settled point
    (None if not within ``decades`` e-folds of the fastest rate, 10^decades in amplitude)."""
    values, vectors = np.linalg.eigh(H_T)
    coefficients = vectors.T @ Z

    def excess(tau: float) -> float:
        moved = vectors @ (np.exp(-tau * values)[:, None] * coefficients)
        return _sigma(assemble(state, A, moved, E)["W0"], rank) - threshold

    taus = np.concatenate([[0.0], np.geomspace(1e-3, decades * np.log(10.0), 400) / rate])
    signs = np.array([excess(tau) for tau in taus]) > 0
    if signs[0] or not signs.any():
        return None
    above = int(np.argmax(signs))
    return float(brentq(excess, taus[above - 1], taus[above], xtol=1e-10 * taus[above]))
