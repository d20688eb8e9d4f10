"""Predicted stage onsets for a run configuration, and their comparison with a run's detected stages.

Rows (stage names as in stages.json):

* condensation: the time condensation completes (the detector's t_end),
* focus, first query: its onset (t_start), and
* restart, direction 1: its onset, all three read by the detectors on the prediction's flow from θ(0)
  (``theory.cycles``, ``rows_observables``): the rank-two flow with direction 1 open from t = 0, which carries
  every order in ε along α and α2 (the chain's rank-one flow where direction 1 never opens). Stage I's orbit, Stage II's focus orbit
  and the rank-one transverse equation give the same times as ε -> 0 (their constants and times are in
  ``constants``); Stage II's time is the first focus row where the flow shows no focus before the confirmed
  horizon. All three are read on the run's save times (``condensation_row``, ``first_focus_row``,
  ``opened_restart_row``), as the detectors will read the run;
* restart, direction r = 2, 3, ...: the time σ_r(W0) passes the detector's threshold (t_start),
  Stage IV, from the transverse equation on the rank-r manifold (``theory.restart``: the
  settled-point formula, or the crossing itself when the restart comes before the flow settles);
* dilution (per query) and focus of the other queries: onsets on the predicted trajectory chained
  through the rank-r manifolds (``theory.cycles``), Stage III, read like the first three rows on the
  run's save times (``events_on_save_times``): the detectors date a focus or a dilution causally, 0.15
  decade before the end of what they read, so the reading does not move with t_end. The chain is
  followed past t_end until the detectors can confirm every event before it (they place it the same on
  a shorter cut of its own trajectory), and an event past the run's last save time is a row with its
  time in ``note``; one whose onset the two cuts place differently would be marked ``unsettled``, with
  how it moved (the causal detectors leave none: the check guards that).

``compare`` lists every row of both sides: predicted and measured (with the relative
error), predicted but not measured within the run, and measured with no prediction
(each marked in ``note``), each measured time with the run's save-grid resolution there. A
restart the theory rules out is a row with no predicted time and the verdict in ``note`` (the
degenerate point of symmetric rare tokens: μ_δ = 0; the Bayes loss reached on the rank-r manifold;
a restart the formula puts beyond the horizon). Nothing here reads or writes files: ``flowsim.runs.predictions``
caches the rows and compares them with run directories.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np

from flowsim.config import ConfigError, RunConfig
from flowsim.assemble import prepare
from flowsim.model.flow import GradientFlow
from flowsim.observe.observables import Observables, stage_observables
from flowsim.solve.trajectory import Trajectory
from flowsim.observe.stages import (StageReport, StageThresholds, detect_condensation, detect_focus_and_dilution, detect_restarts,
                            smooth_in_log_time, subject_label)
from theory.cycles import POINTS_PER_DECADE, CyclePrediction, confirmation_reach, dilution_mechanisms, predict_cycles
from theory.focus import FocusPrediction, predict_focus
from theory.formulas import FormulaPrediction, predict_formulas
from theory.origin import CondensationPrediction, predict_condensation
from theory.restart import REACH_LIMIT, RestartPrediction, RuleName
from theory.mean_field import MeanFieldChain, origin_rate

NOT_MEASURED, NOT_PREDICTED = "predicted, not measured", "measured, not predicted"
AFTER_HORIZON = "after the horizon"
UNSETTLED = "unsettled"


@dataclass(frozen=True)
class Row:
    stage: str
    query: int | None
    direction: int | None
    predicted: float | None  # None: the theory predicts no such event (``note`` says why) or has no prediction
    measured: float | None = None
    rel_error: float | None = None
    note: str = ""
    resolution: float | None = None  # the run's save-time spacing at the measured time, relative: the grid's own error
    formula: float | None = None  # the formula tier's time (``theory.formulas``); None where it has no formula
    formula_error: float | None = None  # |formula - measured| / measured


@dataclass(frozen=True)
class Prediction:
    rows: list[Row]
    condensation: CondensationPrediction
    focus: FocusPrediction
    cycles: CyclePrediction
    formulas: FormulaPrediction
    t_end: float  # the horizon the rows were cut at

    def constants(self) -> str:
        c, f, dilutions = self.condensation, self.focus, self.cycles.dilutions()
        first = f.order[0]
        orbit_focus = f"; the focus orbit puts q{first}'s onset at {f.t_onset[first]:.4g}" if first in f.t_onset else ""
        return (formula_line(self.formulas) + "\n" +
                f"μ1 = {c.mu1:.6g} (condensation on Stage I's orbit: log(1/ε)/μ1 = {c.leading_order:.4g}, O(1) correction "
                f"{c.correction:+.4g}, end {c.t_end:.4g}; unstable amplitude a0 = {c.a0:.4g})\n"
                f"μ2 = {f.mu2:.6g} at the condensed point (h = {f.h:+.4g}; attention amplitude {f.a_attn0:.4g}); "
                f"queries focus in the order {f.order}, on token {first}{orbit_focus}\n"
                "the rows' condensation, first focus and σ1 restart are read on the flow from θ(0) ("
                + ("rank two, direction 1 open from t = 0" if self.cycles.opened is not None else "rank one")
                + ": every order in ε along it)"
                + "".join(f"\n{restart_line(restart)}" for restart in self.cycles.restarts())
                + "".join(f"\npredicted {i.stage} of q{i.query}, read on the prediction's own grid "
                          f"({POINTS_PER_DECADE} times a decade; the table reads it on the run's save times): "
                          f"{i.evidence}\n  {mechanism}"
                          for i, mechanism in zip(dilutions, dilution_mechanisms(self.cycles, dilutions))))


def formula_line(f: FormulaPrediction) -> str:
    """The formula tier's constants and terms (docs/theory.md, "The formula tier")."""
    c = f.constants
    focus = (f"no focus by the formula ({f.outside_range})" if f.outside_range is not None else
             "no focus by the formula" if f.focus is None else
             f"q{c.query}'s first focus t_f = {f.focus:.4g} (leading (1/μ1 + 1/μ2) log(1/ε) = {f.leading_focus:.4g})")
    condensation = "the start is past condensation's level" if f.condensation is None else f"{f.condensation:.4g}"
    r = f.restart
    restart = ("" if r is None else f"; σ1 restart: {r.note}" if r.time is None or r.note else
               f"; σ1 restart t_R = t_h + log(ℓ_1/a_s)/μ_R = {f.focus_half:.4g} + log({r.threshold:.3g}/{r.amplitude:.3g})/"
               f"{r.rate:.4g} = {r.time:.4g} (μ_R = σ_max(C) at the focused critical point, φ = {r.focused_logit:.3g})")
    return (f"formula: μ1 = ‖π‖‖π - u‖ = {c.mu1:.6g}, μ2 = |h*| = {c.mu2:.6g}, ‖ℓ‖ = {c.ell_norm:.4g}, g* = {c.g_star:.4g}, "
            f"a0 = {f.a0:.4g}, a_A = {f.a_attention:.4g}: condensation t_c = {condensation} (leading log(1/ε)/μ1 = "
            f"{f.leading_condensation:.4g}); {focus}{restart}")


