"""Condensation at d = 64: what the focus does to the detector's condensed scale.

    python benchmarks/condensation_scale_diagnosis.py [--seed 2027] [--dims 64]

For the paper-family chains of ``formula_accuracy.py``'s family (ε = 1e-2, seed-0 start), the exact flow (rtol 1e-8,
600 log-spaced saves to t = 600) from θ(0) as it is, with W_Q = W_K = 0 (zero attention stays zero: the attention
held at 0) and with W_Q, W_K three times larger. For each: condensation's end and the detector's condensed scale
(σ0(W0) where its log-log slope first flattens; the end is a third of it), and, as is, the attention along W0's top
direction at the end, ‖W_Qᵀa‖² + ‖W_Kᵀa‖², and σ0's course through the focus. Beside them Stage I's orbit, the formula, and the attention-free scale g*.
Used in docs/theory.md ("The formula tier", accuracy) and benchmarks/MEASUREMENTS.md.
"""

from __future__ import annotations

import argparse

import numpy as np

from formula_accuracy import chains
from prediction_accuracy import flow_config


def main() -> None:
    from flowsim.assemble import prepare
    from flowsim.config import transition_override
    from flowsim.observe.families import compute_observables
    from flowsim.observe.stages import StageThresholds, condensed_scale, detect_stages, smooth_in_log_time
    from flowsim.solve.solvers import solve_flow
    from theory.formulas import predict_formulas
    from theory.origin import predict_condensation

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=2027)
    parser.add_argument("--dims", type=int, nargs="+", default=[64])
    arguments = parser.parse_args()
    print("| chain | as is: t_c (scale) | attention at t_c | attention held at 0 | attention × 3 | Stage I orbit "
          "| formula | g* |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, P in chains(arguments.seed, arguments.dims, [], None):
        if not name.startswith("paper"):
            continue
        config = flow_config([transition_override(P), "init.eps=0.01", "init.seed=0"], 0.01, 600.0, 600)
        prepared = prepare(config)
        formulas = predict_formulas(prepared.chain.pi, prepared.chain.P, prepared.params0, 0.01)
        orbit = predict_condensation(prepared.chain.pi, prepared.chain.P, prepared.params0, 0.01)
        cells = []
        for factor in (1.0, 0.0, 3.0):
            start = dict(prepared.params0, W_Q=factor * prepared.params0["W_Q"], W_K=factor * prepared.params0["W_K"])
            result = solve_flow(prepared.flow, start, prepared.times, rtol=1e-8, atol=config.solver.atol)
            observables = compute_observables(result.trajectory, prepared.model, prepared.chain.pi)
            condensation = detect_stages(observables).of("condensation")[0]
            # the detector's own reading: σ0 smoothed in log t, its scale searched from where it left its floor
            th, t = StageThresholds(), result.trajectory.t
            positive = observables.t > 0
            sigma0 = smooth_in_log_time(observables.t[positive], observables["sv_W0"][positive], th.smoothing_decades)[:, 0]
            departed = int(np.argmax(sigma0 >= th.departure * sigma0[0]))
            scale = condensed_scale(observables.t[positive], sigma0, departed, th)
            cells.append(f"{condensation.t_end:.4g} ({scale:.3g})")
            if factor == 1.0:
                course = ", ".join(f"{sigma0[i]:.3g} at {observables.t[positive][i]:.0f}" for i in np.searchsorted(
                    observables.t[positive], [300.0, 350.0, 380.0, 420.0, 500.0, 600.0]))
                print(f"{name}: σ0(W0) (smoothed) {course}", flush=True)
                at_end = int(np.searchsorted(t, condensation.t_end))
                W0 = np.asarray(result.trajectory.params["W0"][at_end])
                top = np.linalg.svd(W0)[2][0]
                attention = sum(float(np.sum((np.asarray(result.trajectory.params[key][at_end]).T @ top) ** 2))
                                for key in ("W_Q", "W_K"))
                cells.append(f"{attention:.2g}")
        print(f"| {name} | {' | '.join(cells)} | {orbit.t_end:.4g} | {formulas.condensation:.4g} "
              f"| {formulas.constants.g_star:.3g} |", flush=True)


if __name__ == "__main__":
    main()
