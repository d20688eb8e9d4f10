"""The rank-r flows beyond EXACT_JACOBIAN_UP_TO equations: the exact flow's own solver against the former RKC route.

    python benchmarks/reduced_flow_route.py [--runs runs/cycle-tinystories runs/cycle-wikitext2] [--d64]
                                            [--out benchmarks/MEASUREMENTS.md]

``theory.restart.LARGE_METHOD`` picks how a rank-r flow with more than EXACT_JACOBIAN_UP_TO equations is integrated:
"FLOW" (the default: the exact flow of the one-layer model with m = r by ``solve_flow``'s default stiff method, its
dense output a local cubic through saved points, ``ReducedFlow.solve``) or "RKC" (the former route: LSODA until the
flow turns stiff, then RKC). Each case's ``predict_run`` runs once per route, each in a fresh process of its own with
the prediction cache off and no compilation cache (so each pays its own compilations, as a first ``flowsim predict``
does), one after the other. The cases: the surrogates of the given bridge runs (``bridge validate``'s theory part,
d = 1001 for the cycle examples) and, with ``--d64``, ``rkc_deflation.py``'s d = 64 chain (t_end = 6000). Reported:
wall time, the exact flow's solves (calls of ``ReducedFlow.solve``'s "FLOW", how many were solved again to refine
the saved points, and ``solve_flow``'s own compilation and solve seconds over them all), and the largest relative difference between the two routes' timed rows. Run on a quiet machine: a second
busy process slows JAX's compiled loops many times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROUTES = ("RKC", "FLOW")


def prediction_config(case: str):
    """The run config of a case: a bridge run's surrogate (``theory_config``), or "d64" for rkc_deflation's chain."""
    from flowsim.config import load_config

    if case == "d64":
        from prediction_accuracy import random_family

        (pi, lam), = random_family(1, seed=64, dims=(64,), min_pi=0.2 / 64)
        return load_config(None, [f"chain.pi={json.dumps(pi)}", f"chain.lam={lam}", "time.t_end=6000"])
    from flowsim.bridge.config import load_bridge_config
    from flowsim.bridge.train import build_data
    from flowsim.bridge.validate import theory_config

    run = Path(case)
    config = load_bridge_config(run / "sgd" / "config.toml")
    return theory_config(config, build_data(config), run / "sgd", run / "theory")


def one(case: str, route: str) -> dict:
    """``predict_run`` of ``case`` by ``route``, in this process: its seconds, solves and timed rows."""
    import theory.manifold
    import theory.restart
    from theory.predict import predict_run

    theory.restart.LARGE_METHOD = route
    solves = {"calls": 0, "solves": 0, "compile_seconds": 0.0, "solve_seconds": 0.0}
    solve_flow = theory.manifold.solve_flow

    def counted(*args, **kwargs):
        solves["solves"] += 1
        result = solve_flow(*args, **kwargs)
        solves["compile_seconds"] += result.stats.compile_seconds
        solves["solve_seconds"] += result.stats.solve_seconds
        return result

    exact = theory.manifold.ReducedFlow._solve_exact

    def counted_call(self, *args, **kwargs):
        solves["calls"] += 1
        return exact(self, *args, **kwargs)

    theory.manifold.solve_flow, theory.manifold.ReducedFlow._solve_exact = counted, counted_call
    config = prediction_config(case)
    started = time.perf_counter()
    prediction = predict_run(config)
    seconds = time.perf_counter() - started
    rows = {f"{row.stage} q{row.query} σ{row.direction}": row.predicted for row in prediction.rows if row.predicted is not None}
    return {"seconds": seconds, **solves, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, nargs="*", default=[], help="bridge run directories (their surrogates)")
    parser.add_argument("--d64", action="store_true", help="rkc_deflation.py's d = 64 chain too")
    parser.add_argument("--out", type=Path, default=None, help="a Markdown file to write the table into")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # case, route: one run, its result as JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    cases = (["d64"] if args.d64 else []) + [str(run) for run in args.runs]
    if not cases:
        parser.error("nothing to run: give --runs and/or --d64")
    lines = ["| case | route | `predict_run`, s | exact-flow calls (solved again) | their compilation, s | their solves, s "
             "| largest row difference between routes |",
             "|---|---|---:|---:|---:|---:|---|"]
    environment = {**os.environ, "FLOWSIM_PREDICTION_CACHE": "off", "FLOWSIM_COMPILATION_CACHE": "off"}
    for case in cases:
        results = {}
        for route in ROUTES:
            out = subprocess.run([sys.executable, __file__, "--one", case, route], check=True, capture_output=True,
                                 text=True, env=environment).stdout
            results[route] = json.loads(out.splitlines()[-1])
            print(case, route, f"{results[route]['seconds']:.1f} s", flush=True)
        before, after = results["RKC"]["rows"], results["FLOW"]["rows"]
        shared = sorted(set(before) & set(after))
        worst = max(shared, key=lambda key: abs(after[key] - before[key]) / abs(before[key]), default=None)
        difference = "–" if worst is None else (
            f"{abs(after[worst] - before[worst]) / abs(before[worst]):.2g} ({worst}: {before[worst]:.6g} → "
            f"{after[worst]:.6g}; {len(shared)} rows in both, {len(set(before) ^ set(after))} in one only)")
        for route in ROUTES:
            result = results[route]
            flow = route == "FLOW"
            calls = f"{result['calls']} ({result['solves'] - result['calls']})" if flow else "–"
            compiled, solved = (f"{result[key]:.1f}" if flow else "–" for key in ("compile_seconds", "solve_seconds"))
            lines.append(f"| {case} | {route} | {result['seconds']:.1f} | {calls} | {compiled} | {solved} "
                         f"| {difference if flow else ''} |")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        from report import write_section

        write_section(args.out, "reduced-flow-route", text)


if __name__ == "__main__":
    main()
