"""Stage III continued: dilution on the rank-two manifold after the restart.

On the rank-one manifold the default chain's flow focuses and then settles, still
focused (``theory.manifold``): dilution needs the second direction. From the predicted
restart on, the state is continued on the rank-two manifold spanned by α and the
direction α2 in which the transverse part grew (the top right singular vector of
W0 (I - αα^T) at the restart), by the reduced flow of ``ReducedFlow(rank=2)``. The
stage detectors then read the predicted trajectory: the first dilution of each query,
and how the frequent and the rarest token's embeddings moved over it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowsim.flow import GradientFlow
from flowsim.models import OneLayerTransformer
from flowsim.observables import compute_observables
from flowsim.stages import Interval, StageReport, detect_stages
from flowsim.trajectory import Trajectory
from theory.manifold import ReducedFlow, ReducedState, embed, project
from theory.restart import RestartPrediction
from theory.symbolic import MeanFieldTwin


@dataclass(frozen=True)
class DilutionPrediction:
    report: StageReport  # the detectors on the predicted trajectory
    trajectory: Trajectory

    def dilutions(self) -> list[Interval]:
        return self.report.of("dilution")


def predict_dilution(twin: MeanFieldTwin, flow: GradientFlow, model: OneLayerTransformer, alpha: np.ndarray,
                     restart: RestartPrediction, t_end: float) -> DilutionPrediction | None:
    """Continue the predicted state from the restart on the rank-two manifold up to ``t_end``."""
    if restart.t_onset is None or restart.t_onset >= t_end:
        return None
    params = {name: value[0] for name, value in flow.unflatten_batch(restart.theta_at_onset[None]).items()}
    residual = np.asarray(params["W0"]) @ (np.eye(len(alpha)) - np.outer(alpha, alpha))
    alpha2 = np.linalg.svd(residual)[2][0]
    A = np.column_stack([alpha, alpha2 - (alpha2 @ alpha) * alpha])
    state = project(params, A)
    left_over = {name: np.asarray(params[name]) - value for name, value in embed(state, A).items()}
    later = np.geomspace(restart.t_onset, t_end, 300)
    solution = ReducedFlow(twin, model.k, rank=2).solve(state, later, t_start=restart.t_onset)
    continued = [flow.flatten({name: value + left_over[name] for name, value in
                               embed(ReducedState.unpack(y, twin.d, model.k), A).items()}) for y in solution.y.T]
    before = restart.t < restart.t_onset
    t = np.concatenate([restart.t[before], solution.t])
    thetas = np.concatenate([restart.thetas[before], np.array(continued)])
    trajectory = Trajectory(t=t, loss=flow.loss_along(thetas), params=flow.unflatten_batch(thetas))
    report = detect_stages(compute_observables(trajectory, model, twin.pi))
    return DilutionPrediction(report, trajectory)
