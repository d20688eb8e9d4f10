"""The theory's accuracy on chains it was not developed on: a seeded random family (the harness of
``benchmarks/theory_accuracy.py``, and of the tests that check the predictions against the exact flow).

``random_family`` draws paper-family chains P = λ I + (1 - λ) 1 π^T with π from a flat
Dirichlet (entries floored at ``min_pi`` so every token can be measured, then sorted so
token 0 is the most frequent) and λ uniform in [0.2, 0.8]. ``chain_accuracy`` integrates
the exact flow of one of them and puts the predicted condensation and first focus beside the
detectors' own; ``restart_accuracy`` does the same for the restart of direction 1, and
``cycle_accuracy`` for every event of the chained prediction (later restarts, focuses, dilutions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowsim.config import RunConfig, load_config, transition_override
from flowsim.assemble import prepare
from flowsim.observe.families import compute_observables
from flowsim.solve.solvers import solve_flow
from flowsim.observe.stages import StageReport, StageThresholds, detect_stages
from theory.focus import predict_focus
from theory.origin import predict_condensation
from theory.predict import AFTER_HORIZON, Row, compared_rows, predict_run
from theory.restart import RestartPrediction, propagate_rank
from theory.mean_field import MeanFieldChain


HORIZON_CAP = 1e5  # where no focus is predicted, the exact flow of the accuracy check stops here at the latest


def random_family(n: int, seed: int = 0, dims: tuple[int, ...] = (3, 4, 5), min_pi: float = 0.02,
                  lam_range: tuple[float, float] = (0.2, 0.8)) -> list[tuple[list[float], float]]:
    """n chains (π, λ), the vocabulary size cycling through ``dims``; π rounded to 6 digits, summing to 1."""
    if n < 1 or not dims or min(dims) < 2:
        raise ValueError(f"need n >= 1 and vocabulary sizes >= 2, got n = {n}, dims = {dims}")
    rng = np.random.default_rng(seed)
    chains = []
    for index in range(n):
        d = dims[index % len(dims)]
        pi = np.maximum(np.sort(rng.dirichlet(np.ones(d)))[::-1], min_pi)
        pi = np.round(pi / pi.sum(), 6)
        pi[-1] = 1.0 - pi[:-1].sum()
        chains.append(([float(x) for x in pi], float(rng.uniform(*lam_range))))
    return chains


@dataclass(frozen=True)
class ChainAccuracy:
    """Predicted and measured onsets on one chain (None where a side has no such event).

    ``condensation`` and ``focus`` hold ``predict_run``'s rows (the rank-one flow from θ(0)); ``orbits`` the
    asymptotic times of Stage I's orbit and Stage II's focus orbit, which they approach as ε -> 0."""

    pi: list[float]
    lam: float | None  # None: a general transition matrix
    eps: float
    t_end: float
    condensation: tuple[float, float | None]  # (predicted, measured) end of condensation
    focus: tuple[float | None, float | None]  # (predicted, measured) onset of the first query's focus
    restart_measured: float | None  # the first σ1 restart of the measured flow (it can interrupt a focus)
    orbits: tuple[float, float | None]  # Stage I's condensation end, Stage II's first focus

    @staticmethod
    def error(pair: tuple[float | None, float | None]) -> float | None:
        predicted, measured = pair
        return None if predicted is None or measured is None else abs(predicted - measured) / measured

    def orbit_errors(self) -> tuple[float | None, float | None]:
        """The relative errors of Stage I's and Stage II's asymptotic times against the flow."""
        return (self.error((self.orbits[0], self.condensation[1])), self.error((self.orbits[1], self.focus[1])))


def chain_accuracy(pi: list[float], lam: float, eps: float, seed: int = 0, horizon_factor: float = 2.0,
                   n_save: int = 600) -> ChainAccuracy:
    """Predict condensation and the first focus, then integrate the exact flow (m = k = 8, mean field) to
    ``horizon_factor`` × Stage II's predicted focus (or, where it predicts none, × the end of the focus
    orbit's linear phase) on ``n_save`` log-spaced times and detect its stages."""
    return overrides_accuracy([f"chain.pi={pi}", f"chain.lam={lam}"], eps, seed, horizon_factor, n_save, pi, lam)


def transition_accuracy(P: np.ndarray, eps: float, seed: int = 0, horizon_factor: float = 2.0,
                        n_save: int = 600) -> ChainAccuracy:
    """``chain_accuracy`` for a general transition matrix P (π its stationary law): a text surrogate, say."""
    return overrides_accuracy([transition_override(P)], eps, seed, horizon_factor, n_save)


