"""Stage IV: the transverse instability that opens a new direction, and the restart time.

After focus the rank-one flow settles at a critical point θ_deg of the rank-one manifold.
With perfectly symmetric low-frequency tokens (π = (0.7, 0.1, 0.1, 0.1)) the Hessian
there has no negative eigenvalue off the manifold: the point is degenerate and the
flow stalls. An asymmetry δ among those tokens (π = (0.7, 0.1 + δ/2, 0.1, 0.1 - δ/2))
creates one transverse direction with Hessian eigenvalue -μ_δ < 0, μ_δ = c δ^p at
leading order (``transverse_leading_order`` measures p and c from μ at δ and 2δ; for
the chain above p = 1, c ≈ 0.031, with δ² corrections visible from δ ≈ 0.05 on).

Restart time: the part of θ(0) off the rank-one manifold is carried along the rank-one
trajectory θ_1(t) by the variational equation dδθ/dt = J(θ_1(t)) δθ, which grows it at
rate μ_δ once θ_1 is near θ_deg; the restart is predicted where σ1 of
W0 = W0_1(t) + δW0(t) passes the detector's restart_factor × its floor.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from scipy.integrate import solve_ivp

from flowsim.flow import GradientFlow
from flowsim.stages import StageThresholds
from theory.manifold import ReducedFlow, ReducedState, embed, project
from theory.symbolic import MeanFieldTwin


def transverse_eigenpair(twin: MeanFieldTwin, params) -> tuple[float, np.ndarray]:
    """(μ, v): minus the smallest Hessian eigenvalue at ``params`` (a flow growth rate) and its
    unit eigenvector, in flowsim's sorted-name layout."""
    values, vectors = np.linalg.eigh(twin.hessian(params))
    return float(-values[0]), vectors[:, 0]


def settled_rank_one_point(twin: MeanFieldTwin, state0: ReducedState, alpha: np.ndarray, t_settle: float, k: int):
    """The rank-one flow's state after ``t_settle`` (its critical point when it has settled)."""
    flow = ReducedFlow(twin, k)
    solution = flow.solve(state0, np.array([t_settle]))
    return embed(ReducedState.unpack(solution.y[:, -1], twin.d, k), alpha)


def transverse_leading_order(mu_at: dict[float, float]) -> tuple[float, float]:
    """(p, c) with μ_δ ≈ c δ^p, from μ at the two smallest δ given (take them small)."""
    (d1, m1), (d2, m2) = sorted(mu_at.items())[:2]
    p = float(np.log(m2 / m1) / np.log(d2 / d1))
    return p, float(m1 / d1**p)


@dataclass(frozen=True)
class RestartPrediction:
    """Stage IV for one initial point: the predicted restart onset of direction 1."""

    t_onset: float | None  # None when σ1 does not pass the threshold within the horizon
    mu_transverse: float  # μ at the point the rank-one flow settles on (if it settles)
    floor: float
    t: np.ndarray
    sigma1: np.ndarray  # predicted σ1(W0) on the grid t
    thetas: np.ndarray  # predicted flat parameters (rank-one flow + variational part) on the grid t
    theta_at_onset: np.ndarray | None  # the same at t_onset


def predict_restart(twin: MeanFieldTwin, flow: GradientFlow, params0, alpha: np.ndarray, t_end: float,
                    thresholds: StageThresholds | None = None) -> RestartPrediction:
    """Carry θ(0)'s off-manifold part along the rank-one trajectory; σ1 crossing → restart."""
    th = StageThresholds() if thresholds is None else thresholds
    k = np.shape(params0["W_Q"])[1]
    reduced = ReducedFlow(twin, k)
    state0 = project(params0, alpha)
    grid = np.concatenate([[0.0], np.geomspace(1e-1, t_end, 600)])
    rank_one = reduced.solve(state0, grid)

    def on_manifold(t: float) -> np.ndarray:
        return flow.flatten(embed(ReducedState.unpack(rank_one.sol(t), twin.d, k), alpha))

    tangent = jax.jit(lambda t, theta, x: jax.jvp(lambda th: flow.vector_field(t, th), (theta,), (x,))[1])
    floor = float(np.linalg.svd(np.asarray(params0["W0"]), compute_uv=False)[1])
    level = th.restart_factor * floor
    W0_entries = flow.entries_of("W0")

    def sigma1(t: float, x: np.ndarray) -> float:
        W0 = (on_manifold(t) + x)[W0_entries].reshape(np.shape(params0["W0"]))
        return float(np.linalg.svd(W0, compute_uv=False)[1])

    def passes_threshold(t, x):
        return sigma1(t, x) - level

    passes_threshold.terminal = True
    off = {name: np.asarray(params0[name]) - value for name, value in embed(state0, alpha).items()}
    solution = solve_ivp(lambda t, x: np.asarray(tangent(t, on_manifold(t), x)), (0.0, t_end), flow.flatten(off),
                         method="LSODA", t_eval=grid, events=passes_threshold,
                         jac=lambda t, x: flow.jacobian(t, on_manifold(t)), rtol=1e-8, atol=1e-14)
    if solution.status == -1:
        raise RuntimeError(f"the variational equation failed: {solution.message}")
    crossings = solution.t_events[0]
    t_onset = float(crossings[0]) if len(crossings) else None
    theta_at_onset = None if t_onset is None else on_manifold(t_onset) + solution.y_events[0][0]
    thetas = np.array([on_manifold(t) + x for t, x in zip(solution.t, solution.y.T)])
    predicted_sigma1 = np.array([sigma1(t, x) for t, x in zip(solution.t, solution.y.T)])
    settled = embed(ReducedState.unpack(rank_one.y[:, -1], twin.d, k), alpha)
    mu, _ = transverse_eigenpair(twin, settled)
    return RestartPrediction(t_onset, mu, floor, solution.t, predicted_sigma1, thetas, theta_at_onset)
