"""Stage IV: the restart of direction r, from the transverse equation on the rank-r manifold.

Split the parameters at the manifold of span(A) (A: m × r, orthonormal) and an orthonormal basis E
of its complement: θ = the manifold point of coordinates (Γ, B, Q, R) = (W0 A, W1^T A, W_Q^T A, W_K^T A)
plus the transverse part Z = (W0 E; W1^T E; W_Q^T E; W_K^T E), one column per direction of E. To
first order in Z the coordinates follow the reduced flow (``theory.manifold``) and Z the linear
transverse equation dZ/dt = -H_T(t) Z, H_T = [[0, C], [C^T, 0]] (``theory.transverse``). Direction r
restarts when σ_r(W0) passes the detector's threshold ℓ_r = restart_factor × σ_r(W0(0)).

The prediction, per direction:

* **settled, then the formula.** Once the rank-r flow has settled (it converges, and its transverse
  rate σ_max(C(t)) stays within ``SETTLED`` of its limit μ from t_s on) H_T is constant and
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
* **not settled.** σ_r(W0) stays below ℓ_r as far as the rank-r flow is followed, and it still moves there.

The transverse equation integrated to the threshold is kept beside the formula as its check
(``t_integrated``). Nothing here looks at a run's horizon: the rank-r flow is followed over doubling
spans until it converges, or past the crossing until it is known whether it had settled before it (one
span, or less where its rate still moves: ``TransverseAlongPath``, asked after each quarter span), so t_s and
the crossing are properties of the flow. The one exception is a rank that starts past the horizon
(``theory.cycles``): its restart is past the horizon whatever its time, and its flow is followed only until
the detectors have confirmed the events before the horizon, unless it crosses first. Cost per direction:
the reduced flow, (2d + 2k) r equations at O(d² r) per evaluation (LSODA with its exact Jacobian up to
EXACT_JACOBIAN_UP_TO equations, beyond them the exact flow of the model with m = r by flowsim's own stiff solver,
whose Newton-Krylov steps form no Jacobian), and the linear transverse equation, (2d + 2k)(m - r) equations at
O(d² (m - r)) per evaluation (C kept factored, ``TransverseCoupling``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

import numpy as np
from scipy.integrate import solve_ivp
from scipy.optimize import brentq
from scipy.linalg import null_space

from theory.manifold import FlowTurnedStiff, ReducedFlow, ReducedState, project
from theory.mean_field import MeanFieldChain
from theory.transverse import (TransverseCoupling, fastest_transverse_mode, transverse_field, transverse_hessian,
                               transverse_velocity)

SETTLED = 0.01  # the transverse rate within 1% of its limit: settled
CONVERGED = 1e-3  # the rate moved less than this (relative) over the last doubling of the reduced flow's reach: its limit
DEGENERATE_RATE = 1e-8  # μ below this × the largest rate on the way: a degenerate point (or the optimum)
OPTIMUM_GAP = 1e-6  # a loss within this (relative) of the Bayes loss: the flow has reached the optimum
FIRST_SPAN = 64.0  # the reduced flow is followed over t_start + FIRST_SPAN × 2^j, j = 0, 1, ...
REACH_LIMIT = 1e6  # ... until its rate converges, or this far
SAMPLES_PER_SPAN = 48  # rate evaluations per doubling
# the rank-r flows' tolerances (their states are O(1) once condensed); rtol 1e-6 moves a few rows in their 4th digit
# against 1e-8, at a fraction of the cost (benchmarks/MEASUREMENTS.md)
REDUCED_RTOL, REDUCED_ATOL = 1e-6, 1e-12
# the full-rank flow opens no direction: it only shows the detectors the trajectory past the last crossing, and at
# rtol 1e-4 every row's prediction is as at 1e-6 (benchmarks/MEASUREMENTS.md)
FULL_RANK_RTOL = 1e-4
# a rank-r flow that can cross is solved in this many pieces per doubling, so that it stops soon after the rule for its
# crossing is known (at d = 64 ranks 2-7 were followed 1.0-1.6x as far as their rules needed, in whole doublings)
PIECES_PER_SPAN = 4
# beyond EXACT_JACOBIAN_UP_TO equations a rank-r flow is the exact flow of the m = r model, solved by flowsim's own stiff
# solver ("FLOW", ``ReducedFlow.exact_flow``; its cost against RKC's: benchmarks/MEASUREMENTS.md). "RKC" keeps the
# former route for comparison (benchmarks/reduced_flow_route.py): LSODA (Adams) while the flow is not stiff; where
# LSODA asks for a Jacobian the flow has turned stiff, and that piece and every later one take RKC
LARGE_METHOD = "FLOW"
NONSTIFF_METHOD, STIFF_METHOD = "LSODA", "RKC"
# a flow whose Hessian's largest eigenvalue ρ gives ρ × FIRST_SPAN above this starts stiff (a later rank starts where
# the last one turned stiff) and takes RKC at once: at d = 64 LSODA's first span of ranks 3-8 cost 11-45 Jacobians
STIFF_START = 1000.0
# up to this many equations LSODA forms the exact Jacobian (n Hessian-vector products) wherever it asks for one, and
# neither RKC nor its spectral-radius estimates are used: compiling RKC's step and power iteration for each rank cost
# more than the whole integration at d = 4 (benchmarks/MEASUREMENTS.md)
EXACT_JACOBIAN_UP_TO = 200
# the transverse equation is not stiff (H_T's spectrum is ±σ_i(C), growth as fast as decay), and its coefficients follow
# the reduced flow's piecewise-cubic dense output: at d = 64 DOP853 at rtol 1e-8 took 2.6-4.6x the evaluations of RK45
# at rtol 1e-9, and its crossings were further from a rtol 1e-10 reference (benchmarks/MEASUREMENTS.md)
TRANSVERSE_METHOD = "RK45"


class RuleName(str, Enum):
    """Which rule predicted a restart (``RestartPrediction.rule``)."""

    FORMULA = "formula"
    BEFORE_SETTLING = "before settling"
    DEGENERATE = "degenerate"
    OPTIMUM = "at the optimum"
    NOT_SETTLED = "not settled"  # σ_r below ℓ_r as far as the flow was followed, the flow still moving there
    FULL_RANK = "full rank"


@dataclass(frozen=True)
class RestartPrediction:
    """The restart of direction r (σ_r(W0) passing ``threshold``)."""

    direction: int
    t_onset: float | None  # the prediction (None: degenerate, or never within reach)
    rule: RuleName
    t_integrated: float | None  # the transverse equation followed to the threshold (None: not within reach)
    t_settle: float | None  # when the rank-r flow settled (None: not within REACH_LIMIT)
    rate: float  # μ = σ_max(C) at the end of the rank-r flow's reach (where it settled, when it did)
    t_reach: float  # how far the rank-r flow was followed
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


@dataclass(frozen=True)
class ReducedPath:
    """The rank-r flow from ``t_start``, followed over doubling spans until its transverse rate converges
    (to a limit that does not depend on any run's horizon), with the rate sampled on the way."""

    segments: list  # consecutive scipy solutions (dense output)
    ends: np.ndarray  # each segment's end time
    t: np.ndarray  # times of the rate samples (t_start first)
    rates: np.ndarray  # σ_max(C) there
    converged: bool  # the rate reached its limit (or zero: a degenerate point) within REACH_LIMIT
    span_ends: tuple[float, ...] = ()  # the ends of the doubling spans followed to their end

    @property
    def t_reach(self) -> float:
        return float(self.ends[-1])

    def y(self, t: float) -> np.ndarray:
        """The reduced coordinates at t (held at the last state beyond the reach: the flow has settled there)."""
        index = min(int(np.searchsorted(self.ends, t)), len(self.segments) - 1)
        return self.segments[index].sol(min(t, self.t_reach))


def follow_reduced_flow(reduced_flow: ReducedFlow, state0: ReducedState, t_start: float,
                        rate_of: Callable[[np.ndarray], float],
                        enough: Callable[[ReducedPath], bool] = lambda path: False, until: float = REACH_LIMIT,
                        rtol: float = REDUCED_RTOL, pieces: int = 1) -> ReducedPath:
    """Integrate the rank-r flow over t_start + FIRST_SPAN × 2^j until it has converged (over the last
    doubling σ_max(C) moved less than CONVERGED and stayed within SETTLED of its end value, and the state
    moved less than CONVERGED relative to its size), σ_max(C) has
    fallen to zero (degenerate), ``enough(the path so far)`` says so, or ``until`` (at most REACH_LIMIT) is reached.
    Each doubling is solved in ``pieces`` segments, ``enough`` asked after each (a crossing's rule is often known
    a fraction of a span after it). Up to EXACT_JACOBIAN_UP_TO equations the pieces are LSODA's with the exact
    Jacobian throughout. Beyond, they are the exact flow of the model with m = r (``ReducedFlow.solve``'s "FLOW");
    with LARGE_METHOD = "RKC", the former route, LSODA until it asks for a Jacobian (n = (2d + 2k) r Hessian-vector
    products, not formed), then that piece and the later ones by RKC (from the first span where the flow starts
    stiff: ρ × FIRST_SPAN > STIFF_START).
    Cost: (2d + 2k) r equations at O(d² r) per evaluation, and SAMPLES_PER_SPAN couplings per span."""
    segments, ends, times, rates, span_ends = [], [], [float(t_start)], [rate_of(state0.pack())], []
    exact_jacobian = state0.pack().size <= EXACT_JACOBIAN_UP_TO
    if exact_jacobian:
        method = NONSTIFF_METHOD
    elif LARGE_METHOD == "FLOW":
        method = "FLOW"
    else:
        method = STIFF_METHOD if reduced_flow.spectral_radius(state0) * FIRST_SPAN > STIFF_START else NONSTIFF_METHOD
    y0, t0, span, converged = state0.pack(), float(t_start), FIRST_SPAN, False
    until = min(until, REACH_LIMIT)

    def path_so_far() -> ReducedPath:
        return ReducedPath(segments, np.array(ends), np.array(times), np.array(rates), converged, tuple(span_ends))

    while not converged and t0 < until:
        t1 = min(float(t_start) + span, until)
        samples = np.geomspace(max(t0 - t_start, 1e-3 * span), t1 - t_start, SAMPLES_PER_SPAN + 1)[1:] + t_start
        samples[-1] = t1
        y, t_piece, span_rates = y0, t0, []
        for part in np.array_split(samples, pieces):
            start = ReducedState.unpack(y, reduced_flow.d, reduced_flow.k)
            try:
                solution = reduced_flow.solve(start, part, t_start=t_piece, rtol=rtol, atol=REDUCED_ATOL, method=method,
                                              until_stiff=method == NONSTIFF_METHOD and not exact_jacobian)
            except FlowTurnedStiff:  # the piece again, by RKC (as every later one): no Jacobian is formed
                method = STIFF_METHOD
                solution = reduced_flow.solve(start, part, t_start=t_piece, rtol=rtol, atol=REDUCED_ATOL, method=method)
            segments.append(solution)
            ends.append(float(part[-1]))
            part_rates = [rate_of(value) for value in solution.y.T]
            times += list(solution.t)
            rates += part_rates
            span_rates += part_rates
            y, t_piece = solution.y[:, -1], float(part[-1])
            if t_piece == t1:
                span_ends.append(t1)
                peak, last = max(rates), span_rates[-1]
                if peak > 0 and last <= DEGENERATE_RATE * peak:
                    converged = True
                elif len(span_ends) >= 2:
                    # the rate steady over the last doubling, and the state too (near the origin the rate is steady
                    # while the state still grows exponentially)
                    moved = np.abs(np.asarray(span_rates) - last).max()
                    travelled = np.linalg.norm(y - y0) / np.linalg.norm(y)
                    converged = moved <= SETTLED * last and abs(span_rates[0] - last) <= CONVERGED * last and travelled <= CONVERGED
            if enough(path_so_far()):
                return path_so_far()
        y0, t0, span = y, t1, 2.0 * span
    return path_so_far()


def settle_time(path: ReducedPath, rate_of: Callable[[np.ndarray], float]) -> float | None:
    """The time from which σ_max(C) stays within SETTLED of its limit (refined between samples on the dense
    output); None where the rate did not converge within reach or fell to zero."""
    rate, peak = float(path.rates[-1]), float(path.rates.max())
    if not path.converged or peak == 0 or rate <= DEGENERATE_RATE * peak:
        return None
    moving = np.flatnonzero(np.abs(path.rates - rate) > SETTLED * rate)
    if len(moving) == 0:
        return float(path.t[0])
    after = int(moving[-1]) + 1
    lo, hi = path.t[after - 1], path.t[after]
    return float(brentq(lambda t: abs(rate_of(path.y(t)) - rate) - SETTLED * rate, lo, hi, xtol=1e-9 * hi))


TRANSVERSE_RTOL = 1e-9  # the transverse equation's relative tolerance, and its absolute one times Z's initial scale
# ... where the rank only shows the detectors the trajectory (it starts past the horizon, its path solved at
# FULL_RANK_RTOL): the saved parameters move by at most 1e-4 against 1e-9 (W0's entries reach 4.6), below the path's
# own tolerance, for a good part of the cost (benchmarks/MEASUREMENTS.md)
SHOWN_TRANSVERSE_RTOL = 1e-6


class TransverseAlongPath:
    """The transverse equation integrated segment by segment beside the rank-r flow, from Z0, until σ_r(W0)
    of the assembled parameters passes ``threshold`` (RK45 with a terminal event). Called with each new
    segment of the reduced flow, it says whether the flow has been followed far enough to tell whether it
    had settled before the crossing (the rule for what comes first): one span past the crossing, or less
    where the rate still moves after the crossing (``moves_after``). ``rtol``: RK45's relative tolerance and its
    absolute one times the transverse part's initial scale."""

    def __init__(self, chain: MeanFieldChain, A: np.ndarray, E: np.ndarray, Z0: np.ndarray, threshold: float,
                 rtol: float = TRANSVERSE_RTOL):
        self.chain, self.A, self.E, self.Z0, self.threshold, self.rtol = chain, A, E, Z0, threshold, rtol
        self.rank, self.shape = A.shape[1], Z0.shape
        self.k = Z0.shape[0] // 2 - chain.d  # Z0 has 2d + 2k rows
        self.scale = float(np.abs(Z0).max(initial=0.0)) or 1.0  # Z starts at the initial scale and does not shrink much
        self.pieces, self.crossings = [], []
        self.settled: FrozenTransverse | None = None  # the closed form past the reach (``settle_at``)

    def __call__(self, path: ReducedPath) -> bool:
        if not self.crossings:
            self._integrate_over(path.segments[-1])
        if not self.crossings:
            return False
        return self.moves_after(path) or sum(t > self.crossings[0] for t in path.span_ends) >= 2

    def moves_after(self, path: ReducedPath) -> bool:
        """Two rates sampled after the crossing differ by more than 2 SETTLED × (any limit L ≤ max / (1 - SETTLED)):
        one of them is more than SETTLED × L from L, so the flow settles after the crossing whatever its limit,
        and the rule's answer (before settling) is known without following the flow further."""
        after = path.rates[path.t >= self.crossings[0]]
        return len(after) >= 2 and after.max() - after.min() > 2 * SETTLED * after.max() / (1 - SETTLED)

    def _integrate_over(self, segment) -> None:
        d, k = self.chain.d, self.k

        def state(t: float) -> ReducedState:
            return ReducedState.unpack(segment.sol(t), d, k)

        def field(t, z):
            return transverse_velocity(self.chain, state(t), z.reshape(self.shape)).ravel()

        def passes(t, z):
            return _sigma(assemble(state(t), self.A, z.reshape(self.shape), self.E)["W0"], self.rank) - self.threshold

        passes.terminal = True
        z0 = self.Z0.ravel() if not self.pieces else self.pieces[-1].sol(self.pieces[-1].t[-1])
        piece = solve_ivp(field, (segment.sol.t_min, segment.sol.t_max), z0, method=TRANSVERSE_METHOD, events=passes,
                          dense_output=True, rtol=self.rtol, atol=self.rtol * self.scale)
        if piece.status == -1:  # where it stopped and how large z was say whether it blew up before σ crossed
            raise RuntimeError(f"the transverse equation failed at t = {piece.t[-1]:.6g} (|z| = "
                               f"{np.linalg.norm(piece.y[:, -1]):.3g}, σ{self.rank}(W0) not yet at its threshold "
                               f"{self.threshold:.3g}): {piece.message}")
        self.pieces.append(piece)
        self.crossings.extend(float(t) for t in piece.t_events[0][:1])

    @property
    def crossing(self) -> float | None:
        """When σ_r(W0) passed the threshold (None: not within the integrated span)."""
        return self.crossings[0] if self.crossings else None

    def settle_at(self, state: ReducedState, t: float) -> None:
        """The rank-r flow has settled at ``state`` (time t, its reach): past t, H_T is frozen there and Z follows
        exp(-τ H_T) Z(t) in closed form (one dense eigendecomposition, O((2d + 2k)³))."""
        self.settled = FrozenTransverse.at(TransverseCoupling(self.chain, state), self.at(t), t)

    def at(self, t: float) -> np.ndarray:
        """Z(t) within the integrated span; past a settled reach its closed form, else held at the span's end."""
        if self.settled is not None and t > self.settled.t0:
            return self.settled.at_time(t)
        ends = np.array([piece.t[-1] for piece in self.pieces])
        piece = self.pieces[min(int(np.searchsorted(ends, t)), len(self.pieces) - 1)]
        return piece.sol(min(t, piece.t[-1])).reshape(self.shape)


@dataclass(frozen=True)
class RuleVerdict:
    """What the rule for direction r decided (``restart_rule``)."""

    rule: RuleName
    t_onset: float | None
    amplitude: float | None = None
    t_leading: float | None = None


def restart_rule(chain: MeanFieldChain, reduced_flow: ReducedFlow, path: ReducedPath, transverse: TransverseAlongPath,
                 t_settle: float | None, t_integrated: float | None, A: np.ndarray, E: np.ndarray,
                 threshold: float) -> RuleVerdict:
    """Which rule predicts direction r's restart, and its time (the module docstring's three cases, and the
    optimum). Cost: at most one fastest-mode SVD and one frozen-point crossing, O((2d + 2k)³)."""
    rank, d, k = A.shape[1], reduced_flow.d, reduced_flow.k
    rate, peak = float(path.rates[-1]), float(path.rates.max())
    if peak == 0 or rate <= DEGENERATE_RATE * peak:
        # C -> 0 either at a degenerate critical point or because the rank-r flow reaches the Bayes loss
        excess_loss = reduced_flow.loss(ReducedState.unpack(path.y(path.t_reach), d, k)) - chain.bayes_loss()
        return RuleVerdict(RuleName.OPTIMUM if excess_loss <= OPTIMUM_GAP * chain.bayes_loss() else RuleName.DEGENERATE, None)
    if t_integrated is not None and (t_settle is None or t_integrated <= t_settle):
        return RuleVerdict(RuleName.BEFORE_SETTLING, t_integrated)
    if t_settle is None:
        return RuleVerdict(RuleName.NOT_SETTLED, None)
    settled_state = ReducedState.unpack(path.y(t_settle), d, k)
    C = TransverseCoupling(chain, settled_state)
    mode = fastest_transverse_mode(C)
    Z_settle = transverse.at(t_settle)
    basis = np.linalg.svd(settled_state.Gamma, full_matrices=True)[0]
    off_open = basis[:, rank:] @ basis[:, rank:].T
    amplitude = float(np.linalg.norm(mode.direction @ Z_settle) * np.linalg.norm(off_open @ mode.u))
    t_leading = t_settle + float(np.log(threshold / amplitude)) / rate
    tau = settled_crossing(settled_state, A, E, FrozenTransverse.at(C, Z_settle, t_settle), rank, threshold, rate)
    return RuleVerdict(RuleName.FORMULA, None if tau is None else t_settle + tau, amplitude, t_leading)


class TransverseRate:
    """The transverse rate σ_max(C) at a packed reduced state. Successive samples along a path are close, so
    each Lanczos starts from the last sample's left singular vector. Cost: a few O(d² r) products."""

    def __init__(self, chain: MeanFieldChain, k: int):
        self.chain, self.k, self.nearby = chain, k, None

    def __call__(self, y: np.ndarray) -> float:
        state = ReducedState.unpack(y, self.chain.d, self.k)
        rate, self.nearby, _ = TransverseCoupling(self.chain, state).top(start=self.nearby)
        return rate


def propagate_rank(chain: MeanFieldChain, params, A: np.ndarray, t_start: float, look: float,
                   threshold: float, grid: np.ndarray,
                   confirmed: Callable[[np.ndarray, dict[str, np.ndarray]], bool] | None = None,
                   confirm_from: float = 0.0, rtol: float | None = None) -> RankStage:
    """Follow the rank-r flow and the transverse equation from ``params`` at ``t_start``; predict the restart
    of direction r = A.shape[1] (σ_r(W0) passing ``threshold``). The settling and the crossing are found
    without reference to ``look``, which only bounds the saved trajectory (``grid`` times up to the crossing or
    ``look``). Given ``confirmed`` (a rank that starts past the horizon, or full rank: threshold ∞), the flow is
    only shown: unless it crosses first, it stops at ``look`` or once ``confirmed(saved times, parameters)``, asked
    as each piece ends past ``confirm_from``, says the trajectory so far is enough. ``rtol``: the rank-r flow's
    tolerance (default REDUCED_RTOL, FULL_RANK_RTOL at full rank). Cost: the reduced flow and the linear
    transverse equation, (2d + 2k)(m - r) equations at O(d² m) per evaluation."""
    A = np.asarray(A, dtype=float)
    rank, E = A.shape[1], complement(A)
    d, k = chain.d, np.shape(params["W_Q"])[1]
    reduced_flow = ReducedFlow(chain, k, rank)
    full_rank = E.shape[1] == 0 or not np.isfinite(threshold)
    transverse = TransverseAlongPath(chain, A, E, transverse_part(params, E), threshold,
                                     TRANSVERSE_RTOL if confirmed is None else SHOWN_TRANSVERSE_RTOL)

    rate_of = TransverseRate(chain, k)
    transverse_at = (lambda t: np.zeros(transverse.shape)) if full_rank else transverse.at

    def followed_far_enough(path_so_far: ReducedPath) -> bool:
        if not full_rank:
            known = transverse(path_so_far)  # the new segment integrated; True once crossed and the rule is known
            if transverse.crossing is not None or confirmed is None:
                return known
        if path_so_far.t_reach >= look:  # no crossing by the saved trajectory's end
            return True
        if confirmed is None or path_so_far.t_reach < confirm_from:
            return False
        kept, stacked, _ = saved_trajectory(reduced_flow, path_so_far, transverse_at, A, E, t_start, path_so_far.t_reach,
                                            None, grid)
        return confirmed(kept, stacked)

    tolerance = rtol if rtol is not None else FULL_RANK_RTOL if full_rank else REDUCED_RTOL
    path = follow_reduced_flow(reduced_flow, project(params, A), t_start, rate_of, followed_far_enough,
                               until=look if full_rank or confirmed is not None else REACH_LIMIT, rtol=tolerance,
                               pieces=1 if full_rank else PIECES_PER_SPAN)
    t_settle = settle_time(path, rate_of)
    rate, peak = float(path.rates[-1]), float(path.rates.max())
    t_integrated = transverse.crossing

    # past the reduced flow's reach it has settled: Z follows its closed form there, which may cross
    if not full_rank and t_integrated is None and path.converged and rate > DEGENERATE_RATE * peak:
        end_state = ReducedState.unpack(path.y(path.t_reach), d, k)
        transverse.settle_at(end_state, path.t_reach)
        tau = settled_crossing(end_state, A, E, transverse.settled, rank, threshold, rate)
        t_integrated = None if tau is None else path.t_reach + tau

    verdict = RuleVerdict(RuleName.FULL_RANK, None) if full_rank else restart_rule(
        chain, reduced_flow, path, transverse, t_settle, t_integrated, A, E, threshold)

    # a flow stopped before ``look`` (confirmed) is saved to where it was followed; a settled one is held
    saved_until = min(look, path.t_reach) if not path.converged and t_integrated is None else look
    kept, stacked, velocity = saved_trajectory(reduced_flow, path, transverse_at, A, E, t_start, saved_until, t_integrated, grid)
    restart = RestartPrediction(rank, verdict.t_onset, verdict.rule, t_integrated, t_settle, rate, path.t_reach, peak,
                                verdict.amplitude, verdict.t_leading, threshold)
    return RankStage(rank, A, kept, stacked, velocity, restart)


def saved_trajectory(reduced_flow: ReducedFlow, path: ReducedPath, transverse_at: Callable[[float], np.ndarray],
                     A: np.ndarray, E: np.ndarray, t_start: float, look: float, t_integrated: float | None,
                     grid: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The stage's saved times (``grid`` up to the crossing or ``look``, and the crossing itself), the full
    parameters there and their velocity. Cost: O(d² m) per saved time."""
    chain, d, k = reduced_flow.chain, reduced_flow.d, reduced_flow.k
    stop = min(look, t_integrated) if t_integrated is not None else look
    kept = np.concatenate([[t_start], grid[(grid > t_start) & (grid <= stop)]])
    if t_integrated is not None and t_integrated <= look:
        kept = np.append(kept, t_integrated)
    full, speeds = [], []
    for t in kept:
        y, Z = path.y(t), transverse_at(t)
        state = ReducedState.unpack(y, d, k)
        full.append(assemble(state, A, Z, E))
        # assemble is linear in (coordinates, Z), so the predicted velocity is assemble of their fields
        coupling = TransverseCoupling(chain, state)  # its gradients of the maps serve both fields
        moving = -reduced_flow.gradient(state, coupling.gradients).pack() if t <= path.t_reach else np.zeros_like(y)
        speeds.append(assemble(ReducedState.unpack(moving, d, k), A, transverse_field(coupling, Z) if E.shape[1] else Z, E))
    stacked = {name: np.stack([p[name] for p in full]) for name in full[0]}
    velocity = {name: np.stack([v[name] for v in speeds]) for name in speeds[0]}
    return kept, stacked, velocity


@dataclass(frozen=True)
class FrozenTransverse:
    """Z(t0 + τ) = exp(-τ H_T) Z(t0) = W e^{-τΛ} W^T Z(t0) at a frozen point (H_T = W Λ W^T, one dense
    symmetric eigendecomposition, O((2d + 2k)³))."""

    values: np.ndarray
    vectors: np.ndarray
    coefficients: np.ndarray  # W^T Z(t0)
    t0: float

    @staticmethod
    def at(C: TransverseCoupling, Z: np.ndarray, t0: float) -> "FrozenTransverse":
        values, vectors = np.linalg.eigh(transverse_hessian(C.dense()))
        return FrozenTransverse(values, vectors, vectors.T @ Z, float(t0))

    def after(self, tau: float) -> np.ndarray:
        return self.vectors @ (np.exp(-tau * self.values)[:, None] * self.coefficients)

    def at_time(self, t: float) -> np.ndarray:
        return self.after(t - self.t0)


def settled_crossing(state: ReducedState, A: np.ndarray, E: np.ndarray, frozen: FrozenTransverse, rank: int,
                     threshold: float, rate: float, decades: float = 12.0) -> float | None:
    """The first τ at which σ_r(W0) of Z(τ) = exp(-τ H_T) Z passes ``threshold`` at the frozen point
    (None if not within ``decades`` e-folds of the fastest rate, 10^decades in amplitude)."""

    def excess(tau: float) -> float:
        return _sigma(assemble(state, A, frozen.after(tau), E)["W0"], rank) - threshold

    taus = np.concatenate([[0.0], np.geomspace(1e-3, decades * np.log(10.0), 400) / rate])
    signs = np.array([excess(tau) for tau in taus]) > 0
    if signs[0] or not signs.any():
        return None
    above = int(np.argmax(signs))
    return float(brentq(excess, taus[above - 1], taus[above], xtol=1e-10 * taus[above]))