def restart_line(r: RestartPrediction) -> str:
    """How the restart of direction r was predicted, with the numbers of its rule."""
    head = f"σ{r.direction} restart: transverse rate μ = {r.rate:.4g} at t = {r.t_reach:.4g}, the end of the rank-{r.direction} flow's reach"
    check = "" if r.t_integrated is None else f"; transverse equation integrated to the threshold: t = {r.t_integrated:.4g}"
    if r.rule == RuleName.FORMULA:
        crossing = "beyond reach" if r.t_onset is None else f"t = {r.t_onset:.4g}"
        return (f"{head}; settled at t_s = {r.t_settle:.4g}, then σ{r.direction} under exp(-τ H_T) passes ℓ = "
                f"{r.threshold:.3g} at {crossing} (leading term t_s + log(ℓ/a_s)/μ = {r.t_settle:.4g} + "
                f"log({r.threshold:.3g}/{r.amplitude:.3g})/{r.rate:.4g} = {r.t_leading:.4g}){check}")
    if r.rule == RuleName.BEFORE_SETTLING:
        settles = ("before the flow has converged" if r.t_settle is None
                   else f"before the flow settles at t = {r.t_settle:.4g}")
        return f"{head}; σ{r.direction} passes ℓ = {r.threshold:.3g} {settles}{check}"
    if r.rule == RuleName.DEGENERATE:
        return f"{head}: degenerate (largest rate on the way {r.peak_rate:.3g}), no restart"
    if r.rule == RuleName.OPTIMUM:
        return f"{head}: the flow reaches the Bayes loss there (largest rate on the way {r.peak_rate:.3g}), no restart"
    if r.t_reach < REACH_LIMIT:  # a rank that started past the horizon, followed until the events before it were confirmed
        return f"{head}, where the prediction ends; σ{r.direction} stays below ℓ = {r.threshold:.3g} up to it"
    return f"{head}; the flow has not settled by t = {REACH_LIMIT:g} and σ{r.direction} stays below ℓ = {r.threshold:.3g}"


