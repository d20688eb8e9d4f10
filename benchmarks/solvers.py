"""Solver benchmark on the default flow: every method side by side in one process.

    python benchmarks/solvers.py [--t-end 6000] [--methods LSODA,BDF,...]

Prints steps, evaluations, wall time, the ratio to the fastest method, and the largest
parameter difference to the first method at t_end. Each method runs once to compile
(to t = 1) before it is timed, so the ratios compare integration, not compilation.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from flowsim.config import load_config
from flowsim.experiment import prepare
from flowsim.solvers import solve_flow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t-end", type=float, default=6000.0)
    parser.add_argument("--methods", default="LSODA,BDF,Radau,Kvaerno5,Tsit5,Dopri8")
    parser.add_argument("--rtol", type=float, default=1e-8)
    parser.add_argument("--atol", type=float, default=1e-12)
    parser.add_argument("--max-steps", type=int, default=200_000)
    args = parser.parse_args()

    config = load_config(None, [f"time.t_end={args.t_end}"])
    prepared = prepare(config)
    flow, params0, times = prepared.flow, prepared.params0, prepared.times
    rows, reference = [], None
    for method in args.methods.split(","):
        solve_flow(flow, params0, [0.0, 1.0], method=method, rtol=args.rtol, atol=args.atol, lr=0.1)  # compile
        started = time.perf_counter()
        result = solve_flow(flow, params0, times, method=method, rtol=args.rtol, atol=args.atol, max_steps=args.max_steps)
        wall = time.perf_counter() - started
        final = flow.flatten(result.trajectory.at(-1))
        reference = final if reference is None else reference
        difference = np.abs(final - reference).max() if result.success else float("nan")
        rows.append((method, result.status_name, result.stats.n_steps, result.stats.nfev, result.stats.njev, wall, difference))
    fastest = min(row[5] for row in rows if row[1] == "finished")
    print(f"default flow to t = {args.t_end:g}, rtol {args.rtol:g}, atol {args.atol:g}")
    print(f"{'method':10} {'status':11} {'steps':>8} {'nfev':>8} {'njev':>6} {'wall s':>8} {'ratio':>7} {'max |Δθ|':>10}")
    for method, status, steps, nfev, njev, wall, difference in rows:
        print(f"{method:10} {status:11} {steps:8d} {str(nfev):>8} {str(njev):>6} {wall:8.2f} {wall / fastest:7.2f} {difference:10.2e}")


if __name__ == "__main__":
    main()
