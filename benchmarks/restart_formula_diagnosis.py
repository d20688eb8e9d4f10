"""Why the formula tier's σ1 restart misses: its ingredients against the rank-one flow's own path.

    python benchmarks/restart_formula_diagnosis.py [--seed 2027] [--eps 1e-2] [--dims 4 8 16] [--out benchmarks/RESULTS.md]

The formula (``theory.formulas.sigma1_restart``) is t_R = t_f + log(ℓ_1/a_s)/μ_R: the mode carried from θ(0) with
amplitude a_s, still until the first focus t_f, then growing at μ_R = σ_max(C) at a critical point of the rank-one
loss found by L-BFGS. For the chains of ``formula_accuracy.py``'s family that the formula times, this follows the
rank-one flow and its transverse equation (``theory.restart.propagate_rank``, the reduced tier, whose crossing is
the reference here: against the exact flow's detector on these chains it is within 1.3% on 14 of the 17 whose exact
flow shows the restart and 3.2-5.0% on the other three, RESULTS.md "The formula tier") and reads, along that path,
the transverse rate μ(t) = σ_max(C(t)) at each saved time. Columns:

* the flow's crossing t_R and the formula's error against it;
* log(ℓ_1/a_s), the e-folds the formula needs, against ∫μ dt from the formula's condensation end t_c to t_f and
  from t_f to t_R: what the path's own rate gives in each stretch ("–" where the formula's t_f comes after t_R);
* when a_s, grown at the path's μ from t_c and from t_f, reaches ℓ_1 ("–": not before the path's crossing);
* μ_R against μ(t_f) and μ(t_R), and whether the rank-one flow had settled (its rate within 1% of its limit)
  before the crossing;
* the rank-one loss's Hessian over (γ, β, φ) at the formula's critical point (by central differences of its
  closed-form gradient): how many eigenvalues are zero (below 1e-6 of the largest), the gap in decades from the
  largest of those to the smallest of the rest, and the largest |d log μ_R / ds| along a unit step s in the flat
  directions that are not the two symmetries (β along 1; the rescaling γ → cγ, β → β/c, φ → φ/c², whose law is
  the flow's GL(m) balance, docs/model.md), against the largest along the symmetries. Where μ moves along flat
  directions that no conservation law fixes, no constant of the chain picks the flow's rate;
* a next-order term tried and not kept: the rate's approach to μ_R as one exponential at the Hessian's slowest
  nonzero rate λ_s (in the flow's metric), from its value μ_½ at the half-focused point, t_R - (μ_½ - μ_R)/(λ_s μ_R).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from formula_accuracy import chains
from report import published


def diagnosis(name: str, P: np.ndarray, eps: float) -> str | None:
    """The chain's row, or None where the formula gives no σ1 restart."""
    from flowsim.assemble import prepare
    from flowsim.config import load_config, transition_override
    from theory.cycles import prediction_grid
    from theory.formulas import (attention_part, focused_critical_point, focused_state, half_focus_logit,
                                 predict_formulas, rank_one_hessian, symmetry_directions)
    from theory.manifold import project
    from theory.mean_field import MeanFieldChain, condensed_point
    from theory.origin import unstable_projection
    from theory.restart import TransverseRate, propagate_rank
    from theory.transverse import TransverseCoupling

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
        return f"| {name} | – | {restart.time:.4g} | no crossing by t = {look:.4g} |" + " |" * 11
    on_path = np.nonzero(stage.t <= crossing)[0]
    t = stage.t[on_path]
    rate = TransverseRate(chain, np.shape(prepared.params0["W_Q"])[1])
    mu = np.array([rate(project({key: value[i] for key, value in stage.params.items()}, alpha[:, None]).pack())
                   for i in on_path])
    grown_to = np.concatenate([[0.0], np.cumsum(0.5 * (mu[1:] + mu[:-1]) * np.diff(t))])  # ∫_0^t μ on the path
    needed = float(np.log(restart.threshold / restart.amplitude))

    def grown(start: float, end: float) -> float | None:
        """∫_start^end μ dt on the path; None where start is past the crossing (interp would clamp it)."""
        return None if start > crossing else float(np.interp(end, t, grown_to) - np.interp(start, t, grown_to))

    def reached_from(start: float | None) -> float | None:
        """When a_s grown at the path's μ from ``start`` reaches ℓ_1; None: not before the path's crossing."""
        if start is None or start > crossing or grown(start, crossing) < needed:
            return None
        return float(np.interp(np.interp(start, t, grown_to) + needed, grown_to, t))

    d = len(chain.pi)
    gamma, beta, phi = focused_critical_point(chain.pi, chain.P, half_focus_logit(formulas.constants, chain.pi))
    z = np.concatenate([gamma, beta, [phi]])
    hessian = rank_one_hessian(chain, gamma, beta, phi)
    values, vectors = np.linalg.eigh(hessian)
    flat = np.abs(values) < 1e-6 * np.abs(values).max()
    gap = np.log10(np.abs(values[~flat]).min() / np.abs(values[flat]).max())
    attention = attention_part(prepared.params0, alpha, formulas.constants.h_sign)
    symmetries = symmetry_directions(gamma, beta, phi)
    null = vectors[:, flat]
    others = np.linalg.svd(null - symmetries @ (symmetries.T @ null))[0][:, :null.shape[1] - 2]

    def log_rate_slope(direction: np.ndarray, step: float = 1e-3) -> float:
        at = lambda point: TransverseCoupling(chain, focused_state(point[:d], point[d:2 * d], point[2 * d],  # noqa: E731
                                                                     attention)).top()[0]
        return abs(np.log(at(z + step * direction)) - np.log(at(z - step * direction))) / (2 * step)

    # the next-order term tried and not kept: the rate's approach to μ_R from its value at the half-focused point
    # (γ*, β*, φ_½) taken as one exponential at λ_s, the slowest nonzero rate of the Hessian in the flow's metric
    # (2|φ| on φ, where ‖q‖ = ‖r‖), which subtracts (μ_½ - μ_R)/λ_s e-folds from log(ℓ_1/a_s)
    metric = np.ones(len(z))
    metric[-1] = np.sqrt(2 * abs(phi))
    weighted = np.abs(np.linalg.eigvalsh(metric[:, None] * hessian * metric[None, :]))
    slowest = weighted[weighted > 1e-6 * weighted.max()].min()
    gamma_star, beta_star = condensed_point(chain.pi)
    half_focused_rate = TransverseCoupling(chain, focused_state(gamma_star, beta_star, half_focus_logit(
        formulas.constants, chain.pi), attention)).top()[0]
    next_order = restart.time - (half_focused_rate - restart.rate) / slowest / restart.rate

    along_others = max((log_rate_slope(v) for v in others.T), default=0.0)
    along_symmetries = max(log_rate_slope(v) for v in symmetries.T)

    show = lambda value, form: "–" if value is None else format(value, form)  # noqa: E731
    error = lambda value: "–" if value is None else f"{value:.4g} ({100 * (value - crossing) / crossing:+.1f}%)"  # noqa: E731
    before_focus = (None if formulas.condensation is None or formulas.focus > crossing
                    else grown(formulas.condensation, formulas.focus))
    settled = stage.restart.t_settle
    return (f"| {name} | {crossing:.4g} | {error(restart.time)} | {needed:.2f} | {show(before_focus, '.2f')} "
            f"| {show(grown(formulas.focus, crossing), '.2f')} | {error(reached_from(formulas.condensation))} "
            f"| {error(reached_from(formulas.focus))} | {restart.rate:.3g} "
            f"| {show(None if formulas.focus > crossing else float(np.interp(formulas.focus, t, mu)), '.3g')} "
            f"| {mu[-1]:.3g} | {'no' if settled is None or settled > crossing else f'at {settled:.4g}'} "
            f"| {int(flat.sum())} of {len(z)}, {gap:.1f} decades | {along_others:.2g} against {along_symmetries:.1g} "
            f"| {error(next_order)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=2027)
    parser.add_argument("--eps", type=float, default=1e-2)
    parser.add_argument("--dims", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", type=Path, default=None)
    arguments = parser.parse_args()
    started = time.perf_counter()
    lines = ["| chain | flow's t_R | formula | log(ℓ_1/a_s) | ∫μ, t_c → t_f | ∫μ, t_f → t_R "
             "| a_s grown at the path's μ from t_c | from t_f | μ_R | μ(t_f) | μ(t_R) | settled before t_R "
             "| flat directions | max \\|d log μ_R/ds\\| off the symmetries, on them | next-order term (tried) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|"]
    for name, P in chains(arguments.seed, arguments.dims, [], None):
        line = diagnosis(name, P, arguments.eps)
        if line is not None:
            lines.append(line)
            print(line, flush=True)
    command = (f"python benchmarks/restart_formula_diagnosis.py --seed {arguments.seed} --eps {arguments.eps:g} "
               f"--dims {' '.join(map(str, arguments.dims))}")
    published(command, started, lines, arguments.out, f"restart-formula-diagnosis-seed-{arguments.seed}")


if __name__ == "__main__":
    main()