def check_supported(config: RunConfig) -> None:
    """The theory covers the default mean-field one-layer model with unit rates."""
    model, flow = config.model, config.flow
    problems = []
    if model.kind != "one_layer":
        problems.append(f"model.kind = {model.kind!r} (theory is for 'one_layer')")
    if config.loss.kind != "mean_field":
        problems.append(f"loss.kind = {config.loss.kind!r} (theory is for 'mean_field')")
    if model.value_matrix or model.residual or model.logit_scale != "one":
        problems.append("model options value_matrix/residual/logit_scale differ from the paper model")
    if any(rate != 1.0 for rate in flow.rates.values()) or flow.qk_rho != 1.0:
        problems.append("per-group rates or a Q/K slow window are set (theory is for unit rates)")
    if problems:
        raise ConfigError("flowsim predict: " + "; ".join(problems))


def _quiet(message: str) -> None:
    pass


def predict_run(config: RunConfig, progress: Callable[[str], None] = _quiet) -> Prediction:
    """Stage I-IV predictions for the configured chain, model and initial point.

    ``progress`` receives a line before each step (the whole takes tens of seconds).
    """
    check_supported(config)
    prepared = prepare(config)
    source = prepared.chain
    if np.any(source.pi <= 0):
        raise ConfigError(f"predictions need every token to have π > 0, got min π = {source.pi.min():g} "
                          f"(token {int(np.argmin(source.pi))})")
    if origin_rate(source.pi) < 1e-12 * np.linalg.norm(source.pi):  # μ1 = ‖π‖ ‖π - u‖
        raise ConfigError(f"no condensation to predict: π is uniform (d = {len(source.pi)}), so μ1 = ‖π‖ ‖π - u‖ = 0 "
                          "and the origin has no unstable direction")
    eps = initial_scale(config, prepared.params0)
    chain = MeanFieldChain(source.pi, source.P)
    t_end = float(config.time.t_end)
    progress(f"Stage I: spectrum at the origin and the condensation orbit (d = {chain.d})")
    condensation = predict_condensation(chain.pi, chain.P, prepared.params0, eps)
    progress("Stage II: condensed point, attention block, focus onset")
    focus = predict_focus(chain, prepared.params0, condensation, prepared.model.k)
    formulas = predict_formulas(chain.pi, chain.P, prepared.params0, eps)
    progress("Stages III-IV: the rank-r flows, their transverse equations and restarts, until every event before "
             f"t = {t_end:g} is confirmed")
    cycles = predict_cycles(chain, prepared.flow, prepared.model, prepared.params0, condensation.alpha, t_end, progress=progress)
    read = rows_observables(cycles, prepared.flow)
    rows = [timed_row(condensation_row(condensation, read, prepared.times), t_end),
            first_focus_row(focus, cycles, read, prepared.times, t_end)]
    restarts = cycles.restarts()
    if cycles.opened is not None:  # direction 1 open from θ(0): its restart is read on that flow
        rows.append(opened_restart_row(read, restarts.pop(0), prepared.times, t_end))
    rows += [restart_row(restart, t_end) for restart in restarts]
    if cycles.failure is not None:
        rank, t_from, why = cycles.failure
        placed_short = (f"; the chain's flows end at t = {float(cycles.trajectory.t[-1]):.4g}, so its detectors place foci "
                        f"and dilutions only to t = {cycles.confirmed_through:.4g}" if cycles.confirmed_through < t_end else "")
        rows.append(Row("restart", None, rank, None, note=f"not predicted: the rank-{rank} flow from t = {t_from:.4g} failed "
                                                           f"({why}); the rows before it stand{placed_short}"))
    on_run = {query: events_on_save_times(cycles.observables, prepared.times, query) for query in focus.order}
    for stage in ("focus", "dilution"):
        for query in focus.order:
            if stage == "focus" and query == focus.order[0]:
                continue
            found = [i for i in on_run[query] if i.stage == stage]
            unsettled = None
            if not found:  # past the run's last save time: the chain's confirmed events, and how an unsettled one moved
                found = [i for i in confirmed_events(cycles, stage, query) if i.t_start > prepared.times[-1]]
                unsettled = cycles.confirmation.unsettled.get((stage, query))
            row = timed_row(Row(stage, query, None, found[0].t_start), t_end) if found else Row(stage, query, None, None)
            if found or unsettled:
                rows.append(noting_unsettled(row, unsettled))
    return Prediction(with_formulas(rows, formulas), condensation, focus, cycles, formulas, t_end)


