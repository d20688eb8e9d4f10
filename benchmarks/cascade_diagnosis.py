"""A general-P chain whose directions open in a cascade: what the reduced tier's rows read, against the exact flow.

    python benchmarks/cascade_diagnosis.py [--seed 1600] [--t-end 1.4e5]

The chain is ``theory_accuracy.py --large``'s general P d = 16 (P from ``random_transition_matrix(16, seed)``: seed
1600 is its #0, 1601 its #1), m = k = 8, ε = 1e-2, seed-0 start, 600 log-spaced saves to ``--t-end``. Printed:
``predict_run``'s first rows, how far its flows reach (the rows' rank-two flow from θ(0), the chain, where the
chain's detectors place foci, a failed rank), each rank's crossing and rule, and the exact flow's σ1 restart and
first focus of the most frequent query read on the same saves, from θ(0) and from θ(0) projected on span(α) and
span(α, α2), the rank-one and rank-two manifolds the reduced tier's rows use (invariant under the flow; on a
projected start σ1's restart means nothing where σ1(W0(0)) = 0, as on span(α)). Used in
docs/theory.md, "Where the reduced flows stop short of the horizon".
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
    from theory.predict import predict_run

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

    def measured(label: str, params) -> None:
        result = solve_flow(prepared.flow, params, prepared.times, rtol=1e-8, atol=config.solver.atol)
        report = detect_stages(compute_observables(result.trajectory, prepared.model, prepared.chain.pi))
        focus = report.of("focus", first)
        restart = [i.t_start for i in report.of("restart") if i.direction == 1]
        print(f"exact flow {label}: q{first}'s first focus {focus[0].t_start if focus else None}, "
              f"σ1's restart {restart[0] if restart else None} ({result.message})")

    def onto(A: np.ndarray) -> dict[str, np.ndarray]:
        projector = A @ A.T
        return {"W0": initial["W0"] @ projector, "W1": projector @ initial["W1"],
                "W_Q": projector @ initial["W_Q"], "W_K": projector @ initial["W_K"]}

    measured("from θ(0)", initial)
    measured("from θ(0) on span(α)", onto(cycles.stages[0].A))
    if cycles.opened is not None:
        measured("from θ(0) on span(α, α2)", onto(cycles.opened.A))


if __name__ == "__main__":
    main()
