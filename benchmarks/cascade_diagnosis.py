"""A general-P chain whose directions open in a cascade: what the reduced tier's rows read, against the exact flow.

    python benchmarks/cascade_diagnosis.py [--seed 1600] [--t-end 1.4e5]

The chain is ``theory_accuracy.py --large``'s general P d = 16 (P from ``random_transition_matrix(16, seed)``: seed
1600 is its #0, 1601 its #1), m = k = 8, ε = 1e-2, seed-0 start, 600 log-spaced saves to ``--t-end``. Printed:
``predict_run``'s rows, how far its flows reach (the rows' rank-two flow from θ(0), the chain, where the chain's
detectors place foci, a failed rank), each rank's crossing and rule, and the exact flow's σ1 restart and first focus
of the most frequent query read on the same saves from θ(0). Then the rank-two flow on span(α, α2) from θ(0)'s
projection, once as the reduced tier's rank-two flow with no transverse part (it cannot leave the manifold; rtol
1e-8) and once as the exact flow of the m = 8 model from that projection: the manifold is invariant, but its
transverse directions are unstable, so rounding (1e-16) grows out of it. How far that flow has left is printed
(‖W0 E‖, E spanning span(α, α2)^⊥), so that its focus is not mistaken for the manifold's. Used in docs/theory.md,
"Where the reduced flows stop short of the horizon".
"""

from __future__ import annotations

import argparse

import numpy as np

from prediction_accuracy import flow_config
from theory_accuracy import random_transition_matrix


def main() -> None:
    from flowsim.assemble import prepare
    from flowsim.config import transition_override
    from flowsim.observe.families import compute_observables
    from flowsim.observe.stages import detect_stages
    from flowsim.solve.solvers import solve_flow
    from flowsim.observe.stages import StageThresholds
    from flowsim.solve.trajectory import Trajectory
    from theory.cycles import confirmation_reach, prediction_grid
    from theory.mean_field import MeanFieldChain
    from theory.predict import predict_run
    from theory.restart import propagate_rank

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=1600)
    parser.add_argument("--t-end", type=float, default=1.4e5)
    arguments = parser.parse_args()
    P = random_transition_matrix(16, arguments.seed)
    config = flow_config([transition_override(P), "init.eps=0.01", "init.seed=0"], 0.01, arguments.t_end, 600)
    prepared = prepare(config)
    prediction = predict_run(config)
    cycles = prediction.cycles
    for row in prediction.rows:
        print(f"row {row.stage} q{row.query} σ{row.direction}: {row.predicted} {row.note}")
    print(f"rows' flow ends at {cycles.opened.t[-1] if cycles.opened else None}; chain ends at {cycles.trajectory.t[-1]:.6g}, "
          f"its foci placed to {cycles.confirmed_through:.6g}; failure: {cycles.failure}")
    for stage in cycles.stages:
        print(f"rank {stage.rank}: from {stage.t[0]:.6g}, crosses at {stage.restart.t_integrated} ({stage.restart.rule.value})")

    first = prediction.focus.order[0]
    initial = {name: np.asarray(value) for name, value in prepared.params0.items()}

    def first_focus(trajectory) -> float | None:
        observables = compute_observables(trajectory, prepared.model, prepared.chain.pi)
        found = detect_stages(observables).of("focus", first)
        return found[0].t_start if found else None

    result = solve_flow(prepared.flow, initial, prepared.times, rtol=1e-8, atol=config.solver.atol)
    report = detect_stages(compute_observables(result.trajectory, prepared.model, prepared.chain.pi))
    restart = [i.t_start for i in report.of("restart") if i.direction == 1]
    print(f"exact flow from θ(0): q{first}'s first focus {first_focus(result.trajectory)}, "
          f"σ1's restart {restart[0] if restart else None} ({result.message})")
    if cycles.opened is None:
        return
    A = cycles.opened.A
    projector = A @ A.T
    projected = {"W0": initial["W0"] @ projector, "W1": projector @ initial["W1"],
                 "W_Q": projector @ initial["W_Q"], "W_K": projector @ initial["W_K"]}
    look = confirmation_reach(StageThresholds()) * arguments.t_end
    manifold = propagate_rank(MeanFieldChain(prepared.chain.pi, prepared.chain.P), projected, A, 0.0, look, np.inf,
                              prediction_grid(look), confirmed=lambda t, params: False, confirm_from=look, rtol=1e-8)
    on_manifold = Trajectory(t=manifold.t, loss=np.zeros(len(manifold.t)), params=manifold.params)
    print(f"rank-two flow on span(α, α2), no transverse part: q{first}'s first focus {first_focus(on_manifold)}")
    leaving = solve_flow(prepared.flow, projected, prepared.times, rtol=1e-8, atol=config.solver.atol)
    focused = first_focus(leaving.trajectory)
    complement = np.linalg.svd(A, full_matrices=True)[0][:, A.shape[1]:]
    W0 = np.asarray(leaving.trajectory.params["W0"])
    off = [f"{np.linalg.norm(W0[i] @ complement):.2g} at {leaving.trajectory.t[i]:.3g}"
           for i in np.searchsorted(leaving.trajectory.t, [1e4, 3e4, 5e4, focused or arguments.t_end]).clip(max=len(W0) - 1)]
    print(f"exact flow from the projection: q{first}'s first focus {focused}; ‖W0 E‖ {', '.join(off)}")


if __name__ == "__main__":
    main()