def initial_scale(config: RunConfig, params0) -> float:
    """ε: the configured one, or the RMS of W0's entries for a start read from a file."""
    return config.init.eps if config.init.file is None else float(np.sqrt(np.mean(np.asarray(params0["W0"]) ** 2)))


def predict_formulas_only(config: RunConfig) -> tuple[list[Row], FormulaPrediction]:
    """The formula tier alone (``flowsim predict --tier formula``): condensation's end, the first focus and σ1's restart
    in closed form, no flow integrated; O(d² + d m) after the run's set-up, plus the focused critical point's L-BFGS
    iterations (O(d²) each) and C's top singular triplet."""
    check_supported(config)
    prepared = prepare(config)
    eps = initial_scale(config, prepared.params0)
    formulas = predict_formulas(prepared.chain.pi, prepared.chain.P, prepared.params0, eps)
    rows = [Row("condensation", None, None, None, formula=formulas.condensation,
                note="" if formulas.condensation is not None else "the start is past condensation's level already")]
    if formulas.outside_range is not None:
        note = f"outside the formula's range: {formulas.outside_range}"
        rows += [Row("focus", formulas.constants.query, None, None, note=note), Row("restart", None, 1, None, note=note)]
        return rows, formulas
    if formulas.focus is not None:
        rows.append(Row("focus", formulas.constants.query, None, None, formula=formulas.focus))
    if formulas.restart is not None:
        rows.append(Row("restart", None, 1, None, formula=formulas.restart.time, note=formulas.restart.note))
    return rows, formulas


def with_formulas(rows: list[Row], formulas: FormulaPrediction) -> list[Row]:
    """The formula tier's times on the rows it has a formula for: condensation's end, the first focus and σ1's
    restart."""
    first_focus = next((row for row in rows if row.stage == "focus" and row.query == formulas.constants.query), None)
    sigma1 = next((row for row in rows if row.stage == "restart" and row.direction == 1), None)
    restart = None if formulas.restart is None else formulas.restart.time

    def formula(row: Row) -> float | None:
        if row.stage == "condensation":
            return formulas.condensation
        return formulas.focus if row is first_focus else restart if row is sigma1 else None

    return [replace(row, formula=formula(row)) for row in rows]


def confirmed_events(cycles: CyclePrediction, stage: str, query: int) -> list:
    """The chained prediction's intervals of (stage, query) whose onset its detectors confirmed."""
    return [i for i in cycles.report.of(stage, query) if i.t_start <= cycles.confirmed_through]