def overrides_accuracy(chain_overrides: list[str], eps: float, seed: int, horizon_factor: float, n_save: int,
                       pi: list[float] | None = None, lam: float | None = None) -> ChainAccuracy:
    """Condensation and first focus, predicted (``predict_run``'s rows) and measured, for the chain of
    ``chain_overrides``; the horizon comes from Stage II's orbit, which needs no rank-one flow."""
    overrides = chain_overrides + [f"init.eps={eps}", f"init.seed={seed}"]
    prepared = prepare(load_config(None, overrides + [f"solver.atol={atol_below_eps_squared(eps)}"]))
    chain = prepared.chain
    condensation = predict_condensation(chain.pi, chain.P, prepared.params0, eps)
    focus = predict_focus(MeanFieldChain(chain.pi, chain.P), prepared.params0, condensation, prepared.model.k)
    first = focus.order[0]
    orbit_focus = focus.t_onset.get(first)
    # no focus predicted: run past the end of the orbit's linear phase, where its entropy settles
    linear_phase_end = focus.t_shift + np.log(1.0 / focus.orbit.delta) / focus.mu2
    t_end = horizon_factor * orbit_focus if orbit_focus is not None else min(horizon_factor * linear_phase_end,
                                                                             HORIZON_CAP)
    config = flow_config(overrides, eps, t_end, n_save)
    rows = predict_run(config).rows
    predicted = {(row.stage, row.query): row.predicted for row in rows if row.stage in ("condensation", "focus")}
    report = measured_stages(config)
    condensed = report.of("condensation")
    focused = report.of("focus", first)
    restarts = [i.t_start for i in report.of("restart") if i.direction == 1]
    return ChainAccuracy(
        [float(x) for x in chain.pi] if pi is None else pi, lam, eps, t_end,
        (predicted[("condensation", None)], condensed[0].t_end if condensed else None),
        (predicted.get(("focus", first)), focused[0].t_start if focused else None),
        restarts[0] if restarts else None,
        (condensation.t_end, orbit_focus),
    )


@dataclass(frozen=True)
class RestartAccuracy:
    """The predicted σ1 restart beside the measured one on one chain: the rank-one transverse equation's (with its
    rule) and ``predict_run``'s row (read on the flow with direction 1 open from θ(0))."""

    pi: list[float]
    lam: float | None
    eps: float
    t_end: float | None  # the measured flow's horizon (None: the prediction is past ``t_cap``, not measured)
    prediction: RestartPrediction
    measured: float | None
    row: float | None = None  # predict_run's σ1 row on the measured run's save times (None: not computed, or none)

    @property
    def error(self) -> float | None:
        predicted = self.prediction.t_onset
        return None if predicted is None or self.measured is None else abs(predicted - self.measured) / self.measured

    @property
    def row_error(self) -> float | None:
        return None if self.row is None or self.measured is None else abs(self.row - self.measured) / self.measured


def restart_accuracy(pi: list[float], lam: float, eps: float, seed: int = 0, horizon_factor: float = 1.3,
                     t_cap: float = 20000.0, n_save: int = 600) -> RestartAccuracy:
    """Predict direction 1's restart on the rank-one manifold (looking as far as 10 ``t_cap``), then
    integrate the exact flow (m = k = 8, mean field) to ``horizon_factor`` × the prediction, when that
    is within ``t_cap``, and detect its stages."""
    return overrides_restart_accuracy([f"chain.pi={pi}", f"chain.lam={lam}"], eps, seed, horizon_factor, t_cap, n_save,
                                      pi, lam)


def transition_restart_accuracy(P: np.ndarray, eps: float, seed: int = 0, horizon_factor: float = 1.3,
                                t_cap: float = 20000.0, n_save: int = 600) -> RestartAccuracy:
    """``restart_accuracy`` for a general transition matrix P."""
    return overrides_restart_accuracy([transition_override(P)], eps, seed, horizon_factor, t_cap, n_save)


