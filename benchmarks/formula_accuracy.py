"""The formula tier (``theory.formulas``) against the exact flow, beside Stage I's and Stage II's orbits.

    python benchmarks/formula_accuracy.py [--seed 2027] [--eps 1e-2 --eps 1e-3] [--dims 4 8 16 64] [--text-d 64]
                                          [--out benchmarks/RESULTS.md]

A seeded family drawn for this benchmark: per d, two chains of the paper family (π ~ Dirichlet(1) floored at 0.2/d,
λ ~ U[0.2, 0.8]) and two general P (Dirichlet rows floored at 0.1/d), and the bigram surrogates of both corpora at
``--text-d``; m = k = 8, mean-field loss, seed-0 start. Each chain's exact flow (rtol 1e-8, 600 log-spaced saves)
runs to twice the latest of the two first-focus predictions (formula, Stage II's orbit) and the formula's σ1 restart,
at most t = 20 000, and its detectors give the measured end of condensation, first focus of the most frequent query
and σ1's restart. The formula's seconds
are its own evaluation after the run's set-up; h* is the attention coupling with its sign (h* > 0: no focus by the
formula). The last line counts the formula's first foci that the flow does not show by twice their time. The
table goes into RESULTS.md (section formula-accuracy-seed-S).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from prediction_accuracy import flow_config, measured_stages, random_family
from report import published
from theory_accuracy import random_transition_matrix, text_chain

T_CAP = 20_000.0


def chains(seed: int, dims: list[int], text_d: list[int], data: Path | None) -> list[tuple[str, np.ndarray]]:
    from flowsim.corpora import find_data_dir

    cases = []
    for d in dims:
        for index, (pi, lam) in enumerate(random_family(2, seed=seed + d, dims=(d,), min_pi=0.2 / d)):
            cases.append((f"paper d = {d} #{index}", lam * np.eye(d) + (1 - lam) * np.outer(np.ones(d), pi)))
        for index in range(2):
            cases.append((f"general P d = {d} #{index}", random_transition_matrix(d, seed + 100 * d + index)))
    for corpus in ("wikitext2", "tinystories"):
        for d in text_d:
            try:
                cases.append((f"{corpus} bigram d = {d}", text_chain(corpus, d, find_data_dir(corpus, data))))
            except (FileNotFoundError, ValueError) as error:  # no corpus on this machine: said in the table, not fatal
                print(f"{corpus}: {error}", flush=True)
    return cases


def accuracy(name: str, P: np.ndarray, eps: float) -> tuple[str, bool]:
    """The chain's row, and whether the formula put a first focus within the flow's horizon that the flow lacks."""
    from flowsim.assemble import prepare
    from flowsim.config import load_config, transition_override
    from theory.focus import predict_focus
    from theory.formulas import predict_formulas
    from theory.mean_field import MeanFieldChain
    from theory.origin import predict_condensation

    overrides = [transition_override(P), f"init.eps={eps}", "init.seed=0"]
    prepared = prepare(load_config(None, overrides))
    chain = prepared.chain
    started = time.perf_counter()
    formulas = predict_formulas(chain.pi, chain.P, prepared.params0, eps)
    seconds = time.perf_counter() - started
    stage_one = predict_condensation(chain.pi, chain.P, prepared.params0, eps)
    stage_two = predict_focus(MeanFieldChain(chain.pi, chain.P), prepared.params0, stage_one, prepared.model.k)
    query = formulas.constants.query
    orbit_focus = stage_two.t_onset.get(query)
    restart = None if formulas.restart is None else formulas.restart.time
    later = max([t for t in (formulas.focus, orbit_focus, restart) if t is not None],
                default=5 * (formulas.condensation or 10.0))
    horizon = min(2 * later, T_CAP)
    report = measured_stages(flow_config(overrides, eps, horizon, 600))
    condensed = next((i.t_end for i in report.intervals if i.stage == "condensation"), None)
    focused = next((i.t_start for i in report.intervals if i.stage == "focus" and i.query == query), None)
    restarted = next((i.t_start for i in report.intervals if i.stage == "restart" and i.direction == 1), None)
    c = formulas.constants

    def pair(predicted: float | None, measured: float | None) -> str:
        if predicted is None:
            return "–"
        error = "" if measured is None else f" ({100 * (predicted - measured) / measured:+.1f}%)"
        return f"{predicted:.4g}{error}"

    show = lambda value: "–" if value is None else f"{value:.4g}"  # noqa: E731
    false_focus = formulas.focus is not None and 2 * formulas.focus <= horizon and focused is None
    return (f"| {name} | {eps:g} | {c.mu1:.3g} | {c.h_sign * c.mu2:+.3g} | {pair(formulas.condensation, condensed)} "
            f"| {pair(stage_one.t_end, condensed)} | {show(condensed)} | q{query} | {pair(formulas.focus, focused)} "
            f"| {pair(orbit_focus, focused)} | {show(focused)} | {pair(restart, restarted)} | {show(restarted)} "
            f"| {seconds:.3f} |"), false_focus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=2027)
    parser.add_argument("--eps", type=float, action="append")
    parser.add_argument("--dims", type=int, nargs="+", default=[4, 8, 16, 64])
    parser.add_argument("--text-d", type=int, nargs="*", default=[64])
    parser.add_argument("--data", type=Path, default=None, help="the corpora's folder (default: flowsim's search order)")
    parser.add_argument("--out", type=Path, default=None)
    arguments = parser.parse_args()
    data = arguments.data
    started = time.perf_counter()
    lines = ["| chain | ε | μ1 | h* | condensation: formula | Stage I orbit | exact flow | query "
             "| first focus: formula | Stage II orbit | exact flow | σ1 restart: formula | exact flow | formula s |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    false_foci = []
    for eps in arguments.eps or [1e-2, 1e-3]:
        for name, P in chains(arguments.seed, arguments.dims, arguments.text_d, data):
            line, false_focus = accuracy(name, P, eps)
            lines.append(line)
            false_foci += [f"{name} at ε = {eps:g}"] if false_focus else []
            print(line, flush=True)
    lines += ["", f"First foci the formula puts within half the flow's horizon and the flow does not show: {len(false_foci)}"
              + (f" ({'; '.join(false_foci)})" if false_foci else "")]
    command = (f"python benchmarks/formula_accuracy.py --seed {arguments.seed}"
               + "".join(f" --eps {eps:g}" for eps in arguments.eps or [1e-2, 1e-3])
               + f" --dims {' '.join(map(str, arguments.dims))} --text-d {' '.join(map(str, arguments.text_d))}")
    published(command, started, lines, arguments.out, f"formula-accuracy-seed-{arguments.seed}")


if __name__ == "__main__":
    main()