def condensation_row(condensation: CondensationPrediction, read: Observables, times: np.ndarray,
                     thresholds: StageThresholds | None = None) -> Row:
    """Condensation's end as the detectors will read it on the run's save ``times``: σ0(W0) of the rows' flow from
    θ(0) (``read``: ``rows_observables``), interpolated in log-log onto them; Stage I's orbit where no condensation
    is read there.

    Stage I's orbit has no attention, so its σ0 grows to the attention-free scale, while the flow's σ0 levels off
    lower once the focus follows. The detectors end condensation at a fraction of where σ0 flattens, by a slope
    test over a window; where σ0 overshoots and then keeps growing slowly that test can pass on one grid and not
    on another, so the row reads σ0 on the grid the run is read on."""
    th = StageThresholds() if thresholds is None else thresholds
    t = np.asarray(times, dtype=float)
    t = t[t > 0]
    on_run = np.exp(on_save_times(t, read, np.log(read["sv_W0"][:, 0])))
    found = detect_condensation(t, smooth_in_log_time(t, on_run, th.smoothing_decades), th) if len(t) >= 3 else None
    if found is not None and found.t_end is not None:
        return Row("condensation", None, None, found.t_end)
    return Row("condensation", None, None, condensation.t_end, note="Stage I's orbit (the rank-one flow does not "
                                                                       "condense on the run's save times)")


def first_focus_row(focus: FocusPrediction, cycles: CyclePrediction, read: Observables, times: np.ndarray,
                    t_end: float, thresholds: StageThresholds | None = None) -> Row:
    """The first query's focus onset as the detectors will read it on the run's save ``times``: its attention
    entropy on the rows' flow from θ(0) (``read``), interpolated in log t onto them (the detectors time a focus
    where the entropy first falls its drop below its running maximum); where it shows
    none there (past the run's last save time, or not on the rows' flow at all), as the chain's detectors read it
    once confirmed; Stage II's focus orbit where neither shows a focus; a row saying why where nothing does."""
    first = focus.order[0]
    on_run = [i for i in events_on_save_times(read, times, first, thresholds) if i.stage == "focus"]
    found = on_run or confirmed_events(cycles, "focus", first)
    unsettled = None if on_run else cycles.confirmation.unsettled.get(("focus", first))
    if found:
        row = timed_row(Row("focus", first, None, found[0].t_start), t_end)
    elif first in focus.t_onset:
        row = timed_row(Row("focus", first, None, focus.t_onset[first], note="Stage II's focus orbit"), t_end)
    else:
        drop = focus.orbit.entropy[0] - focus.orbit.entropy.min()
        falls = f"falls only {drop:.3g} nats" if drop > 0 else "never falls below its start"
        th = StageThresholds() if thresholds is None else thresholds
        orbit = f"on the focus orbit the entropy {falls} (a focus needs {th.focus_drop:g})"
        # the detectors place an event only a lookahead before a trajectory's end, on either flow
        rows_flow_places_to = float(read.t[-1]) / confirmation_reach(th)
        placed_to = max(rows_flow_places_to, cycles.confirmed_through)
        # flows that end before the horizon (a later rank failed, or σ2 stopped the rows' flow) have not ruled it out
        row = Row("focus", first, None, None, note=f"no focus: {orbit}" if placed_to >= t_end else
                  f"not predicted: no focus where the reduced flows let the detectors place one, up to t = "
                  f"{placed_to:.4g} of {t_end:g} (the rows' flow ends at {float(read.t[-1]):.4g}, the chain's foci are "
                  f"placed to {cycles.confirmed_through:.4g}), and {orbit}")
    return noting_unsettled(row, unsettled)


def noting_unsettled(row: Row, unsettled: str | None) -> Row:
    """``row`` with how an unsettled onset moved between the chain's two cuts added to its note (None: as it is)."""
    return replace(row, note="; ".join(filter(None, [row.note, f"{UNSETTLED}: {unsettled}"]))) if unsettled else row


def events_on_save_times(read: Observables, times: np.ndarray, query: int,
                         thresholds: StageThresholds | None = None) -> list:
    """The detectors' focus and dilution intervals of ``query`` as they will read the run: its attention entropy on
    ``read``, interpolated in log t onto the run's save ``times`` that ``read`` reaches (O(T) on T times)."""
    th = StageThresholds() if thresholds is None else thresholds
    t = within_prediction(times, read)
    if len(t) < 3:
        return []
    entropy = smooth_in_log_time(t, on_save_times(t, read, read["attention_entropy"][:, query]), th.smoothing_decades)
    return detect_focus_and_dilution(t, entropy, query, th)


