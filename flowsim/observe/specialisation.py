"""Premature-specialisation probes of the two-layer model, read from its observables.

* basis maturity: the first time t after which the residual basis h2 turns by less than
  ``mature_angle`` radians over every doubling of time (the largest principal angle
  between span h2(t') and span h2(2t') stays below it for every saved t' >= t whose
  double was saved; observable ``basis_doubling_angle``). It needs no reference to the
  run's end, so a basis that settles on a logarithmic clock matures at the same time
  whatever the horizon, and a maturity claim always rests on one doubling of evidence
  (it is at most t_end / 2);
* the end-relative maturity, for comparison: the first time after which span h2(t) stays
  within ``mature_angle`` of span h2 at the last time (``basis_angle``). It is tied to the
  horizon: a basis that keeps turning slowly matures only near the end;
* upper-layer entropy fall: H2 is the π-weighted mean over queries of the upper
  layer's attention entropy; its fall by time t is H2(0) - H2(t);
* premature-specialisation index: the fall by the time the basis matured, as a fraction
  of the largest fall over the run, clipped at 0 (0: the upper layer waited; 1: it had
  specialised before the basis it attends over was built); under each maturity;
* the basis's turn at specialisation: t_spec is the first time the upper entropy has done
  ``SPECIALISED_SHARE`` of its largest fall, and the turn is the doubling angle there (span
  h2(t_spec) against span h2(2 t_spec)). Defined even when the basis never matures within
  the run: a large turn says the upper layer committed while the basis it reads was still
  being built. t_spec still depends on the horizon through the largest fall (a later fall
  moves it);
* time to reach a loss target, and the loss at the last time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from flowsim.observe.observables import Observables

MATURE_ANGLE = 0.1
SPECIALISED_SHARE = 0.9


@dataclass(frozen=True)
class SpecialisationSummary:
    t_end: float
    final_loss: float
    t_loss_target: float | None  # None: the target was not reached (or none was given)
    t_basis_mature: float | None  # per doubling of time; None: not within the run
    upper_entropy_fall_at_maturity: float | None
    premature_index: float | None
    t_basis_final: float | None  # relative to the last time
    premature_index_final: float | None
    t_upper_specialised: float | None  # the upper entropy has done 90% of its largest fall
    basis_turn_at_specialisation: float | None  # radians over [t_spec, 2 t_spec]; None: 2 t_spec not saved

    def to_json(self) -> dict:
        return asdict(self)


def first_time_below(t: np.ndarray, series: np.ndarray, level: float, *, stays: bool = False) -> float | None:
    """The first t with series <= level (and, with ``stays``, never above it afterwards)."""
    below = series <= level
    if stays:
        below = np.flip(np.logical_and.accumulate(np.flip(below)))
    hits = np.flatnonzero(below)
    return None if len(hits) == 0 else float(t[hits[0]])


def doubling_maturity(t: np.ndarray, doubling_angle: np.ndarray, mature_angle: float = MATURE_ANGLE) -> float | None:
    """The first saved t from which every defined doubling angle stays <= mature_angle
    (NaN entries, t = 0 and the last half of the run, carry no evidence either way)."""
    defined = ~np.isnan(doubling_angle)
    return first_time_below(t[defined], doubling_angle[defined], mature_angle, stays=True)


def summarise(observables: Observables, loss_target: float | None = None,
              mature_angle: float = MATURE_ANGLE) -> SpecialisationSummary:
    """The probes of one two-layer run."""
    if "attention_entropy_2" not in observables.columns:
        raise ValueError("these probes need a two-layer run (its observables have no attention_entropy_2)")
    if "basis_doubling_angle" not in observables.columns:
        raise ValueError("these probes need the observable basis_doubling_angle, which these observables lack "
                         "(flowsim.runs.labelling.observables_of_run recomputes a run's observables from an older layout)")
    t, pi = observables.t, observables.constants["pi"]
    upper = observables["attention_entropy_2"] @ (pi / pi.sum())
    fall = upper[0] - upper

    def index_at(t_mature: float | None) -> tuple[float | None, float | None]:
        if t_mature is None:
            return None, None
        at = float(fall[np.searchsorted(t, t_mature)])
        # an entropy that has risen (negative fall) by maturity has not specialised: index 0
        return at, float(max(at, 0.0) / fall.max()) if fall.max() > 0 else 0.0

    t_mature = doubling_maturity(t, observables["basis_doubling_angle"], mature_angle)
    t_final = first_time_below(t, observables["basis_angle"], mature_angle, stays=True)
    fall_at_maturity, index = index_at(t_mature)
    t_spec = turn = None
    if fall.max() > 0:
        at = int(np.flatnonzero(fall >= SPECIALISED_SHARE * fall.max())[0])
        t_spec, angle = float(t[at]), float(observables["basis_doubling_angle"][at])
        turn = None if np.isnan(angle) else angle
    loss = observables["loss"]
    t_target = None if loss_target is None else first_time_below(t, loss, loss_target)
    return SpecialisationSummary(float(t[-1]), float(loss[-1]), t_target, t_mature, fall_at_maturity, index,
                                 t_final, index_at(t_final)[1], t_spec, turn)