def overrides_restart_accuracy(chain_overrides: list[str], eps: float, seed: int, horizon_factor: float, t_cap: float,
                               n_save: int, pi: list[float] | None = None, lam: float | None = None) -> RestartAccuracy:
    """σ1's restart, predicted and measured, for the chain of ``chain_overrides``."""
    overrides = chain_overrides + [f"init.eps={eps}", f"init.seed={seed}"]
    if pi is None:
        pi = [float(x) for x in prepare(load_config(None, overrides)).chain.pi]
    prediction = first_restart(overrides, eps, 10.0 * t_cap, n_save)
    predicted = prediction.t_onset
    if predicted is None or horizon_factor * predicted > t_cap:
        return RestartAccuracy(pi, lam, eps, None, prediction, None)
    t_end = horizon_factor * predicted
    row = opened_restart_row(overrides, eps, t_end, n_save)
    if row.predicted is None and row.note.startswith(AFTER_HORIZON):  # the row's flow restarts later: look that far
        t_end = min(t_cap, horizon_factor * float(row.note.rsplit("t = ", 1)[1]))
        row = opened_restart_row(overrides, eps, t_end, n_save)
    report = measured_stages(flow_config(overrides, eps, t_end, n_save))
    return RestartAccuracy(pi, lam, eps, t_end, prediction, report.first_time("restart", None, 1), row.predicted)


def opened_restart_row(overrides: list[str], eps: float, t_end: float, n_save: int) -> Row:
    """``predict_run``'s σ1 row for the chain's run to ``t_end``."""
    rows = predict_run(flow_config(overrides, eps, t_end, n_save)).rows
    return next(row for row in rows if row.stage == "restart" and row.direction == 1)


def first_restart(overrides: list[str], eps: float, look: float, n_save: int) -> RestartPrediction:
    """Direction 1's restart on the rank-one manifold, looking as far as ``look``."""
    prepared = prepare(load_config(None, overrides))
    chain, params0 = prepared.chain, prepared.params0
    condensation = predict_condensation(chain.pi, chain.P, params0, eps)
    floor = float(np.linalg.svd(np.asarray(params0["W0"]), compute_uv=False)[1])
    stage = propagate_rank(MeanFieldChain(chain.pi, chain.P), params0, condensation.alpha[:, None], 0.0, look,
                           StageThresholds().restart_factor * floor, np.geomspace(0.1, look, n_save))
    return stage.restart


@dataclass(frozen=True)
class CycleAccuracy:
    """Every event of the chained prediction beside the measured flow's, on one chain (``compared_rows``)."""

    pi: list[float]
    lam: float
    eps: float
    t_end: float
    rows: list  # theory.predict.Row, predicted beside measured


def cycle_accuracy(pi: list[float], lam: float, eps: float, seed: int = 0, restarts: float = 3.0,
                   t_cap: float = 20000.0, n_save: int = 600) -> CycleAccuracy:
    """The chained rank-r prediction (``theory.predict``) and the exact flow (m = k = 8, mean field) to
    ``restarts`` × the predicted σ1 restart (at most ``t_cap``), every event compared."""
    overrides = [f"chain.pi={pi}", f"chain.lam={lam}", f"init.eps={eps}", f"init.seed={seed}"]
    predicted_restart = first_restart(overrides, eps, 10.0 * t_cap, n_save).t_onset
    t_end = t_cap if predicted_restart is None else min(t_cap, restarts * predicted_restart)
    config = flow_config(overrides, eps, t_end, n_save)
    return CycleAccuracy(pi, lam, eps, t_end, compared_rows(predict_run(config).rows, measured_stages(config)))


def atol_below_eps_squared(eps: float) -> float:
    """An absolute tolerance that resolves the early dynamics, whose scale is ε²."""
    return min(1e-12, 1e-3 * eps**2)


def flow_config(overrides: list[str], eps: float, t_end: float, n_save: int) -> RunConfig:
    """The chain's run to ``t_end`` on ``n_save`` log-spaced times, atol well below ε²."""
    return load_config(None, overrides + [f"time.t_end={t_end}", "time.n_linear=2", f"time.n_log={n_save}",
                                          f"solver.atol={atol_below_eps_squared(eps)}"])


def measured_stages(config: RunConfig) -> StageReport:
    """Integrate the exact flow of ``config`` (rtol 1e-8) and detect its stages."""
    prepared = prepare(config)
    result = solve_flow(prepared.flow, prepared.params0, prepared.times, rtol=1e-8, atol=config.solver.atol)
    if not result.success:
        chain = f"π = {config.chain.pi}, λ = {config.chain.lam}" if config.chain.P is None else f"P (d = {len(config.chain.P)})"
        raise RuntimeError(f"the flow of {chain} did not finish: {result.message}")
    return detect_stages(compute_observables(result.trajectory, prepared.model, prepared.chain.pi))
