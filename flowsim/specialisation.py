"""Premature-specialisation probes of the two-layer model, read from its observables.

* basis maturity: the first time after which the largest principal angle between
  span h2(t) and span h2(end) stays below ``mature_angle`` (radians);
* upper-layer entropy fall: H2 is the π-weighted mean over queries of the upper
  layer's attention entropy; its fall by time t is H2(0) - H2(t);
* premature-specialisation index: the fall by the time the basis matured, as a fraction
  of the largest fall over the run, clipped at 0 (0: the upper layer waited; 1: it had
  specialised before the basis it attends over was built);
* time to reach a loss target, and the loss at the last time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from flowsim.observables import Observables

MATURE_ANGLE = 0.1


@dataclass(frozen=True)
class SpecialisationSummary:
    t_end: float
    final_loss: float
    t_loss_target: float | None  # None: the target was not reached (or none was given)
    t_basis_mature: float | None
    upper_entropy_fall_at_maturity: float | None
    premature_index: float | None

    def to_json(self) -> dict:
        return asdict(self)


def first_time_below(t: np.ndarray, series: np.ndarray, level: float, *, stays: bool = False) -> float | None:
    """The first t with series <= level (and, with ``stays``, never above it afterwards)."""
    below = series <= level
    if stays:
        below = np.flip(np.logical_and.accumulate(np.flip(below)))
    hits = np.flatnonzero(below)
    return None if len(hits) == 0 else float(t[hits[0]])


def summarise(observables: Observables, loss_target: float | None = None,
              mature_angle: float = MATURE_ANGLE) -> SpecialisationSummary:
    """The probes of one two-layer run."""
    if "attention_entropy_2" not in observables.columns:
        raise ValueError("these probes need a two-layer run (its observables have no attention_entropy_2)")
    t, pi = observables.t, observables.constants["pi"]
    upper = observables["attention_entropy_2"] @ (pi / pi.sum())
    fall = upper[0] - upper
    t_mature = first_time_below(t, observables["basis_angle"], mature_angle, stays=True)
    fall_at_maturity = index = None
    if t_mature is not None:
        fall_at_maturity = float(fall[np.searchsorted(t, t_mature)])
        # an entropy that has risen (negative fall) by maturity has not specialised: index 0
        index = float(max(fall_at_maturity, 0.0) / fall.max()) if fall.max() > 0 else 0.0
    loss = observables["loss"]
    t_target = None if loss_target is None else first_time_below(t, loss, loss_target)
    return SpecialisationSummary(float(t[-1]), float(loss[-1]), t_target, t_mature, fall_at_maturity, index)