def timed_row(row: Row, t_end: float) -> Row:
    """A predicted event after the horizon keeps its time in ``note`` and has no predicted time in it."""
    if row.predicted is None or row.predicted <= t_end:
        return row
    return Row(row.stage, row.query, row.direction, None, note=f"{AFTER_HORIZON} t = {t_end:g}: predicted at t = {row.predicted:.4g}")


def rows_observables(cycles: CyclePrediction, flow: GradientFlow) -> Observables:
    """What the condensation, first-focus and σ1 rows are read on: the ``stage_observables`` of the rank-two flow
    from θ(0) with direction 1 open where it opens (O(T d² k) on its T times), else the chain's, whose first stage
    is then the rank-one flow from θ(0)."""
    if cycles.opened is None:
        return cycles.observables
    opened = cycles.opened
    return stage_observables(Trajectory(t=opened.t, loss=flow.loss_along(flow.flatten_batch(opened.params)),
                                        params=opened.params), cycles.pi)


def within_prediction(times: np.ndarray, read: Observables) -> np.ndarray:
    """The run's save times t > 0 that the prediction's saved times reach."""
    t = np.asarray(times, dtype=float)
    return t[(t > 0) & (t <= read.t[-1])]


def on_save_times(t: np.ndarray, read: Observables, series: np.ndarray) -> np.ndarray:
    """``series`` (one row per saved time of ``read``; a column or a few) at the times ``t`` > 0, linear in log t."""
    saved = read.t > 0
    x, values = np.log(read.t[saved]), np.asarray(series)[saved]
    if values.ndim == 1:
        return np.interp(np.log(t), x, values)
    return np.column_stack([np.interp(np.log(t), x, column) for column in values.T])


def opened_restart_row(read: Observables, linear: RestartPrediction, times: np.ndarray, t_end: float,
                       thresholds: StageThresholds | None = None) -> Row:
    """Direction 1's restart as the detectors will read it on the run's save ``times``: σ(W0) of the rank-two flow
    from θ(0) (``read``), interpolated in log-log onto them (the floor the threshold is a multiple of is read at
    the run's first saved time, as on the run); past the run's last save time, as read on that flow's own times.
    Where σ1 stays below the detectors' threshold, a row saying so, with the rank-one transverse equation's
    crossing (``linear``) for reference."""
    th = StageThresholds() if thresholds is None else thresholds
    log_sigma = np.log(read["sv_W0"][:, :2])
    for t in (within_prediction(times, read), within_prediction(read.t, read)):  # the run's times, then the flow's own
        if len(t) < 3:
            continue
        on_t = np.exp(on_save_times(t, read, log_sigma))
        found = detect_restarts(t, smooth_in_log_time(t, on_t, th.smoothing_decades), th)
        if found:
            return timed_row(Row("restart", None, 1, found[0].t_start), t_end)
    return Row("restart", None, 1, None, note=f"no restart by t = {min(t_end, float(read.t[-1])):g}: on the flow with "
                                              f"direction 1 open from θ(0), σ1 stays below ℓ = {linear.threshold:.3g} (the "
                                              f"rank-one transverse equation crosses at t = {linear.t_integrated:.4g})")


def restart_row(r: RestartPrediction, t_end: float) -> Row:
    """The row of direction r's restart: its time, or the verdict that rules it out."""
    if r.t_onset is not None and r.t_onset <= t_end:
        return Row("restart", None, r.direction, r.t_onset)
    if r.rule == RuleName.DEGENERATE:
        return Row("restart", None, r.direction, None, note=f"no restart: μ_δ = {r.rate:.2g} ≈ 0, degenerate point")
    if r.rule == RuleName.OPTIMUM:
        return Row("restart", None, r.direction, None,
                   note=f"no restart: the rank-{r.direction} flow reaches the Bayes loss (μ = {r.rate:.2g} ≈ 0)")
    beyond = "" if r.t_onset is None else f"; the formula puts it at t = {r.t_onset:.4g}"
    return Row("restart", None, r.direction, None, note=f"no restart by t = {t_end:g} (transverse rate μ = {r.rate:.3g}{beyond})")


