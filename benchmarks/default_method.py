"""JaxRadau against JaxBDF on small flows: why ``solver.method = 'auto'`` is JaxBDF at every size.

    python benchmarks/default_method.py [--cases NAME,...] [--rounds 3]

Each case is a small flow (m = k = 8 unless its config says otherwise): the default run, the two-layer baseline,
the paper family and general chains of ``benchmarks/theory_accuracy.py`` (``random_family``, seeded by d;
``random_transition_matrix(d, 100 d + i)``) from ε = 1e-2. Each method runs at its default rtol, the two
alternated in one process for ``--rounds`` rounds; the table gives the best solve, the steps and the largest
relative loss error against JaxBDF at rtol 1e-10. On general chains whose attention saturates late, JaxRadau's
steps collapse (it keeps 8 stiff directions below 1024 parameters); benchmarks/MEASUREMENTS.md, "The default
method: JaxBDF at every size".
"""

from __future__ import annotations

import argparse

import numpy as np

from flowsim.assemble import prepare
from flowsim.config import RunConfig, load_config, transition_override
from flowsim.solve.solvers import solve_flow
from prediction_accuracy import flow_config, random_family
from theory_accuracy import random_transition_matrix

EPS = 0.01
METHODS = ("JaxRadau", "JaxBDF")


def paper_family(d: int, t_end: float) -> RunConfig:
    pi, lam = random_family(2, seed=d, dims=(d,), min_pi=0.2 / d)[0]
    return flow_config([f"chain.pi={[float(p) for p in pi]}", f"chain.lam={lam}", f"init.eps={EPS}"], EPS, t_end, 600)


def general_chain(d: int, index: int, t_end: float) -> RunConfig:
    return flow_config([transition_override(random_transition_matrix(d, 100 * d + index)), f"init.eps={EPS}"], EPS,
                       t_end, 600)


CASES = {
    "default run": lambda: load_config(None, []),
    "two-layer baseline": lambda: load_config("configs/two_layer/baseline.toml", []),
    "paper family d = 8 to t = 300": lambda: paper_family(8, 300.0),
    "paper family d = 16 to t = 300": lambda: paper_family(16, 300.0),
    **{f"general P d = {d} #{i} to t = 1e5": (lambda d=d, i=i: general_chain(d, i, 1e5)) for d in (4, 6) for i in range(3)},
    "general P d = 8 #0 to t = 20000": lambda: general_chain(8, 0, 2e4),
    "general P d = 8 #1 to t = 1e5": lambda: general_chain(8, 1, 1e5),
    "general P d = 12 #0 to t = 1e5": lambda: general_chain(12, 0, 1e5),
    "general P d = 16 #0 to t = 20000": lambda: general_chain(16, 0, 2e4),
}


def compare(config: RunConfig, rounds: int) -> tuple[int, dict[str, tuple[float, int, float]]]:
    """(n, {method: (best solve s, steps, loss error)}) with the methods alternated ``rounds`` times."""
    prepared = prepare(config)
    run = lambda method, rtol=None: solve_flow(prepared.flow, prepared.params0, prepared.times, method=method,  # noqa: E731
                                               rtol=rtol, atol=config.solver.atol)
    reference = run("JaxBDF", 1e-10).trajectory.loss
    best: dict[str, tuple[float, int, float]] = {}
    for _ in range(rounds):
        for method in METHODS:
            result = run(method)
            error = float(np.max(np.abs(result.trajectory.loss / reference[:len(result.trajectory)] - 1)))
            if method not in best or result.stats.solve_seconds < best[method][0]:
                best[method] = (result.stats.solve_seconds, result.stats.n_steps, error)
    return prepared.flow.size, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from: {'; '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two methods (the best is kept)")
    args = parser.parse_args()
    names = [name.strip() for name in args.cases.split(",")]
    unknown = [name for name in names if name not in CASES]
    if unknown or args.rounds < 1:
        parser.error(f"unknown cases {unknown} (known: {'; '.join(CASES)})" if unknown else
                     f"--rounds must be at least 1, got {args.rounds}")
    print("| flow | n | " + " | ".join(f"{method}: steps, solve s, loss error" for method in METHODS) + " |")
    print("|---|---:|" + "---|" * len(METHODS))
    for name in names:
        size, best = compare(CASES[name](), args.rounds)
        cells = [f"{steps}, {seconds:.3f}, {error:.1e}" for seconds, steps, error in (best[m] for m in METHODS)]
        print(f"| {name} | {size} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
