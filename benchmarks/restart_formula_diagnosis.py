"""Why the formula tier's σ1 restart misses: its ingredients against the rank-one flow's own path.

    python benchmarks/restart_formula_diagnosis.py [--seed 2027] [--eps 1e-2] [--dims 4 8 16] [--out benchmarks/RESULTS.md]

The formula (``theory.formulas.sigma1_restart``) is t_R = t_f + log(ℓ_1/a_s)/μ_R: the mode carried from θ(0) with
amplitude a_s, still until the first focus t_f, then growing at μ_R = σ_max(C) at a critical point of the rank-one
loss found by L-BFGS. For the chains of ``formula_accuracy.py``'s family that the formula times, this follows the
rank-one flow and its transverse equation (``theory.restart.propagate_rank``, the reduced tier, whose crossing is
the reference here: it is within 0.5% of the exact flow's detector on these chains, RESULTS.md) and reads, along
that path, the transverse rate μ(t) = σ_max(C(t)) at each saved time. Columns:

* the flow's crossing t_R and the formula's error against it;
* log(ℓ_1/a_s), the e-folds the formula needs, against ∫μ dt from the formula's condensation end t_c to t_f and
  from t_f to t_R: what the path's own rate gives in each stretch;
* the time at which ∫_{t_f} μ dt reaches log(ℓ_1/a_s) (the formula's amplitude grown at the path's rate; "–" where
  the path crosses first, so growth before t_f counted);
* μ_R against μ(t_f) and μ(t_R), and whether the rank-one flow had settled (its rate within 1% of its limit)
  before the crossing;
* how many eigenvalues of the rank-one loss's Hessian over (γ, β, φ) at the formula's critical point are zero
  (below 1e-6 of the largest): the dimension of the critical set there. Two of its flat directions are symmetries
  with conservation laws (β along 1; the rescaling γ → cγ, β → β/c, φ → φ/c², whose law is the flow's GL(m)
  balance, docs/model.md); the rest are not, so no law picks the flow's point among them, while μ varies along them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from formula_accuracy import chains
from report import write_section


def diagnosis(name: str, P: np.ndarray, eps: float) -> str | None:
    """The chain's row, or None where the formula gives no σ1 restart."""
    from flowsim.assemble import prepare
    from flowsim.config import load_config, transition_override
    from theory.cycles import prediction_grid
    from theory.formulas import STEP, focused_critical_point, half_focus_logit, predict_formulas, rank_one_gradient
    from theory.manifold import project
    from theory.mean_field import MeanFieldChain
    from theory.origin import unstable_projection
    from theory.restart import TransverseRate, propagate_rank

    prepared = prepare(load_config(None, [transition_override(P), f"init.eps={eps}", "init.seed=0"]))
    chain = MeanFieldChain(prepared.chain.pi, prepared.chain.P)
    formulas = predict_formulas(chain.pi, chain.P, prepared.params0, eps)
    restart = formulas.restart
    if restart is None or restart.time is None:
        return None
    _, alpha = unstable_projection(prepared.params0, chain.pi)
    look = 3 * restart.time
    stage = propagate_rank(chain, prepared.params0, alpha[:, None], 0.0, look, restart.threshold, prediction_grid(look))
    crossing = stage.restart.t_integrated
    if crossing is None:
        return f"| {name} | – | {restart.time:.4g} | no crossing by t = {look:.4g} | | | | | | | | |"
    on_path = np.nonzero(stage.t <= crossing)[0]
    t = stage.t[on_path]
    rate = TransverseRate(chain, np.shape(prepared.params0["W_Q"])[1])
    mu = np.array([rate(project({key: value[i] for key, value in stage.params.items()}, alpha[:, None]).pack())
                   for i in on_path])
    grown = np.concatenate([[0.0], np.cumsum(0.5 * (mu[1:] + mu[:-1]) * np.diff(t))])  # ∫_0^t μ
    at = lambda time_: float(np.interp(time_, t, grown))  # noqa: E731
    needed = float(np.log(restart.threshold / restart.amplitude))
    from_focus = at(crossing) - at(formulas.focus)
    adiabatic = (float(np.interp(at(formulas.focus) + needed, grown, t)) if from_focus >= needed else None)

    d = len(chain.pi)
    gamma, beta, phi = focused_critical_point(chain.pi, chain.P, half_focus_logit(formulas.constants, chain.pi))
    z = np.concatenate([gamma, beta, [phi]])

    def gradient(point: np.ndarray) -> np.ndarray:
        d_x, d_phi = rank_one_gradient(chain, point[:2 * d], point[2 * d])
        return np.append(d_x, d_phi)

    hessian = np.column_stack([(gradient(z + STEP * e) - gradient(z - STEP * e)) / (2 * STEP) for e in np.eye(len(z))])
    eigenvalues = np.abs(np.linalg.eigvalsh((hessian + hessian.T) / 2))
    flat = int(np.sum(eigenvalues < 1e-6 * eigenvalues.max()))

    error = lambda value: f"{value:.4g} ({100 * (value - crossing) / crossing:+.1f}%)"  # noqa: E731
    settled = stage.restart.t_settle
    return (f"| {name} | {crossing:.4g} | {error(restart.time)} | {needed:.2f} "
            f"| {at(formulas.focus) - at(formulas.condensation):.2f} | {from_focus:.2f} "
            f"| {'–' if adiabatic is None else error(adiabatic)} | {restart.rate:.3g} "
            f"| {np.interp(formulas.focus, t, mu):.3g} | {mu[-1]:.3g} "
            f"| {'no' if settled is None or settled > crossing else f'at {settled:.4g}'} | {flat} of {len(z)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=2027)
    parser.add_argument("--eps", type=float, default=1e-2)
    parser.add_argument("--dims", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", type=Path, default=None)
    arguments = parser.parse_args()
    started = time.perf_counter()
    lines = ["| chain | flow's t_R | formula | log(ℓ_1/a_s) | ∫μ, t_c → t_f | ∫μ, t_f → t_R "
             "| a_s grown at the path's μ from t_f | μ_R | μ(t_f) | μ(t_R) | settled before t_R | flat directions |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for name, P in chains(arguments.seed, arguments.dims, [], None):
        line = diagnosis(name, P, arguments.eps)
        if line is not None:
            lines.append(line)
            print(line, flush=True)
    command = (f"python benchmarks/restart_formula_diagnosis.py --seed {arguments.seed} --eps {arguments.eps:g} "
               f"--dims {' '.join(map(str, arguments.dims))}")
    text = "\n".join([f"`{command}` ({time.perf_counter() - started:.0f} s on a 2-core CPU)", "", *lines])
    print(text)
    if arguments.out is not None:
        write_section(arguments.out, f"restart-formula-diagnosis-seed-{arguments.seed}", text)


if __name__ == "__main__":
    main()