def measured_time(report: StageReport, row: Row) -> float | None:
    """The detector's time for a row: the time that dates its first stage (condensation's end, other stages' onset)."""
    return report.first_time(row.stage, row.query, row.direction)


def grid_resolution(times: np.ndarray, t: float) -> float | None:
    """(t_n - t_{n-1}) / t for the save times t_{n-1} <= t < t_n around ``t`` (None outside the grid)."""
    n = int(np.searchsorted(times, t, side="right"))
    return None if n == 0 or n >= len(times) else float((times[n] - times[n - 1]) / t)


def compared_rows(predicted: list[Row], report: StageReport, times: np.ndarray | None = None) -> list[Row]:
    """Each predicted row with its measured time (and, given the run's save ``times``, the grid's
    resolution there), then the first occurrence of every measured (stage, query, direction) that no
    row predicts."""
    def resolution(measured: float | None) -> float | None:
        return None if measured is None or times is None else grid_resolution(np.asarray(times), measured)

    rows = []
    for row in predicted:
        measured = measured_time(report, row)
        error = None if measured is None or row.predicted is None else abs(row.predicted - measured) / measured
        formula_error = None if measured is None or row.formula is None else abs(row.formula - measured) / measured
        note = row.note or (NOT_MEASURED if measured is None else "")
        rows.append(Row(row.stage, row.query, row.direction, row.predicted, measured, error, note, resolution(measured),
                        row.formula, formula_error))
    covered = {(row.stage, row.query, row.direction) for row in rows}
    for interval in report.intervals:
        key = (interval.stage, interval.query, interval.direction)
        if key not in covered:
            covered.add(key)
            rows.append(Row(*key, None, interval.time, None, NOT_PREDICTED, resolution(interval.time)))
    return rows


@dataclass(frozen=True)
class PredictionSummary:
    """What ``predict`` prints and ``compare`` needs: the rows and the constants' text (kept in a cache)."""

    rows: list[Row]
    constants: str
    t_end: float

    def to_json(self) -> dict:
        return {"rows": [asdict(row) for row in self.rows], "constants": self.constants, "t_end": self.t_end}

    @staticmethod
    def from_json(payload: dict) -> "PredictionSummary":
        return PredictionSummary([Row(**row) for row in payload["rows"]], payload["constants"], float(payload["t_end"]))


def table(rows: list[Row], measured: bool = True) -> str:
    """Both tiers per row, the formula first (and, when ``measured``, the measured time, each tier's relative error
    and the save grid's resolution there)."""
    show = lambda value: "-" if value is None else f"{value:.4g}"  # noqa: E731
    percent = lambda value: "-" if value is None else f"{100 * value:.1f}%"  # noqa: E731
    header = f"{'stage':13} {'q/dir':6} {'formula':>9} {'reduced':>9}"
    if measured:
        header += f" {'measured':>9} {'err(F)':>7} {'err(R)':>7} {'grid':>6}"
    lines = [header]
    for row in rows:
        line = f"{row.stage:13} {subject_label(row.query, row.direction):6} {show(row.formula):>9} {show(row.predicted):>9}"
        if measured:
            line += (f" {show(row.measured):>9} {percent(row.formula_error):>7} {percent(row.rel_error):>7}"
                     f" {percent(row.resolution):>6}")
        note = row.note if measured or row.note not in (NOT_MEASURED, NOT_PREDICTED) else ""
        lines.append(line + (f"  {note}" if note else ""))
    lines.append("formula: closed forms in the chain's constants, no flow integrated (theory.formulas; '-': no formula "
                 "for that event yet); reduced: read on the rank-r flows from θ(0) (theory.cycles); both tiers derive "
                 "from the mean-field (s -> infinity) loss")
    if measured:
        lines.append("grid: the run's save-time spacing at the measured time (relative): a detector's time moves by up to "
                     "about that much with the save grid; every row but σ2, σ3, ... is read on these save times, as the run is")
    return "\n".join(lines)
