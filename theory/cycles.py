"""Stages III and IV chained: the rank-r flows and their restarts, one direction after another.

On the rank-one manifold the paper chain's flow focuses and then settles, still focused
(``theory.manifold``): dilution and the next focus need new directions. From θ(0) the prediction
follows the rank-one flow and its transverse equation (``theory.restart``) up to the restart of
direction 1; from that crossing it continues on the rank-two manifold spanned by α and the direction
α2 in which the transverse part grew (the top right singular vector of W0's transverse part, off the
directions already open), with the transverse equation of the remaining m - 2 directions, up to
the restart of direction 2; and so on for every rank r < min(d, m). The stage detectors then read the
predicted trajectory: the later focuses, every dilution, and how the embeddings moved over them.

**Direction 1 opened from θ(0)** (``CyclePrediction.opened``). Once the rank-one crossing has named α2, the
rank-two flow is also followed from θ(0) itself, so the parts of θ(0) along α2 (W0's column, W1's row, W_Q's
and W_K's rows) enter at every order from t = 0, where the transverse equation keeps them to first order only.
At ε = 1e-2 a term bilinear in W0's and W_Q/W_K's parts along α2 opens σ1 and the first foci well before the
linear equation says (benchmarks/MEASUREMENTS.md, "σ1 at ε = 1e-2 on a text surrogate"); as ε -> 0 the two
agree. The rows of condensation, the first focus and σ1 are read on that flow; the later events on the chain.

**Dilution, as a sign.** Query i's attention on token f is A_if = π_f e^{Φ_if} / Σ_j π_j e^{Φ_ij}, so

    D_i = d log A_if / dt = Σ_j (δ_jf - A_ij) dΦ_ij/dt,   dΦ/dt = Ẇ0 S W0^T + W0 S Ẇ0^T + W0 Ṡ W0^T,

S = W_Q W_K^T, Ẇ = -∂L/∂W. A focus of query i on token f is D_i > 0; its dilution is D_i < 0, mass
leaving f. The first two terms of dΦ/dt (``embedding`` below) are the embeddings moving, the frequent
and the rare tokens' rows of W0 redistributing the attention mass; the third (``attention``) is the
query-key map moving. ``dilution_rates`` evaluates both along the predicted trajectory; where the
embedding part is the negative one the dilution is the embeddings' doing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from flowsim.model.flow import GradientFlow
from flowsim.model.models import OneLayerTransformer
from flowsim.observe.observables import Observables, stage_observables
from flowsim.observe.stages import Interval, StageReport, StageThresholds, detect_stages
from flowsim.solve.trajectory import Trajectory
from theory.restart import FULL_RANK_RTOL, RankStage, RestartPrediction, complement, propagate_rank
from theory.mean_field import MeanFieldChain


@dataclass(frozen=True)
class CyclePrediction:
    stages: list[RankStage]  # rank 1, 2, ...: each up to its restart (or t_end)
    opened: RankStage | None  # the rank-two flow from θ(0) with direction 1 open; None: direction 1 does not open
    report: StageReport  # the detectors on the predicted trajectory
    observables: Observables  # what they read: the trajectory's ``stage_observables``
    trajectory: Trajectory
    velocity: dict[str, np.ndarray]  # dθ/dt of the prediction on trajectory.t
    pi: np.ndarray
    confirmation: Confirmation  # the rows read focus and dilution onsets up to confirmation.through
    failure: tuple[int, float, str] | None = None  # (rank, from t, why) when a rank's flow failed: the earlier ranks stand

    @property
    def confirmed_through(self) -> float:
        return self.confirmation.through

    def dilutions(self) -> list[Interval]:
        """The confirmed dilutions (onset up to ``confirmed_through``)."""
        return [i for i in self.report.of("dilution") if i.t_start <= self.confirmed_through]

    def restarts(self) -> list[RestartPrediction]:
        """The restart of each direction that can open (not the last stage's, once W0 has full rank)."""
        return [stage.restart for stage in self.stages if np.isfinite(stage.restart.threshold)]


def next_direction(params, A: np.ndarray) -> np.ndarray:
    """The unit vector of span(A)^⊥ along which W0's transverse part grew most, off the open directions."""
    E = complement(A)
    W0 = np.asarray(params["W0"])
    open_rows = np.linalg.svd(W0 @ A, full_matrices=True)[0][:, A.shape[1]:]
    transverse = open_rows.T @ W0 @ E  # W0's transverse part, off the range of Γ
    return E @ np.linalg.svd(transverse)[2][0]


POINTS_PER_DECADE = 120  # the prediction's own save times: log-spaced from GRID_START, whatever the run's horizon
GRID_START = 0.1
# The chained prediction is followed past the horizon until the detectors can confirm every event before it: to
# T >= 10^(lookahead + CONFIRM_DECADES) × the horizon, where each event up to T / 10^(lookahead + CONFIRM_DECADES)
# is placed on the trajectory and on its cut CONFIRM_DECADES (of log t) earlier, which still reaches the detectors'
# lookahead (their smoothing and hold, ``lookahead_decades``) past it. An event the two place differently would be
# unsettled; the detectors are causal (docs/stages.md), so none is: the check guards that claim on every prediction.
CONFIRM_DECADES = 0.1
CONFIRM_RTOL = 1e-3  # onsets that move less than this between the two cuts are settled (the rows print 4 digits)
MAX_REACH = 4.0  # a rank-r flow that does not restart is saved this far (× the horizon), holding its settled state
CONFIRMED_STAGES = ("focus", "dilution")  # the events the chained prediction's rows read from its detectors


def prediction_grid(look: float) -> np.ndarray:
    """GRID_START × 10^(n / POINTS_PER_DECADE) up to ``look``: the same times for every horizon."""
    count = int(np.floor(np.log10(look / GRID_START) * POINTS_PER_DECADE)) + 1
    return GRID_START * 10.0 ** (np.arange(count) / POINTS_PER_DECADE)


def joined_on_grid(pieces: list[tuple[np.ndarray, dict[str, np.ndarray]]], grid: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Consecutive stages' (times, arrays) joined on ``grid`` and t = 0 (a crossing is not a save time)."""
    saved = [np.isin(t, grid) | (t == 0.0) for t, _ in pieces]
    t = np.concatenate([t[keep] for (t, _), keep in zip(pieces, saved)])
    arrays = {name: np.concatenate([values[name][keep] for (_, values), keep in zip(pieces, saved)]) for name in pieces[0][1]}
    return t, arrays


def placed_events(report: StageReport, until: float) -> dict[tuple, list[float]]:
    """The focus and dilution onsets up to ``until``, by (stage, query)."""
    placed: dict[tuple, list[float]] = {}
    for i in report.intervals:
        if i.stage in CONFIRMED_STAGES and i.t_start <= until:
            placed.setdefault((i.stage, i.query), []).append(i.t_start)
    return placed


def lookahead_decades(thresholds: StageThresholds) -> float:
    """How far past a time (decades of log t) the detectors read to place an event there
    (``StageThresholds.lookahead_decades``); a confirmation cut reaches CONFIRM_DECADES further."""
    return thresholds.lookahead_decades


def confirmation_reach(thresholds: StageThresholds) -> float:
    """A check on the trajectory to T places the events up to T / this: 10^(lookahead + CONFIRM_DECADES + two
    grid intervals), as the detectors' lookahead ends on a save and a save may fall up to an interval past it."""
    return 10.0 ** (lookahead_decades(thresholds) + CONFIRM_DECADES + 2.0 / POINTS_PER_DECADE)


@dataclass(frozen=True)
class Confirmation:
    """The detectors' focus and dilution onsets up to ``through``, placed on a trajectory and on its cut
    CONFIRM_DECADES earlier: ``unsettled`` says, per (stage, query), how those they place differently (count,
    or onset beyond CONFIRM_RTOL) moved."""

    through: float
    unsettled: dict[tuple, str]

    @property
    def confirmed(self) -> bool:
        return not self.unsettled


def differences(longer: dict[tuple, list[float]], cut: dict[tuple, list[float]], t_cut: float, t_end: float) -> dict[tuple, str]:
    """Per (stage, query), how two placements of its onsets differ, in words (none where they agree)."""
    moved = {}
    for key in sorted(set(longer) | set(cut), key=str):
        a, b = longer.get(key, []), cut.get(key, [])
        if len(a) != len(b):
            moved[key] = f"{len(b)} onset(s) on the trajectory to t = {t_cut:.5g}, {len(a)} to t = {t_end:.5g}"
        elif any(abs(onset - earlier) > CONFIRM_RTOL * onset for onset, earlier in zip(a, b)):
            moved[key] = (f"onset {', '.join(f'{x:.5g}' for x in b)} on the trajectory to t = {t_cut:.5g}, "
                          f"{', '.join(f'{x:.5g}' for x in a)} to t = {t_end:.5g}")
    return moved


def check_confirmation(observables: Observables, thresholds: StageThresholds) -> Confirmation:
    """Every focus and dilution up to t[-1] / 10^(lookahead + CONFIRM_DECADES), placed on the trajectory to t[-1]
    and on the one cut CONFIRM_DECADES earlier (which still reads the detectors' lookahead past them), from the
    trajectory's ``stage_observables``. Cost: the detectors twice, O(T d)."""
    t_end = float(observables.t[-1])
    t_cut = t_end / 10.0 ** CONFIRM_DECADES
    through = t_end / confirmation_reach(thresholds)
    whole, earlier = detect_stages(observables, thresholds), detect_stages(observables.until(t_cut), thresholds)
    return Confirmation(through, differences(placed_events(whole, through), placed_events(earlier, through), t_cut, t_end))


class ConfirmationReader:
    """The chained prediction's reads of its own trajectory: the joined pieces on the grid, their
    ``stage_observables`` (the last read kept, as the final trajectory is often the one last confirmed), and the
    confirmations made once the trajectory reaches ``from_t`` (``check_confirmation``)."""

    def __init__(self, chain: MeanFieldChain, flow: GradientFlow, grid: np.ndarray, from_t: float,
                 thresholds: StageThresholds, progress: Callable[[str], None]):
        self.chain, self.flow, self.grid, self.from_t, self.thresholds, self.progress = chain, flow, grid, from_t, thresholds, progress
        self.checked: list[Confirmation] = []
        self._last: tuple[np.ndarray, dict, Observables] | None = None

    def observables(self, t: np.ndarray, thetas: dict) -> Observables:
        """The joined trajectory's ``stage_observables``, O(T d² m); those of the last read where it is the same."""
        if self._last is not None:
            t_read, thetas_read, observables = self._last
            if np.array_equal(t, t_read) and all(np.array_equal(thetas[name], thetas_read[name]) for name in thetas):
                return observables
        trajectory = Trajectory(t=t, loss=self.flow.loss_along(self.flow.flatten_batch(thetas)), params=thetas)
        observables = stage_observables(trajectory, self.chain.pi)
        self._last = (t, thetas, observables)
        return observables

    def confirmed(self, pieces: list[tuple[np.ndarray, dict]]) -> bool:
        """Whether the prediction may stop with these pieces: checked once they reach ``from_t``."""
        t, thetas = joined_on_grid(pieces, self.grid)
        if t[-1] < self.from_t:
            return False
        self.checked.append(check_confirmation(self.observables(t, thetas), self.thresholds))
        unsettled = "".join(f"; {stage} of q{query} unsettled: {how}" for (stage, query), how in self.checked[-1].unsettled.items())
        self.progress(f"at t = {t[-1]:.5g}: the events to t = {self.checked[-1].through:.5g} placed{unsettled}")
        return True


def rank_two_from_start(chain: MeanFieldChain, params0, A: np.ndarray, reach: float, threshold: float,
                        grid: np.ndarray) -> RankStage:
    """The rank-two flow with direction 1 open from θ(0) (``A``: α and α2), for the rows: they read it up to the
    horizon and the detectors a little past it, so it is only shown, to ``reach`` unless σ2 passes ``threshold``
    first; its own restart is not looked for (``propagate_rank`` with a confirmation that never comes). Like every
    flow that is only shown it runs at FULL_RANK_RTOL: on the d = 1001 surrogates its rows moved by at most 4e-4
    (relative) against the rank-r flows' REDUCED_RTOL, for a good part of the cost (benchmarks/MEASUREMENTS.md)."""
    return propagate_rank(chain, params0, A, 0.0, reach, threshold, grid, confirmed=lambda t, thetas: False,
                          confirm_from=reach, rtol=FULL_RANK_RTOL)


def predict_cycles(chain: MeanFieldChain, flow: GradientFlow, model: OneLayerTransformer, params0, alpha: np.ndarray,
                   horizon: float, thresholds: StageThresholds | None = None,
                   progress: Callable[[str], None] = lambda line: None) -> CyclePrediction:
    """The chained rank-r predictions from θ(0), saved on ``prediction_grid``, followed past ``horizon`` until the
    detectors can confirm every focus and dilution before it (``check_confirmation`` at the first rank crossing
    or span end of the full-rank flow past 10^(lookahead + CONFIRM_DECADES) × horizon); ``progress`` receives a
    line as each rank's flow starts and ends (at large d each takes minutes) and at the confirmation.

    Each rank's flow settles and crosses its threshold where it does (``propagate_rank``), so an event's
    predicted time does not depend on the horizon once the detectors confirm it; one they cannot confirm is
    named in ``CyclePrediction.confirmation``.
    Cost: one ``propagate_rank`` per opened direction, one more for the rank-two flow from θ(0) (``opened``, only
    shown: followed to the detectors' confirmation reach past the horizon, its own restart not looked for), and
    the detectors' observables on the grid, O(d² m) per saved time."""
    th = StageThresholds() if thresholds is None else thresholds
    look = MAX_REACH * horizon
    grid = prediction_grid(look)
    reach = confirmation_reach(th)
    floors = np.linalg.svd(np.asarray(params0["W0"]), compute_uv=False)
    A = np.asarray(alpha, dtype=float).reshape(-1, 1)
    initial = {name: np.asarray(value) for name, value in params0.items()}
    params, t_start, stages, opened, failure = initial, 0.0, [], None, None
    reader = ConfirmationReader(chain, flow, grid, reach * horizon, th, progress)

    while True:
        rank = A.shape[1]
        full = rank >= len(floors)  # W0 has no direction left to open: the last stage runs until confirmed
        threshold = np.inf if full else th.restart_factor * float(floors[rank])
        progress(f"rank-{rank} flow from t = {t_start:.5g}" + (" (full rank)" if full else
                                                               f", until σ{rank} passes {threshold:.3g}"))
        earlier = [(stage.t, stage.params) for stage in stages]
        # a rank that starts past the horizon restarts past it: like the full-rank flow it only shows the detectors
        # the trajectory beyond the horizon, at that flow's tolerance, until they confirm the events before it
        shows_only = full or t_start > horizon
        try:
            stage = propagate_rank(chain, params, A, t_start, look, threshold, grid,
                                   confirmed=(lambda t, thetas: reader.confirmed(earlier + [(t, thetas)])) if shows_only else None,
                                   confirm_from=reach * horizon, rtol=FULL_RANK_RTOL if shows_only else None)
        except (RuntimeError, FloatingPointError, OverflowError, np.linalg.LinAlgError) as error:
            if not stages:  # nothing to keep: the rank-one flow is the prediction's first stage
                raise
            failure = (rank, t_start, str(error))  # every earlier rank's rows stand; this rank's restart says why not
            progress(f"rank-{rank} flow failed from t = {t_start:.5g}: {error}")
            break
        stages.append(stage)
        crossed = stage.restart.t_integrated
        if not full:
            progress(f"rank-{rank} flow: " + ("no restart within reach" if crossed is None else f"σ{rank} passes at t = {crossed:.5g}"))
        if crossed is None or crossed > look or full:
            break
        params = {name: value[-1] for name, value in stage.params.items()}
        A = np.column_stack([A, next_direction(params, A)])
        if rank == 1 and len(floors) > 2:  # direction 1 named: its rank-two flow from θ(0) too, for the rows
            progress(f"rank-2 flow from t = 0, direction 1 open (α2 named at the rank-1 crossing, t = {crossed:.5g})")
            opened = rank_two_from_start(chain, initial, A, reach * horizon, th.restart_factor * float(floors[2]), grid)
        if reader.confirmed(earlier + [(stage.t, stage.params)]):
            break
        t_start = crossed
    t, thetas = joined_on_grid([(stage.t, stage.params) for stage in stages], grid)
    velocity = joined_on_grid([(stage.t, stage.velocity) for stage in stages], grid)[1]
    observables = reader.observables(t, thetas)
    trajectory = Trajectory(t=t, loss=observables["loss"], params=thetas)
    report = detect_stages(observables, th)
    # unchecked where a rank-r flow did not restart (saved to ``look``, holding its settled state)
    confirmation = reader.checked[-1] if reader.checked else Confirmation(float(t[-1]) / reach, {})
    return CyclePrediction(stages, opened, report, observables, trajectory, velocity, chain.pi, confirmation, failure)


@dataclass(frozen=True)
class DilutionRates:
    """D_i = d log A_if/dt along a trajectory, split into its embedding and attention parts."""

    query: int
    token: int
    t: np.ndarray
    total: np.ndarray
    embedding: np.ndarray
    attention: np.ndarray


def dilution_rates(prediction: CyclePrediction, pairs: Sequence[tuple[int, int]]) -> list[DilutionRates]:
    """D_i and its two parts for each (query i, token f) of ``pairs`` at every saved point, from the prediction's own
    velocity: only the pairs' rows of Φ and of its derivative, all pairs at once per point, O(d m (m + q)) per point
    for q pairs (d = 1001, 315 pairs: the constants' text in 2.5 s against 13.3 s pair by pair)."""
    if not pairs:
        return []
    queries = np.array([query for query, _ in pairs])
    tokens = np.array([token for _, token in pairs])
    trajectory, log_pi = prediction.trajectory, np.log(prediction.pi)
    embedding, attention = [], []
    for n in range(len(trajectory.t)):
        W0, W_Q, W_K = (trajectory.params[name][n] for name in ("W0", "W_Q", "W_K"))
        dW0, dW_Q, dW_K = (prediction.velocity[name][n] for name in ("W0", "W_Q", "W_K"))
        S, S_dot = W_Q @ W_K.T, dW_Q @ W_K.T + W_Q @ dW_K.T
        X, dX = W0[queries].T, dW0[queries].T  # m × q: the queries' embeddings and their velocity
        SX = S.T @ X
        logits = W0 @ SX + log_pi[:, None]  # column c: row i_c of Φ = W0 S W0^T
        weights = np.exp(logits - logits.max(axis=0))
        weights /= weights.sum(axis=0)
        lever = -weights
        lever[tokens, np.arange(len(pairs))] += 1.0  # δ_jf - A_ij
        moved = W0 @ (S.T @ dX) + dW0 @ SX
        turned = W0 @ (S_dot.T @ X)
        embedding.append(np.sum(lever * moved, axis=0))
        attention.append(np.sum(lever * turned, axis=0))
    embedding, attention, t = np.array(embedding), np.array(attention), np.asarray(trajectory.t)
    return [DilutionRates(int(query), int(token), t, embedding[:, c] + attention[:, c], embedding[:, c], attention[:, c])
            for c, (query, token) in enumerate(pairs)]


def preceding_focus(prediction: CyclePrediction, dilution: Interval) -> Interval:
    """The focus of the dilution's query that came last before it."""
    return [i for i in prediction.report.of("focus", dilution.query) if i.t_start < dilution.t_start][-1]


def focused_token(prediction: CyclePrediction, dilution: Interval) -> int:
    """The token query i attended most to just before its dilution (read midway between its focus onset and it)."""
    focus = preceding_focus(prediction, dilution)
    trajectory = prediction.trajectory
    n = int(np.searchsorted(trajectory.t, (focus.t_start + dilution.t_start) / 2))
    W0, S = trajectory.params["W0"][n], trajectory.params["W_Q"][n] @ trajectory.params["W_K"][n].T
    logits = W0 @ (S.T @ W0[dilution.query]) + np.log(prediction.pi)  # row i of Φ = W0 S W0^T
    return int(np.argmax(logits))


def dilution_mechanisms(prediction: CyclePrediction, dilutions: Sequence[Interval]) -> list[str]:
    """For each dilution: when D_i turned negative after the focus, and which part of it is negative at the onset."""
    tokens = [focused_token(prediction, dilution) for dilution in dilutions]
    lines = []
    for dilution, rates in zip(dilutions, dilution_rates(prediction, [(i.query, f) for i, f in zip(dilutions, tokens)])):
        leaving = np.flatnonzero((rates.total < 0) & (rates.t > preceding_focus(prediction, dilution).t_start))
        # at the onset itself, between the saved times around it
        total, embedding, attention = (float(np.interp(dilution.t_start, rates.t, x))
                                       for x in (rates.total, rates.embedding, rates.attention))
        driver = "the embeddings move" if embedding < 0 <= attention else (
            "the query-key map moves" if attention < 0 <= embedding else "both parts move")
        since = "" if not len(leaving) else f" from t = {rates.t[leaving[0]]:.4g}"
        lines.append(f"D = d log A[{dilution.query},{rates.token}]/dt < 0{since}; at the onset {total:+.3g} = embedding "
                     f"part {embedding:+.3g} + attention part {attention:+.3g}: {driver} the mass")
    return lines
